// qkiln CPU ops for the bf16 serving path: paged decode attention over float KV caches, the cache
// write, and small fused elementwise ops (add + RMSNorm, SiLU-and-mul, rotary embedding).
//
// Built at first use by plugins/cpu_native.py as its own extension (qkiln_cpu_ops, -O3
// -march=native -ffp-contract=off), so a failure here never disables the int4 GEMVs.
// Threads: at::parallel_for (torch's intra-op pool). References: plugins/reference_small_ops.py
// and plugins/reference.py (attention).
//
// ---- decode attention ---------------------------------------------------------------------------
// One query row per sequence; task (sequence s, kv head h) reads the sequence's own T = seq_lens[s]
// slots through its block table (cache [blocks, block_size, Hkv, D]; no gather copy) and serves
// the GQA group of Hq / Hkv query heads in one pass over K and one over V (two-pass softmax,
// fp32 throughout; the scale is folded into the query like cpu_attention.py does):
//     scores[g, t] = (scale * q[g]) . K[t],  p = exp(scores - max),  out[g] = (p @ V) / sum(p)
// Slots past T are never read, so stale or NaN bytes in unused slots cannot leak.
//
// ---- elementwise ops: Hugging Face's eager rounding, op by op -----------------------------------
// Every intermediate that HF's bf16/fp16 code rounds to the activation dtype T is rounded here too
// (R = round to T, float math between):
//     add + RMSNorm   h = R(x + r);  y = R(h * 1 / sqrt(sum(h^2) / H + eps));  out = R(w * y)
//     SiLU and mul    out = R(R(g / (1 + exp(-g))) * u)           exp: torch's own Sleef_expf16_u10
//     RoPE            out = R(R(x * cos) + R(roll(x, D/2) * signed_sin))
// Only the fp32 order of sum(h^2) differs from torch, so results are bit-identical except where
// that changes a rounding. -ffp-contract=off keeps the compiler from fusing a rounded product
// into an FMA.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// float, bf16, fp16 (the kernels have no double path).
#define QKILN_DISPATCH(TYPE, NAME, ...)                                        \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)             \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace {

constexpr int kW = 16;  // floats per vector

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

