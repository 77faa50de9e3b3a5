// int4 KV caches: a packed row dequantized to fp32 (dequantize_int4_row: the portable kernels'
// and AmxPrefill's staging), and decode attention for a bf16 query reading K and V as their codes
// on AVX512-BF16 CPUs (decode_head_int4; a stub AttentionTasks never calls elsewhere, kBf16Heads).
// Layout and math: kv_cache.py; task split and dispatch: cpu_attention.cpp.

#include "attention_common.h"

namespace attention_detail {

// One packed int4 row of D elements -> fp32, x = q * scale + min per group of `group` elements
// (kv_cache.dequantize_int4_groups; low nibble = even element). The row's fp16 scales and
// minimums are widened once into fp32 first (a scalar c10::Half conversion per group cost more
// than the codes).
void dequantize_int4_row(const uint8_t* packed, const c10::Half* scale_h, const c10::Half* min_h, int64_t D,
                         int64_t group, float* out) {
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

void int4_row_as_bf16(const uint8_t* packed, const c10::Half* scale, const c10::Half* minimum, int64_t D,
                      int64_t group, c10::BFloat16* out) {
  alignas(64) float values[kMaxInt4HeadDim];
  dequantize_int4_row(packed, scale, minimum, D, group, values);
  for (int64_t d = 0; d < D; d += kW) store(out + d, load(values + d));
}

#ifdef QKILN_ATTENTION_BF16

namespace {

// The group of each lane's first element, lane l of a chunk starting at element `first` standing for
// `step` elements: (first + step * l) / group, 0 for lanes at or past `end`. int4 caches take D 32,
// 64 or 128 and groups dividing D, so group is a power of two and the division a shift.
inline __m512i group_of_lanes(int first, int step, int64_t group, int64_t end = kMaxInt4HeadDim) {
  const __m512i element = _mm512_add_epi32(_mm512_set1_epi32(first),
                                           _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                                               5, 4, 3, 2, 1, 0),
                                                              _mm512_set1_epi32(step)));
  const __mmask16 inside = _mm512_cmplt_epi32_mask(element, _mm512_set1_epi32(static_cast<int>(end)));
  return _mm512_maskz_srlv_epi32(inside, element, _mm512_set1_epi32(__builtin_ctzll(group)));
}

// The query's 32-element chunk c as bf16 pairs for vdpbf16ps.
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
  for (int c = 0; c < NC; ++c) group_of_lane[c] = group_of_lanes(32 * c, 2, rows.group);
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

}  // namespace

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
template <int NV, typename o_t>
void decode_head_int4(const Decode& a, const c10::BFloat16* q, const Int4Rows& rows, int64_t T, o_t* out,
                      std::vector<float>& buf, float* lse) {
  constexpr int64_t D = NV * kW;
  constexpr int NB = (D + 63) / 64;  // chunks of 64 elements (32 bytes of codes; D = 32: one of 16)
  const int64_t G = a.group, groups = D / rows.group;
  buf.resize(G * D + G * T + G + G * groups);
  float *acc = buf.data(), *scores = acc + G * D, *inv_sum = scores + G * T;
  float* qsum = inv_sum + G;  // [G, groups]
  thread_local std::vector<uint16_t> permuted_buf;  // [G, NB, 2, 32] the query's bf16 bits, codes' order
  thread_local std::vector<Vf> dots_buf;            // [G, 16]
  permuted_buf.resize(G * NB * 64);
  dots_buf.resize(G * kW);
  // plain pointers: each use of a thread_local in the loops below called __tls_get_addr
  uint16_t* permuted = permuted_buf.data();
  Vf* dots = dots_buf.data();
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(q);
  // The per-task setup in word permutes, shifts (group_of_lanes) and vector sums, where it was scalar
  // index arithmetic and divisions: same-process A/B (scattered blocks, 30 layers, 9 rounds), 64
  // decodes x 192 tokens 0.93x and 0.97x the time, batch 1 at 128-192 tokens 0.95-0.96x, 64 x 512
  // 0.99x; outputs within 7e-7 (fp32; group sums added in another order).
  const __m512i even_words = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                              30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd_words = _mm512_add_epi16(even_words, _mm512_set1_epi16(1));
  for (int64_t g = 0; g < G; ++g) {
    for (int c = 0; c < NB; ++c) {  // chunk c: its even elements 64c + 2i, then its odd ones
      uint16_t* dst = permuted + (g * NB + c) * 64;
      const uint16_t* src = bits + g * D + 64 * c;
      if constexpr (D >= 64) {
        const __m512i first = _mm512_loadu_si512(src), second = _mm512_loadu_si512(src + 32);
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(first, even_words, second));
        _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(first, odd_words, second));
      } else {  // 32 elements: 16 even and 16 odd words, the chunk's other 16 words zero
        const __m512i words = _mm512_loadu_si512(src);
        _mm512_storeu_si512(dst, _mm512_maskz_permutexvar_epi16(0xFFFF, even_words, words));
        _mm512_storeu_si512(dst + 32, _mm512_maskz_permutexvar_epi16(0xFFFF, odd_words, words));
      }
    }
    if (rows.group % kW == 0) {  // each group a whole number of 16-element vectors
      for (int64_t j = 0; j < groups; ++j) {
        Vf total = load(q + g * D + j * rows.group);
        for (int64_t d = kW; d < rows.group; d += kW) total = add(total, load(q + g * D + j * rows.group + d));
        qsum[g * groups + j] = reduce_add(total);
      }
    } else {
      for (int64_t j = 0; j < groups; ++j) {
        float total = 0.f;
        for (int64_t d = j * rows.group; d < (j + 1) * rows.group; ++d) total += static_cast<float>(q[g * D + d]);
        qsum[g * groups + j] = total;
      }
    }
  }
  __m512i group_of_lane[NB];  // dword lane l of chunk c sums elements 64c + 4l .. 64c + 4l + 3
  for (int c = 0; c < NB; ++c) group_of_lane[c] = group_of_lanes(64 * c, 4, rows.group, D);
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

#else

template <int NV, typename o_t>
void decode_head_int4(const Decode&, const c10::BFloat16*, const Int4Rows&, int64_t, o_t*, std::vector<float>&,
                      float*) {}

#endif

#define QKILN_DECODE_INT4(NV, O)                                                                     \
  template void decode_head_int4<NV, O>(const Decode&, const c10::BFloat16*, const Int4Rows&, int64_t, O*, \
                                        std::vector<float>&, float*);
#define QKILN_DECODE_INT4_OUT(NV) \
  QKILN_DECODE_INT4(NV, float) QKILN_DECODE_INT4(NV, c10::BFloat16) QKILN_DECODE_INT4(NV, c10::Half)
QKILN_DECODE_INT4_OUT(2)
QKILN_DECODE_INT4_OUT(4)
QKILN_DECODE_INT4_OUT(8)

}  // namespace attention_detail
