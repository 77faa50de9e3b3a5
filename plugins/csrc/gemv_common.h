// Shared by the quantized GEMV kernels (cpu_gemv_int4*.cpp, cpu_gemv_int8*.cpp): tile geometry, the
// output stores and the whole-matrix call. Included by those sources only.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkiln_cpu.h"

namespace {

constexpr int64_t kRows = kGemvTileRows;  // output rows per tile
constexpr int64_t kChunk = 64;   // weights per row per chunk (32 bytes of nibbles)
constexpr int64_t kMaxMB = 4;    // activation rows per microkernel pass

// How far ahead of the tile being read the int4 kernels (exact layout) fetch the weights (~3.5
// tiles at K = 576), 4 KB as the int8 kernel. 30 layers of SmolLM2's int4 linears from memory, 2 threads,
// same-process A/B against 1 KB: M = 1 2.28 -> 2.04 ms, M = 4 2.98 -> 2.92, M = 16 13.5 -> 12.7
// (8 KB no better, 16 KB worse: more of it runs past a thread's last tile).
constexpr int64_t kPrefetchBytes = 4096;

template <typename out_t>
inline void store_row(out_t* out, int64_t index, float value) { out[index] = static_cast<out_t>(value); }

// Bytes from an int8 tile's start to the tile prefetched alongside it: whole tiles, at least 4 KB.
inline int64_t int8_prefetch_distance(int64_t tile_bytes) {
  return (4096 + tile_bytes - 1) / tile_bytes * tile_bytes;
}

#if defined(__AVX2__)  // the GEMVs' AVX2 / AVX-512 paths (an AVX-512 build has AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [hsum(t[0]), hsum(t[1]), hsum(t[2]), hsum(t[3])]: 3 hadds and one add for 4 reductions.
inline __m128 hsum4(const __m256* t) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// Output rows a pass of the int8-activation GEMVs reads for MB activation rows (MB * RB <= 4
// accumulators and their group sums stay in registers).
constexpr int a8_rows_per_pass(int MB) { return MB == 1 ? 4 : MB == 2 ? 2 : 1; }

// A pass's accumulators (8 partial lanes each) -> y[m][r0 .. r0 + RB): one hsum4 and a 16-byte
// store per activation row when the pass covers the whole tile.
template <int MB, int RB>
inline void store_pass_sums(const __m256 (&acc)[MB][RB], int r0, float y[kMaxMB][kRows]) {
  if constexpr (RB == kRows) {
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) _mm_storeu_ps(y[m], hsum4(acc[m]));
  } else {
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) y[m][r0 + r] = hsum(acc[m][r]);
  }
}

// A tile's 4 results -> out[0..3] in out_t, rounded as store_row would (c10::BFloat16: nearest
// even on the bits, NaN -> 0x7FC0; fp16: F16C's nearest even).
inline void store4(float* out, __m128 v) { _mm_storeu_ps(out, v); }
inline void store4(double* out, __m128 v) { _mm256_storeu_pd(out, _mm256_cvtps_pd(v)); }
inline void store4(c10::BFloat16* out, __m128 v) {
  const __m128i bits = _mm_castps_si128(v);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
  __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, _mm_add_epi32(odd, _mm_set1_epi32(0x7FFF))), 16);
  rounded = _mm_blendv_epi8(rounded, _mm_set1_epi32(0x7FC0), _mm_castps_si128(_mm_cmpunord_ps(v, v)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi32(rounded, rounded));
}
inline void store4(c10::Half* out, __m128 v) {
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// The int4 layout's tiles [begin, end) (weights at w, scales at s, zero term at c: [tiles,
// num_groups, 4]) x the rows [0, M) in blocks of up to kMaxMB: f(t, m0, MB, tile weights, tile
// scales, tile zero term), the loop both int4 GEMVs (exact and int8 activations) run.
template <class F>
inline void for_int4_tile_blocks(const uint8_t* w, const float* s, const float* c, int64_t K_p,
                                 int64_t num_groups, int64_t M, int64_t begin, int64_t end, F&& f) {
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* wt = w + t * (K_p / 2) * kRows;
    const float *st = s + t * num_groups * kRows, *ct = c + t * num_groups * kRows;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxMB)
      f(t, m0, static_cast<int>(std::min(kMaxMB, M - m0)), wt, st, ct);
  }
}

// x [M, K] -> y [M, out_features] in x's dtype through an Int4Gemv / Int8Gemv: prepare once, then
// every tile on torch's threads. The activation buffers are reused per calling thread (an
// allocation per call is measurable at batch 1); the reference is taken here because inside the
// parallel region the thread_local's name would be each worker's own, empty one.
template <class Gemv>
at::Tensor gemv_all_tiles(const Gemv& gemv, const at::Tensor& x) {
  thread_local GemvActs thread_acts;
  GemvActs& acts = thread_acts;
  gemv.prepare(x, acts);
  at::Tensor y = at::empty({x.size(0), gemv.out_features}, x.options());
  at::parallel_for(0, gemv.num_tiles, 16, [&](int64_t begin, int64_t end) {
    gemv.tiles(acts, x.size(0), begin, end, y);
  });
  return y;
}

}  // namespace