using Vf = __m512;
inline __mmask16 lanes(int64_t n) { return n >= kW ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
inline Vf load(const float* p, int64_t n = kW) { return _mm512_maskz_loadu_ps(lanes(n), p); }
inline Vf load(const c10::BFloat16* p, int64_t n = kW) {
  const __m256i bits = _mm256_maskz_loadu_epi16(lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Vf load(const c10::Half* p, int64_t n = kW) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(n), p));
}
inline void store(float* p, Vf v, int64_t n = kW) { _mm512_mask_storeu_ps(p, lanes(n), v); }
// c10::BFloat16's rounding (nearest even on the bits; NaN -> 0x7FC0), not vcvtneps2bf16, which
// flushes denormals.
inline __m256i bf16_bits(Vf v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline void store(c10::BFloat16* p, Vf v, int64_t n = kW) {
  _mm256_mask_storeu_epi16(p, lanes(n), bf16_bits(v));
}
inline void store(c10::Half* p, Vf v, int64_t n = kW) {
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vf set1(float x) { return _mm512_set1_ps(x); }
inline Vf add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf sub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf div(Vf a, Vf b) { return _mm512_div_ps(a, b); }
inline Vf vmax(Vf a, Vf b) { return _mm512_max_ps(a, b); }
inline Vf fmadd(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(Vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(Vf v) { return _mm512_reduce_max_ps(v); }
// Round to T and back (identity for float).
template <typename T> inline Vf round_to(Vf v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}

// v[0..15] -> lane i = sum of v[i]'s lanes: a shuffle tree (30 shuffles for 16 sums, against ~64
// for 16 separate horizontal reductions).
inline Vf sum16(const Vf* v) {
  Vf s2[8], s4[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit quarter: [a0+a2, b0+b2, a1+a3, b1+b3]
    s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                          _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per quarter: [a, b, c, d] partial sums
    const __m512d x = _mm512_castps_pd(s2[2 * i]), y = _mm512_castps_pd(s2[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const Vf x = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], 0x88), _mm512_shuffle_f32x4(s4[0], s4[1], 0xDD));
  const Vf y = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], 0x88), _mm512_shuffle_f32x4(s4[2], s4[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// torch's Vectorized<float>::exp is Sleef_expf16_u10 (exported by libtorch_cpu); using the same
// function keeps SiLU bit-identical. Looked up at run time so a torch without it still loads us.
using ExpFn = __m512 (*)(__m512);
ExpFn sleef_exp() {
  static const ExpFn fn = [] {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    return lib ? reinterpret_cast<ExpFn>(dlsym(lib, "Sleef_expf16_u10")) : nullptr;
  }();
  return fn;
}
inline Vf vexp(Vf v) {
  static const ExpFn fn = sleef_exp();
  if (fn) return fn(v);
  alignas(64) float x[kW];
  _mm512_store_ps(x, v);
  for (float& e : x) e = std::exp(e);
  return _mm512_load_ps(x);
}
bool exp_is_torchs() { return sleef_exp() != nullptr; }

#else  // portable: the same kernels over 16-float structs

struct Vf { float x[kW]; };
template <typename T> inline Vf load(const T* p, int64_t n = kW) {
  Vf v{};
  for (int64_t i = 0; i < std::min<int64_t>(n, kW); ++i) v.x[i] = static_cast<float>(p[i]);
  return v;
}
template <typename T> inline void store(T* p, Vf v, int64_t n = kW) {
  for (int64_t i = 0; i < std::min<int64_t>(n, kW); ++i) p[i] = static_cast<T>(v.x[i]);
}
template <typename F> inline Vf map2(Vf a, Vf b, F f) { for (int i = 0; i < kW; ++i) a.x[i] = f(a.x[i], b.x[i]); return a; }
inline Vf set1(float x) { Vf v; for (float& e : v.x) e = x; return v; }
inline Vf add(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return p + q; }); }
inline Vf sub(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return p - q; }); }
inline Vf mul(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return p * q; }); }
inline Vf div(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return p / q; }); }
inline Vf vmax(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return std::max(p, q); }); }
inline Vf fmadd(Vf a, Vf b, Vf c) { return add(mul(a, b), c); }
inline float reduce_add(Vf v) { float s = 0.f; for (float e : v.x) s += e; return s; }
inline float reduce_max(Vf v) { float s = v.x[0]; for (float e : v.x) s = std::max(s, e); return s; }
template <typename T> inline Vf round_to(Vf v) {
  for (float& e : v.x) e = static_cast<float>(static_cast<T>(e));
  return v;
}
inline Vf vexp(Vf v) { for (float& e : v.x) e = std::exp(e); return v; }
inline Vf sum16(const Vf* v) { Vf r; for (int i = 0; i < kW; ++i) r.x[i] = reduce_add(v[i]); return r; }
bool exp_is_torchs() { return false; }

#endif

// ---- decode attention -----------------------------------------------------------------------------

struct Decode {
  const int32_t* tables;
  int64_t max_blocks, block_size, num_kv_heads, head_dim, group;
  float scale;
};

// Softmax numerators in place over scores [G, T]; returns 1 / denominator per row in inv_sum.
inline void softmax_rows(float* scores, int64_t G, int64_t T, float* inv_sum) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * T;
    Vf m = set1(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + kW <= T; t += kW) m = vmax(m, load(s + t));
    float top = reduce_max(m);
    for (; t < T; ++t) top = std::max(top, s[t]);
    const Vf shift = set1(top);
    Vf total = set1(0.f);
    for (int64_t t = 0; t < T; t += kW) {
      store(s + t, vexp(sub(load(s + t, T - t), shift)), T - t);
      total = add(total, load(s + t, T - t));
    }
    inv_sum[g] = 1.f / reduce_add(total);
  }
}

