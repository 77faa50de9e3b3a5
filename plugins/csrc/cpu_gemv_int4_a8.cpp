// qkiln CPU GEMV for int4 weights x int8 activations (opt-in, not exact): the native int4 GEMV
// layout (cpu_gemv_int4.cpp's header) read with each activation row rounded to int8 per block of
// 32 channels, the codes and scales of cpu_gemm_w4a8.cpp (plugins/reference.py,
// quantize_int8_blocks: the same fp32 operations, so the same codes). Int4Gemv runs this instead
// of the exact kernel when its int8_activations is set (qkiln_cpu.h).
//
// Why: without a bf16 dot product (AVX2) the exact kernel decodes every nibble to fp32 and spends
// 7 instructions per 16 weights a row; it computes ~10 G weights/s a core, below what the cores
// stream from DRAM, so batch-1 decode is compute-bound there. Here vpmaddubsw multiplies 32 codes
// by 32 int8 activations per instruction (llama.cpp's Q4_0 x Q8_0 on AVX2): ~15 instructions per
// 64 weights a row. Cost in accuracy (SmolLM2 RTN W4 g128, wiki.test): perplexity +0.43%.
//
// Math, per activation row m, output channel o, weight group g, activation block b (of g):
//     y[m,o] = sum_g s[o,g] * sum_{b in g} sx[m,b] * dot_b(q[o], xq[m])  -  sum_g s[o,g] z[o,g] xs[m,g]
//     xs[m,g] = sum_{b in g} sx[m,b] * sum_{k in b} xq[m,k]
// Every dot_b is exact in int32 (|pair sums| <= 2 * 15 * 127 fit vpmaddubsw's int16); the rest is
// fp32. s z comes from the layout's zero term c = s (16 + z) as c - 16 s (16 s is exact).
//
// Reading the layout: word j of a row's 64-weight chunk at k0 holds q[k0+j] and q[k0+16+j] in its
// low byte, q[k0+32+j] and q[k0+48+j] in its high byte: the low bytes are block 2c (k0..k0+31),
// the high bytes block 2c+1. Per block, the 16 words become 32 byte codes, word j the byte pair
// (q[k0+j], q[k0+16+j]) (or +32): 4 or 5 instructions a block. The activation codes of a block
// are stored in that order (xq[j], xq[16+j] for j = 0..15, "pair order"), so vpmaddubsw's pairs
// and vpmaddwd's quads stay inside one block, and one cvt + FMA by sx[m,b] a block and row
// finishes it.
//
// Rows: one pass reads RB output rows of a tile for MB activation rows (MB * RB <= 4: the block
// sums and the group totals of each (m, r) in registers); the first pass of a tile streams it from
// memory, the others from L1. Without AVX2: plain C++ over the same layout and codes.
// Measured (1 thread, cached weights, AVX2 Zen 4 VM at 2.6 GHz): 3072 x 576
// at 1 row 82-93 us against 112-121 for the exact kernel, at 4 rows 211-215 against 307-390.
// Tried and not kept: decoding both blocks of a chunk at once (vpshufb evens / odds, one shift,
// unpacklo / hi: 6 instructions instead of 9): 1 row within noise, 4 rows 0.8x (3 alternating
// processes each).

#include "gemv_common.h"
#include "qkiln_cpu.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;  // input channels per activation scale

// Block b of one activation row (32 values) -> int8 codes in pair order at q; returns the codes'
// sum and sets *scale = amax / 127. amax, 127 / amax and the rounding (half to even) as in
// cpu_gemm_w4a8.cpp's quantize_block.
template <typename scalar_t>
inline int quantize_pairs(const scalar_t* x, int8_t* q, float* scale) {
  const Vf lo = load(x), hi = load(x + 16);  // exact widening to fp32
  const float amax = reduce_max(vmax(vmax(lo, sub(set1(0.f), lo)), vmax(hi, sub(set1(0.f), hi))));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
#if defined(__AVX2__)
  alignas(32) float v[kBlock];
  store(v, lo);
  store(v + 16, hi);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)  // vcvtps2dq rounds half to even under the default MXCSR
    c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + 8 * i), _mm256_set1_ps(inv)));
  // |codes| <= 127, so the saturating packs are exact; 0xD8 undoes their per-lane order.
  const __m256i first = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
  const __m256i second = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
  const __m256i pairs = _mm256_or_si256(_mm256_and_si256(first, _mm256_set1_epi16(0xFF)),
                                        _mm256_slli_epi16(second, 8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), pairs);
  const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
  sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
  sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
  return _mm_cvtsi128_si32(sum);
#else
  float v[kBlock];
  store(v, lo);
  store(v + 16, hi);
  int sum = 0;
  for (int j = 0; j < 16; ++j) {
    const int a = static_cast<int>(std::nearbyint(v[j] * inv));
    const int b = static_cast<int>(std::nearbyint(v[16 + j] * inv));
    q[2 * j] = static_cast<int8_t>(a), q[2 * j + 1] = static_cast<int8_t>(b);
    sum += a + b;
  }
  return sum;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#define QKILN_INT4_A8_AVX2 1

