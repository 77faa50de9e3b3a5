// qkiln CPU GEMV / small-GEMM kernel for int4-weight linears at few rows (decode, M <= 16).
//
// Built at first use with the other kernels by plugins/cpu_native.py (torch.utils.cpp_extension.load,
// -O3 -march=native).
// Threads: at::parallel_for over tiles of output rows (torch's intra-op pool), or the caller's own
// partition of the tiles through Int4Gemv (qkiln_cpu.h; the decode stack).
//
// ---- int4 (W4A16), exact: no activation quantization ------------------------------------------
// Math: W[o,k] = (q[o,k] - z[o,g]) * s[o,g], g = k / G (the last group may be shorter).
// Each nibble q becomes the bf16 number 16 + q by bit assembly (16.0 = 0x4180 and the ulp in
// [16, 32) is 1/8, so OR-ing q << 3 into the mantissa is exact), and the activations are bf16, so
// every product is exact in fp32 (AVX512-BF16 vdpbf16ps accumulates in fp32):
//
//     y[m,o] = sum_g s[o,g] * dot_g(16 + q[o], x[m])  -  sum_g c[o,g] * xsum[m,g]
//     c[o,g] = s[o,g] * (16 + z[o,g]),  xsum[m,g] = sum_{k in g} x[m,k]
//
// Layout (uint8 [out_p / 4, K_p / 64, 4, 32]): tiles of R = 4 output rows, 64 weights ("chunk")
// per row per step, the 4 rows' chunks contiguous so one activation load serves 4 rows:
//
//     chunk of row o at k0 = 64c: 16 little-endian uint16 words, word j holds 4 nibbles
//         bits  0..3  q[k0 + j]        bits  8..11  q[k0 + 32 + j]
//         bits  4..7  q[k0 + 16 + j]   bits 12..15  q[k0 + 48 + j]
//     so nibble set n (shift 4n) lines up with the 16 activations x[k0 + 16n .. k0 + 16n + 15].
//
// K_p pads K to a multiple of 64 (K itself is a multiple of 32: a half chunk is skipped),
// out_p pads out to a multiple of 4 (zero scales). scales and c: fp32 [out_p / 4, num_groups, 4]
// (a tile's 4 rows side by side, so the zero term of a tile is one 4-wide FMA per group).
// A group boundary always falls on a half chunk (G % 32 == 0).
//
// Why not int8 activations + VNNI (llama.cpp's Q4_0 x Q8_0): at one row this kernel computes
// ~24 GB/s of int4 weights per core from cache (1 thread, SmolLM2 shapes), above what one core
// streams from DRAM here (~11-14 GB/s), so decode is memory-bound either way and exactness costs
// nothing at M = 1. At M = 16 vdpbf16ps (16 MACs/instruction) is the limit; VNNI would be faster
// there, but per-token int8 activations cost SmolLM2 +3.7% perplexity on top of RTN W4 g128
// (wiki.test 16384 tokens: 38.48 -> 39.88, simulated), too much for an implicit default.
//
// Without AVX512-BF16, on AVX2: bf16 / fp16 activations as 16-bit fixed point through vpmaddwd
// (cpu_gemv_fixed16.cpp), fp32 ones through fp32 FMAs over the same layout (below; the
// activations unrounded). Else plain C++.

#include "gemv_common.h"
#include "qkiln_cpu.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define QKILN_INT4_AVX512 1
#endif

