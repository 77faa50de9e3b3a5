// qkiln CPU paged attention over float, fp8 and int4 KV caches (decodes and prefill chunks in one
// call). The cache write: cpu_kv_write.cpp.
//
// Built with the other kernels by plugins/cpu_native.py. Threads: at::parallel_for (torch's
// intra-op pool). Reference: plugins/reference.py.
//
// ---- attention ----------------------------------------------------------------------------------
// Every query row is a decode of its own causal length: row i of a sequence's q_len rows sees the
// T = seq_len - q_len + 1 + i first slots. A task (block of <= 8 rows of one sequence, one kv head,
// or a run of consecutive kv heads: decode_heads_bf16 with 8+ row blocks) reads them through the
// block table (cache [blocks, block_size, Hkv, D]; no gather copy) and serves the GQA group of
// Hq / Hkv query heads in one pass over K and one over V per row (two-pass softmax, fp32 sums;
// the float kernels fold the scale into the query like cpu_attention.py):
//     scores[g, t] = (scale * q[g]) . K[t],  p = exp(scores - max),  out[g] = (p @ V) / sum(p)
// Slots past T are never read, so stale or NaN bytes in unused slots cannot leak.
// fp8 e4m3fn caches (kv_cache.py: x ~= float(k) * k_scale[h]) are widened to fp32 / bf16 in
// registers as they are read, never copied: k_scale[h] joins the score scale, v_scale[h] the
// 1 / sum of the output, so an fp8 step reads half the bytes of a bf16 one. int4 caches (packed
// pairs, an fp16 scale and minimum per slot, head and group): with AVX512-BF16 a decode row reads
// K and V as their codes, the scales and minimums applied to the sums (decode_head_int4);
// otherwise they are dequantized 16 rows at a time into an L1 buffer (Int4Rows), once for the
// whole GQA group, then served like fp32 rows. On AVX2 hosts
// (no AVX512-BF16) a bf16 query's rows over a bf16 cache go to decode_group_bf16
// (cpu_attention_decode_avx2.cpp), which widens each K / V row once for the whole group.
// Prefill costs O(q_len * T) like any exact attention; the rows of a block re-read the same K/V
// from L1/L2, not from memory. Over a bf16 cache (bf16 query, D 64 / 128) a block of prefill rows
// goes to prefill_block_bf16 (cpu_attention_prefill.cpp) instead, which reads each 16-token tile
// once for all its rows: same-process A/B (5 alternating rounds), SmolLM2 heads, 30 layers:
// 8 prompts x 128 tokens 1.639 -> 1.250 ms a layer, one 1024-token prompt 15.94 -> 12.27. Over an
// fp8 cache a prefill block converts its prefix to bf16 rows first (serve_fp8_prefix), over an int4
// one too (serve_int4_prefix); without AVX512-BF16 an int4 block goes to prefill_block_tiled (one
// dequantize of each tile for all its rows). On an AMX CPU
// the sequences with kAmxMinRows+ rows over a bf16, fp8 or int4 cache skip all of this:
// paged_attention hands them to AmxPrefill (cpu_attention_prefill_amx.cpp), 1.8-3x faster from
// 1024-token prompts up (6x over int4). A step of few long decodes splits each row's context
// into parts (kSplitTokens, merge_partials).
//

#include "attention_common.h"
#include "qkiln_cpu.h"

using namespace attention_detail;

namespace {

// ---- decode attention -----------------------------------------------------------------------------

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

}  // namespace

namespace attention_detail {

// One packed int4 row of D elements -> fp32, x = q * scale + min per group of `group` elements
// (kv_cache.dequantize_int4_groups; low nibble = even element). The row's fp16 scales and
// minimums are widened once into fp32 first (a scalar c10::Half conversion per group cost more
// than the codes).
void dequantize_int4_row(const uint8_t* packed, const c10::Half* scale_h, const c10::Half* min_h,
                                int64_t D, int64_t group, float* out) {
  float scale[kMaxInt4HeadDim / 2], minimum[kMaxInt4HeadDim / 2];  // groups have >= 2 elements
  for (int64_t g = 0; g < D / group; g += kW) {
    store(scale + g, load(scale_h + g, D / group - g), D / group - g);
    store(minimum + g, load(min_h + g, D / group - g), D / group - g);
  }
#ifdef QKILN_VEC_SIMD
  if (group % kW == 0) {  // each 16-element chunk lies in one group
    for (int64_t j = 0; j < D; j += kW) {
      const __m128i words = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + j / 2)));
      const __m128i codes = _mm_or_si128(_mm_and_si128(words, _mm_set1_epi16(15)),  // [lo, hi] byte pairs
                                         _mm_slli_epi16(_mm_srli_epi16(words, 4), 8));
      store(out + j, add(mul(widen_u8(codes), set1(scale[j / group])), set1(minimum[j / group])));
    }
    return;
  }
#endif
  for (int64_t j = 0; j < D; ++j) {
    const int code = j % 2 ? packed[j / 2] >> 4 : packed[j / 2] & 15;
    out[j] = static_cast<float>(code) * scale[j / group] + minimum[j / group];
  }
}

}  // namespace attention_detail

