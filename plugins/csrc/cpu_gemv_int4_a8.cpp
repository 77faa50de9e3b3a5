// qkiln CPU GEMV for int4 weights x int8 activations (opt-in, not exact): activations rounded to
// int8 per block of 32 channels with the codes and scales of cpu_gemm_w4a8.cpp
// (plugins/reference.py, quantize_int8_blocks: the same fp32 operations, so the same codes), int4
// weights in their own nibble order (below). Int4Gemv runs this instead of the exact kernel when
// its int8_activations is set (qkiln_cpu.h); the weights are then packed for it
// (cpu_native.pack_w4a16(..., int8_activations=True)), not for the exact kernel.
//
// Why: without a bf16 dot product (AVX2) the exact kernel decodes every nibble to fp32 and spends
// 7 instructions per 16 weights a row; it computes ~15 G weights/s a core, below what the cores
// stream from DRAM, so batch-1 decode is compute-bound there. Here vpmaddubsw multiplies 32 codes
// by 32 int8 activations per instruction (llama.cpp's Q4_0 x Q8_0 on AVX2). Cost in accuracy
// (SmolLM2 RTN W4 g128, wiki.test): perplexity +0.43%.
//
// Math, per activation row m, output channel o, weight group g, activation block b (of g):
//     y[m,o] = sum_g s[o,g] * sum_{b in g} sx[m,b] * dot_b(q[o], xq[m])  -  sum_g zs[o,g] xs[m,g]
//     xs[m,g] = sum_{b in g} sx[m,b] * sum_{k in b} xq[m,k],   zs = s z (the layout's zero term)
// Every dot_b is exact in int32 (|pair sums| <= 2 * 15 * 127 fit vpmaddubsw's int16); the rest is
// fp32.
//
// Layout: the native int4 GEMV's tiles and chunks (uint8 [out_p / 4, K_p / 64, 4, 32], scales
// [out_p / 4, num_groups, 4]; cpu_gemv_int4.cpp's header), but byte i of a row's 64-weight chunk at
// k0 holds q[k0 + i] in its low nibble and q[k0 + 32 + i] in its high one: the low nibbles are
// activation block 2c, the high ones block 2c + 1, each in k order. A block's 32 codes are then one
// vpand (block 2c) or a shift and a vpand (2c + 1), and per block and row: vpmaddubsw and vpmaddwd
// by ones (one vpdpbusd with VNNI, dot4_u8s8), one cvt and one FMA by sx[m,b]; the weight scale
// and zero term once a group.
//
// Rows: one pass reads RB output rows of a tile for MB activation rows (MB * RB <= 4: the block
// sums and the group totals of each (m, r) in registers); the first pass of a tile streams it from
// memory, the others from L1. Without AVX2: plain C++ over the same layout and codes.
// Measured (1 thread, AVX2 Zen 4 VM at 2.6 GHz, median of 5, exact kernel in the same process):
//   3072 x 576 cached, 1 row: 54 us (exact 115); 4 rows: 195 us (exact 384).
//   49152 x 576 from memory, 1 row: 855 us (exact 1825); 4 rows 3129 us (exact 6168).
// History: the first version read the exact kernel's layout (16-bit words of 4 nibbles: 9
// instructions a chunk to rebuild two blocks of codes, against 4 here) and finished each tile in
// a separate pass (the zero term a chain of dependent subtractions, and a scalar store): 3072 x
// 576 at 1 row 85 -> 67 us with this layout, -> 54 us with the zero term folded into the group
// ends and a 4-wide finish. Tried and not kept there: decoding both blocks of a chunk at once from
// the word layout (vpshufb evens / odds): 0.8x at 4 rows.

#include <cmath>
#include <limits>

#include "gemv_common.h"
#include "qkiln_cpu.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;  // input channels per activation scale