namespace {

#ifndef QKILN_FIXED16
// Activations [M, K] of any float dtype -> bf16 bits xb [M, K_p] (zero padded) and the group sums
// of the bf16-rounded values xsum [M, num_groups], summed in k order. bf16 input is copied as is;
// no per-element division (a `k / G` per element cost ~4 us per call at K = 576).
void prepare_bf16_rows(const at::Tensor& x, int64_t K_p, int64_t G, uint16_t* xb, float* xsum) {
  const int64_t M = x.size(0), K = x.size(1), num_groups = (K + G - 1) / G;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qkiln_x_bf16", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* row = xb + m * K_p;
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        std::memcpy(row, src + m * K, K * sizeof(uint16_t));
      } else {
        for (int64_t k = 0; k < K; ++k)
          row[k] = c10::BFloat16(static_cast<float>(src[m * K + k])).x;  // round to nearest even
      }
      std::fill(row + K, row + K_p, uint16_t{0});
      for (int64_t g = 0, k = 0; g < num_groups; ++g) {
        float sum = 0.f;
        for (const int64_t end = std::min(k + G, K); k < end; ++k)
          sum += static_cast<float>(c10::BFloat16(row[k], c10::BFloat16::from_bits()));
        xsum[m * num_groups + g] = sum;
      }
    }
  });
}
#endif


#ifdef QKILN_INT4_AVX512

// Nibble set N of 32 words (two output rows' chunks) -> 32 bf16 values 16 + q (see the header).
template <int N>
inline __m512i nibbles_to_bf16(__m512i words) {
  const __m512i mask = _mm512_set1_epi16(0x78), magic = _mm512_set1_epi16(0x4180);
  const __m512i v = N == 0 ? _mm512_slli_epi16(words, 3) : _mm512_srli_epi16(words, 4 * N - 3);
  return _mm512_ternarylogic_epi32(v, mask, magic, 0xEA);  // (v & mask) | magic
}

// Accumulators of one tile, two output rows per 512-bit register: rows 2p and 2p + 1 are the
// 64 contiguous bytes of a chunk, so one load and one decode serve both, and the 16 activations
// are broadcast to both halves (vdpbf16ps lanes 0-7 sum row 2p, lanes 8-15 row 2p + 1). Half the
// instructions of one row per 256-bit register: ~1.15x on a cached weight, 1 thread. NACC per
// (m, pair) breaks the vdpbf16ps latency chain at MB = 1; indices are compile-time (registers).
template <int MB>
struct Int4Acc {
  static constexpr int NACC = MB == 1 ? 2 : 1;
  __m512 group[MB][2][NACC];  // this group's dot(16 + q, x), unscaled
  __m512 total[MB][2];        // sum over finished groups of s * group

  // Nibble sets N and N + 1 of the chunk `raw` against x[m][16N .. 16N + 31] of that chunk.
  template <int N>
  inline void half(const __m512i raw[2], const uint16_t* x, int64_t K_p) {
    for (int n = N; n < N + 2; ++n) {
      __m512i wv[2];
      for (int p = 0; p < 2; ++p)
        wv[p] = n == N ? nibbles_to_bf16<N>(raw[p]) : nibbles_to_bf16<N + 1>(raw[p]);
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K_p + n * 16)));
        for (int p = 0; p < 2; ++p)
          group[m][p][n % NACC] =
              _mm512_dpbf16_ps(group[m][p][n % NACC], (__m512bh)wv[p], (__m512bh)xv);
      }
    }
  }

  inline void flush(const float* sg) {  // group end: scale this group's dot once
    const __m512 s4 = _mm512_castps128_ps512(_mm_loadu_ps(sg));  // rows 0..3 of this group
    const __m512 sv[2] = {
        _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), s4),
        _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2), s4)};
    for (int m = 0; m < MB; ++m)
      for (int p = 0; p < 2; ++p) {
        __m512 sum = group[m][p][0];
        for (int a = 1; a < NACC; ++a) sum = _mm512_add_ps(sum, group[m][p][a]);
        total[m][p] = _mm512_fmadd_ps(sum, sv[p], total[m][p]);
        for (int a = 0; a < NACC; ++a) group[m][p][a] = _mm512_setzero_ps();
      }
  }
};

