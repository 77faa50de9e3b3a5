// qkiln CPU attention for prefill rows on AMX (Intel AMX-BF16): sequences with kAmxMinRows or more
// query rows in a step, bf16 query over a bf16, fp8 or int4 cache, head_dim 64 or 128.
// cpu_attention.cpp's paged_attention hands these sequences here and serves every other row itself.
//
// Why: prefill attention is O(q_len * T). On AVX512-BF16 (prefill_block_bf16) it ran at ~67
// GFLOP/s on the 2-core AMX Xeon host: one 4096-token SmolLM2 prompt took 11.9 s to prefill, 72% of
// it in attention, where torch's CPU flash attention (SDPA, the same shapes) ran 3.7x faster. Over
// an int4 cache each prefill row was served as a decode (a 2048-token prompt: 7.5 s against 1.2 s
// over bf16). Measured after (README, same-process A/Bs): 4096 tokens 11.17 -> 3.76 s, int4 2048
// tokens 7.54 -> 1.20 s, 64 prompts of 128 tokens 4.27 -> 3.79 s.
//
// How, per (sequence, kv head), in two parallel phases:
// 1. Staging: the sequence's K and V rows [0, seq_len) are read once through the block table into
//    the tile layouts AMX multiplies, so the block size and the cache's strides stop mattering:
//      K^T: per 16-token tile and 32-dim step, a B tile of 16 dim pairs x 16 tokens (row j, word t:
//           K[t][2j], K[t][2j+1]);
//      V:   per 32-token tile and 16-dim slice, a B tile of 16 token pairs x 16 dims (row j, word d:
//           V[2j][d], V[2j+1][d]).
//    Tokens past seq_len are zeros (never garbage: 0 * NaN would reach the sums). fp8 rows are
//    widened exactly (their scales go on the scores and the output), int4 rows dequantized in fp32
//    and rounded to bf16.
// 2. Rows, per task of 16 consecutive query rows (a tile) and one kv head, for each query head g of
//    its GQA group, a two-pass softmax:
//      S = Q K^T for the tokens the last row sees (A: the 16 query rows, B: staged K^T; fp32),
//      per row: scaled, masked to its causal length, max, p = exp(s - max), the sum of p in fp32,
//      p rounded to bf16 (as prefill_block_bf16 and HF's eager attention do),
//      O = P V (A: 16 rows x 32 tokens of p, B: staged V), out = O * out_scale / sum.
//    Scores and p live in per-thread buffers (16 rows x T: 64 KB per 1024 tokens for S); a row
//    never reads slots past its own length's p (zeros), so masking is exact.
// Tiles: C 0-3 (four 16-token score tiles, or four 16-dim output slices), A 4, B 5-6.

#include "cpu_attention_internal.h"
#include "cpu_gemm_bf16_amx.h"
#include "qkiln_cpu.h"
#include "task_stream.h"
#include "vec.h"


#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QKILN_AMX_PREFILL 1
#endif

