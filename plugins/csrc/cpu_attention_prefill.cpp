// qkiln CPU attention for prefill blocks over a bf16 cache (cpu_attention.cpp splits the work
// into tasks, serves decodes and the other cache dtypes, and hands an fp8 cache's prefix here as
// bf16 rows with the head's scales in the Decode).

#include "cpu_attention_internal.h"
#include "vec.h"

namespace attention_detail {

#ifdef QKILN_ATTENTION_BF16

// A prefill block (R consecutive query rows of one sequence; row r sees T_first + r tokens) for one
// kv head over a bf16 cache, D = 32 * NP, flash-attention style: 16-token tiles of K and V are read
// once for the block's R x group query rows, scores come 16 tokens to a vector with no horizontal
// sums (K's tile gathered into pair-major order: lane t of kt[j] holds K[t][2j], K[t][2j+1], met by
// the query's pair j broadcast in vdpbf16ps), the softmax runs online (running max and sum, the
// output rescaled as the max moves) and p @ V goes through vdpbf16ps too, with p rounded to bf16
// (as HF's eager attention and torch's CPU flash attention do) against V rows interleaved in token
// pairs. decode_heads_bf16 serves one row at a time instead, re-reading the tile per row and
// summing each score across a vector. q / out: the block's first row at the head's first query
// head; rows q_stride / out_stride apart.
template <int NP, typename o_t>
void prefill_block_bf16(const Decode& a, const c10::BFloat16* q, int64_t q_stride,
                        const c10::BFloat16* k_head, const c10::BFloat16* v_head, const int32_t* table,
                        int64_t T_first, int64_t R, o_t* out, int64_t out_stride) {
  constexpr int64_t D = NP * 32;
  const int64_t G = a.group, RG = R * G, row_stride = a.num_kv_heads * D, T_max = T_first + R - 1;
  // Per thread, reused: p @ V [R * G][2 * NP] (low / high halves per 32 dims), the running max and
  // sum [R * G]; per tile: the scores [R * G], p in bf16 pairs [R * G][8], each row's rescale and
  // count of tokens it sees. The loops use raw pointers: indexing the vectors themselves made the
  // compiler reload their data pointers (and `a`'s fields) after every float / vector store, which
  // measured 1.46 instead of 1.25 ms a layer (8 x 128 prefill, the A/B in cpu_attention.cpp).
  thread_local std::vector<Vf> acc_buf, scores_buf;
  thread_local std::vector<float> max_buf, sum_buf, rescale_buf;
  thread_local std::vector<uint32_t> pairs_buf;
  thread_local std::vector<int64_t> valid_buf;
  acc_buf.assign(RG * 2 * NP, set1(0.f));
  max_buf.assign(RG, -std::numeric_limits<float>::infinity());
  sum_buf.assign(RG, 0.f);
  scores_buf.resize(RG), pairs_buf.resize(RG * kW / 2), rescale_buf.resize(RG), valid_buf.resize(RG);
  Vf *acc = acc_buf.data(), *tile_scores = scores_buf.data();
  float *run_max = max_buf.data(), *run_sum = sum_buf.data(), *rescales = rescale_buf.data();
  uint32_t* pairs = pairs_buf.data();
  int64_t* valids = valid_buf.data();
  const float scale = a.scale;
  const int64_t block_size = a.block_size;
  __m512i kt[D / 2];          // the K tile, pair-major
  __m512i vi[kW / 2][NP][2];  // the V tile in token pairs: [pair][32 dims][low, high]
  int64_t offsets[kW];
  const __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t t0 = 0; t0 < T_max; t0 += kW) {
    const int64_t n = std::min<int64_t>(kW, T_max - t0);
    tile_slots(table, block_size, t0, n, row_stride, offsets);
    alignas(64) int32_t k_words[kW];  // each token's row in 32-bit words from k_head (past n: row 0)
    for (int64_t t = 0; t < kW; ++t)
      k_words[t] = static_cast<int32_t>((t < n ? offsets[t] : offsets[0]) / 2);
    const __m512i words = _mm512_load_si512(k_words);
    for (int64_t j = 0; j < D / 2; ++j)
      kt[j] = _mm512_i32gather_epi32(_mm512_add_epi32(words, _mm512_set1_epi32(static_cast<int>(j))),
                                     k_head, 4);
    for (int64_t k = 0; k < kW / 2; ++k)
      for (int p = 0; p < NP; ++p) {
        const __m512i zero = _mm512_setzero_si512();
        const __m512i v0 = 2 * k < n ? _mm512_loadu_si512(v_head + offsets[2 * k] + p * 32) : zero;
        const __m512i v1 = 2 * k + 1 < n ? _mm512_loadu_si512(v_head + offsets[2 * k + 1] + p * 32) : zero;
        vi[k][p][0] = _mm512_unpacklo_epi16(v0, v1);
        vi[k][p][1] = _mm512_unpackhi_epi16(v0, v1);
      }
    // scores of all R x G query rows, four rows (eight dot-product chains) at a time
    for (int64_t rg0 = 0; rg0 < RG; rg0 += 4) {
      const int64_t rows = std::min<int64_t>(4, RG - rg0);
      Vf even[4], odd[4];
      const int32_t* qp[4];
      for (int i = 0; i < 4; ++i) {
        even[i] = odd[i] = set1(0.f);
        const int64_t rg = rg0 + std::min<int64_t>(i, rows - 1);
        qp[i] = reinterpret_cast<const int32_t*>(q + rg / G * q_stride + rg % G * D);
      }
      for (int64_t j = 0; j < D / 2; j += 2)
        for (int i = 0; i < 4; ++i) {
          even[i] = _mm512_dpbf16_ps(even[i], (__m512bh)_mm512_set1_epi32(qp[i][j]), (__m512bh)kt[j]);
          odd[i] =
              _mm512_dpbf16_ps(odd[i], (__m512bh)_mm512_set1_epi32(qp[i][j + 1]), (__m512bh)kt[j + 1]);
        }
      for (int i = 0; i < rows; ++i) tile_scores[rg0 + i] = mul(add(even[i], odd[i]), set1(scale));
    }
    for (int64_t rg = 0; rg < RG; ++rg) {
      const int64_t valid = std::min<int64_t>(kW, T_first + rg / G - t0);  // the row's tokens here
      valids[rg] = valid;
      if (valid <= 0) continue;
      const __mmask16 seen =
          _mm512_cmplt_epi32_mask(lane_index, _mm512_set1_epi32(static_cast<int>(valid)));
      const Vf scores =
          _mm512_mask_mov_ps(set1(-std::numeric_limits<float>::infinity()), seen, tile_scores[rg]);
      const float top = std::max(run_max[rg], _mm512_reduce_max_ps(scores));
      const Vf p = vexp(sub(scores, set1(top)));  // 0 past `valid`
      const float rescale = std::exp(run_max[rg] - top);
      run_max[rg] = top;
      run_sum[rg] = run_sum[rg] * rescale + _mm512_reduce_add_ps(p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + rg * kW / 2),
                          (__m256i)_mm512_cvtneps_pbh(p));
      rescales[rg] = rescale;
    }
    // p @ V, two query rows (4 * NP chains) at a time
    for (int64_t rg0 = 0; rg0 < RG; rg0 += 2) {
      const int64_t rows = std::min<int64_t>(2, RG - rg0);
      Vf lo[2][NP], hi[2][NP];
      int64_t most = 0;
      for (int i = 0; i < 2; ++i) {
        const int64_t rg = rg0 + std::min<int64_t>(i, rows - 1);
        const bool on = i < rows && valids[rg] > 0;
        most = std::max(most, on ? valids[rg] : 0);
        for (int c = 0; c < NP; ++c) {
          lo[i][c] = on ? mul(acc[rg * 2 * NP + 2 * c], set1(rescales[rg])) : set1(0.f);
          hi[i][c] = on ? mul(acc[rg * 2 * NP + 2 * c + 1], set1(rescales[rg])) : set1(0.f);
        }
      }
      for (int64_t k = 0; 2 * k < most; ++k)
        for (int i = 0; i < 2; ++i) {
          const int64_t rg = rg0 + std::min<int64_t>(i, rows - 1);
          const bool on = i < rows && 2 * k < valids[rg];
          const __m512bh pk = (__m512bh)_mm512_set1_epi32(on ? static_cast<int>(pairs[rg * kW / 2 + k]) : 0);
          for (int c = 0; c < NP; ++c) {
            lo[i][c] = _mm512_dpbf16_ps(lo[i][c], (__m512bh)vi[k][c][0], pk);
            hi[i][c] = _mm512_dpbf16_ps(hi[i][c], (__m512bh)vi[k][c][1], pk);
          }
        }
      for (int i = 0; i < rows; ++i) {
        const int64_t rg = rg0 + i;
        if (valids[rg] <= 0) continue;
        for (int c = 0; c < NP; ++c)
          acc[rg * 2 * NP + 2 * c] = lo[i][c], acc[rg * 2 * NP + 2 * c + 1] = hi[i][c];
      }
    }
  }
  // low lane 4L + i holds dimension 8L + i of its 32, high lane 4L + i dimension 8L + 4 + i
  const __m512i first_16 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i last_16 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rg = r * G + g;
      const Vf inv = set1(a.out_scale / run_sum[rg]);  // out_scale: an fp8 cache's v_scale
      o_t* dst = out + r * out_stride + g * D;
      for (int c = 0; c < NP; ++c) {
        const Vf lo = acc[rg * 2 * NP + 2 * c], hi = acc[rg * 2 * NP + 2 * c + 1];
        store(dst + c * 32, mul(_mm512_permutex2var_ps(lo, first_16, hi), inv));
        store(dst + c * 32 + kW, mul(_mm512_permutex2var_ps(lo, last_16, hi), inv));
      }
    }
}

#else

template <int NP, typename o_t>
void prefill_block_bf16(const Decode&, const c10::BFloat16*, int64_t, const c10::BFloat16*,
                        const c10::BFloat16*, const int32_t*, int64_t, int64_t, o_t*, int64_t) {}

#endif

#define QKILN_PREFILL_BLOCK(NP, O)                                                                 \
  template void prefill_block_bf16<NP, O>(const Decode&, const c10::BFloat16*, int64_t,            \
                                          const c10::BFloat16*, const c10::BFloat16*, const int32_t*, \
                                          int64_t, int64_t, O*, int64_t);
QKILN_PREFILL_BLOCK(2, float)
QKILN_PREFILL_BLOCK(2, c10::BFloat16)
QKILN_PREFILL_BLOCK(2, c10::Half)
QKILN_PREFILL_BLOCK(4, float)
QKILN_PREFILL_BLOCK(4, c10::BFloat16)
QKILN_PREFILL_BLOCK(4, c10::Half)

}  // namespace attention_detail
