// qkiln CPU GEMV for int8 weights x int8 activations (opt-in, not exact): the int8 GEMV's weight
// as it is (row-major int8 [out, K], fp32 scales [out]; cpu_gemv_int8.cpp's header) with each
// activation row rounded to int8 per block of 32 channels (quantize_int8_rows, the codes of
// cpu_gemv_int4_a8.cpp and plugins/reference.py). Int8Gemv runs this instead of the exact kernel
// when its int8_activations is set (qkiln_cpu.h).
//
// Why: the exact AVX2 kernel widens every weight to fp32 (pmovsxbd, cvtdq2ps, FMA per 8 weights)
// and reaches ~12 G weights/s a core, so two cores stream the 28 MB SmolLM2 lm_head at ~25 GB/s,
// below the ~31 GB/s the int4 GEMV reads at. Here one vpmaddubsw multiplies 32 pairs:
//     y[m,o] = s[o] * sum_b sx[m,b] * dot_b(q[o], xq[m]) + bias[o]
// vpmaddubsw wants an unsigned operand: |q| times xq with q's sign (vpsignb), so each product is
// q * xq exactly, and a pair sums to at most 2 * 128 * 127 < 2^15: no saturation. Per block and
// row: vpabsb, vpsignb, vpmaddubsw, vpmaddwd by ones, one cvt and one FMA by sx[m,b].
// Rows: one pass reads RB rows of a tile for MB activation rows (MB * RB = 4), as the int4 one.
// Without AVX2: plain C++ over the same codes.

#include "gemv_common.h"
#include "qkiln_cpu.h"

namespace {

constexpr int64_t kBlock = 32;  // input channels per activation scale

#if defined(__AVX2__) && defined(__FMA__)
#define QKILN_INT8_A8_AVX2 1

// Rows r0 .. r0 + RB - 1 of one tile (w: its first row, row stride K) x MB activation rows (codes
// at xq, row m at xq + m * K; block scales at sx, row m at sx + m * KB) -> y[m][r] = sum_b sx *
// dot_b.
template <int MB, int RB>
void w8a8_rows(const int8_t* w, const int8_t* xq, const float* sx, int64_t K, int r0,
               float y[kMaxMB][kRows]) {
  __m256 acc[MB][RB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) acc[m][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t KB = K / kBlock;
  // The first pass walks the tile(s) >= 4 KB ahead at this tile's pace (as the exact kernel).
  const char* ahead = reinterpret_cast<const char*>(w) + int8_prefetch_distance(kRows * K);
  for (int64_t b = 0; b < KB; ++b, ahead += kRows * kBlock) {
    if (r0 == 0) {
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (r0 + r) * K + b * kBlock));
      const __m256i magnitude = _mm256_abs_epi8(q);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * kBlock));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, q));
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)),
                                    _mm256_broadcast_ss(sx + m * KB + b), acc[m][r]);
      }
    }
  }
  store_pass_sums<MB, RB>(acc, r0, y);
}

// One whole tile (output rows o0 .. o0 + 3) x MB activation rows -> out rows m * N + o0.
template <int MB, typename out_t>
void w8a8_tile(const int8_t* w, const float* s, const int8_t* xq, const float* sx, int64_t K,
               const float* bias, int64_t o0, int64_t N, out_t* out) {
  constexpr int RB = a8_rows_per_pass(MB);
  alignas(16) float y[kMaxMB][kRows];
  for (int r0 = 0; r0 < kRows; r0 += RB) w8a8_rows<MB, RB>(w, xq, sx, K, r0, y);
  const __m128 scale = _mm_loadu_ps(s + o0);
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
    __m128 v = _mm_mul_ps(_mm_load_ps(y[m]), scale);
    if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias + o0));
    store4(out + m * N + o0, v);
  }
}

template <typename out_t>
void w8a8_whole_tile(int MB, const int8_t* w, const float* s, const int8_t* xq, const float* sx,
                     int64_t K, const float* bias, int64_t o0, int64_t N, out_t* out) {
  switch (MB) {
    case 1: w8a8_tile<1>(w, s, xq, sx, K, bias, o0, N, out); break;
    case 2: w8a8_tile<2>(w, s, xq, sx, K, bias, o0, N, out); break;
    case 3: w8a8_tile<3>(w, s, xq, sx, K, bias, o0, N, out); break;
    default: w8a8_tile<4>(w, s, xq, sx, K, bias, o0, N, out); break;
  }
}

#endif

// Output rows o0 .. o0 + rows - 1 x MB activation rows in plain C++: the last tile when `out`
// is not a multiple of 4, and every tile without AVX2. Same integer dots, same fp32 steps.
template <typename out_t>
void w8a8_rows_plain(int MB, const int8_t* w, const float* s, const int8_t* xq, const float* sx,
                     int64_t K, const float* bias, int64_t o0, int64_t rows, int64_t N, out_t* out) {
  const int64_t KB = K / kBlock;
  for (int m = 0; m < MB; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < KB; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += w[r * K + b * kBlock + i] * xq[m * K + b * kBlock + i];
        total += static_cast<float>(dot) * sx[m * KB + b];
      }
      store_row(out, m * N + o0 + r, total * s[o0 + r] + (bias ? bias[o0 + r] : 0.f));
    }
}

}  // namespace

void Int8Gemv::prepare_int8(const at::Tensor& x, GemvActs& acts) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "w8a8_gemv: x must be [M, in_features]");
  quantize_int8_rows(x, K, 0, acts);
}

void Int8Gemv::tiles_int8(const GemvActs& acts, int64_t M, int64_t begin, int64_t end,
                          at::Tensor& y) const {
  const int64_t KB = K / kBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "qkiln_w8a8_gemv", [&] {
    scalar_t* out = y.data_ptr<scalar_t>();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * kRows, rows = std::min(kRows, out_features - o0);
      const int8_t* wt = w + o0 * K;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMB) {
        const int MB = static_cast<int>(std::min(kMaxMB, M - m0));
        const int8_t* xq = acts.codes.data() + m0 * K;
        const float* sx = acts.block_scales.data() + m0 * KB;
        scalar_t* rows_out = out + m0 * out_features;
#ifdef QKILN_INT8_A8_AVX2
        if (rows == kRows) {
          w8a8_whole_tile(MB, wt, s, xq, sx, K, bias, o0, out_features, rows_out);
          continue;
        }
#endif
        w8a8_rows_plain(MB, wt, s, xq, sx, K, bias, o0, rows, out_features, rows_out);
      }
    }
  });
}

// x [M, K] float/bf16/fp16 (K a multiple of 32) -> y [M, out] = rounded x @ (weight int8 [out, K]
// * scales fp32 [out])^T + bias, in x's dtype (the header).
at::Tensor w8a8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "w8a8_gemv: x must be [M, in_features]");
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  Int8Gemv gemv(weight, scales, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr);
  TORCH_CHECK(gemv.K % kBlock == 0, "w8a8_gemv: in_features must be a multiple of 32");
  gemv.int8_activations = true;
  return gemv_all_tiles(gemv, x);
}

// Which kernel w8a8_gemv compiled: "avx2" or "portable".
std::string int8_a8_kernel_isa() {
#ifdef QKILN_INT8_A8_AVX2
  return "avx2";
#else
  return "portable";
#endif
}