namespace attention_detail {

namespace {

constexpr int64_t kTile = 16;       // query rows, tokens or dims per tile side
constexpr int64_t kStageChunk = 64;  // tokens per staging task (two V tiles, four K tiles)

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

#ifdef QKILN_AMX_PREFILL
namespace {

// exp(x) for x <= 0 (a score minus its row's max), inlined: n = round(x / ln 2), r = x - n ln 2 in
// two parts (|r| <= 0.35), a degree-6 Taylor polynomial, times 2^n by vscalefps (underflows to 0);
// at most 2.3e-7 from exp, relative, over [-87, 0]. Called through a pointer, torch's Sleef exp
// took as long as all the tile work here (perf, one 4096-token prompt). p is rounded to bf16 (8
// bits) for P @ V anyway.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);        // ln 2, the rest
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace
#endif

AmxPrefill::AmxPrefill(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const int32_t* tables, int64_t max_blocks, const int32_t* seq_lens,
                       const int32_t* starts, int64_t num_seqs, float scale, const KVParams& params,
                       at::Tensor& out)
    : query_(query), k_cache_(k_cache), v_cache_(v_cache), out_(out), tables_(tables),
      max_blocks_(max_blocks), lens_(seq_lens), starts_(starts), scale_(scale) {
  served_.assign(num_seqs, 0);
  const int64_t D = query.size(2);
  const auto dtype = k_cache.scalar_type();
  if (!amx_prefill_ready() || query.scalar_type() != at::kBFloat16 || (D != 64 && D != 128) ||
      !(dtype == at::kBFloat16 || dtype == at::kFloat8_e4m3fn || dtype == at::kByte))
    return;
  if (dtype == at::kFloat8_e4m3fn)  // (paged_attention checked that the scales are there)
    k_scale_ = params.k_scale->data_ptr<float>(), v_scale_ = params.v_scale->data_ptr<float>();
  if (dtype == at::kByte)
    k_group_scale_ = *params.k_group_scale, k_group_min_ = *params.k_group_min,
    v_group_scale_ = *params.v_group_scale, v_group_min_ = *params.v_group_min;
  const int64_t Hkv = k_cache.size(2);
  int64_t staged = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = starts[s + 1] - starts[s];
    if (rows < kAmxMinRows) continue;
    served_[s] = 1;
    const int64_t T_pad = round_up(seq_lens[s], kStageChunk);
    seqs_.push_back({s, staged, T_pad});
    staged += T_pad * Hkv * D;  // elements of K^T (and as many of V) for all kv heads
    const int64_t index = static_cast<int64_t>(seqs_.size()) - 1;
    for (int64_t c = 0; c < T_pad / kStageChunk; ++c)
      for (int64_t h = 0; h < Hkv; ++h) stage_tasks_.push_back({index, h, c});
    for (int64_t t = (rows + kTile - 1) / kTile - 1; t >= 0; --t)  // a sequence's longest rows first
      for (int64_t h = 0; h < Hkv; ++h) row_tasks_.push_back({index, h, t});
  }
  staged_k_.reset(new uint16_t[staged]), staged_v_.reset(new uint16_t[staged]);
}

#ifdef QKILN_AMX_PREFILL

// One cache row (slot * Hkv + kv head) of K or V as D bf16 words: fp8 exactly (e4m3 values are
// bf16 values; vec.h's load and store, NaN to 0x7FC0); int4 dequantized in fp32 as the decode
// kernels do, then rounded to bf16 (int4_row_as_bf16, as serve_int4_prefix does).
void AmxPrefill::widen_row(bool value, int64_t row, uint16_t* out) const {
  const int64_t D = query_.size(2);
  const at::Tensor& cache = value ? v_cache_ : k_cache_;
  auto* words = reinterpret_cast<c10::BFloat16*>(out);
  if (cache.scalar_type() == at::kFloat8_e4m3fn) {
    const auto* codes = cache.data_ptr<c10::Float8_e4m3fn>() + row * D;
    for (int64_t d = 0; d < D; d += kW) store(words + d, load(codes + d));
    return;
  }
  const at::Tensor& scales = value ? v_group_scale_ : k_group_scale_;
  const at::Tensor& mins = value ? v_group_min_ : k_group_min_;
  const int64_t groups = scales.size(3);
  int4_row_as_bf16(cache.data_ptr<uint8_t>() + row * D / 2, scales.data_ptr<c10::Half>() + row * groups,
                   mins.data_ptr<c10::Half>() + row * groups, D, D / groups, words);
}

// Phase 1: tokens [64 c, 64 c + 64) of one sequence's kv head h into its staged K^T / V tiles
// (fp8 and int4 caches' rows widened to bf16 on the way).
void AmxPrefill::stage(const Task& task) {
  const Staged& sq = seqs_[task.seq];
  const int64_t D = query_.size(2), Hkv = k_cache_.size(2), block_size = k_cache_.size(1);
  const int64_t T = lens_[sq.seq], row_stride = Hkv * D, head_elems = sq.T_pad * D;
  uint16_t* kt = staged_k_.get() + sq.offset + task.h * head_elems;
  uint16_t* vp = staged_v_.get() + sq.offset + task.h * head_elems;
  const int64_t t0 = task.index * kStageChunk, n = std::max<int64_t>(0, std::min(kStageChunk, T - t0));
  const int32_t* table = tables_ + sq.seq * max_blocks_;
  int64_t offsets[kStageChunk];  // row i of the chunk at kc / vc + offsets[i]
  static const uint16_t zeros[128] = {};
  alignas(64) uint16_t widened[2][kStageChunk][128];  // fp8 / int4: the chunk's K and V rows as bf16
  const uint16_t *kc, *vc;
  if (k_cache_.scalar_type() == at::kBFloat16) {
    tile_slots(table, block_size, t0, n, row_stride, offsets);
    kc = reinterpret_cast<const uint16_t*>(k_cache_.data_ptr<at::BFloat16>()) + task.h * D;
    vc = reinterpret_cast<const uint16_t*>(v_cache_.data_ptr<at::BFloat16>()) + task.h * D;
  } else {
    int64_t slots[kStageChunk];
    tile_slots(table, block_size, t0, n, 1, slots);
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t i = 0; i < n; ++i) widen_row(kv == 1, slots[i] * Hkv + task.h, widened[kv][i]);
    for (int64_t i = 0; i < n; ++i) offsets[i] = i * 128;
    kc = widened[0][0], vc = widened[1][0];
  }
  auto k_row = [&](int64_t i) { return i < n ? kc + offsets[i] : zeros; };
  auto v_row = [&](int64_t i) { return i < n ? vc + offsets[i] : zeros; };
  // K^T: tile u (16 tokens) x step ks (32 dims) at ((u * D / 32 + ks) * 16 rows) * 32 words
  const uint32_t* kw[kStageChunk];
  for (int64_t i = 0; i < kStageChunk; ++i) kw[i] = reinterpret_cast<const uint32_t*>(k_row(i));
  for (int64_t u = 0; u < kStageChunk / kTile; ++u)
    for (int64_t ks = 0; ks < D / 32; ++ks) {
      auto* tile = reinterpret_cast<uint32_t*>(kt + ((t0 / kTile + u) * (D / 32) + ks) * 512);
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t t = 0; t < kTile; ++t) tile[j * 16 + t] = kw[u * kTile + t][ks * 16 + j];
    }
  // V: tile w (32 tokens) x slice c (16 dims) at ((w * D / 16 + c) * 16 rows) * 32 words
  for (int64_t w = 0; w < kStageChunk / 32; ++w)
    for (int64_t j = 0; j < 16; ++j) {
      const uint16_t *v0 = v_row(w * 32 + 2 * j), *v1 = v_row(w * 32 + 2 * j + 1);
      for (int64_t c = 0; c < D / 16; ++c) {
        uint16_t* row = vp + ((t0 / 32 + w) * (D / 16) + c) * 512 + j * 32;
        for (int64_t d = 0; d < 16; ++d) row[2 * d] = v0[c * 16 + d], row[2 * d + 1] = v1[c * 16 + d];
      }
    }
}

