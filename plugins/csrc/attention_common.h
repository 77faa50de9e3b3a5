// What the decode kernels share (cpu_attention.cpp with cpu_attention_portable.h,
// cpu_attention_decode_bf16.cpp, cpu_attention_int4.cpp, cpu_attention_decode_avx2.cpp): the
// entries of the ISA-specific decode kernels and what they take (NextKeys, Int4Rows), the two-pass
// softmax over a task's scores and the scaled write of its heads, in vec.h's vectors.
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

// Whether the AVX512-BF16 decode kernels (cpu_attention_decode_bf16.cpp, cpu_attention_int4.cpp)
// run here (QKILN_ATTENTION_BF16).
#ifdef QKILN_ATTENTION_BF16
constexpr bool kBf16Heads = true;
#else
constexpr bool kBf16Heads = false;
#endif

// fp8 (e4m3fn) rows as decode_heads_bf16 reads them (RowWords, cpu_attention_decode_bf16.cpp):
// through byte tables, their words permuted within each 64-element chunk, where the CPU has
// AVX512-VBMI (kPermutedRows); else widened in order to x / 256, and kRowUnit puts the 256 back
// into the head scales.
#if defined(__AVX512VBMI__)
constexpr bool kFp8Tables = true;
#else
constexpr bool kFp8Tables = false;
#endif
template <typename kv_t>
constexpr bool kPermutedRows = kFp8Tables && std::is_same_v<kv_t, c10::Float8_e4m3fn>;
template <typename kv_t>
constexpr float kRowUnit = std::is_same_v<kv_t, c10::Float8_e4m3fn> && !kFp8Tables ? 256.f : 1.f;

// The K rows the same thread reads next (the next task's), fetched into L2 during this task's
// p @ V: table nullptr when there is none.
template <typename kv_t>
struct NextKeys {
  const kv_t* k_head = nullptr;
  const int32_t* table = nullptr;
  int64_t T = 0;
};

// Int4Rows: an int4 cache's rows dequantized into fp32 once per tile, for every query head of the
// group (the bytes and the per-(slot, head, group) fp16 scale / min through the block table): the
// portable kernels fill it; decode_head_int4 and the int4 prefill blocks read its pointers only.
// The tile's values live in one buffer per thread, not in the struct: every decode row makes a new
// Int4Rows, and an 8 KB member was zeroed and copied each time. So a fill overwrites the thread's
// last tile (the kernels use one tile at a time).
struct Int4Rows {
  const uint8_t *k_head, *v_head;  // the head's bytes of slot 0
  const c10::Half *k_scale, *k_min, *v_scale, *v_min;  // the head's groups of slot 0
  const int32_t* table;
  int64_t block_size, head_dim, group, num_kv_heads;
  const float* rows[kW];
  // This head's K (value false) or V row of a slot: its packed codes, fp16 scales and minimums.
  struct Row {
    const uint8_t* codes;
    const c10::Half *scale, *minimum;
  };
  Row row(int64_t slot, bool value) const {
    const int64_t bytes = num_kv_heads * head_dim / 2, groups = num_kv_heads * head_dim / group;
    return {(value ? v_head : k_head) + slot * bytes, (value ? v_scale : k_scale) + slot * groups,
            (value ? v_min : k_min) + slot * groups};
  }
  void fill(int64_t t0, int64_t n, bool value) {
    thread_local float values[kW * kMaxInt4HeadDim];
    int64_t slots[kW];
    tile_slots(table, block_size, t0, n, 1, slots);
    for (int64_t i = 0; i < n; ++i) {
      const Row r = row(slots[i], value);
      dequantize_int4_row(r.codes, r.scale, r.minimum, head_dim, group, values + i * head_dim);
      rows[i] = values + i * head_dim;
    }
  }
};

// decode_head for a bf16 query over a bf16 or fp8 cache, D = 32 * NP (64, 128), for H consecutive
// kv heads at once (cpu_attention_decode_bf16.cpp): q, out: their H * group query heads; k_head /
// v_head: the first one's slice of row 0; k_scale / v_scale: per kv head of the task (fp8), else
// nullptr; next: the next task's K, prefetched; lse: a part of a split context's log-sum-exp.
template <int NP, typename kv_t, typename o_t>
void decode_heads_bf16(const Decode& a, const c10::BFloat16* q, const kv_t* k_head, const kv_t* v_head,
                       const int32_t* table, int64_t T, o_t* out, std::vector<float>& buf, int64_t H,
                       const float* k_scale, const float* v_scale, const NextKeys<kv_t>& next = {},
                       float* lse = nullptr);

// Tokens [0, T) of one kv head of an fp8 cache (head: its slice of slot 0, through the block table)
// as bf16 rows in element order, D = 32 * NP apart in out (cpu_attention_decode_bf16.cpp).
template <int NP>
void widen_fp8_rows(const c10::Float8_e4m3fn* head, int64_t row_stride, const int32_t* table, int64_t block_size,
                    int64_t T, c10::BFloat16* out);

// decode_head for a bf16 query over an int4 cache, D = 16 * NV (32, 64, 128), groups of a multiple
// of 4 elements (at most 16 a row), K and V read as their codes (cpu_attention_int4.cpp).
template <int NV, typename o_t>
void decode_head_int4(const Decode& a, const c10::BFloat16* q, const Int4Rows& rows, int64_t T, o_t* out,
                      std::vector<float>& buf, float* lse = nullptr);

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

#ifdef QKILN_ATTENTION_BF16
// Accumulators kept as even and odd elements (lane l: elements 2l and 2l + 1) back in element
// order: lanes 0-7 of even and odd interleaved (elements 0-15), then lanes 8-15 (16-31).
inline Vf interleave_first(Vf even, Vf odd) {
  return _mm512_permutex2var_ps(even, _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), odd);
}
inline Vf interleave_last(Vf even, Vf odd) {
  return _mm512_permutex2var_ps(even, _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8),
                                odd);
}
#endif
}  // namespace
