// qkiln CPU GEMV / small-GEMM kernels for int8-weight linears at few rows (decode, M <= 16).
//
// Built with the other kernels by plugins/cpu_native.py; threads: at::parallel_for over tiles, or
// the caller's own partition of the tiles through Int8Gemv (qkiln_cpu.h; the decode stack).
//
// ---- int8 (W8A16), exact ----------------------------------------------------------------------
// weight int8 [out, K] row-major (canonical, no repacking: a tile of 4 output rows is already one
// contiguous block of 4K bytes), scales fp32 [out]: y[m,o] = s[o] * sum_k q[o,k] * x[m,k] + b[o],
// every product exact and the sums fp32, whatever x's dtype (no activation rounding):
//   - bf16 x, M >= 2: q -> fp32 -> bf16 is exact (|q| <= 128 has at most 8 significant bits), so
//     AVX512-BF16 vdpbf16ps (32 MACs per instruction) multiplies exactly; for M > 4 each tile is
//     converted once into an L1 buffer that the passes over 4 activation rows reuse.
//   - otherwise (fp32, fp16 widened exactly, bf16 at M = 1): AVX-512 fp32 FMA, 16 MACs per
//     instruction; at M = 1 the int8 -> fp32 conversion, not the FMA, is the limit, and the bf16
//     route's extra fp32 -> bf16 step measured ~15% slower.
// Tiles of 4 output rows share each activation load; accumulators per (row, output row) are split
// to hide the multiply-add latency at small M; the next tile is software-prefetched.
// Without AVX-512 (BF16, VL, BW): bf16 / fp16 x as 16-bit fixed point through vpmaddwd on AVX2
// (cpu_gemv_fixed16.cpp, ~2x faster), fp32 x through the AVX2 FMA loop (below), else plain C++.

#include "gemv_common.h"
#include "qkiln_cpu.h"