// Block b of one activation row (32 values) -> int8 codes at q, in k order; returns the codes'
// sum and sets *scale = amax / 127. amax, 127 / amax and the rounding (half to even) as in
// cpu_gemm_w4a8.cpp's quantize_block.
template <typename scalar_t>
inline int quantize_block(const scalar_t* x, int8_t* q, float* scale) {
  const Vf lo = load(x), hi = load(x + 16);  // exact widening to fp32
  float amax = reduce_max(vmax(vmax(lo, sub(set1(0.f), lo)), vmax(hi, sub(set1(0.f), hi))));
  // max drops a NaN (it returns its other operand): the block's sum keeps it, so a NaN activation
  // gives a NaN scale and output, as the reference's amax does, not finite codes
  if (std::isnan(reduce_add(add(lo, hi)))) amax = std::numeric_limits<float>::quiet_NaN();
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
#if defined(__AVX2__)
  alignas(32) float v[kBlock];
  store(v, lo);
  store(v + 16, hi);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)  // vcvtps2dq rounds half to even under the default MXCSR
    c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + 8 * i), _mm256_set1_ps(inv)));
  // |codes| <= 127, so the saturating packs are exact. They interleave per 128-bit lane: the
  // dwords come out as c0[0:4] c1[0:4] c2[0:4] c3[0:4] c0[4:8] c1[4:8] c2[4:8] c3[4:8].
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i codes = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), codes);
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
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
    sum += q[i];
  }
  return sum;
#endif
}

// One tile's 4 results for one activation row -> out[0 .. rows): plus the bias (fp32 at o0 or
// nullptr).
template <typename out_t>
inline void store_tile_row(const float* y, const float* bias, int64_t rows, out_t* out) {
  for (int64_t r = 0; r < rows; ++r) store_row(out, r, y[r] + (bias ? bias[r] : 0.f));
}

#if defined(__AVX2__) && defined(__FMA__)
#define QKILN_INT4_A8_AVX2 1

// Unsigned codes x signed activations -> int32 lanes, each the sum of 4 adjacent products: one
// vpdpbusd where the CPU has AVX512-VNNI (with VL) or AVX-VNNI, else vpmaddubsw + vpmaddwd by
// ones; the same sums (no pair of products reaches vpmaddubsw's int16 limit here). Same-process
// A/B against the other form (an AVX512-VNNI Zen 4 VM, 1536 x 576, one row, median of 7 rounds):
// 0.89-0.98x the time from cache, 0.89-1.0x from memory. Not used by the int8 x int8 GEMV
// (cpu_gemv_int8_a8.cpp): its lm_head read from memory was 1.09-1.2x slower with it at 2 threads.
inline __m256i dot4_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Block H of a row's 64-weight chunk (0: its low nibbles, q[k0 .. k0 + 31]; 1: its high nibbles,
// q[k0 + 32 .. k0 + 63]) -> 32 codes in k order: 1 instruction (the load folds into vpand) or 3.
template <int H>
inline __m256i block_codes(const uint8_t* chunk) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  if constexpr (H == 0) return _mm256_and_si256(w, nibble);
  return _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
}

