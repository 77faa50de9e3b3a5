// qkiln CPU GEMVs for int4 and int8 weights on AVX2 hosts (no AVX512-BF16), bf16 / fp16
// activations as 16-bit fixed point: one power-of-two scale per group of channels (int4: the
// weight group; int8: 128 channels), int32 dot products through vpmaddwd. Int4Gemv / Int8Gemv run
// these where QKILN_FIXED16 is defined and x is bf16 or fp16; fp32 x takes the fp32 FMA kernels
// of cpu_gemv_int4.cpp / cpu_gemv_int8.cpp (exact fp32 rows), which these were measured against.
//
// Why: AVX2 has no bf16 dot product, so the FMA kernels turn every weight into an fp32 number
// first (int4, per 16 weights a row: a shift, an AND, an OR, two unpacks, two FMAs; int8: two
// sign extensions, two conversions, two FMAs) and are compute-bound at batch 1. vpmaddwd
// multiplies 16 int16 pairs an instruction: per 16 weights a row, one vpmaddwd and one vpaddd,
// plus a shift and/or an AND (int4: 6 for a chunk's 4 nibble sets) or a sign extension (int8).
// Measured (AVX2 EPYC, 2 threads, 30 distinct layers from memory, median of 7, same process):
// int4 M = 1 gate_up 3072 x 576 70.2 -> 62.4 us (1 thread 181 -> 102), qkv 960 x 576 23.5 ->
// 13.7, down 576 x 1536 39.4 -> 24.4; M = 4 1.13-1.40x. SmolLM2 W4A16 batch-1 decode, `qkiln bench
// latency`, switch on / off in turn: 4.95 ms a step against 6.17.
//
// Math, activation row m, group g of channels (int4: G = the weight group; int8: 128):
//     e = the binary exponent of amax = max |x[m, k in g]| (amax < 2^e <= 2 amax),
//     sx[m,g] = 2^(e - 15),   xi[m,k] = round(x[m,k] / sx)  (|xi| <= 32767)
//   int4: y[m,o] = sum_g s[o,g] sx[m,g] dot_g(q[o], xi[m])  -  sum_g s[o,g] z[o,g] xsum[m,g]
//         xsum[m,g] = sx[m,g] sum_{k in g} xi[m,k],   s z = c - 16 s   (c: the layout's zero term)
//   int8: y[m,o] = s[o] sum_g sx[m,g] dot_g(q[o], xi[m])
// dot_g is exact in int32. The division by sx is exact for every value within 2^7 of amax in bf16
// (8 significant bits; fp16: 11 bits, 2^4 of amax): those activations are the same numbers the FMA
// kernels multiply, and their products are summed without rounding. A value further below amax is
// rounded to a multiple of sx, under 2^-15 of 2 amax: less than a quarter of an ulp of amax in
// bf16 (2^-8 relative), the rounding bf16 already put on the group's largest term. NaN or inf in a
// group makes that group's sx (and xsum) NaN: every output of the row is NaN, as from the FMA
// kernels (inf - inf, inf * 0). QKILN_FIXED16=0 turns both off (read per call: A/B timings).

#include <cmath>
#include <limits>

#include "gemv_common.h"
#include "qkiln_cpu.h"
#include "vec.h"

#ifdef QKILN_FIXED16

namespace {

// Output rows a pass reads for MB activation rows: the int32 accumulators of all (m, r) and the
// activation vectors in the 16 ymm registers (the float totals live in memory: a group end only).
constexpr int fixed_rows_per_pass(int MB) { return MB <= 2 ? 4 : 2; }

template <int N>
inline __m256i nibble_set(__m256i words) {  // nibble set N of 16 words (the layout) as int16 q
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  if constexpr (N == 0) return _mm256_and_si256(words, low4);
  else if constexpr (N == 3) return _mm256_srli_epi16(words, 12);
  else return _mm256_and_si256(_mm256_srli_epi16(words, 4 * N), low4);
}

template <int MB>
struct FixedAcc {
  static constexpr int RB = fixed_rows_per_pass(MB);
  __m256i group[MB][RB];  // this group's dot(q, xi) in 8 int32 lanes
  __m256 total[MB][RB];   // sum over finished groups of s sx dot

