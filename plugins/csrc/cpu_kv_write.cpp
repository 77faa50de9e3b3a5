// qkiln CPU cache write: K/V rows of a step into their paged slots, quantized on the way for fp8
// and int4 caches, bit for bit as plugins/kv_cache.py's torch quantizers (tests compare the bytes).
//
// Built with the other kernels by plugins/cpu_native.py. Runs on the calling thread: a decode
// step writes a few hundred elements a layer; a 1024-token prefill chunk ~0.35 ms a layer in int4.

#include "qkiln_cpu.h"
#include "vec.h"

namespace {

// x rounded to fp16, then moved one fp16 step toward +inf (up) or -inf when rounding went the
// other way: kv_cache._round_fp16_toward.
inline c10::Half fp16_toward(float x, bool up) {
  const c10::Half r(x);
  const float rf = static_cast<float>(r);
  if (std::isnan(x) || (up ? rf >= x : rf <= x)) return r;
  uint16_t bits = r.x;
  if ((bits & 0x7FFF) == 0) bits = up ? 0x0001 : 0x8001;
  else if (((bits & 0x8000) == 0) == up) ++bits;  // away from zero
  else --bits;                                     // toward zero
  return c10::Half(bits, c10::Half::from_bits());
}

// One head's row x [D] -> packed codes [D / 2] and per-group fp16 scale / min, exactly as
// kv_cache.quantize_int4_groups: min rounded down and scale up to fp16 (both clamped to +-65504),
// codes round half to even.
template <typename x_t>
void quantize_int4_row(const x_t* x, int64_t D, int64_t group, uint8_t* packed, c10::Half* scale,
                       c10::Half* minimum) {
  constexpr float kEps = std::numeric_limits<float>::epsilon(), kFp16Max = 65504.f;
  for (int64_t g0 = 0; g0 < D; g0 += group) {
    float lo = static_cast<float>(x[g0]), hi = lo;
#ifdef QKILN_VEC_SIMD
    if (group % kW == 0) {
      Vf vlo = load(x + g0), vhi = vlo;
      for (int64_t j = g0 + kW; j < g0 + group; j += kW)
        vlo = vmin(vlo, load(x + j)), vhi = vmax(vhi, load(x + j));
      lo = reduce_min(vlo), hi = reduce_max(vhi);
    } else
#endif
    for (int64_t j = g0 + 1; j < g0 + group; ++j) {
      const float v = static_cast<float>(x[j]);
      lo = std::min(lo, v), hi = std::max(hi, v);
    }
    // Past 65504 an fp16 min / scale would be inf (attention NaN): the extremes saturate instead.
    const c10::Half mn = fp16_toward(std::clamp(lo, -kFp16Max, kFp16Max), false);
    const c10::Half sc = fp16_toward(std::clamp((hi - static_cast<float>(mn)) / 15.f, kEps, kFp16Max), true);
    minimum[g0 / group] = mn, scale[g0 / group] = sc;
    const float m = static_cast<float>(mn), s = static_cast<float>(sc);
#ifdef QKILN_VEC_SIMD
    if (group % kW == 0) {
      for (int64_t j = g0; j < g0 + group; j += kW) {
        Vf q = round_even(div(sub(load(x + j), set1(m)), set1(s)));
        q = vmin(vmax(q, set1(0.f)), set1(15.f));  // NaN -> 0 (maxps: 2nd operand)
        const __m128i pairs = to_u8(q);  // 8 words: even | odd << 8
        const __m128i merged = _mm_and_si128(_mm_or_si128(pairs, _mm_srli_epi16(pairs, 4)), _mm_set1_epi16(0xFF));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(packed + j / 2), _mm_packus_epi16(merged, merged));
      }
      continue;
    }
#endif
    for (int64_t j = g0; j < g0 + group; j += 2) {
      const auto code = [&](int64_t k) {
        const float q = std::nearbyint((static_cast<float>(x[k]) - m) / s);
        return static_cast<uint8_t>(q >= 0.f ? std::min(q, 15.f) : 0.f);  // NaN -> 0
      };
      packed[j / 2] = code(j) | code(j + 1) << 4;
    }
  }
}

}  // namespace