// Phase 2: query rows [16 t, 16 t + 16) of one sequence (fewer at its end) for kv head h's group.
template <typename o_t>
void AmxPrefill::rows(const Task& task, o_t* out) const {
  const Staged& sq = seqs_[task.seq];
  const int64_t D = query_.size(2), Hq = query_.size(1), Hkv = k_cache_.size(2), G = Hq / Hkv;
  const int64_t q_len = starts_[sq.seq + 1] - starts_[sq.seq];
  const int64_t r0 = task.index * kTile, n_rows = std::min(kTile, q_len - r0);
  const int64_t T_first = lens_[sq.seq] - q_len + 1 + r0;  // tokens row r0 sees
  const int64_t T_last = T_first + n_rows - 1;              // tokens the tile's last row sees
  const int64_t n16 = (T_last + kTile - 1) / kTile, n32 = (T_last + 31) / 32;
  const int64_t S_ld = n16 * kTile, P_ld = n32 * 32;  // score / p row strides
  const int64_t head_elems = sq.T_pad * D;
  const uint16_t* kt = staged_k_.get() + sq.offset + task.h * head_elems;
  const uint16_t* vp = staged_v_.get() + sq.offset + task.h * head_elems;
  const auto* q = reinterpret_cast<const uint16_t*>(query_.data_ptr<at::BFloat16>());
  const int64_t q_stride = query_.stride(0), row0 = starts_[sq.seq] + r0;
  const float score_scale = k_scale_ ? scale_ * k_scale_[task.h] : scale_;  // fp8: x = code * scale
  const float out_scale = v_scale_ ? v_scale_[task.h] : 1.f;

  thread_local std::vector<float> scores_buf;
  thread_local std::vector<uint16_t> p_buf;
  scores_buf.resize(kTile * S_ld), p_buf.resize(kTile * P_ld);
  float* S = scores_buf.data();
  uint16_t* P = p_buf.data();
  alignas(64) uint16_t qtile[kTile * 128];  // the 16 rows of one query head, zero past n_rows
  alignas(64) float o[kTile * 128];
  float inv_sum[kTile];

  for (int64_t g = 0; g < G; ++g) {
    const int64_t hq = task.h * G + g;
    for (int64_t r = 0; r < kTile; ++r)
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i v = r < n_rows ? _mm512_loadu_si512(q + (row0 + r) * q_stride + hq * D + d)
                                     : _mm512_setzero_si512();
        _mm512_store_si512(qtile + r * D + d, v);
      }
    // S = Q K^T, four 16-token tiles at a time (C 0-3), A: this head's rows, B: K^T tiles
    for (int64_t u0 = 0; u0 < n16; u0 += 4) {
      const int64_t nu = std::min<int64_t>(4, n16 - u0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t ks = 0; ks < D / 32; ++ks) {
        _tile_loadd(4, qtile + ks * 32, D * 2);
        auto b = [&](int64_t u) { return kt + ((u0 + u) * (D / 32) + ks) * 512; };
        _tile_loadd(5, b(0), 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nu > 1) { _tile_loadd(6, b(1), 64); _tile_dpbf16ps(1, 4, 6); }
        if (nu > 2) { _tile_loadd(5, b(2), 64); _tile_dpbf16ps(2, 4, 5); }
        if (nu > 3) { _tile_loadd(6, b(3), 64); _tile_dpbf16ps(3, 4, 6); }
      }
      float* s = S + u0 * kTile;
      _tile_stored(0, s, S_ld * 4);
      if (nu > 1) _tile_stored(1, s + 16, S_ld * 4);
      if (nu > 2) _tile_stored(2, s + 32, S_ld * 4);
      if (nu > 3) _tile_stored(3, s + 48, S_ld * 4);
      asm volatile("" : : : "memory");  // tile stores are memory writes (see AmxTiles)
    }
    // softmax per row over its own causal length; p in bf16, zeros past the length
    for (int64_t r = 0; r < kTile; ++r) {
      uint16_t* p = P + r * P_ld;
      if (r >= n_rows) {
        std::memset(p, 0, P_ld * sizeof(uint16_t));
        continue;
      }
      const float* s = S + r * S_ld;
      const int64_t T = T_first + r;
      Vf top = set1(-std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < T; t += kW) top = _mm512_mask_max_ps(top, lanes(T - t), top, load(s + t));
      const Vf scale = set1(score_scale), mx = set1(reduce_max(top) * score_scale);  // scale > 0
      Vf sum = set1(0.f);
      for (int64_t t = 0; t < P_ld; t += kW) {
        const __mmask16 seen = t < T ? lanes(T - t) : 0;
        const Vf x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(seen, s + t), scale, mx);
        const Vf e = _mm512_maskz_mov_ps(seen, exp_nonpositive(x));
        sum = add(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
      }
      inv_sum[r] = out_scale / reduce_add(sum);
    }
    // O = P V per 64 dims (C 0-3), A: 16 rows x 32 tokens of p, B: staged V slices
    for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t w = 0; w < n32; ++w) {
        _tile_loadd(4, P + w * 32, P_ld * 2);
        const uint16_t* b = vp + (w * (D / 16) + c0) * 512;
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, b + 1536, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, o + c0 * 16, D * 4);
      _tile_stored(1, o + c0 * 16 + 16, D * 4);
      _tile_stored(2, o + c0 * 16 + 32, D * 4);
      _tile_stored(3, o + c0 * 16 + 48, D * 4);
      asm volatile("" : : : "memory");
    }
    for (int64_t r = 0; r < n_rows; ++r) {
      o_t* dst = out + ((row0 + r) * Hq + hq) * D;
      for (int64_t d = 0; d < D; d += kW) store(dst + d, mul(load(o + r * D + d), set1(inv_sum[r])));
    }
  }
}

void AmxPrefill::run() {
  if (seqs_.empty()) return;
  {
    const int64_t n = static_cast<int64_t>(stage_tasks_.size());
    TaskQueue queue(n);
    at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
      for (int64_t i = queue.claim(); i >= 0; i = queue.claim()) stage(stage_tasks_[i]);
    });
  }
  const int64_t n = static_cast<int64_t>(row_tasks_.size());
  TaskQueue queue(n);
  QKILN_DISPATCH(out_.scalar_type(), "qkiln_attn_amx_o", [&] {
    scalar_t* op = out_.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
      AmxTiles tiles;
      for (int64_t i = queue.claim(); i >= 0; i = queue.claim()) rows(row_tasks_[i], op);
    });
  });
}

// Read per call, so a process can compare the two kernels (bench/, tests).
bool amx_prefill_ready() { return amx_bf16_ready() && !switched_off("QKILN_AMX_PREFILL"); }

#else

void AmxPrefill::widen_row(bool, int64_t, uint16_t*) const {}
void AmxPrefill::stage(const Task&) {}
template <typename o_t>
void AmxPrefill::rows(const Task&, o_t*) const {}
void AmxPrefill::run() {}
bool amx_prefill_ready() { return false; }

#endif

}  // namespace attention_detail
