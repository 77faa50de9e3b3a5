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
// Where the kernels live: this file splits a step into tasks and dispatches them (AttentionTasks)
// and widens quantized prefixes for prefill blocks (serve_*_prefix); decode_heads_bf16 and the fp8
// byte tables: cpu_attention_decode_bf16.cpp; decode_head_int4 and dequantize_int4_row:
// cpu_attention_int4.cpp; decode_head, decode_head_tiled, prefill_block_tiled (any ISA):
// cpu_attention_portable.h; decode_group_bf16: cpu_attention_decode_avx2.cpp; prefill_block_bf16:
// cpu_attention_prefill.cpp; AmxPrefill: cpu_attention_prefill_amx.cpp.

#include "attention_common.h"
#include "cpu_attention_portable.h"
#include "qkiln_cpu.h"

using namespace attention_detail;

namespace {

#ifdef QKILN_ATTENTION_BF16
// A prefill block over a quantized cache, served as a bf16 one: one kv head's K and V for tokens
// [0, T) widened to bf16 rows in thread-local buffers (widen(k_rows, v_rows) writes them, [T, D]
// each), then served as a cache of one block and one head through serve(decode, k, v, table):
// prefill_block_bf16, with `scale` for the scores and `out_scale` for the output. Each block
// widens its own prefix (a few instructions per element against the block's rows x group dot
// products over it).
template <int64_t D, typename Widen, typename Serve>
void serve_as_bf16_rows(const Decode& a, int64_t T, float scale, float out_scale, Widen&& widen, Serve&& serve) {
  thread_local std::vector<c10::BFloat16> k_rows, v_rows;  // [T, D]
  if (static_cast<int64_t>(k_rows.size()) < T * D) k_rows.resize(T * D), v_rows.resize(T * D);
  widen(k_rows.data(), v_rows.data());
  static const int32_t first_block = 0;
  const Decode one{&first_block, 1, T, 1, D, a.group, scale, out_scale};
  serve(one, k_rows.data(), v_rows.data(), &first_block);
}

// fp8: rows through decode_heads_bf16's byte tables, in element order (widen_fp8_rows), served
// with the head's scales. Before, fp8 prefill rows went one at a time through decode_heads_bf16,
// which re-reads the prefix for every row: same-process A/B on the AMX Xeon host, 8 prompts x 128
// tokens, 30 layers: 119.0 -> 104.0 and 98.8 -> 89.0 ms (bf16, tiled against row by row in the same
// runs: 87.5 -> 76.8, 107.3 -> 96.8).
template <int NP, typename Serve>
void serve_fp8_prefix(const Decode& a, const c10::Float8_e4m3fn* k_head, const c10::Float8_e4m3fn* v_head,
                      const int32_t* table, int64_t T, float k_scale, float v_scale, Serve&& serve) {
  const int64_t row_stride = a.num_kv_heads * NP * 32;
  auto widen = [&](c10::BFloat16* k_rows, c10::BFloat16* v_rows) {
    widen_fp8_rows<NP>(k_head, row_stride, table, a.block_size, T, k_rows);
    widen_fp8_rows<NP>(v_head, row_stride, table, a.block_size, T, v_rows);
  };
  serve_as_bf16_rows<NP * 32>(a, T, a.scale * k_scale * kRowUnit<c10::Float8_e4m3fn>,
                              v_scale * kRowUnit<c10::Float8_e4m3fn>, widen, serve);
}

// int4: rows dequantized and rounded to bf16 (int4_row_as_bf16), as AmxPrefill stages them. Before, int4 prefill rows
// went one at a time through decode_head_int4, each row reading and widening its whole prefix again.
template <int NP, typename Serve>
void serve_int4_prefix(const Decode& a, const Int4Rows& rows, int64_t T, Serve&& serve) {
  constexpr int64_t D = NP * 32;
  auto widen = [&](c10::BFloat16* k_rows, c10::BFloat16* v_rows) {
    int64_t slots[kW];
    for (int64_t t0 = 0; t0 < T; t0 += kW) {
      const int64_t n = std::min<int64_t>(kW, T - t0);
      tile_slots(rows.table, a.block_size, t0, n, 1, slots);
      for (int64_t i = 0; i < n; ++i) {
        const Int4Rows::Row k = rows.row(slots[i], false), v = rows.row(slots[i], true);
        int4_row_as_bf16(k.codes, k.scale, k.minimum, D, rows.group, k_rows + (t0 + i) * D);
        int4_row_as_bf16(v.codes, v.scale, v.minimum, D, rows.group, v_rows + (t0 + i) * D);
      }
    }
  };
  serve_as_bf16_rows<D>(a, T, a.scale, 1.f, widen, serve);
}
#else
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

// The step's metadata against the cache and the query, before any row is read or written: a
// scheduler bug or a malformed engine feed (compile/onnx_ort.py) is an error naming it, not a read
// past the cache or a write past `out`. O(sequences + their blocks): nothing beside a step.
void check_step_metadata(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, int64_t num_rows, int64_t num_blocks,
                         int64_t block_size) {
  const int64_t num_seqs = seq_lens.size(0), width = block_tables.size(1);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == num_rows, "paged_attention: query_start_loc must run from 0 to ",
              num_rows, " (the query's rows), got ", starts[0], " .. ", starts[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = starts[s + 1] - starts[s], len = lens[s];
    TORCH_CHECK(rows >= 0 && rows <= len && len <= width * block_size, "paged_attention: sequence ", s,
                " has ", rows, " query rows and context ", len, "; needs 0 <= rows <= context <= ",
                width * block_size, " (its block-table row)");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks, "paged_attention: sequence ",
                  s, " reads block ", tables[s * width + b], " (table entry ", b, "); the cache has ", num_blocks,
                  " blocks");
  }
}

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
  TORCH_CHECK(Hq % Hkv == 0, "paged_attention: ", Hq, " query heads cannot share ", Hkv,
              " kv heads (query heads must be a multiple of kv heads)");
  TORCH_CHECK(cache_head_dim(k_cache) == D && D % kW == 0, "paged_attention: query head_dim ", D,
              " must equal the cache's and be a multiple of ", kW);
  TORCH_CHECK(block_tables.dim() == 2 && query_start_loc.size(0) == num_seqs + 1 &&
                  block_tables.size(0) == num_seqs,
              "paged_attention: block_tables [S, B], seq_lens [S] and query_start_loc [S + 1] must agree on S");
  check_step_metadata(block_tables, seq_lens, query_start_loc, query.size(0), k_cache.size(0),
                      k_cache.size(1));
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