// key/value [N, Hkv, D] (rows at any stride, heads dense; each any float dtype) -> caches at
// slot_mapping [N] int64 (-1 skipped), in the cache's format (kv_cache.py, bit for bit): float
// caches convert; fp8 stores clamp(x / scale[h], +-448) rounded to e4m3; int4 stores packed codes
// and the per-(slot, head, group) fp16 scale and min (params: KVParams).
void cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slot_mapping, const KVParams& params) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == v_cache.scalar_type(),
              "cache_write: slot_mapping must be contiguous int64, caches contiguous of one dtype");
  const bool int4 = k_cache.scalar_type() == at::kByte;
  const int64_t N = key.size(0), Hkv = k_cache.size(2), D = cache_head_dim(k_cache);
  const int64_t width = Hkv * D, num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  params.check(k_cache, D, "cache_write");
  for (const at::Tensor* x : {&key, &value})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == N && x->size(1) == Hkv && x->size(2) == D &&
                x->stride(2) == 1 && x->stride(1) == x->size(2),
                "cache_write: key/value must be [N, Hkv, D] as the cache is, with dense heads");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == N, "cache_write: slot_mapping has ",
              slot_mapping.numel(), " slots for ", N, " rows");
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(slots[i] < num_slots, "cache_write: slot ", slots[i], " is past the cache");
  for (int which = 0; which < 2; ++which) {
    const at::Tensor& x = which ? value : key;
    at::Tensor& cache = which ? v_cache : k_cache;
    QKILN_DISPATCH(x.scalar_type(), "qkiln_cw_x", [&] {
      using x_t = scalar_t;
      const x_t* src = x.data_ptr<x_t>();
      if (int4) {
        const at::Tensor &gs = which ? *params.v_group_scale : *params.k_group_scale,
                         &gm = which ? *params.v_group_min : *params.k_group_min;
        const int64_t groups = gs.size(3), group = D / groups;
        uint8_t* dst = cache.data_ptr<uint8_t>();
        c10::Half *scale = gs.data_ptr<c10::Half>(), *minimum = gm.data_ptr<c10::Half>();
        for (int64_t i = 0; i < N; ++i) {
          if (slots[i] < 0) continue;
          for (int64_t h = 0; h < Hkv; ++h) {
            const int64_t at = slots[i] * Hkv + h;
            quantize_int4_row(src + i * x.stride(0) + h * D, D, group, dst + at * D / 2,
                              scale + at * groups, minimum + at * groups);
          }
        }
        return;
      }
      const c10::optional<at::Tensor>& head_scale = which ? params.v_scale : params.k_scale;
      QKILN_DISPATCH_KV(cache.scalar_type(), "qkiln_cw_c", [&] {
        using c_t = scalar_t;
        c_t* dst = cache.data_ptr<c_t>();
        for (int64_t i = 0; i < N; ++i) {
          if (slots[i] < 0) continue;
          const x_t* row = src + i * x.stride(0);
          c_t* slot = dst + slots[i] * width;
          if constexpr (std::is_same_v<c_t, c10::Float8_e4m3fn>) {
            const float* s = head_scale->data_ptr<float>();
            for (int64_t h = 0; h < Hkv; ++h)
              for (int64_t j = 0; j < D; j += kW) {
                const Vf v = clamp_abs(div(load(row + h * D + j, D - j), set1(s[h])), 448.f);
                store(slot + h * D + j, v, D - j);
              }
          } else if constexpr (std::is_same_v<x_t, c_t>) {
            std::memcpy(slot, row, width * sizeof(c_t));
          } else {
            for (int64_t j = 0; j < width; j += kW) store(slot + j, load(row + j, width - j), width - j);
          }
        }
      });
    });
  }
}