namespace {

// Int4Rows: an int4 cache's rows dequantized into fp32 once per tile, for every query head of the
// group (the bytes and the per-(slot, head, group) fp16 scale / min through the block table).
// The tile's values live in one buffer per thread, not in the struct: every decode row makes a new
// Int4Rows, and an 8 KB member was zeroed and copied each time. So a fill overwrites the thread's
// last tile (the kernels use one tile at a time).
struct Int4Rows {
  const uint8_t *k_head, *v_head;  // the head's bytes of slot 0
  const c10::Half *k_scale, *k_min, *v_scale, *v_min;  // the head's groups of slot 0
  const int32_t* table;
  int64_t block_size, head_dim, group, num_kv_heads;
  const float* rows[kW];
  void fill(int64_t t0, int64_t n, bool value) {
    thread_local float values[kW * kMaxInt4HeadDim];
    const int64_t bytes = num_kv_heads * head_dim / 2, groups = num_kv_heads * head_dim / group;
    int64_t slots[kW];
    tile_slots(table, block_size, t0, n, 1, slots);
    for (int64_t i = 0; i < n; ++i) {
      dequantize_int4_row((value ? v_head : k_head) + slots[i] * bytes,
                          (value ? v_scale : k_scale) + slots[i] * groups,
                          (value ? v_min : k_min) + slots[i] * groups, head_dim, group, values + i * head_dim);
      rows[i] = values + i * head_dim;
    }
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

// The K rows the same thread reads next (the next task's), fetched into L2 during this task's
// p @ V: table nullptr when there is none.
template <typename kv_t>
struct NextKeys {
  const kv_t* k_head = nullptr;
  const int32_t* table = nullptr;
  int64_t T = 0;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Heads = true;

// Prefetches `rows` cache rows from `first` (row_stride elements apart), row_bytes of each, with
// `hint`: the decode kernel's ways of having K / V in cache before its passes reach them.
template <_mm_hint hint, typename kv_t>
inline void fetch_rows(const kv_t* first, int64_t rows, int64_t row_stride, int64_t row_bytes) {
  for (int64_t o = 0; o < rows; ++o) {
    const char* row = reinterpret_cast<const char*>(first + o * row_stride);
    for (int64_t byte = 0; byte < row_bytes; byte += 64) _mm_prefetch(row + byte, hint);
  }
}

// A K/V row slice of D = 32 * NP elements as NP vectors of 32 bf16 (RowWords::read), the form
// decode_heads_bf16 computes with. bf16 rows are read as they are. An fp8 (e4m3fn) row goes
// through byte tables where the CPU has AVX512-VBMI: e4m3 values are all exact bf16 normals, so
// two vpermi2b look up the bf16 high and low bytes of 64 codes at once (the sign ORed in, NaN codes
// to NaN) and two unpacks pair them; ~3 instructions per 32 elements where widening through fp16
// and fp32 took ~15 and left fp8 decode attention compute bound (AMX Xeon host, 64 decodes x 192
// tokens, 30 layers, 2 threads; cache in L2: 21.5 ms against 13.9 for bf16, scattered blocks in
// memory: 24.0 against 22.6). With the tables (held in registers; reloaded per row they cost a
// third more): 12.4 ms in L2, 16.0-16.5 from memory, the bf16 cache 22.7 in the same runs; against
// the widening build, processes in turn: 29.9 -> 17.8 and 31.8 -> 23.5 ms from memory. The
// unpacks leave each 64-element chunk's words in RowWords::row_order0/1's order (they pair bytes
// within 128-bit lanes): the query is permuted into it once per task and the outputs back at the end;
// the order does not change a dot product. Without VBMI the row is widened in order, exactly, to
// x / 256 (e4m3's fields as fp16, then fp32, then bf16: none a bf16 subnormal, which vdpbf16ps
// would flush), and kRowUnit puts the 256 back into the head scales.
#if defined(__AVX512VBMI__)
constexpr bool kFp8Tables = true;
#else
constexpr bool kFp8Tables = false;
#endif
template <typename kv_t>
constexpr bool kPermutedRows = kFp8Tables && std::is_same_v<kv_t, c10::Float8_e4m3fn>;
template <typename kv_t>
constexpr float kRowUnit = std::is_same_v<kv_t, c10::Float8_e4m3fn> && !kFp8Tables ? 256.f : 1.f;
template <typename kv_t>
struct RowWords;

template <>
struct RowWords<c10::BFloat16> {
  template <int NP>
  void read(const c10::BFloat16* p, __m512i* out) const {
    for (int c = 0; c < NP; ++c) out[c] = _mm512_loadu_si512(p + c * 32);
  }
};

template <>
struct RowWords<c10::Float8_e4m3fn> {
  __m512i lo0, lo1, hi0, hi1;  // bf16 low / high byte of codes 0-63 and 64-127 (sign cleared)
  RowWords() {
    alignas(64) uint8_t lo[128], hi[128];
    for (int m = 0; m < 128; ++m) {
      const int e = m >> 3, f = m & 7;
      const float x = e == 0 ? std::ldexp(static_cast<float>(f), -9)  // subnormal: f / 8 * 2^-6
                             : std::ldexp(static_cast<float>(8 + f), e - 10);
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      const uint16_t word = m == 0x7F ? 0x7FC0 : static_cast<uint16_t>(bits >> 16);  // exact
      lo[m] = static_cast<uint8_t>(word & 0xFF), hi[m] = static_cast<uint8_t>(word >> 8);
    }
    lo0 = _mm512_load_si512(lo), lo1 = _mm512_load_si512(lo + 64);
    hi0 = _mm512_load_si512(hi), hi1 = _mm512_load_si512(hi + 64);
    alignas(64) int16_t rows[2][32], elements[2][32];
    for (int j = 0; j < 64; ++j) {
      // read's word j of half j / 32 holds element 0-7, 16-23, 32-39, 48-55 | 8-15, 24-31, ...
      rows[j / 32][j % 32] = static_cast<int16_t>(j % 32 / 8 * 16 + j / 32 * 8 + j % 8);
      // element e sits in half e / 8 % 2 (of the pair, 32 + for the second) at word e / 16 * 8 + e % 8
      elements[j / 32][j % 32] = static_cast<int16_t>(j / 8 % 2 * 32 + j / 16 * 8 + j % 8);
    }
    row_order0 = _mm512_load_si512(rows[0]), row_order1 = _mm512_load_si512(rows[1]);
    in_order0 = _mm512_load_si512(elements[0]), in_order1 = _mm512_load_si512(elements[1]);
  }
  __m512i row_order0, row_order1;  // a chunk's elements into read's word order (the query)
  __m512i in_order0, in_order1;    // read's words back into element order (read_in_order)
  // The row in element order, for prefill_block_bf16, which pairs the elements itself.
  template <int NP>
  void read_in_order(const c10::Float8_e4m3fn* p, __m512i* out) const {
    read<NP>(p, out);
#if defined(__AVX512VBMI__)
    for (int c = 0; c < NP / 2; ++c) {
      const __m512i first = out[2 * c], second = out[2 * c + 1];
      out[2 * c] = _mm512_permutex2var_epi16(first, in_order0, second);
      out[2 * c + 1] = _mm512_permutex2var_epi16(first, in_order1, second);
    }
#endif
  }
  template <int NP>
  void read(const c10::Float8_e4m3fn* p, __m512i* out) const {
#if defined(__AVX512VBMI__)
    for (int c = 0; c < NP / 2; ++c) {
      const __m512i codes = _mm512_loadu_si512(p + c * 64);
      const __m512i lo = _mm512_permutex2var_epi8(lo0, codes, lo1);  // index bits 0-6
      __m512i hi = _mm512_permutex2var_epi8(hi0, codes, hi1);
      hi = _mm512_ternarylogic_epi32(hi, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | sign
      out[2 * c] = _mm512_unpacklo_epi8(lo, hi);
      out[2 * c + 1] = _mm512_unpackhi_epi8(lo, hi);
    }
#else
    for (int c = 0; c < NP; ++c) {
      const __m512i fp16 = fp8_as_fp16_div256(
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 32))));
      const __m512 low = _mm512_cvtph_ps(_mm512_castsi512_si256(fp16));
      const __m512 high = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(fp16, 1));
      out[c] = (__m512i)_mm512_cvtne2ps_pbh(high, low);
    }
#endif
  }
};

// The tables, built once per process (a copy per kernel call keeps them in registers: reloaded
// per row they cost a third more).
template <typename kv_t>
const RowWords<kv_t>& row_words() {
  static const RowWords<kv_t> words;
  return words;
}

// Accumulators kept as even and odd elements (lane l: elements 2l and 2l + 1) back in element
// order: lanes 0-7 of even and odd interleaved (elements 0-15), then lanes 8-15 (16-31).
inline Vf interleave_first(Vf even, Vf odd) {
  return _mm512_permutex2var_ps(even, _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), odd);
}
inline Vf interleave_last(Vf even, Vf odd) {
  return _mm512_permutex2var_ps(even, _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8),
                                odd);
}