namespace {

// ---- int8 microkernels: one tile of kRows output rows (a contiguous block of the row-major
// weight) x MB activation rows; dots[m][r] = sum_k q[r,k] * x[m,k], exact products, fp32 sums.
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define QKILN_INT8_AVX512 1

// bf16 activations, 32 weights per step: q -> fp32 -> bf16 is exact (|q| <= 128 has at most 8
// significant bits), so every vdpbf16ps product is exact.
struct Int8Bf16 {
  static constexpr int64_t W = 32;
  static constexpr bool kPrefetch = true;
  using wtype = int8_t;
  using xtype = uint16_t;
  using mask_t = __mmask32;
  static mask_t tail(int64_t n) { return n >= 32 ? ~0u : (1u << n) - 1u; }
  static __m512i convert(__m128i lo, __m128i hi) {
    const __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    const __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    return (__m512i)_mm512_cvtne2ps_pbh(fhi, flo);  // words 0..15 come from flo
  }
  static __m512i weights(const int8_t* p) {
    return convert(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  static __m512i weights(const int8_t* p, mask_t mk) {
    return convert(_mm_maskz_loadu_epi8(static_cast<__mmask16>(mk), p),
                   _mm_maskz_loadu_epi8(static_cast<__mmask16>(mk >> 16), p + 16));
  }
  static __m512i acts(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static __m512i acts(const uint16_t* p, mask_t mk) { return _mm512_maskz_loadu_epi16(mk, p); }
  static __m512 madd(__m512 acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
};

// fp32 activations (fp16 is widened exactly), 16 weights per step: fp32 FMA.
struct Int8F32 {
  static constexpr int64_t W = 16;
  static constexpr bool kPrefetch = true;
  using wtype = int8_t;
  using xtype = float;
  using mask_t = __mmask16;
  static mask_t tail(int64_t n) { return n >= 16 ? 0xFFFF : (1u << n) - 1u; }
  static __m512 weights(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static __m512 weights(const int8_t* p, mask_t mk) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, p)));
  }
  static __m512 acts(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 acts(const float* p, mask_t mk) { return _mm512_maskz_loadu_ps(mk, p); }
  static __m512 madd(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bf16 steps over a tile converted once into an L1 buffer, for M > kMaxMB: the passes over
// activation rows reload it instead of converting again (M = 16: ~1.15x). The same for fp32
// measured ~15% slower than converting again, so fp32 x keeps Int8F32 (F32Pre below).
struct Bf16Pre : Int8Bf16 {
  static constexpr bool kPrefetch = false;  // convert_tile prefetches the int8 weights
  using wtype = uint16_t;
  static __m512i weights(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static __m512i weights(const uint16_t* p, mask_t mk) { return _mm512_maskz_loadu_epi16(mk, p); }
  // The tile's n = kRows * K contiguous weights -> dst[n + W]; prefetches the next tile.
  static void convert_tile(const int8_t* w, int64_t n, uint16_t* dst) {
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      if (i % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w) + int8_prefetch_distance(n) + i, _MM_HINT_T0);
      _mm512_storeu_si512(dst + i, Int8Bf16::weights(w + i));
    }
    if (i < n) _mm512_storeu_si512(dst + i, Int8Bf16::weights(w + i, tail(n - i)));
  }
};
using F32Pre = Int8F32;

// NACC accumulators per (m, r) break the multiply-add latency chain when MB is small.
template <class Ops, int MB>
struct Int8Acc {
  static constexpr int NACC = MB == 1 ? 4 : (MB == 2 ? 2 : 1);
  __m512 acc[MB][kRows][NACC];

  template <int A, bool Tail>
  inline void step(const typename Ops::wtype* w, int64_t K, const typename Ops::xtype* x, int64_t ldx,
                   int64_t k0, typename Ops::mask_t mk) {
    decltype(Ops::weights(w)) wv[kRows];
    for (int r = 0; r < kRows; ++r)
      wv[r] = Tail ? Ops::weights(w + r * K + k0, mk) : Ops::weights(w + r * K + k0);
    for (int m = 0; m < MB; ++m) {
      const auto xv = Tail ? Ops::acts(x + m * ldx + k0, mk) : Ops::acts(x + m * ldx + k0);
      for (int r = 0; r < kRows; ++r) acc[m][r][A] = Ops::madd(acc[m][r][A], wv[r], xv);
    }
  }

  template <size_t... A>
  inline void steps(const typename Ops::wtype* w, int64_t K, const typename Ops::xtype* x, int64_t ldx,
                    int64_t k0, std::index_sequence<A...>) {
    (step<A, false>(w, K, x, ldx, k0 + static_cast<int64_t>(A) * Ops::W, 0), ...);
  }
};

template <class Ops, int MB>
void int8_tile(const typename Ops::wtype* w, int64_t K, const typename Ops::xtype* x, int64_t ldx,
               float dots[kMaxMB][kRows]) {
  using Acc = Int8Acc<Ops, MB>;
  constexpr int64_t kStep = Acc::NACC * Ops::W;
  Acc a;
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < Acc::NACC; ++i) a.acc[m][r][i] = _mm512_setzero_ps();
  // The tiles are consecutive blocks of kRows * K bytes: walk a tile >= 4 KB ahead at the pace
  // this one is consumed. Measured on the 28 MB lm_head at M = 1: ~4 ms without, ~1.3 ms with
  // (the hardware prefetcher alone reached ~7 GB/s); 2 tiles ahead vs 1 at K = 576: ~5%.
  const char* ahead = reinterpret_cast<const char*>(w) + int8_prefetch_distance(kRows * K);
  int64_t k0 = 0;
  for (; k0 + kStep <= K; k0 += kStep, ahead += kRows * kStep) {
    if constexpr (Ops::kPrefetch)
      for (int64_t b = 0; b < kRows * kStep; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    a.steps(w, K, x, ldx, k0, std::make_index_sequence<Acc::NACC>{});
  }
  for (; k0 + Ops::W <= K; k0 += Ops::W) a.template step<0, false>(w, K, x, ldx, k0, 0);
  if (k0 < K) a.template step<0, true>(w, K, x, ldx, k0, Ops::tail(K - k0));
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) {
      __m512 sum = a.acc[m][r][0];
      for (int i = 1; i < Acc::NACC; ++i) sum = _mm512_add_ps(sum, a.acc[m][r][i]);
      dots[m][r] = _mm512_reduce_add_ps(sum);
    }
}

template <class Ops>
void int8_tile_rows(int MB, const typename Ops::wtype* w, int64_t K, const typename Ops::xtype* x,
                    int64_t ldx, float dots[kMaxMB][kRows]) {
  switch (MB) {
    case 1: int8_tile<Ops, 1>(w, K, x, ldx, dots); break;
    case 2: int8_tile<Ops, 2>(w, K, x, ldx, dots); break;
    case 3: int8_tile<Ops, 3>(w, K, x, ldx, dots); break;
    default: int8_tile<Ops, 4>(w, K, x, ldx, dots); break;
  }
}

#else  // AVX2 + FMA (8 weights per step), or plain C++

struct Int8F32 {
  using wtype = int8_t;
  using xtype = float;
};
using F32Pre = Int8F32;

template <int MB>
void int8_tile_avx2(const int8_t* w, int64_t K, const float* x, int64_t ldx,
                    float dots[kMaxMB][kRows]) {
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) dots[m][r] = 0.f;
  int64_t k0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // MB = 1: two accumulators per row, as 4 chains of dependent FMAs (latency 4) capped the rate.
  constexpr int NACC = MB == 1 ? 2 : 1;
  constexpr int64_t kStep = 8 * NACC;
  __m256 acc[MB][kRows][NACC];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r)
      for (int a = 0; a < NACC; ++a) acc[m][r][a] = _mm256_setzero_ps();
  // Walk the next tile(s) >= 4 KB ahead at this tile's pace, as the AVX-512 kernel does (the
  // hardware prefetcher alone left the 28 MB lm_head at ~9 GB/s at M = 1).
  const char* ahead = reinterpret_cast<const char*>(w) + int8_prefetch_distance(kRows * K);
  for (; k0 + kStep <= K; k0 += kStep, ahead += kRows * kStep) {
    for (int64_t b = 0; b < kRows * kStep; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    for (int a = 0; a < NACC; ++a) {
      __m256 wv[kRows];
      for (int r = 0; r < kRows; ++r)
        wv[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + r * K + k0 + 8 * a))));
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * ldx + k0 + 8 * a);
        for (int r = 0; r < kRows; ++r) acc[m][r][a] = _mm256_fmadd_ps(wv[r], xv, acc[m][r][a]);
      }
    }
  }
  for (; k0 + 8 <= K; k0 += 8) {
    for (int r = 0; r < kRows; ++r) {
      const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + r * K + k0))));
      for (int m = 0; m < MB; ++m)
        acc[m][r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k0), acc[m][r][0]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) {
      __m256 sum = acc[m][r][0];
      for (int a = 1; a < NACC; ++a) sum = _mm256_add_ps(sum, acc[m][r][a]);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, sum);
      for (float v : lanes) dots[m][r] += v;
    }
