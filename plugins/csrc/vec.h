// The 16-float vector abstraction the attention and elementwise kernels are written in: AVX-512
// when the build has it, else two AVX2 halves, else plain structs over the same interface.
#pragma once

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

// float, bf16, fp16 (the kernels have no double path); KV adds fp8 e4m3fn caches.
#define QKILN_DISPATCH(TYPE, NAME, ...)                                        \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)             \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
#define QKILN_DISPATCH_KV(TYPE, NAME, ...)                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)             \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)                 \
                     AT_DISPATCH_CASE(at::kFloat8_e4m3fn, __VA_ARGS__))

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
// flushes denormals: the rounded bf16 sits in the high 16 bits of each 32-bit lane, the low 16 are
// left over (bf16_bits shifts them out, round_to masks them off).
inline __m512i bf16_rounded_high(Vf v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}
inline __m256i bf16_bits(Vf v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_high(v), 16)); }
inline void store(c10::BFloat16* p, Vf v, int64_t n = kW) {
  _mm256_mask_storeu_epi16(p, lanes(n), bf16_bits(v));
}
inline void store(c10::Half* p, Vf v, int64_t n = kW) {
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// fp8 e4m3fn (bias 7) bytes in 16-bit lanes -> fp16 bits with the same exponent and mantissa
// fields (bias 15): exactly x / 256, subnormals included; NaN (0x7F, 0xFF) stays NaN.
inline __m512i fp8_as_fp16_div256(__m512i bytes) {
  const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi16(0x7F));
  __m512i bits = _mm512_or_si512(_mm512_slli_epi16(magnitude, 7),
                                 _mm512_slli_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0x80)), 8));
  return _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7F)),
                               _mm512_set1_epi16(0x7E00));
}
inline Vf load(const c10::Float8_e4m3fn* p, int64_t n = kW) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_maskz_loadu_epi8(lanes(n), p)));
  const Vf div256 = _mm512_cvtph_ps(_mm512_castsi512_si256(fp8_as_fp16_div256(words)));
  return _mm512_mul_ps(div256, _mm512_set1_ps(256.f));
}
// fp32 -> e4m3fn bytes as c10::Float8_e4m3fn rounds (nearest even; below 2^-6 onto the subnormal
// grid; NaN -> 0x7F). Finite inputs must be within +-448 (the caller clamps; larger ones would
// round to the NaN code as in c10).
inline void store(c10::Float8_e4m3fn* p, Vf v, int64_t n = kW) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(magnitude, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd));
  __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
  const Vf scaled = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(512.f));  // exact
  const __m512i subnormal = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  code = _mm512_mask_mov_epi32(code, _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(0x3C800000)),
                               subnormal);  // |x| < 2^-6
  code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));
  _mm_mask_storeu_epi8(p, lanes(n), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
}
// min(max(v, -limit), limit), NaN kept (torch.clamp's rule; maxps returns its second operand on NaN).
inline Vf clamp_abs(Vf v, float limit) {
  return _mm512_min_ps(_mm512_set1_ps(limit), _mm512_max_ps(_mm512_set1_ps(-limit), v));
}
inline Vf set1(float x) { return _mm512_set1_ps(x); }
inline Vf add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf sub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf div(Vf a, Vf b) { return _mm512_div_ps(a, b); }
inline Vf vmax(Vf a, Vf b) { return _mm512_max_ps(a, b); }
inline Vf vmin(Vf a, Vf b) { return _mm512_min_ps(a, b); }
inline Vf fmadd(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(Vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(Vf v) { return _mm512_reduce_max_ps(v); }
inline float reduce_min(Vf v) { return _mm512_reduce_min_ps(v); }
// The SIMD branches only (QKILN_VEC_SIMD): round half to even; 16 bytes widened to floats; values
// in [0, 256) truncated to 16 bytes.
#define QKILN_VEC_SIMD 1
inline Vf round_even(Vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vf widen_u8(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }
inline __m128i to_u8(Vf v) { return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)); }
// Round to T and back (identity for float).
template <typename T> inline Vf round_to(Vf v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // kept in 32-bit lanes: packing to 16 bits and
    // widening back cost two lane-crossing shuffles (SiLU-and-mul of 1024 x 3072 on one thread
    // 1.415 -> 1.293 ms, the same bits)
    return _mm512_castsi512_ps(
        _mm512_and_si512(bf16_rounded_high(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
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

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// AVX2 (CPUs without AVX-512, or VMs that hide it): a vector is two 8-float halves. Same results
// as the AVX-512 functions above, bit for bit, wherever the lane order of a reduction matches
// (reduce_add / reduce_max fold the halves as _mm512_reduce_* do; sum16's order differs).
// Partial vectors (n < 16) go through a zeroed 16-element buffer: tails only.
#define QKILN_VEC_AVX2 1  // this branch: widen_bf16 and sum8 exist (cpu_attention_decode_avx2.cpp)
struct Vf { __m256 lo, hi; };
template <typename T, typename F> inline Vf load_partial(const T* p, int64_t n, F full) {
  alignas(32) T tmp[kW] = {};
  std::memcpy(tmp, p, std::max<int64_t>(0, std::min<int64_t>(n, kW)) * sizeof(T));
  return full(tmp);
}
template <typename T, typename F> inline void store_partial(T* p, Vf v, int64_t n, F full) {
  alignas(32) T tmp[kW];
  full(tmp, v);
  std::memcpy(p, tmp, std::max<int64_t>(0, std::min<int64_t>(n, kW)) * sizeof(T));
}
inline __m256 widen_bf16(__m128i words) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}
inline Vf load(const float* p, int64_t n = kW) {
  if (n >= kW) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::max<int64_t>(n, 0))), iota);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::max<int64_t>(n - 8, 0))), iota);
  return {_mm256_maskload_ps(p, lo), _mm256_maskload_ps(p + 8, hi)};
}
inline Vf load(const c10::BFloat16* p, int64_t n = kW) {
  if (n < kW) return load_partial(p, n, [](const c10::BFloat16* t) { return load(t); });
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {widen_bf16(_mm256_castsi256_si128(words)), widen_bf16(_mm256_extracti128_si256(words, 1))};
}
inline Vf load(const c10::Half* p, int64_t n = kW) {
  if (n < kW) return load_partial(p, n, [](const c10::Half* t) { return load(t); });
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(words)), _mm256_cvtph_ps(_mm256_extracti128_si256(words, 1))};
}
inline void store(float* p, Vf v, int64_t n = kW) {
  if (n >= kW) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
    return;
  }
  store_partial(p, v, n, [](float* t, Vf w) { store(t, w); });
}
// c10::BFloat16's rounding, as bf16_rounded_high above.
inline __m256i bf16_rounded_high(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                                              _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
// Two vectors of 32-bit lanes holding values < 2^16 -> 16 words in lane order.
inline __m256i pack_words(__m256i lo, __m256i hi) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}
inline void store(c10::BFloat16* p, Vf v, int64_t n = kW) {
  if (n < kW) return store_partial(p, v, n, [](c10::BFloat16* t, Vf w) { store(t, w); });
  const __m256i words = pack_words(_mm256_srli_epi32(bf16_rounded_high(v.lo), 16),
                                   _mm256_srli_epi32(bf16_rounded_high(v.hi), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), words);
}
inline void store(c10::Half* p, Vf v, int64_t n = kW) {
  if (n < kW) return store_partial(p, v, n, [](c10::Half* t, Vf w) { store(t, w); });
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.lo, kRound));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(v.hi, kRound));
}
// 8 fp8 e4m3fn bytes -> fp32 through fp16 bits, as fp8_as_fp16_div256 above.
inline __m256 widen_fp8(__m128i bytes8) {
  const __m128i words = _mm_cvtepu8_epi16(bytes8);
  const __m128i magnitude = _mm_and_si128(words, _mm_set1_epi16(0x7F));
  const __m128i bits = _mm_or_si128(_mm_slli_epi16(magnitude, 7),
                                    _mm_slli_epi16(_mm_and_si128(words, _mm_set1_epi16(0x80)), 8));
  const __m128i nan = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F));
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_blendv_epi8(bits, _mm_set1_epi16(0x7E00), nan)),
                       _mm256_set1_ps(256.f));
}
inline Vf load(const c10::Float8_e4m3fn* p, int64_t n = kW) {
  if (n < kW) return load_partial(p, n, [](const c10::Float8_e4m3fn* t) { return load(t); });
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {widen_fp8(bytes), widen_fp8(_mm_srli_si128(bytes, 8))};
}
// fp32 -> e4m3fn codes (32-bit lanes) as store(Float8_e4m3fn*) above rounds them.
inline __m256i fp8_codes(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(magnitude, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), odd));
  __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(120 << 3));
  const __m256 scaled = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(512.f));  // exact
  const __m256i subnormal = _mm256_cvtps_epi32(scaled);  // MXCSR's default: nearest even
  code = _mm256_blendv_epi8(code, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), magnitude));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_or_si256(code, sign);
}
inline void store(c10::Float8_e4m3fn* p, Vf v, int64_t n = kW) {
  if (n < kW) return store_partial(p, v, n, [](c10::Float8_e4m3fn* t, Vf w) { store(t, w); });
  const __m256i words = pack_words(fp8_codes(v.lo), fp8_codes(v.hi));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
}
template <typename F> inline Vf map2(Vf a, Vf b, F f) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }
inline Vf clamp_abs(Vf v, float limit) {  // NaN kept, as the AVX-512 clamp_abs
  const __m256 lo = _mm256_set1_ps(-limit), hi = _mm256_set1_ps(limit);
  return {_mm256_min_ps(hi, _mm256_max_ps(lo, v.lo)), _mm256_min_ps(hi, _mm256_max_ps(lo, v.hi))};
}
inline Vf set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vf add(Vf a, Vf b) { return map2(a, b, [](__m256 p, __m256 q) { return _mm256_add_ps(p, q); }); }
inline Vf sub(Vf a, Vf b) { return map2(a, b, [](__m256 p, __m256 q) { return _mm256_sub_ps(p, q); }); }
inline Vf mul(Vf a, Vf b) { return map2(a, b, [](__m256 p, __m256 q) { return _mm256_mul_ps(p, q); }); }
inline Vf div(Vf a, Vf b) { return map2(a, b, [](__m256 p, __m256 q) { return _mm256_div_ps(p, q); }); }
inline Vf vmax(Vf a, Vf b) { return map2(a, b, [](__m256 p, __m256 q) { return _mm256_max_ps(p, q); }); }
inline Vf vmin(Vf a, Vf b) { return map2(a, b, [](__m256 p, __m256 q) { return _mm256_min_ps(p, q); }); }
inline Vf fmadd(Vf a, Vf b, Vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float reduce_add(Vf v) {  // _mm512_reduce_add_ps's order: halves, quarters, pairs, lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(_mm256_add_ps(v.lo, v.hi)),
                        _mm256_extractf128_ps(_mm256_add_ps(v.lo, v.hi), 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline float reduce_max(Vf v) {
  const __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline float reduce_min(Vf v) {
  const __m256 m = _mm256_min_ps(v.lo, v.hi);
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_min_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#define QKILN_VEC_SIMD 1  // round_even, widen_u8, to_u8: as the AVX-512 ones
inline Vf round_even(Vf v) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, kRound), _mm256_round_ps(v.hi, kRound)};
}
inline Vf widen_u8(__m128i bytes) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline __m128i to_u8(Vf v) {
  const __m256i words = pack_words(_mm256_cvttps_epi32(v.lo), _mm256_cvttps_epi32(v.hi));
  return _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}
template <typename T> inline Vf round_to(Vf v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i keep = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    return {_mm256_castsi256_ps(_mm256_and_si256(bf16_rounded_high(v.lo), keep)),
            _mm256_castsi256_ps(_mm256_and_si256(bf16_rounded_high(v.hi), keep))};
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_cvtph_ps(_mm256_cvtps_ph(v.lo, kRound)), _mm256_cvtph_ps(_mm256_cvtps_ph(v.hi, kRound))};
  } else {
    return v;
  }
}
// Eight 8-float vectors -> lane i = sum of t[i]'s lanes (a horizontal-add tree).
inline __m256 sum8(const __m256* t) {
  const __m256 e = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
  const __m256 f = _mm256_hadd_ps(_mm256_hadd_ps(t[4], t[5]), _mm256_hadd_ps(t[6], t[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(e, f, 0x20), _mm256_permute2f128_ps(e, f, 0x31));
}
inline Vf sum16(const Vf* v) {
  __m256 t[kW];
  for (int i = 0; i < kW; ++i) t[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {sum8(t), sum8(t + 8)};
}
// torch's AVX2 Vectorized<float>::exp is Sleef_expf8_u10 (see the AVX-512 vexp).
using ExpFn = __m256 (*)(__m256);
ExpFn sleef_exp() {
  static const ExpFn fn = [] {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    return lib ? reinterpret_cast<ExpFn>(dlsym(lib, "Sleef_expf8_u10")) : nullptr;
  }();
  return fn;
}
inline Vf vexp(Vf v) {
  static const ExpFn fn = sleef_exp();
  if (fn) return {fn(v.lo), fn(v.hi)};
  alignas(32) float x[kW];
  _mm256_store_ps(x, v.lo);
  _mm256_store_ps(x + 8, v.hi);
  for (float& e : x) e = std::exp(e);
  return {_mm256_load_ps(x), _mm256_load_ps(x + 8)};
}
bool exp_is_torchs() { return sleef_exp() != nullptr; }

#else  // portable: the same kernels over 16-float structs

struct Vf { float x[kW]; };
template <typename T> inline Vf load_any(const T* p, int64_t n) {
  Vf v{};
  for (int64_t i = 0; i < std::min<int64_t>(n, kW); ++i) v.x[i] = static_cast<float>(p[i]);
  return v;
}
template <typename T> inline void store_any(T* p, Vf v, int64_t n) {
  for (int64_t i = 0; i < std::min<int64_t>(n, kW); ++i) p[i] = static_cast<T>(v.x[i]);
}
// Plain overloads, not a template: argument-dependent lookup also finds c10::load<T> for c10
// types, and a template here would be ambiguous with it.
inline Vf load(const float* p, int64_t n = kW) { return load_any(p, n); }
inline Vf load(const c10::BFloat16* p, int64_t n = kW) { return load_any(p, n); }
inline Vf load(const c10::Half* p, int64_t n = kW) { return load_any(p, n); }
inline void store(float* p, Vf v, int64_t n = kW) { store_any(p, v, n); }
inline void store(c10::BFloat16* p, Vf v, int64_t n = kW) { store_any(p, v, n); }
inline void store(c10::Half* p, Vf v, int64_t n = kW) { store_any(p, v, n); }
inline Vf load(const c10::Float8_e4m3fn* p, int64_t n = kW) { return load_any(p, n); }
inline void store(c10::Float8_e4m3fn* p, Vf v, int64_t n = kW) { store_any(p, v, n); }
inline Vf clamp_abs(Vf v, float limit) {
  for (float& e : v.x) e = std::isnan(e) ? e : std::min(limit, std::max(-limit, e));
  return v;
}
template <typename F> inline Vf map2(Vf a, Vf b, F f) { for (int i = 0; i < kW; ++i) a.x[i] = f(a.x[i], b.x[i]); return a; }
inline Vf set1(float x) { Vf v; for (float& e : v.x) e = x; return v; }
inline Vf add(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return p + q; }); }
inline Vf sub(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return p - q; }); }
inline Vf mul(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return p * q; }); }
inline Vf div(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return p / q; }); }
inline Vf vmax(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return std::max(p, q); }); }
inline Vf vmin(Vf a, Vf b) { return map2(a, b, [](float p, float q) { return std::min(p, q); }); }
inline Vf fmadd(Vf a, Vf b, Vf c) { return add(mul(a, b), c); }
inline float reduce_add(Vf v) { float s = 0.f; for (float e : v.x) s += e; return s; }
inline float reduce_max(Vf v) { float s = v.x[0]; for (float e : v.x) s = std::max(s, e); return s; }
inline float reduce_min(Vf v) { float s = v.x[0]; for (float e : v.x) s = std::min(s, e); return s; }
template <typename T> inline Vf round_to(Vf v) {
  for (float& e : v.x) e = static_cast<float>(static_cast<T>(e));
  return v;
}
inline Vf vexp(Vf v) { for (float& e : v.x) e = std::exp(e); return v; }
inline Vf sum16(const Vf* v) { Vf r; for (int i = 0; i < kW; ++i) r.x[i] = reduce_add(v[i]); return r; }
bool exp_is_torchs() { return false; }

#endif

}  // namespace