// decode_head for a bf16 query over a bf16 cache, D = 32 * NP, for H consecutive kv heads at once
// (q, out: their H * group query heads; k_head / v_head: the first one's slice of row 0). About
// half the instructions of decode_head_tiled, which widens every K/V element to fp32 once per
// query head and at 64 decodes was bound by that (1 thread took 1.9x the time of 2). The cache is
// bf16 or fp8 (RowWords); k_scale / v_scale: per kv head of the task (fp8), else nullptr.
// Scores: vdpbf16ps multiplies bf16 query/key pairs exactly and sums in fp32 (32 products an
// instruction, K read as is); the scale is applied to the sums. p @ V stays fp32: a bf16 V row
// splits into its even and odd elements as fp32 (a shift and a mask), accumulated per parity
// and interleaved back at the end. Scores walk the rows once, each row's H head slices in turn
// (with H = Hkv a block is one contiguous stream); p @ V walks each block once per head, with
// the next block's slices prefetched. Each K row's V slices are prefetched into L2 as the K pass
// reaches it: with only the hardware prefetchers the two passes ran at ~11 GB/s against ~30 a
// plain read reaches (64 decodes x 192 tokens, 30 layers; four same-process A/Bs: 0.67-0.95 ->
// 0.51-0.71 ms a layer, 23-29% less). The K pass also fetches the next 16-token tile's K rows
// into L2 (blocks are scattered, so the hardware prefetchers restart at every block; profiled,
// half the kernel's time sat on K loads): same-process A/Bs with scattered blocks 0.572 -> 0.481
// and 0.600 -> 0.502 ms a layer at 192 tokens, 2.99 -> 2.44 at 1024. Fetching the next
// sequence's first tile during this one's p @ V showed no effect and was not kept; fetching the
// next task's whole K during p @ V (`next`, spread over the V blocks) did: same-process A/Bs with
// scattered blocks, 64 decodes, 30 layers: 0.577 -> 0.497, 0.615 -> 0.534 ms a layer at 192
// tokens, 0.734 -> 0.646 at 256, 0.539 -> 0.468 at 140; with the engine's block layout 0.505 ->
// 0.415 at 192; the offline 64 x 128/128 run's decode steps 2.7 ms faster (a lock-step A/B).
// Every prefetch is issued one row at a time, interleaved with the arithmetic (a trickle): the
// next tile's K one row per row of this tile, the next V block and the next task's K one row per
// row of the first head's p @ V walk. Issued in bursts (a tile's 96 lines at once), the prefetches
// themselves stalled on the full miss queue (profiled on the AMX Xeon host: a third of the
// kernel's samples sat on prefetcht1) while no arithmetic ran. Same-process A/B there, scattered
// blocks, 64 decodes, 30 layers, bursts -> trickle: 27.1 -> 22.4 and 23.7 -> 19.6 ms at 192
// tokens, 33.0 -> 28.1 at 256, 22.6 -> 19.1 at 144 (a 283 MB read takes 16-17 ms there).
// Fetching every other line only (the rest left to the adjacent-line prefetcher) was slower
// (20.0 -> 22.7 ms), and fetching K two tiles ahead instead of one no better (23.8 vs 24.2).
template <int NP, typename kv_t, typename o_t>
void decode_heads_bf16(const Decode& a, const c10::BFloat16* q, const kv_t* k_head, const kv_t* v_head,
                       const int32_t* table, int64_t T, o_t* out, std::vector<float>& buf, int64_t H,
                       const float* k_scale, const float* v_scale, const NextKeys<kv_t>& next = {},
                       float* lse = nullptr) {
  constexpr int64_t D = NP * 32;
  constexpr int kValueHeads = 8 / NP;  // query heads whose accumulators stay in registers
  const int64_t G = a.group, HG = H * G, row_stride = a.num_kv_heads * D, bs = a.block_size;
  const int64_t block_stride = bs * row_stride;
  buf.resize(HG * T + HG);
  float *scores = buf.data(), *inv_sum = scores + HG * T;  // [H * G, T], [H * G]
  thread_local std::vector<Vf> dots_buf, acc_buf;  // [H * G][kW] row dot products, [H * G][2][NP]
  dots_buf.resize(HG * kW);
  acc_buf.assign(HG * 2 * NP, set1(0.f));
  Vf *dots = dots_buf.data(), *acc = acc_buf.data();  // (a thread_local costs a call per use)
  float score_scale[16], out_scale[16];  // per kv head of the task (H * G <= 16)
  for (int64_t h = 0; h < H; ++h) {
    score_scale[h] = k_scale ? a.scale * (k_scale[h] * kRowUnit<kv_t>) : a.scale;
    out_scale[h] = v_scale ? v_scale[h] * kRowUnit<kv_t> : 1.f;
  }
  const int64_t row_bytes = H * D * int64_t(sizeof(kv_t));  // this task's slice of a cache row
  const RowWords<kv_t> words = row_words<kv_t>();
  alignas(64) c10::BFloat16 q_permuted[16 * 128];  // the query in the rows' word order
  if constexpr (kPermutedRows<kv_t>) {
    for (int64_t j = 0; j < HG * D; j += 64) {
      const __m512i a = _mm512_loadu_si512(q + j), b = _mm512_loadu_si512(q + j + 32);
      _mm512_store_si512(q_permuted + j, _mm512_permutex2var_epi16(a, words.row_order0, b));
      _mm512_store_si512(q_permuted + j + 32, _mm512_permutex2var_epi16(a, words.row_order1, b));
    }
    q = q_permuted;
  }
  int64_t offsets[kW];
  for (int64_t t0 = 0; t0 < T; t0 += kW) {  // pass 1: scores
    const int64_t n = std::min<int64_t>(kW, T - t0);
    tile_slots(table, bs, t0, n, row_stride, offsets);
    const int64_t n_ahead = t0 + kW < T ? std::min<int64_t>(kW, T - t0 - kW) : 0;
    int64_t ahead[kW];  // the next tile's K rows: fetched into L2 one per row of this tile
    tile_slots(table, bs, t0 + kW, n_ahead, row_stride, ahead);
    for (int64_t i = 0; i < kW; ++i) {
      if (i >= n) {
        for (int64_t j = 0; j < HG; ++j) dots[j * kW + i] = set1(0.f);
        continue;
      }
      if (i < n_ahead) fetch_rows<_MM_HINT_T1>(k_head + ahead[i], 1, 0, row_bytes);
      // this row's V slices into L2 now, while the K pass computes: pass 2 finds them there
      fetch_rows<_MM_HINT_T1>(v_head + offsets[i], 1, 0, row_bytes);
      for (int64_t h = 0; h < H; ++h) {
        __m512i kv[NP];
        words.template read<NP>(k_head + offsets[i] + h * D, kv);
        for (int64_t g = 0; g < G; ++g) {
          const c10::BFloat16* qg = q + (h * G + g) * D;
          Vf d = _mm512_dpbf16_ps(set1(0.f), (__m512bh)_mm512_loadu_si512(qg), (__m512bh)kv[0]);
          for (int p = 1; p < NP; ++p)
            d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(qg + p * 32), (__m512bh)kv[p]);
          dots[(h * G + g) * kW + i] = d;
        }
      }
    }
    for (int64_t j = 0; j < HG; ++j)
      store(scores + j * T + t0, mul(sum16(dots + j * kW), set1(score_scale[j / G])), n);
  }
  float row_max[16];
  softmax_rows(scores, HG, T, inv_sum, row_max);
  if (lse)  // a part of a split context: its scores' log-sum-exp, for merge_partials
    for (int64_t j = 0; j < HG; ++j) lse[j] = row_max[j] - std::log(inv_sum[j]);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t t0 = 0, b = 0; t0 < T; t0 += bs, ++b) {  // pass 2: p @ V
    const kv_t* rows = v_head + table[b] * block_stride;
    const kv_t* next_v = t0 + bs < T ? v_head + table[b + 1] * block_stride : nullptr;
    const int64_t next_v_rows = next_v ? std::min(bs, T - t0 - bs) : 0;
    int64_t nk0 = 0, nk_rows = 0;  // this V block's share of the next task's K: rows from block nk0
    if (next.table) {
      const int64_t nb = (T + bs - 1) / bs, next_nb = (next.T + bs - 1) / bs;
      nk0 = b * next_nb / nb;
      nk_rows = std::max<int64_t>(0, std::min((b + 1) * next_nb / nb * bs, next.T) - nk0 * bs);
    }
    const int64_t rows_here = std::min(bs, T - t0);
    // row o of the first head's walk over the block fetches row o of the next V block and its
    // share of the next task's K rows
    auto trickle = [&](int64_t o) {
      if (o < next_v_rows) fetch_rows<_MM_HINT_T0>(next_v + o * row_stride, 1, 0, row_bytes);
      for (int64_t r = o * nk_rows / rows_here; r < (o + 1) * nk_rows / rows_here; ++r)
        fetch_rows<_MM_HINT_T1>(next.k_head + (next.table[nk0 + r / bs] * bs + r % bs) * row_stride, 1, 0,
                                row_bytes);
    };
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t g0 = 0; g0 < G; g0 += kValueHeads) {
        const int64_t heads = std::min<int64_t>(kValueHeads, G - g0);
        Vf even[kValueHeads][NP], odd[kValueHeads][NP];
        Vf* saved = acc + (h * G + g0) * 2 * NP;
        for (int g = 0; g < kValueHeads; ++g)
          for (int p = 0; p < NP; ++p)
            if (g < heads) even[g][p] = saved[(g * 2) * NP + p], odd[g][p] = saved[(g * 2 + 1) * NP + p];
        const float* pg0 = scores + (h * G + g0) * T + t0;
        for (int64_t o = 0; o < rows_here; ++o) {
          if (h == 0 && g0 == 0) trickle(o);
          Vf ve[NP], vo[NP];
          __m512i v[NP];
          words.template read<NP>(rows + o * row_stride + h * D, v);
          for (int p = 0; p < NP; ++p) {
            ve[p] = _mm512_castsi512_ps(_mm512_slli_epi32(v[p], 16));
            vo[p] = _mm512_castsi512_ps(_mm512_and_si512(v[p], high_half));
          }
          for (int g = 0; g < kValueHeads; ++g) {
            if (g >= heads) break;
            const Vf pg = set1(pg0[g * T + o]);
            for (int p = 0; p < NP; ++p) {
              even[g][p] = fmadd(pg, ve[p], even[g][p]);
              odd[g][p] = fmadd(pg, vo[p], odd[g][p]);
            }
          }
        }
        for (int g = 0; g < kValueHeads; ++g)
          for (int p = 0; p < NP; ++p)
            if (g < heads) saved[(g * 2) * NP + p] = even[g][p], saved[(g * 2 + 1) * NP + p] = odd[g][p];
      }
    }
  }
  // lanes 0-7 of a then of b; lanes 8-15 of a then of b
  const __m512i low_halves = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i high_halves = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
  for (int64_t j = 0; j < HG; ++j) {
    const Vf inv = set1(inv_sum[j] * out_scale[j / G]);
    Vf words_in_order[2 * NP];  // per p: its words 0-15, 16-31, in the rows' word order
    for (int p = 0; p < NP; ++p) {
      const Vf even = acc[(j * 2) * NP + p], odd = acc[(j * 2 + 1) * NP + p];
      words_in_order[2 * p] = interleave_first(even, odd);
      words_in_order[2 * p + 1] = interleave_last(even, odd);
    }
    o_t* dst = out + j * D;
    if constexpr (kPermutedRows<kv_t>) {  // chunk c's elements 0-7 | 16-23 | 32-39 | 48-55 and 8-15 | ...
      for (int c = 0; c < NP / 2; ++c) {
        const Vf *first = words_in_order + 4 * c, *second = first + 2;
        store(dst + c * 64, mul(_mm512_permutex2var_ps(first[0], low_halves, second[0]), inv));
        store(dst + c * 64 + 16, mul(_mm512_permutex2var_ps(first[0], high_halves, second[0]), inv));
        store(dst + c * 64 + 32, mul(_mm512_permutex2var_ps(first[1], low_halves, second[1]), inv));
        store(dst + c * 64 + 48, mul(_mm512_permutex2var_ps(first[1], high_halves, second[1]), inv));
      }
    } else {
      for (int p = 0; p < 2 * NP; ++p) store(dst + p * kW, mul(words_in_order[p], inv));
    }
  }
}