// Block H (0: the low bytes, 1: the high bytes) of a row's chunk of 16 words -> 32 codes, word j
// the pair (q[j], q[16 + j]) of that block.
template <int H>
inline __m256i block_codes(const uint8_t* chunk) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x0F00);
  if constexpr (H == 0)
    return _mm256_or_si256(_mm256_and_si256(w, low), _mm256_and_si256(_mm256_slli_epi16(w, 4), high));
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 8), low),
                         _mm256_and_si256(_mm256_srli_epi16(w, 4), high));
}

// Rows r0 .. r0 + RB - 1 of one tile (w: its first chunk; s: its scales [num_groups, 4]) x MB
// activation rows (codes at xq, row m at xq + m * K_p; block scales at sx, row m at sx + m * KB)
// -> dots[m][r] = sum_g s * sum_b sx * dot_b (int4_rows_avx2's group bookkeeping). The sums are
// local arrays indexed by unrolled loops only, so they live in registers (as struct members GCC
// kept them on the stack: a store and a reload on every block's FMA chain, 0.6x the speed).
template <int MB, int RB>
void a8_rows(const uint8_t* w, const float* s, const int8_t* xq, const float* sx, int64_t K_p,
             int64_t K, int64_t G, int r0, float dots[kMaxMB][kRows]) {
  __m256 group[MB][RB];  // this weight group's sum of sx * dot_b, 8 partial lanes
  __m256 total[MB][RB];  // sum over finished groups of s * group
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) total[m][r] = group[m][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t KB = K_p / kBlock;
  s += r0;
  auto block = [&](auto half, const uint8_t* rows, int64_t k, int64_t b) {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256i codes = block_codes<decltype(half)::value>(rows + r * 32);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K_p + k));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
        group[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(sx + m * KB + b),
                                      group[m][r]);
      }
    }
  };
  auto flush = [&] {  // group end: the weight scale, once a group
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256 sr = _mm256_broadcast_ss(s + r);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        total[m][r] = _mm256_fmadd_ps(group[m][r], sr, total[m][r]);
        group[m][r] = _mm256_setzero_ps();
      }
    }
    s += kRows;
  };
  int64_t group_end = std::min(G, K);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk, w += kRows * 32) {
    if (r0 == 0) {  // the first pass streams the tile from memory (see cpu_gemv_int4.cpp)
      _mm_prefetch(reinterpret_cast<const char*>(w) + 4096, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 4096 + 64, _MM_HINT_T0);
    }
    const uint8_t* rows = w + r0 * 32;
    block(std::integral_constant<int, 0>{}, rows, k0, k0 / kBlock);
    if (k0 + 32 == group_end) {
      flush();
      group_end = std::min(group_end + G, K);
    }
    if (k0 + 32 == K) break;  // K % 64 == 32: the chunk's high bytes are padding
    block(std::integral_constant<int, 1>{}, rows, k0 + 32, k0 / kBlock + 1);
    if (k0 + 64 == group_end) {
      flush();
      group_end = std::min(group_end + G, K);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) dots[m][r0 + r] = hsum(total[m][r]);
}

template <int MB>
void a8_tile(const uint8_t* w, const float* s, const int8_t* xq, const float* sx, int64_t K_p,
             int64_t K, int64_t G, float dots[kMaxMB][kRows]) {
  constexpr int RB = MB == 1 ? 4 : MB == 2 ? 2 : 1;
  for (int r0 = 0; r0 < kRows; r0 += RB) a8_rows<MB, RB>(w, s, xq, sx, K_p, K, G, r0, dots);
}

void a8_tile_rows(int MB, const uint8_t* w, const float* s, const int8_t* xq, const float* sx,
                  int64_t K_p, int64_t K, int64_t G, float dots[kMaxMB][kRows]) {
  switch (MB) {
    case 1: a8_tile<1>(w, s, xq, sx, K_p, K, G, dots); break;
    case 2: a8_tile<2>(w, s, xq, sx, K_p, K, G, dots); break;
    case 3: a8_tile<3>(w, s, xq, sx, K_p, K, G, dots); break;
    default: a8_tile<4>(w, s, xq, sx, K_p, K, G, dots); break;
  }
}

#else  // portable: the same layout, codes and sums in plain C++

