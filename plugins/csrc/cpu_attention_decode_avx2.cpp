// Decode attention over a bf16 cache on AVX2 hosts (no AVX512-BF16): one kv head's whole GQA
// group per pass over its K and V rows, each bf16 row widened to fp32 once for all the group's
// query heads.
//
// Why: decode_head_tiled (cpu_attention_portable.h) widens a 16-token tile's rows again for every query
// head, reduces the scores 16 tokens at a time through sum16 and walks the rows through pointer
// tables; at SmolLM2's group of 3 that took ~180 cycles a token and kv head (batch-1 decode stack,
// 192-token context: attention 20% of the step). Here, per token:
//   pass 1  the K row as 8-float vectors (vpmovzxwd + vpslld each), one FMA per vector and query
//           head into two accumulators per head (the query from L1); every 8 tokens sum8 turns a
//           head's 8 accumulators into 8 scores;
//   pass 2  per 8 * NC output columns, the V row's vectors once and one broadcast of p per head,
//           NC FMAs per head into accumulators that stay in registers over all T tokens.
// 30 layers' attention alone (3 kv heads, 192 tokens, 1 thread): 69 -> 43 cycles a token and kv
// head with the cache in L3, 108 -> 53 with it evicted, 288 -> 152 evicted and the blocks
// scattered. In the decode stack the rows come from memory (the weights stream 88 MB a step
// through L3): ~110 cycles, a warm second pass over them ~46. Prefetching the next block's rows
// (16 tokens ahead) was measured there and changed nothing (1.00x); the rows are split by context
// like decode_heads_bf16's (split_decodes): 400-token prompt, step 4.75 -> 4.39 ms with the split.
// Groups of more than 4 query heads run in sub-groups of up to 4 (register budget). The math is
// decode_head_tiled's: scores of the scaled fp32 query, two-pass softmax (softmax_rows_lse), fp32
// sums in another order, so results agree to rounding, not bit for bit.

#include "attention_common.h"

namespace attention_detail {

#ifdef QKILN_VEC_AVX2

namespace {

using bf16 = c10::BFloat16;

inline __m256 widen8(const bf16* p) {
  return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// scores[g * T + t] = qf[g] . K[t] for the G heads of qf (fp32 [G, D], already scaled).
template <int G, int D>
void group_scores(const float* qf, const bf16* k_head, const int32_t* table, int64_t block_size,
                  int64_t row_stride, int64_t T, float* scores) {
  __m256 dots[G][8];  // the current 8 tokens' per-lane partial dot products
  int i = 0;
  auto flush = [&](int64_t first, int n) {  // tokens first .. first + n - 1
    for (int g = 0; g < G; ++g) {
      for (int j = n; j < 8; ++j) dots[g][j] = _mm256_setzero_ps();
      alignas(32) float sums[8];
      _mm256_store_ps(sums, sum8(dots[g]));
      std::memcpy(scores + g * T + first, sums, n * sizeof(float));
    }
  };
  for_each_row(k_head, table, block_size, row_stride, T, [&](int64_t t, const bf16* row) {
    __m256 even[G], odd[G];  // two chains per head halve the FMA latency chain
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_ps();
    for (int j = 0; j < D; j += 16) {
      const __m256 k0 = widen8(row + j), k1 = widen8(row + j + 8);
      for (int g = 0; g < G; ++g) {
        even[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + j), k0, even[g]);
        odd[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + j + 8), k1, odd[g]);
      }
    }
    for (int g = 0; g < G; ++g) dots[g][i] = _mm256_add_ps(even[g], odd[g]);
    if (++i == 8) flush(t - 7, 8), i = 0;
  });
  if (i) flush(T - i, i);
}

// acc[g * D + d] = sum_t p[g * T + t] * V[t, d] for the G heads.
template <int G, int D>
void group_values(const float* p, const bf16* v_head, const int32_t* table, int64_t block_size,
                  int64_t row_stride, int64_t T, float* acc) {
  constexpr int NC = 4 * G + 5 <= 16 ? 4 : 2;  // vectors per column chunk: accumulators in registers
  for (int c = 0; c < D; c += 8 * NC) {
    __m256 sums[G][NC];
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) sums[g][k] = _mm256_setzero_ps();
    for_each_row(v_head, table, block_size, row_stride, T, [&](int64_t t, const bf16* row) {
      __m256 v[NC];
      for (int k = 0; k < NC; ++k) v[k] = widen8(row + c + 8 * k);
      for (int g = 0; g < G; ++g) {
        const __m256 pg = _mm256_broadcast_ss(p + g * T + t);
        for (int k = 0; k < NC; ++k) sums[g][k] = _mm256_fmadd_ps(pg, v[k], sums[g][k]);
      }
    });
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) _mm256_storeu_ps(acc + g * D + c + 8 * k, sums[g][k]);
  }
}

