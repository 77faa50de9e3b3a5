// The portable decode and prefill kernels of paged attention (vec.h's vectors, any ISA): row by
// row (decode_head), 16-token tiles served to a whole GQA group (decode_head_tiled over CacheRows
// or Int4Rows) and int4 prefill blocks with an online softmax (prefill_block_tiled). They serve
// what the ISA-specific kernels do not (cpu_attention.cpp's overview says which); only
// cpu_attention.cpp includes this header.
#pragma once

#include "attention_common.h"

namespace {

using namespace attention_detail;

// One (sequence, kv head): q [group, D] (row-contiguous heads), K/V rows at stride Hkv * D,
// out [group, D]. buf holds the scaled query, the accumulators and the scores.
template <typename kv_t, typename q_t, typename o_t>
void decode_head(const Decode& a, const q_t* q, const kv_t* k_head, const kv_t* v_head,
                 const int32_t* table, int64_t T, o_t* out, std::vector<float>& buf) {
  const int64_t D = a.head_dim, G = a.group, row_stride = a.num_kv_heads * D;
  buf.resize(2 * G * D + G * T);
  float *qf = buf.data(), *acc = qf + G * D, *scores = acc + G * D;  // [G, D], [G, D], [G, T]
  const Vf scale = set1(a.scale);
  for (int64_t i = 0; i < G * D; i += kW) {
    store(qf + i, mul(load(q + i), scale));
    store(acc + i, set1(0.f));
  }
  for_each_row(k_head, table, a.block_size, row_stride, T, [&](int64_t t, const kv_t* row) {  // pass 1: scores
    for (int64_t g = 0; g < G; ++g) {
      Vf dot = set1(0.f);
      for (int64_t d = 0; d < D; d += kW) dot = fmadd(load(qf + g * D + d), load(row + d), dot);
      scores[g * T + t] = reduce_add(dot);
    }
  });
  std::vector<float> inv_sum_rows(G);
  float* inv_sum = inv_sum_rows.data();
  softmax_rows(scores, G, T, inv_sum);
  for_each_row(v_head, table, a.block_size, row_stride, T, [&](int64_t t, const kv_t* row) {  // pass 2: p @ V
    for (int64_t d = 0; d < D; d += kW) {
      const Vf v = load(row + d);
      for (int64_t g = 0; g < G; ++g)
        store(acc + g * D + d, fmadd(set1(scores[g * T + t]), v, load(acc + g * D + d)));
    }
  });
  write_heads(acc, inv_sum, G, D, a.out_scale, out);
}

// The K or V rows of one 16-token tile of one kv head, for decode_head_tiled: fill(t0, n, value)
// points rows[0 .. n) at tokens t0 .. t0 + n - 1 of K (value false) or V.
// CacheRows: into a float or fp8 cache (kv_t), through the block table.
template <typename kv_t>
struct CacheRows {
  const kv_t *k_head, *v_head;  // the head's slice of slot 0
  const int32_t* table;
  int64_t block_size, row_stride;
  const kv_t* rows[kW];
  void fill(int64_t t0, int64_t n, bool value) {
    int64_t offsets[kW];
    tile_slots(table, block_size, t0, n, row_stride, offsets);
    for (int64_t i = 0; i < n; ++i) rows[i] = (value ? v_head : k_head) + offsets[i];
  }
};


// The scores of one (scaled) query row qf [D] against rows.rows[0 .. n) of a 16-token K tile,
// D = 16 * NV; lanes past n hold 0.
template <int NV, typename Rows>
inline Vf tile_scores(const Rows& rows, const float* qf, int64_t n) {
  Vf qv[NV], dots[kW];
  for (int j = 0; j < NV; ++j) qv[j] = load(qf + j * kW);
  for (int i = 0; i < kW; ++i) {
    if (i >= n) { dots[i] = set1(0.f); continue; }
    const auto* row = rows.rows[i];
    Vf d = mul(qv[0], load(row));
    for (int j = 1; j < NV; ++j) d = fmadd(qv[j], load(row + j * kW), d);
    dots[i] = d;
  }
  return sum16(dots);
}

// acc[0 .. D) = acc * rescale + sum_{i < n} p[i] * rows.rows[i] for D = 16 * NV: one query row's
// share of a 16-token V tile (values_tiled, prefill_block_tiled).
template <int NV, typename Rows>
inline void accumulate_tile(const Rows& rows, const float* p, int64_t n, float rescale, float* acc) {
  Vf even[NV], odd[NV];  // two chains halve the FMA latency chain
  for (int j = 0; j < NV; ++j) even[j] = mul(load(acc + j * kW), set1(rescale)), odd[j] = set1(0.f);
  int64_t i = 0;
  for (; i + 1 < n; i += 2) {
    const auto *r0 = rows.rows[i], *r1 = rows.rows[i + 1];
    const Vf p0 = set1(p[i]), p1 = set1(p[i + 1]);
    for (int j = 0; j < NV; ++j) {
      even[j] = fmadd(p0, load(r0 + j * kW), even[j]);
      odd[j] = fmadd(p1, load(r1 + j * kW), odd[j]);
    }
  }
  if (i < n)
    for (int j = 0; j < NV; ++j) even[j] = fmadd(set1(p[i]), load(rows.rows[i] + j * kW), even[j]);
  for (int j = 0; j < NV; ++j) store(acc + j * kW, add(even[j], odd[j]));
}

// acc [G, D] += p @ V for D = 16 * NV, scores [G, T] holding p, V rows from `rows` a 16-token
// tile at a time (pass 2 of decode_head_tiled and decode_head_int4).
template <int NV, typename Rows>
void values_tiled(Rows& rows, int64_t T, int64_t G, const float* scores, float* acc) {
  constexpr int64_t D = NV * kW;
  for (int64_t t0 = 0; t0 < T; t0 += kW) {  // pass 2: p @ V
    const int64_t n = std::min<int64_t>(kW, T - t0);
    rows.fill(t0, n, true);
    for (int64_t g = 0; g < G; ++g) accumulate_tile<NV>(rows, scores + g * T + t0, n, 1.f, acc + g * D);
  }
}

// decode_head for D = 16 * NV: the query row and the accumulators live in registers, scores are
// reduced 16 tokens at a time (sum16), and each 16-token tile of K/V is read once from memory and
// served to the whole GQA group from L1.
template <int NV, typename Rows, typename q_t, typename o_t>
void decode_head_tiled(const Decode& a, const q_t* q, Rows& rows, int64_t T, o_t* out,
                       std::vector<float>& buf, float* lse = nullptr) {
  constexpr int64_t D = NV * kW;
  const int64_t G = a.group;
  buf.resize(2 * G * D + G * T + G);
  float *qf = buf.data(), *acc = qf + G * D, *scores = acc + G * D;  // [G, D], [G, D], [G, T]
  float* inv_sum = scores + G * T;
  for (int64_t i = 0; i < G * D; i += kW) {
    store(qf + i, mul(load(q + i), set1(a.scale)));
    store(acc + i, set1(0.f));
  }
  for (int64_t t0 = 0; t0 < T; t0 += kW) {  // pass 1: scores
    const int64_t n = std::min<int64_t>(kW, T - t0);
    rows.fill(t0, n, false);
    for (int64_t g = 0; g < G; ++g) {
      store(scores + g * T + t0, tile_scores<NV>(rows, qf + g * D, n), n);
    }
  }
  softmax_rows_lse(scores, G, T, inv_sum, lse);
  values_tiled<NV>(rows, T, G, scores, acc);
  write_heads(acc, inv_sum, G, D, a.out_scale, out);
}

// A prefill block (R consecutive query rows of one sequence; row r sees T_first + r tokens) for one
// kv head over an int4 cache, D = 16 * NV, in the portable vectors: each 16-token tile of K and
// then of V is dequantized once (Int4Rows) and served to all R x group query rows, with an online
// softmax (running max and sum per query row, the accumulators rescaled as the max moves). Row by
// row, decode_head_tiled dequantized the whole prefix again for every row. Serves the int4 prefill
// blocks where AVX512-BF16 is absent. Same-process A/B (QKILN_TILED_PREFILL, 5 alternating
// rounds, w4a16-rtn+kv-int4, one 512-token prompt, AVX2 EPYC host): prefill 1769 -> 1375 ms, and
// 1730 -> 1236 ms in a second sitting (1.29x, 1.40x).
// Over a bf16 cache the same kernel (CacheRows) measured 0.96x of row by row (7 rounds), so the
// float caches stay row by row there: a bf16 tile costs little to read again.
// q / out: the block's first row at the kv head's first query head; rows q_stride / out_stride
// apart.
template <int NV, typename Rows, typename q_t, typename o_t>
void prefill_block_tiled(const Decode& a, const q_t* q, int64_t q_stride, Rows& rows, int64_t T_first,
                         int64_t R, o_t* out, int64_t out_stride) {
  constexpr int64_t D = NV * kW;
  const int64_t G = a.group, RG = R * G, T_max = T_first + R - 1;
  thread_local std::vector<float> buf;
  // [RG, D] scaled queries, [RG, D] accumulators, [RG, kW] the tile's p, [RG] max, sum, rescale
  buf.resize(RG * (2 * D + kW + 3));
  float *qf = buf.data(), *acc = qf + RG * D, *p = acc + RG * D, *run_max = p + RG * kW;
  float *run_sum = run_max + RG, *rescale = run_sum + RG;
  for (int64_t rg = 0; rg < RG; ++rg) {
    const q_t* qrow = q + rg / G * q_stride + rg % G * D;
    for (int64_t d = 0; d < D; d += kW) {
      store(qf + rg * D + d, mul(load(qrow + d), set1(a.scale)));
      store(acc + rg * D + d, set1(0.f));
    }
    run_max[rg] = -std::numeric_limits<float>::infinity(), run_sum[rg] = 0.f;
  }
  for (int64_t t0 = 0; t0 < T_max; t0 += kW) {
    const int64_t n = std::min<int64_t>(kW, T_max - t0);
    // the tile's tokens query row rg sees (its row r sees T_first + r in all)
    auto valid = [&](int64_t rg) { return std::min(n, T_first + rg / G - t0); };
    rows.fill(t0, n, false);
    for (int64_t rg = 0; rg < RG; ++rg) {
      const int64_t seen = valid(rg);
      if (seen <= 0) continue;
      float* pr = p + rg * kW;
      store(pr, tile_scores<NV>(rows, qf + rg * D, seen));
      float top = run_max[rg];
      for (int64_t i = 0; i < seen; ++i) top = std::max(top, pr[i]);
      rescale[rg] = std::exp(run_max[rg] - top);  // 0 on the first tile (max -inf)
      run_max[rg] = top;
      store(pr, vexp(sub(load(pr, seen), set1(top))), seen);  // p past `seen` is never read
      run_sum[rg] = run_sum[rg] * rescale[rg] + reduce_add(load(pr, seen));
    }
    rows.fill(t0, n, true);
    for (int64_t rg = 0; rg < RG; ++rg) {
      const int64_t seen = valid(rg);
      if (seen > 0) accumulate_tile<NV>(rows, p + rg * kW, seen, rescale[rg], acc + rg * D);
    }
  }
  for (int64_t rg = 0; rg < RG; ++rg) {
    o_t* orow = out + rg / G * out_stride + rg % G * D;
    const Vf s = set1(a.out_scale / run_sum[rg]);
    for (int64_t d = 0; d < D; d += kW) store(orow + d, mul(load(acc + rg * D + d), s));
  }
}

}  // namespace