// decode_head for a bf16 query over an int4 cache, D = 16 * NV (32, 64, 128), groups of a multiple
// of 4 elements. Scores read K as its codes: with k = c * s + m per group (kv_cache.py),
// q . k = sum_g s_g (q_g . c_g) + m_g sum(q_g); the codes widen exactly to bf16 (0..15) for
// vdpbf16ps against the bf16 query (4 instructions per 64 codes through a word table, against ~40
// to dequantize them to fp32 and the FMAs after), the group scales multiply its per-lane sums, the minimums' term
// comes from the query's group sums (for a tile's 16 tokens at once). V is read as codes too
// (values_codes). Same-process A/B against the dequantizing path (decode_head_tiled) for K (64
// decodes x 192 tokens, scattered blocks, 30 layers): 1.67 -> 1.54, 1.92 -> 1.71, 1.85 -> 1.69 ms
// a layer (before / after the tile-wide minimum term), 10.1 -> 9.2 at 1024 tokens; fp32 outputs
// within 3e-6 of the dequantizing path's. Then for V (values_codes against values_tiled, EPYC
// Zen 4 host, 7 alternating rounds): 1.05 -> 0.80 ms a layer at 192 tokens, 2.48 -> 1.85 at 512.
// The codes widen through a word table (vpermw) into two vectors per 64 elements, the even ones
// and the odd ones; the query is permuted to match once per row, and the 4 elements each fp32 lane
// sums always lie in one group, so the lane takes one scale.
inline __m512bh query_chunk(const uint16_t* q, int c) {
  return (__m512bh)_mm512_loadu_si512(q + 32 * c);
}

// acc [G, D] = p @ V over an int4 cache for D = 16 * NV (pass 2 of decode_head_int4), V read as
// its codes: with v = c * s + m per group, sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t m_t, so
// each row's codes widen to fp32 (elements 2l and 2l + 1 of a 32-element chunk in lane l of two
// vectors: one byte's nibbles) and take one FMA per query head against p_t times the lane's scale,
// and the minimums' term is summed per group on the side. Dequantizing each tile into an fp32
// buffer first (Int4Rows, values_tiled) took ~80 instructions a row for 3 query heads against ~40
// here. Up to kHeads = 8 / NC query heads share one walk over the rows (their accumulators in
// registers).
template <int NV>
void values_codes(const Int4Rows& rows, int64_t T, int64_t G, const float* scores, float* acc) {
  constexpr int64_t D = NV * kW;
  constexpr int NC = D / 32;              // 32-element chunks, 16 bytes each
  constexpr int kHeads = 8 / NC;          // query heads per walk (D <= kMaxInt4HeadDim)
  const int64_t groups = D / rows.group, bytes = rows.num_kv_heads * D / 2;
  const int64_t slot_groups = rows.num_kv_heads * groups;
  __m512i group_of_lane[NC];  // lane l of chunk c holds elements 32c + 2l, + 1: one group
  for (int c = 0; c < NC; ++c) {
    alignas(64) int32_t idx[kW];
    for (int l = 0; l < kW; ++l) idx[l] = static_cast<int32_t>((32 * c + 2 * l) / rows.group);
    group_of_lane[c] = _mm512_load_si512(idx);
  }
  const __m512i low_nibble = _mm512_set1_epi32(15);
  int64_t slots[kW];
  for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
    const int64_t heads = std::min<int64_t>(kHeads, G - g0);
    Vf even[kHeads][NC], odd[kHeads][NC], min_sum[kHeads];  // min_sum: lane j = group j
    for (int g = 0; g < kHeads; ++g) {
      min_sum[g] = set1(0.f);
      for (int c = 0; c < NC; ++c) even[g][c] = odd[g][c] = set1(0.f);
    }
    for (int64_t t0 = 0; t0 < T; t0 += kW) {
      const int64_t n = std::min<int64_t>(kW, T - t0);
      tile_slots(rows.table, rows.block_size, t0, n, 1, slots);
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t* packed = rows.v_head + slots[i] * bytes;
        const Vf scale = load(rows.v_scale + slots[i] * slot_groups, groups);
        const Vf minimum = load(rows.v_min + slots[i] * slot_groups, groups);
        Vf low[NC], high[NC], lane_scale[NC];
        for (int c = 0; c < NC; ++c) {
          const __m512i byte =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + 16 * c)));
          low[c] = _mm512_cvtepi32_ps(_mm512_and_si512(byte, low_nibble));
          high[c] = _mm512_cvtepi32_ps(_mm512_srli_epi32(byte, 4));
          lane_scale[c] = _mm512_permutexvar_ps(group_of_lane[c], scale);
        }
        for (int g = 0; g < kHeads; ++g) {
          if (g >= heads) break;
          const Vf p = set1(scores[(g0 + g) * T + t0 + i]);
          min_sum[g] = fmadd(p, minimum, min_sum[g]);
          for (int c = 0; c < NC; ++c) {
            const Vf w = mul(p, lane_scale[c]);
            even[g][c] = fmadd(w, low[c], even[g][c]);
            odd[g][c] = fmadd(w, high[c], odd[g][c]);
          }
        }
      }
    }
    for (int g = 0; g < heads; ++g) {
      float* dst = acc + (g0 + g) * D;
      for (int c = 0; c < NC; ++c) {
        const Vf m = _mm512_permutexvar_ps(group_of_lane[c], min_sum[g]);
        const Vf e = add(even[g][c], m), o = add(odd[g][c], m);
        store(dst + 32 * c, interleave_first(e, o));
        store(dst + 32 * c + 16, interleave_last(e, o));
      }
    }
  }
}