// One tile of 4 output rows x MB activation rows; dots[m][r] = sum_g s * dot_g(16 + q, x).
template <int MB>
void int4_tile(const uint8_t* w, const float* s, const uint16_t* x, int64_t K_p, int64_t K,
               int64_t G, float dots[kMaxMB][kRows]) {
  Int4Acc<MB> acc;
  for (int m = 0; m < MB; ++m)
    for (int p = 0; p < 2; ++p) {
      acc.total[m][p] = _mm512_setzero_ps();
      for (int a = 0; a < Int4Acc<MB>::NACC; ++a) acc.group[m][p][a] = _mm512_setzero_ps();
    }
  int64_t group_end = std::min(G, K);  // the next group boundary (a multiple of 32)
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const __m512i raw[2] = {_mm512_loadu_si512(w), _mm512_loadu_si512(w + 64)};
    // Decode is DRAM-bound at one row; the hardware prefetcher alone does not keep enough
    // lines in flight (kPrefetchBytes).
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
    w += kRows * 32;
    acc.template half<0>(raw, x + k0, K_p);
    // Group ends are tracked by a running boundary: a `%` by the runtime G here cost ~4% (2
    // divisions per chunk).
    if (k0 + 32 == group_end) {
      acc.flush(s);
      s += kRows;
      group_end = std::min(group_end + G, K);
    }
    if (k0 + 32 == K) break;  // K % 64 == 32: the chunk's second half is padding
    acc.template half<2>(raw, x + k0, K_p);
    if (k0 + 64 == group_end) {
      acc.flush(s);
      s += kRows;
      group_end = std::min(group_end + G, K);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int p = 0; p < 2; ++p) {
      dots[m][2 * p] = hsum(_mm512_castps512_ps256(acc.total[m][p]));
      dots[m][2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc.total[m][p], 1));
    }
}

void int4_tile_rows(int MB, const uint8_t* w, const float* s, const uint16_t* x, int64_t K_p,
                    int64_t K, int64_t G, float dots[kMaxMB][kRows]) {
  switch (MB) {
    case 1: int4_tile<1>(w, s, x, K_p, K, G, dots); break;
    case 2: int4_tile<2>(w, s, x, K_p, K, G, dots); break;
    case 3: int4_tile<3>(w, s, x, K_p, K, G, dots); break;
    default: int4_tile<4>(w, s, x, K_p, K, G, dots); break;
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define QKILN_INT4_AVX2 1

// AVX2 (no bf16 dot product), fp32 activations (bf16 / fp16 ones: cpu_gemv_fixed16.cpp, faster;
// this kernel is what it was measured against): a row's 32-byte chunk is loaded as its 16 words;
// nibble set n of all 16 becomes the bf16 bits of 16 + q by the AVX-512 kernel's bit assembly (in
// 16-bit lanes),
// and unpacking those with zero words makes them the high halves of fp32 lanes: 16 + q in fp32.
// The unpacks work within 128-bit lanes, so the low vector holds words 0-3 and 8-11 and the high
// one words 4-7 and 12-15; Int4Gemv::prepare puts the fp32 activations in that order per 16
// (kWideOrder). Every product is rounded once in fp32 (exact for activations with <= 19
// significant bits, so for bf16 / fp16 ones). Per 16 weights: a shift, an AND, an OR, two unpacks,
// two FMAs.
// Measured against widening the words to 32-bit lanes first (vpmovzxwd, then the same assembly
// with 32-bit shifts: two of each per 16 weights), 30 layers of SmolLM2's int4 linears, same
// process (AVX2 EPYC): one row 1.19-1.22x (1 and 2 threads), four rows 1.05x. One pass over 8
// activation rows (1 output row a pass) measured 0.97-0.98x against two of 4: not kept.
// RB output rows per pass: 4 while the accumulators and activations fit the 16 ymm registers
// (MB <= 2), else 2 (two passes per tile, the second reading the tile from L1).

constexpr int kWideOrder[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

// Activations [M, K] of any float dtype -> fp32 [M, K_p] in kWideOrder per 16 (zero padded) and
// their group sums xsum [M, num_groups], summed in k order. Widening is exact: fp32 rows keep
// every bit (the AVX-512 kernel rounds them to bf16).
void prepare_wide_rows(const at::Tensor& x, int64_t K_p, int64_t G, float* wide, float* xsum) {
  const int64_t M = x.size(0), K = x.size(1), num_groups = (K + G - 1) / G;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qkiln_x_wide", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m) {
      const scalar_t* row = src + m * K;
      float* out = wide + m * K_p;
      for (int64_t b = 0; b < K_p; b += 16)  // K is a multiple of 32, K_p of 64
        for (int i = 0; i < 16; ++i)
          out[b + i] = b < K ? static_cast<float>(row[b + kWideOrder[i]]) : 0.f;
      for (int64_t g = 0, k = 0; g < num_groups; ++g) {
        float sum = 0.f;
        for (const int64_t end = std::min(k + G, K); k < end; ++k) sum += static_cast<float>(row[k]);
        xsum[m * num_groups + g] = sum;
      }
    }
  });
}