void a8_tile_rows(int MB, const uint8_t* w, const float* s, const int8_t* xq, const float* sx,
                  int64_t K_p, int64_t K, int64_t G, float dots[kMaxMB][kRows]) {
  const int64_t KB = K_p / kBlock;
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) {
      float total = 0.f, group = 0.f;
      for (int64_t b = 0; b < K / kBlock; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) {  // pair order: position 2j + h holds k = 16h + j
          const int64_t k = b * kBlock + i, c = k / kChunk, n = (k % kChunk) / 16, j = k % 16;
          const uint8_t* words = w + (c * kRows + r) * 32;
          const int q = ((words[2 * j] | (words[2 * j + 1] << 8)) >> (4 * n)) & 15;
          dot += q * xq[m * K_p + b * kBlock + 2 * (i % 16) + i / 16];
        }
        group += static_cast<float>(dot) * sx[m * KB + b];
        const int64_t end = (b + 1) * kBlock;
        if (end % G == 0 || end == K) {
          total += group * s[(b * kBlock / G) * kRows + r];
          group = 0.f;
        }
      }
      dots[m][r] = total;
    }
}

#endif

// One tile's dots -> output rows: minus the zero term sum_g (c - 16 s)[o,g] * xs[m,g], plus the
// bias. c4, s4: this tile's [num_groups, 4]; xs at row m0; out at row m0 (row stride N). The 4
// rows of a tile are one SSE vector: scalar, this took a third of the kernel's time at 4 rows.
template <typename out_t>
void finish_a8_tile(const float dots[kMaxMB][kRows], int MB, const float* c4, const float* s4,
                    const float* xs, int64_t num_groups, const float* bias, int64_t o0, int64_t N,
                    out_t* out) {
  __m128 v[kMaxMB];
  for (int m = 0; m < MB; ++m) v[m] = _mm_loadu_ps(dots[m]);
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m128 zero_scale = _mm_sub_ps(_mm_loadu_ps(c4 + g * kRows),
                                         _mm_mul_ps(_mm_set1_ps(16.f), _mm_loadu_ps(s4 + g * kRows)));
    for (int m = 0; m < MB; ++m)
      v[m] = _mm_sub_ps(v[m], _mm_mul_ps(zero_scale, _mm_set1_ps(xs[m * num_groups + g])));
  }
  const int64_t rows = std::min<int64_t>(kRows, N - o0);
  for (int m = 0; m < MB; ++m) {
    alignas(16) float y[kRows];
    _mm_store_ps(y, v[m]);
    for (int64_t r = 0; r < rows; ++r) store_row(out, m * N + o0 + r, y[r] + (bias ? bias[o0 + r] : 0.f));
  }
}

}  // namespace

void Int4Gemv::prepare_int8(const at::Tensor& x, GemvActs& acts) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "w4a8_gemv: x must be [M, in_features]");
  const at::Tensor rows = x.contiguous();
  const int64_t M = x.size(0), KB = K_p / kBlock;
  // Every block below K is written; the padding block where K % 64 == 32 is never read (the
  // kernels stop at K), so neither buffer is cleared. xs accumulates: cleared.
  acts.codes.resize(M * K_p);
  acts.block_scales.resize(M * KB);
  acts.f32.assign(M * num_groups, 0.f);
  QKILN_DISPATCH(rows.scalar_type(), "qkiln_w4a8_gemv_prepare", [&] {
    const scalar_t* xp = rows.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < K / kBlock; ++b) {
        float* scale = acts.block_scales.data() + m * KB + b;
        const int sum = quantize_pairs(xp + m * K + b * kBlock, acts.codes.data() + m * K_p + b * kBlock,
                                       scale);
        acts.f32[m * num_groups + b * kBlock / G] += *scale * static_cast<float>(sum);
      }
  });
}

void Int4Gemv::tiles_int8(const GemvActs& acts, int64_t M, int64_t begin, int64_t end,
                          at::Tensor& y) const {
  const int64_t KB = K_p / kBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "qkiln_w4a8_gemv", [&] {
    scalar_t* out = y.data_ptr<scalar_t>();
    float dots[kMaxMB][kRows];
    for_int4_tile_blocks(w, s, c, K_p, num_groups, M, begin, end,
                         [&](int64_t t, int64_t m0, int MB, const uint8_t* wt, const float* st,
                             const float* ct) {
      a8_tile_rows(MB, wt, st, acts.codes.data() + m0 * K_p, acts.block_scales.data() + m0 * KB,
                   K_p, K, G, dots);
      finish_a8_tile(dots, MB, ct, st, acts.f32.data() + m0 * num_groups, num_groups, bias,
                     t * kRows, out_features, out + m0 * out_features);
    });
  });
}

// x [M, K] float/bf16/fp16 -> y [M, out_features] in x's dtype: the native int4 layout with int8
// activations (the header).
at::Tensor w4a8_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& c, const c10::optional<at::Tensor>& bias, int64_t G,
                     int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "w4a8_gemv: x must be [M, in_features]");
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  Int4Gemv gemv(packed, scales, c, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, G,
                x.size(1), out_features);
  gemv.int8_activations = true;
  return gemv_all_tiles(gemv, x);
}

// Which kernel w4a8_gemv compiled: "avx2" or "portable".
std::string int4_a8_kernel_isa() {
#ifdef QKILN_INT4_A8_AVX2
  return "avx2";
#else
  return "portable";
#endif
}