// One (sequence, kv head): q [group, D] (row-contiguous heads), K/V rows at stride Hkv * D,
// out [group, D]. buf holds the scaled query, the accumulators and the scores.
template <typename kv_t, typename q_t, typename o_t>
void decode_head(const Decode& a, const q_t* q, const kv_t* k_head, const kv_t* v_head,
                 const int32_t* table, int64_t T, o_t* out, std::vector<float>& buf) {
  const int64_t D = a.head_dim, G = a.group, row_stride = a.num_kv_heads * D;
  const int64_t block_stride = a.block_size * row_stride;
  buf.resize(2 * G * D + G * T);
  float *qf = buf.data(), *acc = qf + G * D, *scores = acc + G * D;  // [G, D], [G, D], [G, T]
  const Vf scale = set1(a.scale);
  for (int64_t i = 0; i < G * D; i += kW) {
    store(qf + i, mul(load(q + i), scale));
    store(acc + i, set1(0.f));
  }
  for (int64_t t0 = 0, b = 0; t0 < T; t0 += a.block_size, ++b) {  // pass 1: scores
    const kv_t* rows = k_head + table[b] * block_stride;
    for (int64_t t = t0; t < std::min(T, t0 + a.block_size); ++t, rows += row_stride) {
      for (int64_t g = 0; g < G; ++g) {
        Vf dot = set1(0.f);
        for (int64_t d = 0; d < D; d += kW) dot = fmadd(load(qf + g * D + d), load(rows + d), dot);
        scores[g * T + t] = reduce_add(dot);
      }
    }
  }
  std::vector<float> inv_sum(G);
  softmax_rows(scores, G, T, inv_sum.data());
  for (int64_t t0 = 0, b = 0; t0 < T; t0 += a.block_size, ++b) {  // pass 2: p @ V
    const kv_t* rows = v_head + table[b] * block_stride;
    for (int64_t t = t0; t < std::min(T, t0 + a.block_size); ++t, rows += row_stride) {
      for (int64_t d = 0; d < D; d += kW) {
        const Vf v = load(rows + d);
        for (int64_t g = 0; g < G; ++g)
          store(acc + g * D + d, fmadd(set1(scores[g * T + t]), v, load(acc + g * D + d)));
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; d += kW)
      store(out + g * D + d, mul(load(acc + g * D + d), set1(inv_sum[g])));
}

// decode_head for D = 16 * NV: the query row and the accumulators live in registers, scores are
// reduced 16 tokens at a time (sum16), and each 16-token tile of K/V is read once from memory and
// served to the whole GQA group from L1.
template <int NV, typename kv_t, typename q_t, typename o_t>
void decode_head_tiled(const Decode& a, const q_t* q, const kv_t* k_head, const kv_t* v_head,
                       const int32_t* table, int64_t T, o_t* out, std::vector<float>& buf) {
  constexpr int64_t D = NV * kW;
  const int64_t G = a.group, row_stride = a.num_kv_heads * D, bs = a.block_size;
  buf.resize(2 * G * D + G * T + G);
  float *qf = buf.data(), *acc = qf + G * D, *scores = acc + G * D;  // [G, D], [G, D], [G, T]
  float* inv_sum = scores + G * T;
  for (int64_t i = 0; i < G * D; i += kW) {
    store(qf + i, mul(load(q + i), set1(a.scale)));
    store(acc + i, set1(0.f));
  }
  int64_t offsets[kW];  // element offsets of the tile's rows in k_head / v_head
  auto tile_rows = [&](int64_t t0, int64_t n) {
    int64_t b = t0 / bs, o = t0 % bs;
    for (int64_t i = 0; i < n; ++i) {
      offsets[i] = (table[b] * bs + o) * row_stride;
      if (++o == bs) o = 0, ++b;
    }
  };
  for (int64_t t0 = 0; t0 < T; t0 += kW) {  // pass 1: scores
    const int64_t n = std::min<int64_t>(kW, T - t0);
    tile_rows(t0, n);
    for (int64_t g = 0; g < G; ++g) {
      Vf qv[NV], dots[kW];
      for (int j = 0; j < NV; ++j) qv[j] = load(qf + g * D + j * kW);
      for (int i = 0; i < kW; ++i) {
        if (i >= n) { dots[i] = set1(0.f); continue; }
        const kv_t* row = k_head + offsets[i];
        Vf d = mul(qv[0], load(row));
        for (int j = 1; j < NV; ++j) d = fmadd(qv[j], load(row + j * kW), d);
        dots[i] = d;
      }
      store(scores + g * T + t0, sum16(dots), n);
    }
  }
  softmax_rows(scores, G, T, inv_sum);
  for (int64_t t0 = 0; t0 < T; t0 += kW) {  // pass 2: p @ V
    const int64_t n = std::min<int64_t>(kW, T - t0);
    tile_rows(t0, n);
    for (int64_t g = 0; g < G; ++g) {
      Vf even[NV], odd[NV];  // two chains halve the FMA latency chain
      for (int j = 0; j < NV; ++j) even[j] = load(acc + g * D + j * kW), odd[j] = set1(0.f);
      const float* p = scores + g * T + t0;
      int64_t i = 0;
      for (; i + 1 < n; i += 2) {
        const kv_t *r0 = v_head + offsets[i], *r1 = v_head + offsets[i + 1];
        const Vf p0 = set1(p[i]), p1 = set1(p[i + 1]);
        for (int j = 0; j < NV; ++j) {
          even[j] = fmadd(p0, load(r0 + j * kW), even[j]);
          odd[j] = fmadd(p1, load(r1 + j * kW), odd[j]);
        }
      }
      if (i < n)
        for (int j = 0; j < NV; ++j) even[j] = fmadd(set1(p[i]), load(v_head + offsets[i] + j * kW), even[j]);
      for (int j = 0; j < NV; ++j) store(acc + g * D + j * kW, add(even[j], odd[j]));
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; d += kW)
      store(out + g * D + d, mul(load(acc + g * D + d), set1(inv_sum[g])));
}

}  // namespace

// Decode rows of a paged attention step: every sequence s with exactly one query row (at row
// query_start_loc[s]) gets out[row] (out [N, Hq, D], any float dtype; other rows untouched).
// query [N, Hq, D] (rows at any stride, heads dense: a view of the fused qkv); caches [blocks, block_size, Hkv, D] bf16/fp16/fp32, D % 16 == 0.
void paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                            double scale, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2) &&
              out.is_contiguous() && out.sizes() == query.sizes(),
              "query must be [N, Hq, D] with dense heads, out contiguous [N, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype(),
              "k_cache and v_cache must be contiguous [blocks, block_size, Hkv, D] of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              query_start_loc.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "block_tables, seq_lens, query_start_loc must be contiguous int32");
  const int64_t num_seqs = seq_lens.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % kW == 0 && Hq % Hkv == 0 &&
              query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "paged_decode_attention: shapes do not match (needs head_dim % 16 == 0)");
  const Decode a{block_tables.data_ptr<int32_t>(), block_tables.size(1), k_cache.size(1), Hkv, D,
                 Hq / Hkv, static_cast<float>(scale)};
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  QKILN_DISPATCH(k_cache.scalar_type(), "qkiln_decode_kv", [&] {
    using kv_t = scalar_t;
    const kv_t* kp = k_cache.data_ptr<kv_t>();
    const kv_t* vp = v_cache.data_ptr<kv_t>();
    QKILN_DISPATCH(query.scalar_type(), "qkiln_decode_q", [&] {
      using q_t = scalar_t;
      const q_t* qp = query.data_ptr<q_t>();
      QKILN_DISPATCH(out.scalar_type(), "qkiln_decode_o", [&] {
        scalar_t* op = out.data_ptr<scalar_t>();
        at::parallel_for(0, num_seqs * Hkv, 1, [&](int64_t begin, int64_t end) {
          thread_local std::vector<float> buf;
          for (int64_t i = begin; i < end; ++i) {
            const int64_t s = i / Hkv, h = i % Hkv, row = starts[s], T = lens[s];
            if (starts[s + 1] - row != 1) continue;  // a prefill chunk: not ours
            const int64_t offset = (row * Hq + h * a.group) * D;  // in out
            if (T <= 0) {
              for (int64_t j = 0; j < a.group * D; ++j) op[offset + j] = 0;
              continue;
            }
            const q_t* qrow = qp + row * query.stride(0) + h * a.group * D;
            const int32_t* table = a.tables + s * a.max_blocks;
            if (D == 64)
              decode_head_tiled<4>(a, qrow, kp + h * D, vp + h * D, table, T, op + offset, buf);
            else if (D == 128)
              decode_head_tiled<8>(a, qrow, kp + h * D, vp + h * D, table, T, op + offset, buf);
            else
              decode_head(a, qrow, kp + h * D, vp + h * D, table, T, op + offset, buf);
          }
        });
      });
    });
  });
}