// Rows r0 .. r0 + RB - 1 of one tile (w: its first chunk; s, zs: its scales and zero terms
// [num_groups, 4]) x MB activation rows (codes at xq, row m at xq + m * K_p; block scales at sx,
// row m at sx + m * KB; zero-term sums / 8 at xs8, row m at xs8 + m * num_groups) -> y[m][r] =
// sum_g s * sum_b sx * dot_b - zs * xs. The zero term goes in at each group's end, an eighth in
// each of the 8 lanes (exact scaling), where it overlaps the next group's multiplies (as a
// separate pass after the tile it was a chain of dependent subtractions, ~10% of the time at one
// row). The sums are local arrays indexed by unrolled loops only, so they live in registers (as
// struct members GCC kept them on the stack: a store and a reload on every block's FMA, 0.6x).
template <int MB, int RB>
void a8_rows(const uint8_t* w, const float* s, const float* zs, const int8_t* xq, const float* sx,
             const float* xs8, int64_t K_p, int64_t K, int64_t G, int64_t num_groups, int r0,
             float y[kMaxMB][kRows]) {
  __m256 group[MB][RB];  // this weight group's sum of sx * dot_b, 8 partial lanes
  __m256 total[MB][RB];  // sum over finished groups of s * group - zs * xs / 8
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) total[m][r] = group[m][r] = _mm256_setzero_ps();
  const int64_t KB = K_p / kBlock;
  s += r0;
  zs += r0;
  auto block = [&](auto half, const uint8_t* rows, int64_t k, int64_t b) {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256i codes = block_codes<decltype(half)::value>(rows + r * 32);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K_p + k));
        const __m256i dot = dot4_u8s8(codes, x);
        group[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(sx + m * KB + b),
                                      group[m][r]);
      }
    }
  };
  int64_t g = 0;
  auto flush = [&] {  // group end: its weight scale and zero term
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256 sr = _mm256_broadcast_ss(s + r), zr = _mm256_broadcast_ss(zs + r);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        total[m][r] = _mm256_fmadd_ps(group[m][r], sr, total[m][r]);
        total[m][r] = _mm256_fnmadd_ps(zr, _mm256_broadcast_ss(xs8 + m * num_groups + g), total[m][r]);
        group[m][r] = _mm256_setzero_ps();
      }
    }
    s += kRows;
    zs += kRows;
    ++g;
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
    if (k0 + 32 == K) break;  // K % 64 == 32: the chunk's high nibbles are padding
    block(std::integral_constant<int, 1>{}, rows, k0 + 32, k0 / kBlock + 1);
    if (k0 + 64 == group_end) {
      flush();
      group_end = std::min(group_end + G, K);
    }
  }
  store_pass_sums<MB, RB>(total, r0, y);
}

// One tile (output rows o0 .. o0 + 3) x MB activation rows -> out rows m * N + o0 (out_t).
template <int MB, typename out_t>
void a8_tile(const uint8_t* w, const float* s, const float* zs, const int8_t* xq, const float* sx,
             const float* xs8, int64_t K_p, int64_t K, int64_t G, int64_t num_groups,
             const float* bias, int64_t o0, int64_t N, out_t* out) {
  constexpr int RB = a8_rows_per_pass(MB);
  alignas(16) float y[kMaxMB][kRows];
  for (int r0 = 0; r0 < kRows; r0 += RB)
    a8_rows<MB, RB>(w, s, zs, xq, sx, xs8, K_p, K, G, num_groups, r0, y);
  if (o0 + kRows > N) {  // the last tile's padding rows: no 4-wide bias load or store
    for (int m = 0; m < MB; ++m) store_tile_row(y[m], bias ? bias + o0 : nullptr, N - o0, out + m * N + o0);
    return;
  }
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
    __m128 v = _mm_load_ps(y[m]);
    if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias + o0));
    store4(out + m * N + o0, v);
  }
}

template <typename out_t>
void a8_tile_rows(int MB, const uint8_t* w, const float* s, const float* zs, const int8_t* xq,
                  const float* sx, const float* xs8, int64_t K_p, int64_t K, int64_t G,
                  int64_t num_groups, const float* bias, int64_t o0, int64_t N, out_t* out) {
  switch (MB) {
    case 1: a8_tile<1>(w, s, zs, xq, sx, xs8, K_p, K, G, num_groups, bias, o0, N, out); break;
    case 2: a8_tile<2>(w, s, zs, xq, sx, xs8, K_p, K, G, num_groups, bias, o0, N, out); break;
    case 3: a8_tile<3>(w, s, zs, xq, sx, xs8, K_p, K, G, num_groups, bias, o0, N, out); break;
    default: a8_tile<4>(w, s, zs, xq, sx, xs8, K_p, K, G, num_groups, bias, o0, N, out); break;
  }
}

#else  // portable: the same layout, codes and sums in plain C++