#endif
  for (int m = 0; m < MB; ++m)
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t k = k0; k < K; ++k) dots[m][r] += w[r * K + k] * x[m * ldx + k];
}

template <class Ops>
void int8_tile_rows(int MB, const int8_t* w, int64_t K, const float* x, int64_t ldx,
                    float dots[kMaxMB][kRows]) {
  switch (MB) {
    case 1: int8_tile_avx2<1>(w, K, x, ldx, dots); break;
    case 2: int8_tile_avx2<2>(w, K, x, ldx, dots); break;
    case 3: int8_tile_avx2<3>(w, K, x, ldx, dots); break;
    default: int8_tile_avx2<4>(w, K, x, ldx, dots); break;
  }
}

#endif

inline float as_float(float v) { return v; }
inline float as_float(uint16_t bits) {
  return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
}

// y[M, N] = (x[M, K] @ q^T) * s + b over tiles [begin, end); the last tile may be partial.
template <class Ops, class Pre, typename out_t>
void int8_gemm_tiles(const int8_t* w, const float* s, const float* b,
                     const typename Ops::xtype* x, int64_t M, int64_t K, int64_t N,
                     out_t* out, int64_t begin, int64_t end) {
  constexpr bool kUsePre = !std::is_same_v<Ops, Pre>;
  // + 32: convert_tile stores whole vectors, the last one past the tile's end.
  std::vector<typename Pre::wtype> converted(kUsePre && M > kMaxMB ? kRows * K + 32 : 0);
  float dots[kMaxMB][kRows];
  for (int64_t t = begin; t < end; ++t) {
    const int64_t rows = std::min(kRows, N - t * kRows);
    const int8_t* wt = w + t * kRows * K;
    if constexpr (kUsePre)
      if (!converted.empty() && rows == kRows) Pre::convert_tile(wt, kRows * K, converted.data());
    for (int64_t m0 = 0; m0 < M; m0 += kMaxMB) {
      const int MB = static_cast<int>(std::min(kMaxMB, M - m0));
      if (rows == kRows && !converted.empty()) {
        if constexpr (kUsePre) int8_tile_rows<Pre>(MB, converted.data(), K, x + m0 * K, K, dots);
      } else if (rows == kRows) {
        int8_tile_rows<Ops>(MB, wt, K, x + m0 * K, K, dots);
      } else {  // the partial last tile: plain loops, same exact products
        for (int m = 0; m < MB; ++m)
          for (int64_t r = 0; r < rows; ++r) {
            float d = 0.f;
            for (int64_t k = 0; k < K; ++k) d += wt[r * K + k] * as_float(x[(m0 + m) * K + k]);
            dots[m][r] = d;
          }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t o = t * kRows + r;
        for (int m = 0; m < MB; ++m)
          store_row(out, (m0 + m) * N + o, dots[m][r] * s[o] + (b ? b[o] : 0.f));
      }
    }
  }
}

}  // namespace