template <int NV, typename o_t>
void decode_head_int4(const Decode& a, const c10::BFloat16* q, Int4Rows& rows, int64_t T, o_t* out,
                      std::vector<float>& buf, float* lse = nullptr) {
  constexpr int64_t D = NV * kW;
  constexpr int NB = (D + 63) / 64;  // chunks of 64 elements (32 bytes of codes; D = 32: one of 16)
  const int64_t G = a.group, groups = D / rows.group;
  buf.resize(G * D + G * T + G + G * groups);
  float *acc = buf.data(), *scores = acc + G * D, *inv_sum = scores + G * T;
  float* qsum = inv_sum + G;  // [G, groups]
  thread_local std::vector<uint16_t> permuted_buf;  // [G, NB, 2, 32] the query's bf16 bits, codes' order
  thread_local std::vector<Vf> dots_buf;            // [G, 16]
  permuted_buf.assign(G * NB * 64, 0);
  dots_buf.resize(G * kW);
  // plain pointers: each use of a thread_local in the loops below called __tls_get_addr
  uint16_t* permuted = permuted_buf.data();
  Vf* dots = dots_buf.data();
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(q);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) {  // chunk c: its even elements 64c + 2i, then its odd ones
      const int64_t c = d / 64, e = d % 64;
      permuted[((g * NB + c) * 2 + e % 2) * 32 + e / 2] = bits[g * D + d];
    }
    for (int64_t j = 0; j < groups; ++j) {
      float total = 0.f;
      for (int64_t d = j * rows.group; d < (j + 1) * rows.group; ++d)
        total += static_cast<float>(q[g * D + d]);
      qsum[g * groups + j] = total;
    }
  }
  __m512i group_of_lane[NB];  // dword lane l of chunk c sums elements 64c + 4l .. 64c + 4l + 3
  for (int c = 0; c < NB; ++c) {
    alignas(64) int32_t idx[kW];
    for (int l = 0; l < kW; ++l) idx[l] = 64 * c + 4 * l < D ? static_cast<int32_t>((64 * c + 4 * l) / rows.group) : 0;
    group_of_lane[c] = _mm512_load_si512(idx);
  }
  // word i: the bf16 bits of (i mod 16), for vpermw, which reads an index's low 5 bits: a byte's
  // word indexes its low nibble's value, the word shifted right by 4 its high nibble's
  static const __m512i code_words = [] {
    alignas(64) uint16_t words[32];
    for (int i = 0; i < 32; ++i) {
      const float x = static_cast<float>(i % 16);
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      words[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
    }
    return _mm512_load_si512(words);
  }();
  std::fill(acc, acc + G * D, 0.f);
  const int64_t bytes = rows.num_kv_heads * D / 2, slot_groups = rows.num_kv_heads * groups;
  alignas(64) float minimum[kW * kW];  // [group, token of the tile]: the tile's K minimums
  int64_t slots[kW], ahead[kW];
  // A slot's codes, scales and minimums of this head into L2 (one line each: a head's codes are
  // D / 2 <= 64 bytes, its groups' fp16 scales fewer). Without these prefetches the kernel read
  // only what the hardware prefetchers brought; same-process A/B on the AMX Xeon host (64 decodes x
  // 192 tokens, scattered blocks, 30 layers, 2 threads): 63.5 -> 50.7, 60.0 -> 45.0, 65.7 -> 53.1 ms.
  auto fetch_slot = [&](const uint8_t* codes, const c10::Half* scales, const c10::Half* mins, int64_t slot) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + slot * bytes), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(scales + slot * slot_groups), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(mins + slot * slot_groups), _MM_HINT_T1);
  };
  for (int64_t t0 = 0; t0 < T; t0 += kW) {  // pass 1: scores
    const int64_t n = std::min<int64_t>(kW, T - t0);
    tile_slots(rows.table, rows.block_size, t0, n, 1, slots);
    const int64_t n_ahead = t0 + kW < T ? std::min<int64_t>(kW, T - t0 - kW) : 0;
    tile_slots(rows.table, rows.block_size, t0 + kW, n_ahead, 1, ahead);
    for (int64_t i = 0; i < kW; ++i) {
      if (i >= n) {
        for (int64_t g = 0; g < G; ++g) dots[g * kW + i] = set1(0.f);
        for (int64_t j = 0; j < groups; ++j) minimum[j * kW + i] = 0.f;
        continue;
      }
      const int64_t slot = slots[i];
      // one row at a time, as decode_heads_bf16 does: the next tile's K, this row's V for pass 2
      if (i < n_ahead) fetch_slot(rows.k_head, rows.k_scale, rows.k_min, ahead[i]);
      fetch_slot(rows.v_head, rows.v_scale, rows.v_min, slot);
      const uint8_t* packed = rows.k_head + slot * bytes;
      const Vf scale = load(rows.k_scale + slot * slot_groups, groups);
      // one scalar conversion per group: a masked vector store read back as scalars cannot be
      // forwarded and stalled every row (a quarter of the kernel's samples)
      const c10::Half* row_minimum = rows.k_min + slot * slot_groups;
      for (int64_t j = 0; j < groups; ++j) minimum[j * kW + i] = _cvtsh_ss(row_minimum[j].x);
      // the codes as exact bf16: word i of a chunk's `even` is element 64c + 2i (its byte's low
      // nibble), of `odd` element 64c + 2i + 1; 4 instructions per 64 codes (widening through
      // fp32 took 12)
      __m512bh even[NB], odd[NB];
      Vf lane_scale[NB];
      for (int c = 0; c < NB; ++c) {
        const __m512i word =
            D >= 64 ? _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32 * c)))
                    : _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed))));
        even[c] = (__m512bh)_mm512_permutexvar_epi16(word, code_words);
        odd[c] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(word, 4), code_words);
        lane_scale[c] = _mm512_permutexvar_ps(group_of_lane[c], scale);
      }
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qg = permuted + g * NB * 64;
        auto chunk_dot = [&](int c) {  // lane l: the codes of elements 64c + 4l .. + 3 against the query's
          return _mm512_dpbf16_ps(_mm512_dpbf16_ps(set1(0.f), query_chunk(qg, 2 * c), even[c]),
                                  query_chunk(qg, 2 * c + 1), odd[c]);
        };
        Vf d = mul(chunk_dot(0), lane_scale[0]);
        for (int c = 1; c < NB; ++c) d = fmadd(chunk_dot(c), lane_scale[c], d);
        dots[g * kW + i] = d;
      }
    }
    for (int64_t g = 0; g < G; ++g) {  // + sum_j m_j sum(q_j), for the tile's 16 tokens at once
      Vf min_term = set1(0.f);
      for (int64_t j = 0; j < groups; ++j)
        min_term = fmadd(load(minimum + j * kW), set1(qsum[g * groups + j]), min_term);
      store(scores + g * T + t0, mul(add(sum16(dots + g * kW), min_term), set1(a.scale)), n);
    }
  }
  softmax_rows_lse(scores, G, T, inv_sum, lse);
  values_codes<NV>(rows, T, G, scores, acc);
  write_heads(acc, inv_sum, G, D, a.out_scale, out);  // out_scale is 1 without fp8
}

// A prefill block over a quantized cache, served as a bf16 one: one kv head's K and V for tokens
// [0, T) widened to bf16 rows in thread-local buffers (widen(slot, k_row, v_row) writes a slot's
// two rows), then served as a cache of one block and one head through serve(decode, k, v, table):
// prefill_block_bf16, with `scale` for the scores and `out_scale` for the output. Each block
// widens its own prefix (a few instructions per element against the block's rows x group dot
// products over it).
template <int64_t D, typename Widen, typename Serve>
void serve_as_bf16_rows(const Decode& a, const int32_t* table, int64_t T, float scale, float out_scale,
                        Widen&& widen, Serve&& serve) {
  thread_local std::vector<c10::BFloat16> k_rows, v_rows;  // [T, D]
  if (static_cast<int64_t>(k_rows.size()) < T * D) k_rows.resize(T * D), v_rows.resize(T * D);
  int64_t slots[kW];
  for (int64_t t0 = 0; t0 < T; t0 += kW) {
    const int64_t n = std::min<int64_t>(kW, T - t0);
    tile_slots(table, a.block_size, t0, n, 1, slots);
    for (int64_t i = 0; i < n; ++i) widen(slots[i], k_rows.data() + (t0 + i) * D, v_rows.data() + (t0 + i) * D);
  }
  static const int32_t first_block = 0;
  const Decode one{&first_block, 1, T, 1, D, a.group, scale, out_scale};
  serve(one, k_rows.data(), v_rows.data(), &first_block);
}

// fp8: rows through RowWords, in element order, served with the head's scales. Before, fp8
// prefill rows went one at a time through decode_heads_bf16, which re-reads the prefix for every
// row: same-process A/B on the AMX Xeon host, 8 prompts x 128 tokens, 30 layers: 119.0 -> 104.0
// and 98.8 -> 89.0 ms (bf16, tiled against row by row in the same runs: 87.5 -> 76.8, 107.3 -> 96.8).
template <int NP, typename Serve>
void serve_fp8_prefix(const Decode& a, const c10::Float8_e4m3fn* k_head, const c10::Float8_e4m3fn* v_head,
                      const int32_t* table, int64_t T, float k_scale, float v_scale, Serve&& serve) {
  constexpr int64_t D = NP * 32;
  const RowWords<c10::Float8_e4m3fn> words = row_words<c10::Float8_e4m3fn>();
  const int64_t row_stride = a.num_kv_heads * D;
  auto widen = [&](int64_t slot, c10::BFloat16* k_row, c10::BFloat16* v_row) {
    __m512i row[NP];
    words.template read_in_order<NP>(k_head + slot * row_stride, row);
    for (int p = 0; p < NP; ++p) _mm512_storeu_si512(k_row + p * 32, row[p]);
    words.template read_in_order<NP>(v_head + slot * row_stride, row);
    for (int p = 0; p < NP; ++p) _mm512_storeu_si512(v_row + p * 32, row[p]);
  };
  serve_as_bf16_rows<D>(a, table, T, a.scale * k_scale * kRowUnit<c10::Float8_e4m3fn>,
                        v_scale * kRowUnit<c10::Float8_e4m3fn>, widen, serve);
}

// int4: rows dequantized and rounded to bf16, as AmxPrefill stages them. Before, int4 prefill rows
// went one at a time through decode_head_int4, each row reading and widening its whole prefix again.
template <int NP, typename Serve>
void serve_int4_prefix(const Decode& a, const Int4Rows& rows, int64_t T, Serve&& serve) {
  constexpr int64_t D = NP * 32;
  const int64_t bytes = rows.num_kv_heads * D / 2, groups = rows.num_kv_heads * D / rows.group;
  auto widen = [&](int64_t slot, c10::BFloat16* k_row, c10::BFloat16* v_row) {
    alignas(64) float values[D];
    dequantize_int4_row(rows.k_head + slot * bytes, rows.k_scale + slot * groups, rows.k_min + slot * groups,
                        D, rows.group, values);
    for (int64_t d = 0; d < D; d += kW) store(k_row + d, load(values + d));
    dequantize_int4_row(rows.v_head + slot * bytes, rows.v_scale + slot * groups, rows.v_min + slot * groups,
                        D, rows.group, values);
    for (int64_t d = 0; d < D; d += kW) store(v_row + d, load(values + d));
  };
  serve_as_bf16_rows<D>(a, rows.table, T, a.scale, 1.f, widen, serve);
}
#else
constexpr bool kBf16Heads = false;
template <int NP, typename kv_t, typename o_t>
void decode_heads_bf16(const Decode&, const c10::BFloat16*, const kv_t*, const kv_t*, const int32_t*,
                       int64_t, o_t*, std::vector<float>&, int64_t, const float*, const float*,
                       const NextKeys<kv_t>& = {}, float* = nullptr) {}