// key/value [N, Hkv, D] (rows at any stride, heads dense) -> caches at slot_mapping [N] int64
// (-1 skipped), converted to the cache dtype (float caches only).
void cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              k_cache.is_contiguous() && v_cache.is_contiguous(),
              "cache_write: slot_mapping must be contiguous int64, caches contiguous");
  const int64_t N = key.size(0), width = k_cache.size(2) * k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (const at::Tensor* x : {&key, &value})
    TORCH_CHECK(x->dim() == 3 && x->size(1) * x->size(2) == width && x->stride(2) == 1 &&
                x->stride(1) == x->size(2) && x->dtype() == key.dtype(),
                "cache_write: key/value must be [N, Hkv, D] with dense heads");
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(slots[i] < num_slots, "cache_write: slot ", slots[i], " is past the cache");
  QKILN_DISPATCH(k_cache.scalar_type(), "qkiln_cw_c", [&] {
    using c_t = scalar_t;
    QKILN_DISPATCH(key.scalar_type(), "qkiln_cw_x", [&] {
      for (auto [x, cache] : {std::pair{&key, &k_cache}, std::pair{&value, &v_cache}}) {
        const scalar_t* src = x->data_ptr<scalar_t>();
        c_t* dst = cache->data_ptr<c_t>();
        for (int64_t i = 0; i < N; ++i) {
          if (slots[i] < 0) continue;
          const scalar_t* row = src + i * x->stride(0);
          c_t* slot = dst + slots[i] * width;
          if constexpr (std::is_same_v<scalar_t, c_t>) {
            std::memcpy(slot, row, width * sizeof(c_t));
          } else {
            for (int64_t j = 0; j < width; j += kW) store(slot + j, load(row + j, width - j), width - j);
          }
        }
      }
    });
  });
}

