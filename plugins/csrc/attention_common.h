// What the decode kernels share (cpu_attention.cpp, cpu_attention_decode_avx2.cpp): the AVX2
// group kernel's entry, the two-pass softmax over a task's scores and the scaled write of its
// heads, in vec.h's vectors.
#pragma once

#include "cpu_attention_internal.h"
#include "vec.h"

namespace attention_detail {

// Whether decode_group_bf16 runs here: vec.h in its AVX2 form (AVX2 hosts without AVX-512).
#ifdef QKILN_VEC_AVX2
constexpr bool kGroupDecodeBf16 = true;
#else
constexpr bool kGroupDecodeBf16 = false;
#endif

// One decode row's query heads of one kv head over a bf16 cache, head_dim 64 or 128, the whole
// GQA group per pass over K and V (cpu_attention_decode_avx2.cpp); q [group, D] bf16, out
// [group, D], lse (a part of a split context) as decode_head_tiled's.
template <typename o_t>
void decode_group_bf16(const Decode& a, const c10::BFloat16* q, const c10::BFloat16* k_head,
                       const c10::BFloat16* v_head, const int32_t* table, int64_t T, o_t* out,
                       float* lse);

}  // namespace attention_detail

namespace {

// Softmax numerators in place over scores [G, T]; returns 1 / denominator per row in inv_sum (and
// each row's max in row_max when given).
inline void softmax_rows(float* scores, int64_t G, int64_t T, float* inv_sum, float* row_max = nullptr) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * T;
    Vf m = set1(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + kW <= T; t += kW) m = vmax(m, load(s + t));
    float top = reduce_max(m);
    for (; t < T; ++t) top = std::max(top, s[t]);
    if (row_max) row_max[g] = top;
    const Vf shift = set1(top);
    Vf total = set1(0.f);
    for (int64_t t = 0; t < T; t += kW) {
      store(s + t, vexp(sub(load(s + t, T - t), shift)), T - t);
      total = add(total, load(s + t, T - t));
    }
    inv_sum[g] = 1.f / reduce_add(total);
  }
}

// softmax_rows, and where `lse` is given (a part of a split context) each row's log-sum-exp of its
// scores into it, for merge_partials.
inline void softmax_rows_lse(float* scores, int64_t G, int64_t T, float* inv_sum, float* lse) {
  if (!lse) return softmax_rows(scores, G, T, inv_sum);
  softmax_rows(scores, G, T, inv_sum, lse);  // lse holds the rows' maxima here
  for (int64_t g = 0; g < G; ++g) lse[g] -= std::log(inv_sum[g]);
}

// out [G, D] = acc * out_scale / sum(p), row by row: the last step of every decode_head form.
template <typename o_t>
inline void write_heads(const float* acc, const float* inv_sum, int64_t G, int64_t D, float out_scale,
                        o_t* out) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; d += kW)
      store(out + g * D + d, mul(load(acc + g * D + d), set1(inv_sum[g] * out_scale)));
}

}  // namespace