template <int NV, typename o_t>
void decode_head_int4(const Decode&, const c10::BFloat16*, Int4Rows&, int64_t, o_t*,
                      std::vector<float>&, float* = nullptr) {}
template <int NP, typename Serve>
void serve_fp8_prefix(const Decode&, const c10::Float8_e4m3fn*, const c10::Float8_e4m3fn*, const int32_t*,
                      int64_t, float, float, Serve&&) {}
template <int NP, typename Serve>
void serve_int4_prefix(const Decode&, const Int4Rows&, int64_t, Serve&&) {}
#endif

// Prefill chunks are cut into blocks of this many query rows, so one long prompt still spreads
// over every thread (each row reads K/V from the cache; a block's rows share them through L1/L2).
constexpr int64_t kRowsPerTask = 8;
// Row blocks from which a task serves several kv heads (below it, one head per task keeps every
// thread busy at batch 1).
constexpr int64_t kFuseHeadsMinBlocks = 8;
// Below kFuseHeadsMinBlocks row blocks, a decode row over a bf16, fp8 or int4 cache with at least twice
// this many tokens is served in parts of about this many (a multiple of the block size), any
// thread taking any part, and merge_partials combines the parts' outputs by their log-sum-exp
// (flash-decoding). With one task per kv head, batch-1 decode at long contexts left the threads
// unequal: SmolLM2's 3 kv heads on 2 threads, one thread read twice the KV of the other and the
// other spun (perf, 4000-token context: attention 40% of the step, the spin 12%).
// QKILN_DECODE_SPLIT=0 turns it off (read per call, for comparisons). int4 caches (session 20,
// the same A/B with 3 rounds): 2000-token context 60.3 -> 75.5 tok/s, 4000: 46.7 -> 52.1, 500: 1.01x.
constexpr int64_t kSplitTokens = 512;
// Shorter rows are split too when the step's tasks would not divide evenly over the threads (3 kv
// heads on 2 threads at batch 1): into one part per thread, where a part gets kMinSplitTokens+.
// Same-process A/B (QKILN_DECODE_SPLIT=0/1, batch-1 SmolLM2, 64 steps after the prompt, 5-7 rounds,
// with parts of 64+): prompt of 400 tokens 111.9 -> 115.2 tok/s, 600: 98.1 -> 104.9, 700: 89.4 ->
// 90.7; 256 and 128 (parts below 160 tokens) 1.00x and 0.98x, hence 128. decode_group_bf16 on an
// AVX2 host (session 25, 5-9 rounds, median step): prompt of 400 tokens 4.75 -> 4.39 ms; 128 1.00x,
// and 1.02x slower with parts from 48 tokens.
constexpr int64_t kMinSplitTokens = 128;

// paged_attention's argument checks (AttentionTasks makes them; paged_attention before AmxPrefill).
void check_paged_attention_args(const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                const at::Tensor& out, const KVParams& params) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2) &&
              out.is_contiguous() && out.sizes() == query.sizes(),
              "query must be [N, Hq, D] with dense heads, out contiguous [N, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype(),
              "k_cache and v_cache must be contiguous [blocks, block_size, Hkv, D] of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              query_start_loc.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "block_tables, seq_lens, query_start_loc must be contiguous int32");
  const int64_t num_seqs = seq_lens.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t Hkv = k_cache.size(2);
  params.check(k_cache, D, "paged_attention");
  if (k_cache.scalar_type() == at::kByte)
    TORCH_CHECK(D == 32 || D == 64 || D == 128, "paged_attention: int4 caches need head_dim 32, 64 or 128");
  TORCH_CHECK(cache_head_dim(k_cache) == D && D % kW == 0 && Hq % Hkv == 0 &&
              query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "paged_attention: shapes do not match (needs head_dim % 16 == 0)");
}

}  // namespace

AttentionTasks::AttentionTasks(const at::Tensor& query, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               double scale, at::Tensor& out, const KVParams& params,
                               const uint8_t* skip_seqs)
    : query_(query), k_cache_(k_cache), v_cache_(v_cache), out_(out),
      scale_(static_cast<float>(scale)) {
  check_paged_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                             params);
  const int64_t num_seqs = seq_lens.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t Hkv = k_cache.size(2);
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  int4_ = k_cache.scalar_type() == at::kByte;
  k_scale_ = params.k_scale.value_or(at::Tensor()), v_scale_ = params.v_scale.value_or(at::Tensor());
  if (int4_) {
    k_group_scale_ = *params.k_group_scale, k_group_min_ = *params.k_group_min;
    v_group_scale_ = *params.v_group_scale, v_group_min_ = *params.v_group_min;
  }
  tables_ = block_tables.data_ptr<int32_t>();
  lens_ = seq_lens.data_ptr<int32_t>();
  starts_ = query_start_loc.data_ptr<int32_t>();
  max_blocks_ = block_tables.size(1);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t first = 0; first < starts_[s + 1] - starts_[s] && !(skip_seqs && skip_seqs[s]);
         first += kRowsPerTask)
      blocks_.push_back({s, first, std::min(kRowsPerTask, starts_[s + 1] - starts_[s] - first)});
  // With many row blocks (a decode batch) a task serves several kv heads, so K rows are read
  // whole rather than one head's 2-line slice at a time, which the hardware prefetcher hardly
  // follows across blocks. Only decode_heads_bf16 serves more than one head; at most 16 query
  // heads per task (its per-row dot products stay in L1).
  bf16_heads_ = kBf16Heads && query.scalar_type() == at::kBFloat16 &&
                (k_cache.scalar_type() == at::kBFloat16 || fp8) && (D == 64 || D == 128);
  // Prefill blocks over a bf16 cache: prefill_block_bf16 (its K gather takes 32-bit word offsets);
  // over an fp8 one, on the block's K / V prefix converted to bf16 rows first
  prefill_tiled_ = kBf16Heads && query.scalar_type() == at::kBFloat16 && (D == 64 || D == 128) &&
                   ((k_cache.scalar_type() == at::kBFloat16 &&
                     k_cache.numel() / 2 < std::numeric_limits<int32_t>::max()) || fp8);
  if (bf16_heads_ && static_cast<int64_t>(blocks_.size()) >= kFuseHeadsMinBlocks)
    for (int64_t h = Hkv; h > 1; --h)
      if (Hkv % h == 0 && h * (Hq / Hkv) <= 16) {
        heads_per_task_ = h;
        break;
      }
  // Decodes over a bf16 cache on AVX2 hosts: decode_group_bf16. QKILN_GROUP_DECODE=0 keeps
  // decode_head_tiled (read per call, for comparisons).
  group_bf16_ = kGroupDecodeBf16 && query.scalar_type() == at::kBFloat16 &&
                k_cache.scalar_type() == at::kBFloat16 && (D == 64 || D == 128) &&
                !switched_off("QKILN_GROUP_DECODE");
  if ((bf16_heads_ || group_bf16_ || int4_) && static_cast<int64_t>(blocks_.size()) < kFuseHeadsMinBlocks &&
      !switched_off("QKILN_DECODE_SPLIT"))
    split_decodes(k_cache.size(1));
}

// Replaces each long one-row block by its parts (kSplitTokens, or one per thread where the tasks
// would not divide evenly over the threads); heads_per_task_ is 1 here.
void AttentionTasks::split_decodes(int64_t block_size) {
  const auto context = [&](const RowBlock& b) {  // a one-row block's tokens, 0 for prefill blocks
    return b.count == 1 ? causal_len(b, b.first) : 0;
  };
  const auto whole_blocks = [&](int64_t tokens) { return (tokens + block_size - 1) / block_size * block_size; };
  int64_t part = whole_blocks(kSplitTokens), min_context = 2 * part;
  const int64_t threads = at::get_num_threads(), tasks = blocks_.size() * k_cache_.size(2);
  if (threads > 1 && tasks % threads != 0) {
    int64_t longest = 0;
    for (const RowBlock& b : blocks_) longest = std::max(longest, context(b));
    const int64_t even = whole_blocks((longest + threads - 1) / threads);
    if (even >= kMinSplitTokens && even < part) part = even, min_context = even + 1;
  }
  std::vector<RowBlock> blocks;
  int64_t partials = 0;
  for (const RowBlock& b : blocks_) {
    const int64_t T = context(b);
    if (T < min_context) {
      blocks.push_back(b);
      continue;
    }
    const int64_t parts = (T + part - 1) / part;
    splits_.push_back({starts_[b.seq] + b.first, parts, partials});
    for (int64_t p = 0; p < parts; ++p) blocks.push_back({b.seq, b.first, 1, p, partials + p});
    partials += parts;
  }
  if (partials == 0) return;
  split_tokens_ = part;
  blocks_ = std::move(blocks);
  const int64_t Hq = query_.size(1), D = query_.size(2);
  partial_out_ = at::empty({partials, Hq, D}, query_.options().dtype(at::kFloat));
  partial_lse_ = at::empty({partials, Hq}, query_.options().dtype(at::kFloat));
}

