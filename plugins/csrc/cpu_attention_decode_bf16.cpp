// Decode attention for a bf16 query over a bf16 or fp8 cache on AVX512-BF16 CPUs
// (decode_heads_bf16), and fp8 cache rows widened to bf16 rows (widen_fp8_rows) for the prefill
// blocks AttentionTasks serves as bf16 (cpu_attention.cpp). Without AVX512-BF16 both are stubs that
// AttentionTasks never calls (kBf16Heads).

#include "attention_common.h"

namespace attention_detail {

#ifdef QKILN_ATTENTION_BF16

namespace {

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

}  // namespace

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
                       const float* k_scale, const float* v_scale, const NextKeys<kv_t>& next, float* lse) {
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

// Tokens [0, T) of one kv head of an fp8 cache (head: its slice of slot 0, rows row_stride elements
// apart, through the block table) as bf16 rows in element order, D = 32 * NP apart in out.
template <int NP>
void widen_fp8_rows(const c10::Float8_e4m3fn* head, int64_t row_stride, const int32_t* table, int64_t block_size,
                    int64_t T, c10::BFloat16* out) {
  const RowWords<c10::Float8_e4m3fn> words = row_words<c10::Float8_e4m3fn>();
  for_each_row(head, table, block_size, row_stride, T, [&](int64_t t, const c10::Float8_e4m3fn* src) {
    __m512i row[NP];
    words.template read_in_order<NP>(src, row);
    for (int p = 0; p < NP; ++p) _mm512_storeu_si512(out + t * NP * 32 + p * 32, row[p]);
  });
}

#else

template <int NP, typename kv_t, typename o_t>
void decode_heads_bf16(const Decode&, const c10::BFloat16*, const kv_t*, const kv_t*, const int32_t*,
                       int64_t, o_t*, std::vector<float>&, int64_t, const float*, const float*,
                       const NextKeys<kv_t>&, float*) {}
template <int NP>
void widen_fp8_rows(const c10::Float8_e4m3fn*, int64_t, const int32_t*, int64_t, int64_t, c10::BFloat16*) {}

#endif

#define QKILN_DECODE_HEADS(NP, KV, O)                                                                    \
  template void decode_heads_bf16<NP, KV, O>(const Decode&, const c10::BFloat16*, const KV*, const KV*,  \
                                             const int32_t*, int64_t, O*, std::vector<float>&, int64_t,   \
                                             const float*, const float*, const NextKeys<KV>&, float*);
#define QKILN_DECODE_HEADS_KV(NP, KV) \
  QKILN_DECODE_HEADS(NP, KV, float) QKILN_DECODE_HEADS(NP, KV, c10::BFloat16) QKILN_DECODE_HEADS(NP, KV, c10::Half)
QKILN_DECODE_HEADS_KV(2, c10::BFloat16)
QKILN_DECODE_HEADS_KV(4, c10::BFloat16)
QKILN_DECODE_HEADS_KV(2, c10::Float8_e4m3fn)
QKILN_DECODE_HEADS_KV(4, c10::Float8_e4m3fn)
template void widen_fp8_rows<2>(const c10::Float8_e4m3fn*, int64_t, const int32_t*, int64_t, int64_t,
                                 c10::BFloat16*);
template void widen_fp8_rows<4>(const c10::Float8_e4m3fn*, int64_t, const int32_t*, int64_t, int64_t,
                                 c10::BFloat16*);

}  // namespace attention_detail