template <int N>
inline __m256i nibbles_to_bf16(__m256i words) {  // nibble set N of 16 words -> bf16 bits of 16 + q
  const __m256i v = N == 0 ? _mm256_slli_epi16(words, 3) : _mm256_srli_epi16(words, 4 * N - 3);
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x78)), _mm256_set1_epi16(0x4180));
}

template <int MB>
struct Int4AccAvx2 {
  static constexpr int RB = MB <= 2 ? 4 : 2;
  __m256 group[MB][RB];  // this group's dot(16 + q, x), unscaled
  __m256 total[MB][RB];  // sum over finished groups of s * group

  // Nibble set N of rows r0.. of one chunk against x[m][16N .. 16N + 15] (kWideOrder).
  template <int N>
  inline void nibble_set(const uint8_t* chunk, const float* x, int64_t K_p) {
    const __m256i zero = _mm256_setzero_si256();
    for (int r = 0; r < RB; ++r) {
      const __m256i bits = nibbles_to_bf16<N>(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + r * 32)));
      const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits));
      const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits));
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * K_p + 16 * N;
        group[m][r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xm), group[m][r]);
        group[m][r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xm + 8), group[m][r]);
      }
    }
  }

  inline void flush(const float* sg) {  // group end: scale this group's dot once
    for (int r = 0; r < RB; ++r) {
      const __m256 sv = _mm256_set1_ps(sg[r]);
      for (int m = 0; m < MB; ++m) {
        total[m][r] = _mm256_fmadd_ps(group[m][r], sv, total[m][r]);
        group[m][r] = _mm256_setzero_ps();
      }
    }
  }
};

// Rows r0 .. r0 + RB - 1 of one tile x MB activation rows (fp32 [MB, K_p], kWideOrder); the
// group bookkeeping of int4_tile (AVX-512).
template <int MB>
void int4_rows_avx2(const uint8_t* w, const float* s, const float* x, int64_t K_p, int64_t K,
                    int64_t G, int r0, float dots[kMaxMB][kRows]) {
  using Acc = Int4AccAvx2<MB>;
  Acc acc;
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < Acc::RB; ++r) acc.total[m][r] = acc.group[m][r] = _mm256_setzero_ps();
  s += r0;
  int64_t group_end = std::min(G, K);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk, w += kRows * 32) {
    if (r0 == 0) {  // the first pass streams the tile from memory (the AVX-512 kernel's prefetch)
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
    }
    const uint8_t* rows = w + r0 * 32;
    acc.template nibble_set<0>(rows, x + k0, K_p);
    acc.template nibble_set<1>(rows, x + k0, K_p);
    if (k0 + 32 == group_end) {
      acc.flush(s);
      s += kRows;
      group_end = std::min(group_end + G, K);
    }
    if (k0 + 32 == K) break;  // K % 64 == 32: the chunk's second half is padding
    acc.template nibble_set<2>(rows, x + k0, K_p);
    acc.template nibble_set<3>(rows, x + k0, K_p);
    if (k0 + 64 == group_end) {
      acc.flush(s);
      s += kRows;
      group_end = std::min(group_end + G, K);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < Acc::RB; ++r) dots[m][r0 + r] = hsum(acc.total[m][r]);
}