// out = sum_p w_p out_p / sum_p w_p with w_p = exp(lse_p - max lse): the parts' softmax
// denominators put back (each part's output was normalized by its own).
void AttentionTasks::merge_partials() const {
  if (splits_.empty()) return;
  const int64_t Hq = query_.size(1), D = query_.size(2);
  const float *parts_out = partial_out_.data_ptr<float>(), *parts_lse = partial_lse_.data_ptr<float>();
  QKILN_DISPATCH(out_.scalar_type(), "qkiln_attn_merge", [&] {
    scalar_t* op = out_.data_ptr<scalar_t>();
    for (const SplitRow& r : splits_)
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t p = r.first; p < r.first + r.parts; ++p)
          top = std::max(top, parts_lse[p * Hq + hq]);
        Vf acc[8];  // D <= 128
        for (int64_t c = 0; c < D / kW; ++c) acc[c] = set1(0.f);
        float total = 0.f;
        for (int64_t p = r.first; p < r.first + r.parts; ++p) {
          const float w = std::exp(parts_lse[p * Hq + hq] - top);
          total += w;
          for (int64_t c = 0; c < D / kW; ++c)
            acc[c] = fmadd(set1(w), load(parts_out + (p * Hq + hq) * D + c * kW), acc[c]);
        }
        for (int64_t c = 0; c < D / kW; ++c)
          store(op + (r.row * Hq + hq) * D + c * kW, mul(acc[c], set1(1.f / total)));
      }
  });
}

int64_t AttentionTasks::size() const {
  return static_cast<int64_t>(blocks_.size()) * (k_cache_.size(2) / heads_per_task_);
}

// The stream's tasks: task = row block * (Hkv / heads_per_task_) + kv head group.
void AttentionTasks::run(TaskStream& tasks) const {
  const int64_t Hq = query_.size(1), D = query_.size(2), Hkv = k_cache_.size(2);
  const Decode a{tables_, max_blocks_, k_cache_.size(1), Hkv, D, Hq / Hkv, scale_};
  const float* k_scale = k_scale_.defined() ? k_scale_.data_ptr<float>() : nullptr;
  const float* v_scale = v_scale_.defined() ? v_scale_.data_ptr<float>() : nullptr;
  const int64_t H = heads_per_task_, per_block = Hkv / H;
  QKILN_DISPATCH(query_.scalar_type(), "qkiln_attn_q", [&] {
    using q_t = scalar_t;
    const q_t* qp = query_.data_ptr<q_t>();
    QKILN_DISPATCH(out_.scalar_type(), "qkiln_attn_o", [&] {
      scalar_t* op = out_.data_ptr<scalar_t>();
      thread_local std::vector<float> buf;
      // attend(h, table, T, query row, out row, next, lse): one query row's heads
      // h .. h + H * group - 1; next (kv head, table, T) is the next task's first row when this
      // is a one-row block (decodes), else table nullptr. A part of a split row attends to its
      // tokens only (table and T shifted) into partial_out_, writing its log-sum-exp to lse.
      // whole_block(b, h, table): serves all of block b's rows for heads h .. h + H * group - 1
      // itself and returns true, or returns false to leave them to attend.
      // A part's tokens: its share of the table and of T.
      auto part_of = [&](const RowBlock& b, const int32_t*& table, int64_t& T) {
        if (b.part < 0) return;
        table += b.part * split_tokens_ / a.block_size;
        T = std::min(split_tokens_, T - b.part * split_tokens_);
      };
      auto each_row = [&](auto&& attend, auto&& whole_block) {
        for (; !tasks.done(); tasks.advance()) {
          const int64_t task = tasks.task(), ahead = tasks.ahead();
          const RowBlock& b = blocks_[task / per_block];
          const int64_t h = task % per_block * H;
          const int32_t* table = a.tables + b.seq * a.max_blocks;
          if (b.count > 1 && whole_block(b, h, table)) continue;
          struct { int64_t h; const int32_t* table; int64_t T; } next{0, nullptr, 0};
          if (b.count == 1 && ahead >= 0) {
            const RowBlock& nb = blocks_[ahead / per_block];
            next = {ahead % per_block * H, a.tables + nb.seq * a.max_blocks, causal_len(nb, nb.first)};
            part_of(nb, next.table, next.T);
            if (next.T <= 0) next.table = nullptr;
          }
          for (int64_t i = b.first; i < b.first + b.count; ++i) {
            const int64_t row = starts_[b.seq] + i;
            int64_t T = causal_len(b, i);
            const q_t* qrow = qp + row * query_.stride(0) + h * a.group * D;
            if (b.part >= 0) {
              const int32_t* part_table = table;
              part_of(b, part_table, T);
              const int64_t at = b.partial * Hq + h * a.group;
              attend(h, part_table, T, qrow, partial_out_.data_ptr<float>() + at * D, next,
                     partial_lse_.data_ptr<float>() + at);
              continue;
            }
            const int64_t offset = (row * Hq + h * a.group) * D;  // in out
            if (T <= 0) {
              for (int64_t j = 0; j < H * a.group * D; ++j) op[offset + j] = 0;
              continue;
            }
            attend(h, table, T, qrow, op + offset, next, nullptr);
          }
        }
      };
      if (int4_) {
        const int64_t groups = k_group_scale_.size(3);
        const uint8_t *k = k_cache_.data_ptr<uint8_t>(), *v = v_cache_.data_ptr<uint8_t>();
        const c10::Half *ks = k_group_scale_.data_ptr<c10::Half>(), *km = k_group_min_.data_ptr<c10::Half>(),
                        *vs = v_group_scale_.data_ptr<c10::Half>(), *vm = v_group_min_.data_ptr<c10::Half>();
        auto head_rows = [&](int64_t h, const int32_t* table) {
          const int64_t g = h * groups;  // the head's first group in a slot
          return Int4Rows{k + h * D / 2, v + h * D / 2, ks + g, km + g, vs + g, vm + g, table, a.block_size, D,
                          D / groups, Hkv, {}};
        };
        each_row([&](int64_t h, const int32_t* table, int64_t T, const q_t* qrow, auto* orow, auto, float* lse) {
          Int4Rows rows = head_rows(h, table);
          if (kBf16Heads && std::is_same_v<q_t, c10::BFloat16> && rows.group % 4 == 0 &&
              groups <= kW) {  // K read as codes
            const auto* qb = reinterpret_cast<const c10::BFloat16*>(qrow);
            if (D == 32) decode_head_int4<2>(a, qb, rows, T, orow, buf, lse);
            else if (D == 64) decode_head_int4<4>(a, qb, rows, T, orow, buf, lse);
            else decode_head_int4<8>(a, qb, rows, T, orow, buf, lse);
            return;
          }
          if (D == 32) decode_head_tiled<2>(a, qrow, rows, T, orow, buf, lse);
          else if (D == 64) decode_head_tiled<4>(a, qrow, rows, T, orow, buf, lse);
          else decode_head_tiled<8>(a, qrow, rows, T, orow, buf, lse);
        }, [&](const RowBlock& b, int64_t h, const int32_t* table) {  // a prefill block
          // With AVX512-BF16 (a bf16 query, D 64 / 128): the prefix as bf16 rows through
          // prefill_block_bf16 (serve_int4_prefix); without it, prefill_block_tiled.
          // QKILN_TILED_PREFILL=0: decode_head_int4 / decode_head_tiled row by row (read per call,
          // for comparisons).
          const int64_t T_first = causal_len(b, b.first), row = starts_[b.seq] + b.first;
          if (T_first <= 0 || switched_off("QKILN_TILED_PREFILL")) return false;
          Int4Rows rows = head_rows(h, table);
          const int64_t q_stride = query_.stride(0), out_stride = Hq * D;
          const q_t* qh = qp + row * q_stride + h * a.group * D;
          auto* oh = op + (row * Hq + h * a.group) * D;
          if (kBf16Heads) {
            if (!std::is_same_v<q_t, c10::BFloat16> || (D != 64 && D != 128)) return false;
            const auto* qb = reinterpret_cast<const c10::BFloat16*>(qh);
            auto serve = [&](const Decode& d, const c10::BFloat16* kh, const c10::BFloat16* vh,
                             const int32_t* tbl) {
              if (D == 64) prefill_block_bf16<2>(d, qb, q_stride, kh, vh, tbl, T_first, b.count, oh, out_stride);
              else prefill_block_bf16<4>(d, qb, q_stride, kh, vh, tbl, T_first, b.count, oh, out_stride);
            };
            const int64_t T_max = T_first + b.count - 1;
            if (D == 64) serve_int4_prefix<2>(a, rows, T_max, serve);
            else serve_int4_prefix<4>(a, rows, T_max, serve);
            return true;
          }
          if (D == 32) prefill_block_tiled<2>(a, qh, q_stride, rows, T_first, b.count, oh, out_stride);
          else if (D == 64) prefill_block_tiled<4>(a, qh, q_stride, rows, T_first, b.count, oh, out_stride);
          else prefill_block_tiled<8>(a, qh, q_stride, rows, T_first, b.count, oh, out_stride);
          return true;
        });
        return;
      }
      QKILN_DISPATCH_KV(k_cache_.scalar_type(), "qkiln_attn_kv", [&] {
        using kv_t = scalar_t;
        const kv_t* kp = k_cache_.data_ptr<kv_t>();
        const kv_t* vp = v_cache_.data_ptr<kv_t>();
        each_row([&](int64_t h, const int32_t* table, int64_t T, const q_t* qrow, auto* orow,
                     const auto& next, float* lse) {
          const kv_t *kh = kp + h * D, *vh = vp + h * D;
          constexpr bool kBf16Rows = std::is_same_v<kv_t, c10::BFloat16> ||
                                     std::is_same_v<kv_t, c10::Float8_e4m3fn>;
          if constexpr (kBf16Rows) {
            if (bf16_heads_) {  // q_t is bf16 here, D is 64 or 128 (the constructor)
              const auto* qb = reinterpret_cast<const c10::BFloat16*>(qrow);
              const NextKeys<kv_t> ahead{kp + next.h * D, next.table, next.T};
              const float *ks = k_scale ? k_scale + h : nullptr, *vs = v_scale ? v_scale + h : nullptr;
              if (D == 64)
                decode_heads_bf16<2>(a, qb, kh, vh, table, T, orow, buf, H, ks, vs, ahead, lse);
              else
                decode_heads_bf16<4>(a, qb, kh, vh, table, T, orow, buf, H, ks, vs, ahead, lse);
              return;
            }
          }
          if constexpr (std::is_same_v<kv_t, c10::BFloat16> && std::is_same_v<q_t, c10::BFloat16>) {
            if (group_bf16_) {  // D is 64 or 128 (the constructor)
              decode_group_bf16(a, qrow, kh, vh, table, T, orow, lse);
              return;
            }
          }
          Decode head = a;  // one kv head per task here (H == 1)
          if (k_scale) head.scale = a.scale * k_scale[h], head.out_scale = v_scale[h];
          CacheRows<kv_t> rows{kh, vh, table, a.block_size, Hkv * D};
          if (D == 64)
            decode_head_tiled<4>(head, qrow, rows, T, orow, buf);
          else if (D == 128)
            decode_head_tiled<8>(head, qrow, rows, T, orow, buf);
          else
            decode_head(head, qrow, kh, vh, table, T, orow, buf);
        }, [&](const RowBlock& b, int64_t h, const int32_t* table) {  // a prefill block
          const int64_t T_first = causal_len(b, b.first), row = starts_[b.seq] + b.first;
          if (!prefill_tiled_ || T_first <= 0) return false;
          // (the casts only name what the types already are: this lambda is compiled for every
          // dtype pair but runs for bf16 queries over bf16 or fp8 caches)
          using bf16 = c10::BFloat16;
          const auto* qb = reinterpret_cast<const bf16*>(qp);
          const int64_t q_stride = query_.stride(0);
          for (int64_t hh = h; hh < h + H; ++hh) {
            const bf16* qh = qb + row * q_stride + hh * a.group * D;
            auto* oh = op + (row * Hq + hh * a.group) * D;
            auto serve = [&](const Decode& d, const bf16* kh, const bf16* vh, const int32_t* tbl) {
              if (D == 64) prefill_block_bf16<2>(d, qh, q_stride, kh, vh, tbl, T_first, b.count, oh, Hq * D);
              else prefill_block_bf16<4>(d, qh, q_stride, kh, vh, tbl, T_first, b.count, oh, Hq * D);
            };
            if constexpr (std::is_same_v<kv_t, c10::Float8_e4m3fn>) {
              const auto *kf = reinterpret_cast<const c10::Float8_e4m3fn*>(kp) + hh * D,
                         *vf = reinterpret_cast<const c10::Float8_e4m3fn*>(vp) + hh * D;
              const int64_t T_max = T_first + b.count - 1;
              if (D == 64) serve_fp8_prefix<2>(a, kf, vf, table, T_max, k_scale[hh], v_scale[hh], serve);
              else serve_fp8_prefix<4>(a, kf, vf, table, T_max, k_scale[hh], v_scale[hh], serve);
            } else {
              serve(a, reinterpret_cast<const bf16*>(kp) + hh * D, reinterpret_cast<const bf16*>(vp) + hh * D,
                    table);
            }
          }
          return true;
        });
      });
    });
  });
}