template <int G, int D, typename o_t>
void decode_group(const Decode& a, const bf16* q, const bf16* k_head, const bf16* v_head,
                  const int32_t* table, int64_t T, o_t* out, float* lse) {
  thread_local std::vector<float> buf;
  buf.resize(2 * G * D + G * T + G);
  float *qf = buf.data(), *acc = qf + G * D, *scores = acc + G * D;  // [G, D], [G, D], [G, T]
  float* inv_sum = scores + G * T;
  for (int64_t i = 0; i < G * D; i += kW) store(qf + i, mul(load(q + i), set1(a.scale)));
  const int64_t row_stride = a.num_kv_heads * D;
  group_scores<G, D>(qf, k_head, table, a.block_size, row_stride, T, scores);
  softmax_rows_lse(scores, G, T, inv_sum, lse);
  group_values<G, D>(scores, v_head, table, a.block_size, row_stride, T, acc);
  write_heads(acc, inv_sum, G, D, a.out_scale, out);
}

template <int D, typename o_t>
void decode_group_d(const Decode& a, const bf16* q, const bf16* k_head, const bf16* v_head,
                    const int32_t* table, int64_t T, o_t* out, float* lse) {
  for (int64_t g0 = 0; g0 < a.group; g0 += 4) {  // sub-groups of up to 4 query heads
    const bf16* qg = q + g0 * D;
    o_t* og = out + g0 * D;
    float* lg = lse ? lse + g0 : nullptr;
    switch (std::min<int64_t>(4, a.group - g0)) {
      case 1: decode_group<1, D>(a, qg, k_head, v_head, table, T, og, lg); break;
      case 2: decode_group<2, D>(a, qg, k_head, v_head, table, T, og, lg); break;
      case 3: decode_group<3, D>(a, qg, k_head, v_head, table, T, og, lg); break;
      default: decode_group<4, D>(a, qg, k_head, v_head, table, T, og, lg); break;
    }
  }
}

}  // namespace

template <typename o_t>
void decode_group_bf16(const Decode& a, const c10::BFloat16* q, const c10::BFloat16* k_head,
                       const c10::BFloat16* v_head, const int32_t* table, int64_t T, o_t* out,
                       float* lse) {
  TORCH_CHECK(a.head_dim == 64 || a.head_dim == 128, "decode_group_bf16: head_dim must be 64 or 128");
  if (a.head_dim == 64) decode_group_d<64>(a, q, k_head, v_head, table, T, out, lse);
  else decode_group_d<128>(a, q, k_head, v_head, table, T, out, lse);
}

#else  // vec.h is not in its AVX2 form: AttentionTasks never calls it (kGroupDecodeBf16)

template <typename o_t>
void decode_group_bf16(const Decode&, const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                       const int32_t*, int64_t, o_t*, float*) {
  TORCH_CHECK(false, "decode_group_bf16: built for AVX2 hosts only");
}

#endif

template void decode_group_bf16<float>(const Decode&, const c10::BFloat16*, const c10::BFloat16*,
                                       const c10::BFloat16*, const int32_t*, int64_t, float*, float*);
template void decode_group_bf16<c10::BFloat16>(const Decode&, const c10::BFloat16*, const c10::BFloat16*,
                                               const c10::BFloat16*, const int32_t*, int64_t,
                                               c10::BFloat16*, float*);
template void decode_group_bf16<c10::Half>(const Decode&, const c10::BFloat16*, const c10::BFloat16*,
                                           const c10::BFloat16*, const int32_t*, int64_t, c10::Half*,
                                           float*);

}  // namespace attention_detail