Int8Gemv::Int8Gemv(const at::Tensor& weight, const at::Tensor& scales, const float* bias_f32)
    : w(weight.data_ptr<int8_t>()), s(scales.data_ptr<float>()), bias(bias_f32),
      K(weight.size(1)), out_features(weight.size(0)), num_tiles((weight.size(0) + kRows - 1) / kRows) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == weight.size(0),
              "w8a16: needs int8 weight [out, K] and fp32 scales [out], contiguous");
}

// bf16 x feeds the vdpbf16ps kernel as is (M >= 2); otherwise x is widened to fp32 (exact).
void Int8Gemv::prepare(const at::Tensor& x, GemvActs& acts) const {
  if (int8_activations) return prepare_int8(x, acts);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "w8a16: x must be [M, in_features]");
  const int64_t M = x.size(0);
  acts.bf16.clear();
  acts.f32.clear();
#ifdef QKILN_FIXED16
  if (fixed_point_for(x)) return prepare_fixed(x.contiguous(), acts);
  acts.fixed_point = false;
#endif
#ifdef QKILN_INT8_AVX512
  if (x.scalar_type() == at::kBFloat16 && M >= 2) {
    acts.bf16.resize(M * K);
    const at::Tensor xc = x.contiguous();
    std::memcpy(acts.bf16.data(), xc.data_ptr<at::BFloat16>(), M * K * sizeof(uint16_t));
    return;
  }
#endif
  acts.f32.resize(M * K);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qkiln_x_f32", [&] {
    const at::Tensor xc = x.contiguous();
    const scalar_t* src = xc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M * K; ++i) acts.f32[i] = static_cast<float>(src[i]);
  });
}

void Int8Gemv::tiles(const GemvActs& acts, int64_t M, int64_t begin, int64_t end,
                     at::Tensor& y) const {
  if (int8_activations) return tiles_int8(acts, M, begin, end, y);
#ifdef QKILN_FIXED16
  if (acts.fixed_point) return tiles_fixed(acts, M, begin, end, y);
#endif
#ifdef QKILN_INT8_AVX512
  if (!acts.bf16.empty()) {
    TORCH_CHECK(y.scalar_type() == at::kBFloat16, "w8a16: bf16 activations give bf16 outputs");
    int8_gemm_tiles<Int8Bf16, Bf16Pre>(w, s, bias, acts.bf16.data(), M, K, out_features,
                                       y.data_ptr<at::BFloat16>(), begin, end);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "qkiln_w8a16", [&] {
    int8_gemm_tiles<Int8F32, F32Pre>(w, s, bias, acts.f32.data(), M, K, out_features,
                                     y.data_ptr<scalar_t>(), begin, end);
  });
}

// x [M, K] -> y [M, out] = x @ (weight int8 [out, K] * scales fp32 [out])^T + bias, x's dtype.
at::Tensor w8a16_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias) {
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const Int8Gemv gemv(weight, scales, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr);
  return gemv_all_tiles(gemv, x);
}

// Which int8 kernels this build compiled: "avx512" (vdpbf16ps for bf16 x, fp32 FMA otherwise),
// or "fallback" (AVX2 fixed point / FMA when available, else plain C++).
std::string int8_kernel_isa() {
#ifdef QKILN_INT8_AVX512
  return "avx512";
#else
  return "fallback";
#endif
}