// Causal paged attention for every query row of a step (decodes and prefill chunks alike): row i
// of sequence s (q_len rows from query_start_loc[s]) sits at context position
// seq_lens[s] - q_len + i and attends to the sequence's slots [0, that position] through its block
// table, as one decode of that length. out [N, Hq, D] contiguous, any float dtype.
// query [N, Hq, D] (rows at any stride, heads dense: a view of the fused qkv); caches
// [blocks, block_size, Hkv, D] bf16/fp16/fp32, or fp8 e4m3fn with k_scale / v_scale fp32 [Hkv];
// D % 16 == 0.
void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, at::Tensor& out,
                     const KVParams& params) {
  check_paged_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                             params);  // before AmxPrefill reads them
  AmxPrefill amx(query, k_cache, v_cache, block_tables.data_ptr<int32_t>(), block_tables.size(1),
                 seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(), seq_lens.size(0),
                 static_cast<float>(scale), params, out);
  // the sequences AMX serves are skipped here
  const AttentionTasks tasks(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                             out, params, amx.served_any() ? amx.served() : nullptr);
  amx.run();
  TaskQueue queue(tasks.size());
  at::parallel_for(0, tasks.size(), 1, [&](int64_t, int64_t) {
    TaskStream mine(queue);
    tasks.run(mine);
  });
  tasks.merge_partials();
}

// Which decode kernel serves a bf16 query over a bf16 cache (head_dim 64 / 128) in this build:
// "avx512-bf16" (decode_heads_bf16), "avx2" (decode_group_bf16) or "portable" (decode_head_tiled).
std::string decode_attention_isa() {
  if (kBf16Heads) return "avx512-bf16";
  return kGroupDecodeBf16 ? "avx2" : "portable";
}

void KVParams::check(const at::Tensor& k_cache, int64_t head_dim, const char* op) const {
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn, int4 = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()) && fp8 == (k_scale || v_scale),
              op, ": k_scale and v_scale go with an fp8 cache, and only with one");
  if (fp8)
    for (const at::Tensor& t : {*k_scale, *v_scale})
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == k_cache.size(2),
                  op, ": k_scale / v_scale must be contiguous fp32 [num_kv_heads]");
  const bool all_groups = k_group_scale && k_group_min && v_group_scale && v_group_min;
  TORCH_CHECK(int4 == all_groups && int4 == (k_group_scale || k_group_min || v_group_scale || v_group_min),
              op, ": group scales and minimums go with an int4 (uint8) cache, and only with one");
  if (int4) {
    const int64_t groups = k_group_scale->size(-1);
    for (const at::Tensor& t : {*k_group_scale, *k_group_min, *v_group_scale, *v_group_min})
      TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 4 &&
                      t.size(0) == k_cache.size(0) && t.size(1) == k_cache.size(1) &&
                      t.size(2) == k_cache.size(2) && t.size(3) == groups && groups > 0 &&
                      head_dim % groups == 0 && (head_dim / groups) % 2 == 0,
                  op, ": int4 group scales / minimums must be contiguous fp16 [blocks, block_size, "
                  "Hkv, head_dim / group] with an even group");
  }
}