template <typename out_t>
void a8_tile_rows(int MB, const uint8_t* w, const float* s, const float* zs, const int8_t* xq,
                  const float* sx, const float* xs8, int64_t K_p, int64_t K, int64_t G,
                  int64_t num_groups, const float* bias, int64_t o0, int64_t N, out_t* out) {
  const int64_t KB = K_p / kBlock;
  for (int m = 0; m < MB; ++m) {
    float y[kRows];
    for (int r = 0; r < kRows; ++r) {
      float total = 0.f, group = 0.f;
      for (int64_t b = 0; b < K / kBlock; ++b) {
        const uint8_t* bytes = w + ((b / 2) * kRows + r) * 32;  // block b: its chunk's nibble b % 2
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i)
          dot += ((bytes[i] >> (4 * (b % 2))) & 15) * xq[m * K_p + b * kBlock + i];
        group += static_cast<float>(dot) * sx[m * KB + b];
        const int64_t end = (b + 1) * kBlock;
        if (end % G == 0 || end == K) {
          const int64_t g = b * kBlock / G;
          total += group * s[g * kRows + r] - zs[g * kRows + r] * 8.f * xs8[m * num_groups + g];
          group = 0.f;
        }
      }
      y[r] = total;
    }
    store_tile_row(y, bias ? bias + o0 : nullptr, std::min<int64_t>(kRows, N - o0), out + m * N + o0);
  }
}

#endif

}  // namespace

void quantize_int8_rows(const at::Tensor& x, int64_t K_p, int64_t G, GemvActs& acts) {
  const at::Tensor rows = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), KB = K_p / kBlock, num_groups = G > 0 ? (K + G - 1) / G : 0;
  TORCH_CHECK(K % kBlock == 0 && K <= K_p, "int8 activations: in_features must be a multiple of 32");
  // Every block below K is written; a padding block past K is never read (the kernels stop at
  // K), so neither buffer is cleared. The zero-term sums accumulate: cleared.
  acts.codes.resize(M * K_p);
  acts.block_scales.resize(M * KB);
  acts.f32.assign(M * num_groups, 0.f);
  QKILN_DISPATCH(rows.scalar_type(), "qkiln_quantize_int8_rows", [&] {
    const scalar_t* xp = rows.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < K / kBlock; ++b) {
        float* scale = acts.block_scales.data() + m * KB + b;
        const int sum = quantize_block(xp + m * K + b * kBlock, acts.codes.data() + m * K_p + b * kBlock,
                                       scale);
        // xs / 8 (exact): the int4 kernel subtracts it from each of 8 lanes
        if (num_groups) acts.f32[m * num_groups + b * kBlock / G] += 0.125f * *scale * static_cast<float>(sum);
      }
  });
}

void Int4Gemv::prepare_int8(const at::Tensor& x, GemvActs& acts) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "w4a8_gemv: x must be [M, in_features]");
  quantize_int8_rows(x, K_p, G, acts);
}

void Int4Gemv::tiles_int8(const GemvActs& acts, int64_t M, int64_t begin, int64_t end,
                          at::Tensor& y) const {
  const int64_t KB = K_p / kBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "qkiln_w4a8_gemv", [&] {
    scalar_t* out = y.data_ptr<scalar_t>();
    for_int4_tile_blocks(w, s, c, K_p, num_groups, M, begin, end,
                         [&](int64_t t, int64_t m0, int MB, const uint8_t* wt, const float* st,
                             const float* zt) {
      a8_tile_rows(MB, wt, st, zt, acts.codes.data() + m0 * K_p, acts.block_scales.data() + m0 * KB,
                   acts.f32.data() + m0 * num_groups, K_p, K, G, num_groups, bias, t * kRows,
                   out_features, out + m0 * out_features);
    });
  });
}

// x [M, K] float/bf16/fp16 -> y [M, out_features] in x's dtype: the int8-activation layout
// (the header), c its zero term s z.
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