template <int MB>
void int4_tile_avx2(const uint8_t* w, const float* s, const float* x, int64_t K_p, int64_t K,
                    int64_t G, float dots[kMaxMB][kRows]) {
  for (int r0 = 0; r0 < kRows; r0 += Int4AccAvx2<MB>::RB)
    int4_rows_avx2<MB>(w, s, x, K_p, K, G, r0, dots);
}

void int4_tile_rows(int MB, const uint8_t* w, const float* s, const float* x, int64_t K_p,
                    int64_t K, int64_t G, float dots[kMaxMB][kRows]) {
  switch (MB) {
    case 1: int4_tile_avx2<1>(w, s, x, K_p, K, G, dots); break;
    case 2: int4_tile_avx2<2>(w, s, x, K_p, K, G, dots); break;
    case 3: int4_tile_avx2<3>(w, s, x, K_p, K, G, dots); break;
    default: int4_tile_avx2<4>(w, s, x, K_p, K, G, dots); break;
  }
}

#else  // portable fallback over the same layout

void int4_tile_rows(int MB, const uint8_t* w, const float* s, const uint16_t* x, int64_t K_p,
                    int64_t K, int64_t G, float dots[kMaxMB][kRows]) {
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < kRows; ++r) {
      float total = 0.f, group = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t c = k / kChunk, n = (k % kChunk) / 16, j = k % 16;
        const uint8_t* words = w + (c * kRows + r) * 32;
        const int q = ((words[2 * j] | (words[2 * j + 1] << 8)) >> (4 * n)) & 15;
        group += (16.f + q) * static_cast<float>(c10::BFloat16(x[m * K_p + k], c10::BFloat16::from_bits()));
        if ((k + 1) % G == 0 || k + 1 == K) {
          total += group * s[(k / G) * kRows + r];
          group = 0.f;
        }
      }
      dots[m][r] = total;
    }
  }
}

#endif

// Int4Gemv reads the AVX2 kernel's fp32 rows exactly where the fixed-point kernels take bf16 ones
#if defined(QKILN_FIXED16) != defined(QKILN_INT4_AVX2)
#error "QKILN_FIXED16 (qkiln_cpu.h) and the AVX2 int4 kernel need the same build condition"
#endif

// One tile's dots [MB][4] -> output rows: minus the zero term sum_g c[o,g] * xsum[m,g], plus the
// bias. c4: this tile's c [num_groups, 4]; xsum at row m0; out at row m0 (row stride N).
template <typename out_t>
void finish_tile(const float dots[kMaxMB][kRows], int MB, const float* c4, const float* xsum,
                 int64_t num_groups, const float* bias, int64_t o0, int64_t N, out_t* out) {
  const int64_t rows = std::min<int64_t>(kRows, N - o0);
  for (int m = 0; m < MB; ++m) {
    const float* xs = xsum + m * num_groups;
#ifdef QKILN_INT4_AVX512
    if (rows == kRows) {  // 4 rows at once: one FMA per group, one 4-wide store
      __m128 v = _mm_loadu_ps(dots[m]);
      for (int64_t g = 0; g < num_groups; ++g)
        v = _mm_fnmadd_ps(_mm_loadu_ps(c4 + g * kRows), _mm_set1_ps(xs[g]), v);
      if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias + o0));
      out_t* y = out + m * N + o0;
      if constexpr (std::is_same_v<out_t, at::BFloat16>) {
        const __m128i bits = (__m128i)_mm_cvtneps_pbh(v);  // round to nearest even
        std::memcpy(y, &bits, kRows * sizeof(uint16_t));
      } else {
        alignas(16) float tmp[kRows];
        _mm_store_ps(tmp, v);
        for (int r = 0; r < kRows; ++r) store_row(y, r, tmp[r]);
      }
      continue;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      float v = dots[m][r];
      for (int64_t g = 0; g < num_groups; ++g) v -= c4[g * kRows + r] * xs[g];
      store_row(out, m * N + o0 + r, v + (bias ? bias[o0 + r] : 0.f));
    }
  }
}

}  // namespace