// ---- elementwise ops (see the header for the rounding) -------------------------------------------

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // below this, one thread: a parallel region costs more

template <typename F>
void for_rows(int64_t rows, int64_t width, const F& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) body(r);
                   });
}

// One row: (residual ? h = R(x + residual) -> residual : h = x); x_out = R(w * R(h * inv_rms)).
template <typename T>
void norm_row(const T* x, T* residual, const T* w, T* out, int64_t H, float eps) {
  Vf sumsq = set1(0.f);
  const T* h = x;
  if (residual) {
    for (int64_t i = 0; i < H; i += kW) store(residual + i, add(load(x + i, H - i), load(residual + i, H - i)), H - i);
    h = residual;
  }
  for (int64_t i = 0; i < H; i += kW) {
    const Vf v = load(h + i, H - i);
    sumsq = add(sumsq, mul(v, v));
  }
  // torch: mean = sum / H, then + eps, then rsqrt (1 / sqrt, two roundings).
  const float inv = 1.f / std::sqrt(reduce_add(sumsq) / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; i += kW) {
    const Vf y = round_to<T>(mul(load(h + i, H - i), set1(inv)));
    store(out + i, mul(load(w + i, H - i), y), H - i);
  }
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 &&
              x.size(-1) == weight.size(0) && x.dtype() == weight.dtype(),
              "rms_norm: x must be contiguous [..., H] and weight [H] of x's dtype");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  QKILN_DISPATCH(x.scalar_type(), "qkiln_rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, H, [&](int64_t r) {
      norm_row<scalar_t>(xp + r * H, nullptr, wp, op + r * H, H, static_cast<float>(eps));
    });
  });
  return out;
}