  // Nibble sets N and N + 1 of rows r0.. of one chunk against xi[m][16N .. 16N + 31].
  template <int N>
  inline void half(const uint8_t* rows, const int16_t* x, int64_t K_p) {
    __m256i xv[MB][2];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < 2; ++n)
        xv[m][n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K_p + 16 * (N + n)));
    for (int r = 0; r < RB; ++r) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * 32));
      const __m256i q[2] = {nibble_set<N>(words), nibble_set<N + 1>(words)};
      for (int n = 0; n < 2; ++n)
        for (int m = 0; m < MB; ++m)
          group[m][r] = _mm256_add_epi32(group[m][r], _mm256_madd_epi16(q[n], xv[m][n]));
    }
  }

  // Group end: s[r] this group's weight scales, sx[m * num_groups] its activation scales.
  inline void flush(const float* s, const float* sx, int64_t num_groups) {
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < RB; ++r) {
        const __m256 scale = _mm256_set1_ps(s[r] * sx[m * num_groups]);
        total[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group[m][r]), scale, total[m][r]);
        group[m][r] = _mm256_setzero_si256();
      }
  }
};

// Rows r0 .. r0 + RB - 1 of one tile x MB activation rows -> dots[m][r] = sum_g s sx dot_g(q, xi).
template <int MB>
void fixed_rows(const uint8_t* w, const float* s, const int16_t* x, const float* sx, int64_t K_p,
                int64_t K, int64_t G, int64_t num_groups, int r0, float dots[kMaxMB][kRows]) {
  using Acc = FixedAcc<MB>;
  Acc acc;
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < Acc::RB; ++r) {
      acc.group[m][r] = _mm256_setzero_si256();
      acc.total[m][r] = _mm256_setzero_ps();
    }
  s += r0;
  int64_t group_end = std::min(G, K);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk, w += kRows * 32) {
    if (r0 == 0) {  // the first pass streams the tile from memory (the FMA kernel's prefetch)
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
    }
    const uint8_t* rows = w + r0 * 32;
    acc.template half<0>(rows, x + k0, K_p);
    if (k0 + 32 == group_end) {
      acc.flush(s, sx++, num_groups);
      s += kRows;
      group_end = std::min(group_end + G, K);
    }
    if (k0 + 32 == K) break;  // K % 64 == 32: the chunk's second half is padding
    acc.template half<2>(rows, x + k0, K_p);
    if (k0 + 64 == group_end) {
      acc.flush(s, sx++, num_groups);
      s += kRows;
      group_end = std::min(group_end + G, K);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < Acc::RB; ++r) dots[m][r0 + r] = hsum(acc.total[m][r]);
}

template <int MB>
void fixed_tile(const uint8_t* w, const float* s, const int16_t* x, const float* sx, int64_t K_p,
                int64_t K, int64_t G, int64_t num_groups, float dots[kMaxMB][kRows]) {
  for (int r0 = 0; r0 < kRows; r0 += fixed_rows_per_pass(MB))
    fixed_rows<MB>(w, s, x, sx, K_p, K, G, num_groups, r0, dots);
}

// One tile's dots -> output rows: minus the zero term sum_g (c - 16 s) xsum, plus the bias.
template <typename out_t>
void finish_fixed_tile(const float dots[kMaxMB][kRows], int MB, const float* s4, const float* c4,
                       const float* xsum, int64_t num_groups, const float* bias, int64_t o0,
                       int64_t N, out_t* out) {
  const int64_t rows = std::min<int64_t>(kRows, N - o0);
  for (int m = 0; m < MB; ++m) {
    const float* xs = xsum + m * num_groups;
    __m128 v = _mm_loadu_ps(dots[m]);
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m128 sz = _mm_fnmadd_ps(_mm_set1_ps(16.f), _mm_loadu_ps(s4 + g * kRows),
                                      _mm_loadu_ps(c4 + g * kRows));
      v = _mm_fnmadd_ps(sz, _mm_set1_ps(xs[g]), v);
    }
    if (rows == kRows) {
      if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias + o0));
      store4(out + m * N + o0, v);
    } else {
      alignas(16) float tmp[kRows];
      _mm_store_ps(tmp, v);
      for (int64_t r = 0; r < rows; ++r)
        store_row(out, m * N + o0 + r, tmp[r] + (bias ? bias[o0 + r] : 0.f));
    }
  }
}