void Int4Gemv::tiles(const GemvActs& acts, int64_t M, int64_t begin, int64_t end,
                     at::Tensor& y) const {
  if (int8_activations) return tiles_int8(acts, M, begin, end, y);
#ifdef QKILN_FIXED16
  if (acts.fixed_point) return tiles_fixed(acts, M, begin, end, y);
  const float* xb = acts.wide.data();
#else
  const uint16_t* xb = acts.bf16.data();
#endif
  const float* xsum = acts.f32.data();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "qkiln_w4a16", [&] {
    scalar_t* out = y.data_ptr<scalar_t>();
    float dots[kMaxMB][kRows];
    for_int4_tile_blocks(w, s, c, K_p, num_groups, M, begin, end,
                         [&](int64_t t, int64_t m0, int MB, const uint8_t* wt, const float* st,
                             const float* ct) {
      int4_tile_rows(MB, wt, st, xb + m0 * K_p, K_p, K, G, dots);
      finish_tile(dots, MB, ct, xsum + m0 * num_groups, num_groups, bias, t * kRows, out_features,
                  out + m0 * out_features);
    });
  });
}

void Int4Gemv::prepare(const at::Tensor& x, GemvActs& acts) const {
  if (int8_activations) return prepare_int8(x, acts);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "w4a16: x must be [M, in_features]");
  acts.f32.resize(x.size(0) * num_groups);
#ifdef QKILN_FIXED16
  if (fixed_point_for(x)) return prepare_fixed(x.contiguous(), acts);
  acts.fixed_point = false;
  // fp32 rows (or groups too long for the fixed-point kernel): x widened exactly, not rounded
  acts.wide.resize(x.size(0) * K_p);
  prepare_wide_rows(x.contiguous(), K_p, G, acts.wide.data(), acts.f32.data());
#else
  acts.bf16.resize(x.size(0) * K_p);
  prepare_bf16_rows(x.contiguous(), K_p, G, acts.bf16.data(), acts.f32.data());
#endif
}

Int4Gemv::Int4Gemv(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zero_term,
                   const float* bias_f32, int64_t group_size, int64_t in_features, int64_t out)
    : w(packed.data_ptr<uint8_t>()), s(scales.data_ptr<float>()),
      c(zero_term.data_ptr<float>()), bias(bias_f32), K_p(packed.size(1) * kChunk),
      K(in_features), G(group_size), num_groups(scales.size(1)), num_tiles(packed.size(0)),
      out_features(out) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kRows && packed.size(3) == 32 &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "w4a16: packed must be contiguous uint8 [out_p / 4, K_p / 64, 4, 32]");
  TORCH_CHECK(scales.dtype() == at::kFloat && zero_term.dtype() == at::kFloat &&
                  scales.is_contiguous() && zero_term.is_contiguous() &&
                  scales.sizes() == zero_term.sizes() && scales.dim() == 3 &&
                  scales.size(0) == num_tiles && scales.size(2) == kRows &&
                  out_features <= num_tiles * kRows,
              "w4a16: scales and zero term must be fp32 [out_p / 4, num_groups, 4]");
  TORCH_CHECK(K % 32 == 0 && K <= K_p && K_p < K + kChunk && G % 32 == 0 &&
                  num_groups == (K + G - 1) / G,
              "w4a16: in_features and group size do not match the native int4 layout");
}

// x [M, K] float/bf16/fp16 contiguous -> y [M, out_features] in x's dtype (see header for layout).
at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& c, const c10::optional<at::Tensor>& bias, int64_t G,
                      int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "w4a16_gemm: x must be [M, in_features]");
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const Int4Gemv gemv(packed, scales, c, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, G,
                      x.size(1), out_features);
  return gemv_all_tiles(gemv, x);
}

// Which int4 kernel this build compiled: "avx512bf16", "avx2" or "portable".
std::string int4_kernel_isa() {
#ifdef QKILN_INT4_AVX512
  return "avx512bf16";
#elif defined(QKILN_INT4_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}