// vLLM's fused_add_rms_norm: residual = R(x + residual); x = rms_norm(residual) * weight.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.dtype() == x.dtype(),
              "fused_add_rms_norm: residual must be contiguous and match x");
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  QKILN_DISPATCH(x.scalar_type(), "qkiln_add_rms_norm", [&] {
    scalar_t *xp = x.data_ptr<scalar_t>(), *rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    for_rows(rows, H, [&](int64_t r) {
      norm_row<scalar_t>(xp + r * H, rp + r * H, wp, xp + r * H, H, static_cast<float>(eps));
    });
  });
}

// gate_up [..., 2I] contiguous -> R(R(silu(gate)) * up) [..., I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_and_mul: needs a contiguous [..., 2 * I] tensor");
  const int64_t I = gate_up.size(-1) / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options());
  QKILN_DISPATCH(gate_up.scalar_type(), "qkiln_silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, 2 * I, [&](int64_t r) {
      const scalar_t *g = in + r * 2 * I, *u = g + I;
      for (int64_t i = 0; i < I; i += kW) {
        const Vf x = load(g + i, I - i);
        const Vf silu = round_to<scalar_t>(div(x, add(set1(1.f), vexp(sub(set1(0.f), x)))));
        store(op + r * I + i, mul(silu, load(u + i, I - i)), I - i);
      }
    });
  });
  return out;
}

// In place on heads [0, num_heads) of qkv [N, H_total, D] (rows at any stride, heads dense);
// cos, signed_sin [N, D] contiguous, qkv's dtype (runtime/rope.py's tables).
void rotary_embedding(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                      int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2) &&
              qkv.size(2) % 2 == 0 && num_heads <= qkv.size(1),
              "rotary_embedding: qkv must be [N, H, D] with dense heads, even D");
  const int64_t N = qkv.size(0), D = qkv.size(2), half = D / 2;
  for (const at::Tensor* t : {&cos, &signed_sin})
    TORCH_CHECK(t->is_contiguous() && t->numel() == N * D && t->dtype() == qkv.dtype(),
                "rotary_embedding: cos/sin must be contiguous [N, D] in qkv's dtype");
  QKILN_DISPATCH(qkv.scalar_type(), "qkiln_rope", [&] {
    using T = scalar_t;
    T* base = qkv.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *sp = signed_sin.data_ptr<T>();
    for_rows(N, num_heads * D, [&](int64_t n) {
      const T *c = cp + n * D, *s = sp + n * D;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x = base + n * qkv.stride(0) + h * D;
        for (int64_t i = 0; i < half; i += kW) {
          const int64_t m = half - i;
          const Vf x1 = load(x + i, m), x2 = load(x + half + i, m);
          const Vf y1 = add(round_to<T>(mul(x1, load(c + i, m))), round_to<T>(mul(x2, load(s + i, m))));
          const Vf y2 = add(round_to<T>(mul(x2, load(c + half + i, m))),
                            round_to<T>(mul(x1, load(s + half + i, m))));
          store(x + i, y1, m);
          store(x + half + i, y2, m);
        }
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode rows of paged attention");
  m.def("cache_write", &cache_write, "write K/V rows into float paged caches");
  m.def("rms_norm", &rms_norm, "RMSNorm with Hugging Face's rounding");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE in place");
  m.def("exp_is_torchs", &exp_is_torchs, "whether SiLU uses torch's own vector exp");
}