// One group of one row (n values) -> codes at xi[0 .. n rounded up to 16) (zeros past n);
// returns xsum and sets *sx.
template <typename scalar_t>
float fixed_group(const scalar_t* x, int64_t n, int16_t* xi, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += kW) {
    const Vf v = load(x + k, n - k);
    amax = _mm256_max_ps(amax, _mm256_max_ps(_mm256_andnot_ps(sign, v.lo), _mm256_andnot_ps(sign, v.hi)));
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(v.lo, v.lo, _CMP_UNORD_Q),
                                         _mm256_cmp_ps(v.hi, v.hi, _CMP_UNORD_Q)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  const float top = *std::max_element(lanes, lanes + 8);
  if (_mm256_movemask_ps(nan) || std::isinf(top)) {  // the group's outputs are NaN (the header)
    std::fill(xi, xi + (n + kW - 1) / kW * kW, int16_t{0});
    *sx = std::numeric_limits<float>::quiet_NaN();
    return *sx;
  }
  int e = 0;
  std::frexp(top, &e);  // top < 2^e; 0 -> e = 0 (all codes 0)
  e = std::max(e, -100);  // 2^(15 - e) stays a normal fp32 number
  const __m256 up = _mm256_set1_ps(std::ldexp(1.f, 15 - e));  // exact: a power of two
  __m256i sums = _mm256_setzero_si256();
  for (int64_t k = 0; k < n; k += kW) {
    const Vf v = load(x + k, n - k);
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v.lo, up));  // nearest even (MXCSR default)
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v.hi, up));
    sums = _mm256_add_epi32(sums, _mm256_add_epi32(lo, hi));
    // packs interleaves the 128-bit lanes; the permute puts the 16 codes back in k order
    const __m256i codes = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xi + k), codes);
  }
  alignas(32) int32_t isum[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(isum), sums);
  int64_t total = 0;
  for (int i = 0; i < 8; ++i) total += isum[i];
  *sx = std::ldexp(1.f, e - 15);
  return *sx * static_cast<float>(total);
}

// x [M, K] bf16 / fp16 (contiguous) -> acts.fixed [M, ldx] (zeros past K) and acts.fixed_scales
// [M, num_groups], groups of `group` channels; with xsum, also each group's scaled code sum there
// [M, num_groups] (the int4 zero term's). Both GEMVs' prepare_fixed.
void fixed_point_rows(const at::Tensor& x, int64_t ldx, int64_t group, GemvActs& acts, float* xsum) {
  const int64_t M = x.size(0), K = x.size(1), num_groups = (K + group - 1) / group;
  acts.fixed.resize(M * ldx);
  acts.fixed_scales.resize(M * num_groups);
  auto rows = [&](const auto* src) {
    for (int64_t m = 0; m < M; ++m) {
      int16_t* xi = acts.fixed.data() + m * ldx;
      std::fill(xi + K, xi + ldx, int16_t{0});
      for (int64_t g = 0; g < num_groups; ++g) {
        const int64_t k0 = g * group;
        const float sum = fixed_group(src + m * K + k0, std::min(group, K - k0), xi + k0,
                                      &acts.fixed_scales[m * num_groups + g]);
        if (xsum) xsum[m * num_groups + g] = sum;
      }
    }
  };
  if (x.scalar_type() == at::kBFloat16) rows(x.data_ptr<at::BFloat16>());
  else rows(x.data_ptr<at::Half>());  // fixed_point_dtype admits these two only
  acts.fixed_point = true;
}

// ---- int8 weights, row-major [out, K]: one tile of kRows output rows (a contiguous block) x MB
// activation rows; dots[m][r] = sum_b sx[m,b] dot_b(q[r], xi[m]) over blocks b of kBlock8.
constexpr int64_t kBlock8 = 128;  // Int8Gemv::kFixedBlock

template <int MB>
void int8_fixed_tile(const int8_t* w, int64_t K, const int16_t* x, int64_t ldx, const float* sx,
                     int64_t num_blocks, float dots[kMaxMB][kRows]) {
  __m256 total[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) total[m][r] = _mm256_setzero_ps();
  // The next tile(s) >= 4 KB ahead at this tile's pace, as the FMA kernel (a line a 16-step)
  const char* ahead = reinterpret_cast<const char*>(w) + int8_prefetch_distance(kRows * K);
  for (int64_t b = 0, b0 = 0; b0 < K; ++b, b0 += kBlock8) {
    const int64_t end = std::min(b0 + kBlock8, K);
    __m256i acc[MB][kRows];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_si256();
    int64_t k = b0;
    for (; k + 16 <= end; k += 16, ahead += kRows * 16) {
      _mm_prefetch(ahead, _MM_HINT_T0);
      __m256i wv[kRows];
      for (int r = 0; r < kRows; ++r)
        wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * K + k)));
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * ldx + k));
        for (int r = 0; r < kRows; ++r)
          acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(wv[r], xv));
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < kRows; ++r) {
        int32_t tail = 0;  // K % 16 channels of the last block: a row may end at the tensor's end
        for (int64_t t = k; t < end; ++t) tail += w[r * K + t] * x[m * ldx + t];
        const __m256i lanes = _mm256_add_epi32(acc[m][r], _mm256_setr_epi32(tail, 0, 0, 0, 0, 0, 0, 0));
        total[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(sx[m * num_blocks + b]),
                                      total[m][r]);
      }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) dots[m][r] = hsum(total[m][r]);
}

// The partial last tile (rows < kRows): the same sums, plain loops.
void int8_fixed_rows(const int8_t* w, int64_t rows, int64_t K, const int16_t* x, int64_t ldx,
                     const float* sx, int64_t num_blocks, int MB, float dots[kMaxMB][kRows]) {
  for (int m = 0; m < MB; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      float d = 0.f;
      for (int64_t b = 0, b0 = 0; b0 < K; ++b, b0 += kBlock8) {
        int32_t dot = 0;
        for (int64_t k = b0; k < std::min(b0 + kBlock8, K); ++k) dot += w[r * K + k] * x[m * ldx + k];
        d += static_cast<float>(dot) * sx[m * num_blocks + b];
      }
      dots[m][r] = d;
    }
}

// bf16 / fp16 rows take the fixed-point kernels unless QKILN_FIXED16=0 (the header).
bool fixed_point_dtype(const at::Tensor& x) {
  return (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
         !switched_off("QKILN_FIXED16");
}

}  // namespace

bool Int4Gemv::fixed_point_for(const at::Tensor& x) const {
  return !int8_activations && G <= kMaxFixedGroup && fixed_point_dtype(x);
}

void Int4Gemv::prepare_fixed(const at::Tensor& x, GemvActs& acts) const {  // prepare sized acts.f32
  fixed_point_rows(x, K_p, G, acts, acts.f32.data());
}

void Int4Gemv::tiles_fixed(const GemvActs& acts, int64_t M, int64_t begin, int64_t end,
                           at::Tensor& y) const {
  auto run = [&](auto* out) {
    float dots[kMaxMB][kRows];
    for_int4_tile_blocks(w, s, c, K_p, num_groups, M, begin, end,
                         [&](int64_t t, int64_t m0, int MB, const uint8_t* wt, const float* st,
                             const float* ct) {
      const int16_t* xi = acts.fixed.data() + m0 * K_p;
      const float* sx = acts.fixed_scales.data() + m0 * num_groups;
      switch (MB) {
        case 1: fixed_tile<1>(wt, st, xi, sx, K_p, K, G, num_groups, dots); break;
        case 2: fixed_tile<2>(wt, st, xi, sx, K_p, K, G, num_groups, dots); break;
        case 3: fixed_tile<3>(wt, st, xi, sx, K_p, K, G, num_groups, dots); break;
        default: fixed_tile<4>(wt, st, xi, sx, K_p, K, G, num_groups, dots); break;
      }
      finish_fixed_tile(dots, MB, st, ct, acts.f32.data() + m0 * num_groups, num_groups, bias,
                        t * kRows, out_features, out + m0 * out_features);
    });
  };
  if (y.scalar_type() == at::kBFloat16) run(y.data_ptr<at::BFloat16>());
  else run(y.data_ptr<at::Half>());  // y has x's dtype
}

bool Int8Gemv::fixed_point_for(const at::Tensor& x) const {
  return !int8_activations && fixed_point_dtype(x);
}

void Int8Gemv::prepare_fixed(const at::Tensor& x, GemvActs& acts) const {
  static_assert(kFixedBlock == kBlock8);
  fixed_point_rows(x, (K + 15) / 16 * 16, kFixedBlock, acts, nullptr);
}

void Int8Gemv::tiles_fixed(const GemvActs& acts, int64_t M, int64_t begin, int64_t end,
                           at::Tensor& y) const {
  const int64_t ldx = (K + 15) / 16 * 16, num_blocks = (K + kFixedBlock - 1) / kFixedBlock;
  auto run = [&](auto* out) {
    float dots[kMaxMB][kRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rows = std::min(kRows, out_features - t * kRows);
      const int8_t* wt = w + t * kRows * K;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMB) {
        const int MB = static_cast<int>(std::min(kMaxMB, M - m0));
        const int16_t* xi = acts.fixed.data() + m0 * ldx;
        const float* sx = acts.fixed_scales.data() + m0 * num_blocks;
        if (rows < kRows) int8_fixed_rows(wt, rows, K, xi, ldx, sx, num_blocks, MB, dots);
        else if (MB == 1) int8_fixed_tile<1>(wt, K, xi, ldx, sx, num_blocks, dots);
        else if (MB == 2) int8_fixed_tile<2>(wt, K, xi, ldx, sx, num_blocks, dots);
        else if (MB == 3) int8_fixed_tile<3>(wt, K, xi, ldx, sx, num_blocks, dots);
        else int8_fixed_tile<4>(wt, K, xi, ldx, sx, num_blocks, dots);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t o = t * kRows + r;
          for (int m = 0; m < MB; ++m)
            store_row(out, (m0 + m) * out_features + o, dots[m][r] * s[o] + (bias ? bias[o] : 0.f));
        }
      }
    }
  };
  if (y.scalar_type() == at::kBFloat16) run(y.data_ptr<at::BFloat16>());
  else run(y.data_ptr<at::Half>());  // y has x's dtype
}

#endif  // QKILN_FIXED16
