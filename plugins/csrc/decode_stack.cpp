// The CPU decode stack: one native call runs every decoder layer of a decode-only step.
//
// Why: at batch 1 a SmolLM2-135M step is ~300 small kernel calls (30 layers x norm, qkv, RoPE,
// cache write, attention, o, add + norm, gate/up, SiLU-and-mul, down); through Python modules and
// the dispatcher each cost ~10 us on top of the kernel, a third of the step. Here the same
// kernels are called directly, in the same order, on the same dtypes, so the result is
// bit-identical to runtime/model.py's fused path (the test compares them exactly):
//
//     residual = h; h = rms_norm(h)                                  (first layer)
//     per layer:  [fused_add_rms_norm(h, residual)]                 (after the first)
//                 qkv = qkv_proj(h); rope(q, k in qkv); cache_write(k, v)
//                 h = o_proj(paged_attention(q))
//                 fused_add_rms_norm(h, residual); h = down(silu_and_mul(gate_up(h)))
//     fused_add_rms_norm(h, residual, final_norm)
//     logits = head(h)        (logits(): a native lm_head, its tiles split like a layer linear's,
//                              each thread then taking the argmax of the columns it wrote)
//
// Threads: ONE OpenMP parallel region for the whole step, not a fork/join per kernel (~150 per
// step). Each linear's output tiles and the attention tasks are split evenly over the threads;
// the small ops and the activation preparation run on thread 0; a barrier separates dependent
// phases. A tile's result does not depend on the partition, so this stays bit-identical to the
// per-call path. Nothing may throw out of the region: every step runs guarded, the first error is
// rethrown after it.
//
// runtime/decode_stack.py decides when a model and a step qualify (native linears everywhere,
// caches the native attention serves, decodes only; more than 16 rows: decode_stack_rows.cpp,
// int8 activations or dense weights) and builds this object once per engine.

#include "decode_stack_internal.h"

#include <omp.h>

#include <cmath>
#include <cstring>

NativeLinear::NativeLinear(int64_t bits, at::Tensor weight, at::Tensor scales,
                           at::Tensor zero_term, c10::optional<at::Tensor> bias,
                           int64_t group_size, int64_t in_features, int64_t out_features)
    : weight_(std::move(weight)), scales_(std::move(scales)), zero_term_(std::move(zero_term)),
      out_features_(out_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "NativeLinear: bits must be 4 or 8");
  if (bias.has_value()) bias_ = *bias, bias_f32_ = bias->to(at::kFloat).contiguous();
  const float* b = bias_f32_.defined() ? bias_f32_.data_ptr<float>() : nullptr;
  if (bits == 4) {
    TORCH_CHECK(zero_term_.defined(), "NativeLinear: int4 needs its zero term");
    int4_.emplace(weight_, scales_, zero_term_, b, group_size, in_features, out_features);
  } else {
    int8_.emplace(weight_, scales_, b);
    TORCH_CHECK(int8_->K == in_features && int8_->out_features == out_features,
                "NativeLinear: int8 weight shape does not match in/out features");
  }
}

void NativeLinear::add_int8_activations(at::Tensor packed, at::Tensor scales, at::Tensor zero_scales,
                                        int64_t group_size) {
  w4a8_packed_ = std::move(packed), w4a8_scales_ = std::move(scales);
  w4a8_zero_scales_ = std::move(zero_scales);
  const float* b = bias_f32_.defined() ? bias_f32_.data_ptr<float>() : nullptr;
  w4a8_.emplace(w4a8_packed_, w4a8_scales_, w4a8_zero_scales_, b, group_size, out_features_);
  TORCH_CHECK(w4a8_->K == (int4_ ? int4_->K : int8_->K),
              "NativeLinear: the int8-activation layout's in_features do not match");
}

void NativeLinear::use_int8_activations() {
  TORCH_CHECK(in_features() % 32 == 0, "NativeLinear: int8 activations need in_features % 32 == 0");
  if (int4_) int4_->int8_activations = true;
  else int8_->int8_activations = true;
}

void NativeLinear::prepare(const at::Tensor& x, GemvActs& acts) const {
  if (int4_) int4_->prepare(x, acts);
  else int8_->prepare(x, acts);
}

void NativeLinear::tiles(const GemvActs& acts, int64_t M, int64_t begin, int64_t end,
                         at::Tensor& y) const {
  if (int4_) int4_->tiles(acts, M, begin, end, y);
  else int8_->tiles(acts, M, begin, end, y);
}

DecodeStack::DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, int64_t max_gemv_rows)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), max_gemv_rows_(max_gemv_rows), eps_(eps),
      scale_(1.0 / std::sqrt(static_cast<double>(head_dim))) {
  TORCH_CHECK(!layers_.empty() && num_heads % num_kv_heads == 0 && head_dim % 16 == 0,
              "DecodeStack: needs layers, Hq % Hkv == 0 and head_dim % 16 == 0");
  const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t hidden = final_norm_.size(0), gate_up = layers_.front().gate_up.out_features();
  for (const StackLayer& l : layers_) {
    TORCH_CHECK(l.qkv.out_features() == qkv_width && l.o.out_features() == hidden &&
                    l.gate_up.out_features() == gate_up && gate_up % 2 == 0 &&
                    l.down.out_features() == hidden,
                "DecodeStack: linear shapes do not match the attention geometry");
    TORCH_CHECK(l.k_cache.dim() == 4 && l.k_cache.size(2) == num_kv_heads &&
                    cache_head_dim(l.k_cache) == head_dim,
                "DecodeStack: caches must be [blocks, block_size, Hkv, D]");
  }
  int8_activations_ = dense_rows_ = true;
  for (const StackLayer& l : layers_)
    for (const NativeLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      int8_activations_ = int8_activations_ && lin->int8_activations();
      dense_rows_ = dense_rows_ && lin->has_dense();
    }
}

void DecodeStack::set_inputs(at::Tensor embedding, at::Tensor cos, at::Tensor signed_sin) {
  const auto dtype = final_norm_.scalar_type();
  TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous() && embedding.scalar_type() == dtype &&
                  embedding.size(1) == final_norm_.size(0),
              "DecodeStack.set_inputs: the embedding must be contiguous [vocab, hidden] in the norms' dtype");
  for (const at::Tensor* t : {&cos, &signed_sin})
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == dtype &&
                    t->size(1) == 1 && t->size(2) == head_dim_ && t->sizes() == cos.sizes(),
                "DecodeStack.set_inputs: RoPE tables must be contiguous [max_positions, 1, head_dim]");
  embedding_ = std::move(embedding), cos_ = std::move(cos), signed_sin_ = std::move(signed_sin);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> DecodeStack::inputs(const at::Tensor& ids,
                                                                   const at::Tensor& positions) const {
  TORCH_CHECK(embedding_.defined(), "DecodeStack.inputs: no tables (set_inputs)");
  TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && ids.size(0) == positions.size(0) &&
                  ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  ids.is_contiguous() && positions.is_contiguous(),
              "DecodeStack.inputs: ids and positions must be contiguous int64 [M]");
  const int64_t M = ids.size(0), H = embedding_.size(1), D = head_dim_;
  const int64_t row_bytes = H * embedding_.element_size(), rope_bytes = D * cos_.element_size();
  at::Tensor h = at::empty({M, H}, embedding_.options());
  at::Tensor cos = at::empty({M, 1, D}, cos_.options()), sin = at::empty({M, 1, D}, cos_.options());
  const int64_t *id = ids.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
  const auto* table = static_cast<const char*>(embedding_.data_ptr());
  const auto *cos_table = static_cast<const char*>(cos_.data_ptr()),
             *sin_table = static_cast<const char*>(signed_sin_.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(id[m] >= 0 && id[m] < embedding_.size(0), "DecodeStack.inputs: token id ", id[m],
                " is not in [0, ", embedding_.size(0), ")");
    TORCH_CHECK(pos[m] >= 0 && pos[m] < cos_.size(0), "DecodeStack.inputs: position ", pos[m],
                " is not in [0, ", cos_.size(0), ")");
    std::memcpy(static_cast<char*>(h.data_ptr()) + m * row_bytes, table + id[m] * row_bytes, row_bytes);
    std::memcpy(static_cast<char*>(cos.data_ptr()) + m * rope_bytes, cos_table + pos[m] * rope_bytes, rope_bytes);
    std::memcpy(static_cast<char*>(sin.data_ptr()) + m * rope_bytes, sin_table + pos[m] * rope_bytes, rope_bytes);
  }
  return {h, cos, sin};
}

void DecodeStack::set_head(NativeLinear head) {
  TORCH_CHECK(head.in_features() == final_norm_.size(0),
              "DecodeStack.set_head: the head's in_features must be the hidden size");
  head_.emplace(std::move(head));
}

namespace decode_stack_detail {

// Layer l's key and value rows into its caches at `slots`, the key offset (if any) taken off
// in fp32 first, as kv_cache.offset_key does.
void write_kv(const StackLayer& l, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  at::Tensor k_cache = l.k_cache, v_cache = l.v_cache;
  const at::Tensor key = l.k_offset.defined() ? at::sub(k.to(at::kFloat), l.k_offset) : k;
  cache_write(key, v, k_cache, v_cache, slots, l.kv);
}

}  // namespace decode_stack_detail

using namespace decode_stack_detail;

at::Tensor DecodeStack::forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(0) == seq_lens.size(0) &&
                  h.size(1) == final_norm_.size(0),
              "DecodeStack.forward: h must be contiguous [num_seqs, hidden] (decodes only)");
  if (h.size(0) > max_gemv_rows_) {
    TORCH_CHECK(int8_activations_ || dense_rows_, "DecodeStack.forward: more than ", max_gemv_rows_,
                " rows need every linear's int8-activation layout or dense form");
    return int8_activations_
               ? forward_many_rows(h, cos, signed_sin, slot_mapping, block_tables, seq_lens, query_start_loc)
               : forward_dense_rows(h, cos, signed_sin, slot_mapping, block_tables, seq_lens, query_start_loc);
  }
  return forward_gemv(h, cos, signed_sin, slot_mapping, block_tables, seq_lens, query_start_loc,
                      nullptr, nullptr);
}

std::tuple<at::Tensor, at::Tensor> DecodeStack::logits(
    at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, bool argmax) const {
  TORCH_CHECK(head_.has_value(), "DecodeStack.logits: no head (set_head)");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(0) == seq_lens.size(0) &&
                  h.size(1) == final_norm_.size(0) && h.size(0) <= max_gemv_rows_,
              "DecodeStack.logits: h must be contiguous [num_seqs, hidden], decodes only, at most ",
              max_gemv_rows_, " rows");
  at::Tensor logits = at::empty({h.size(0), head_->out_features()}, h.options()), token_ids;
  if (argmax) token_ids = at::empty({h.size(0)}, h.options().dtype(at::kLong));
  forward_gemv(h, cos, signed_sin, slot_mapping, block_tables, seq_lens, query_start_loc, &logits,
               argmax ? &token_ids : nullptr);
  return {logits, token_ids};
}

at::Tensor DecodeStack::forward_gemv(at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
                                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                     at::Tensor* logits, at::Tensor* token_ids) const {
  const int64_t M = h.size(0), Hq = num_heads_, Hkv = num_kv_heads_;
  StepBuffers buf(h, Hq, Hkv, head_dim_, layers_.front().gate_up.out_features());
  auto& [residual, hidden, qkv, attn, gate_up, q, k, v, qkv2d, attn2d] = buf;
  GemvActs acts;                          // the current linear's input, prepared by thread 0
  std::optional<AttentionTasks> tasks;    // the current layer's, made by thread 0
  FirstError errors;
  const int threads = std::max(1, at::get_num_threads());
  std::vector<ArgmaxSpan> argmax_parts(token_ids ? M * threads : 0);  // [row, thread]

#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    auto guarded = [&](auto&& body) { errors.guard(body); };
    auto serial = [&](auto&& body) {  // thread 0 runs it; everyone sees its writes after
      if (tid == 0) guarded(body);
#pragma omp barrier
    };
    auto linear = [&](const NativeLinear& lin, at::Tensor& y) {
      const auto [begin, end] = share(lin.num_tiles(), tid, n);
      guarded([&] { lin.tiles(acts, M, begin, end, y); });
#pragma omp barrier
    };
    at::Tensor x;  // thread 0's view of the current norm output
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      serial([&] {
        if (i == 0) {
          x = rms_norm(h, l.input_norm, eps_);
        } else {
          fused_add_rms_norm(hidden, residual, l.input_norm, eps_);
          x = hidden;
        }
        l.qkv.prepare(x, acts);
      });
      linear(l.qkv, qkv2d);
      serial([&] {
        rotary_embedding(qkv, cos, signed_sin, Hq + Hkv);
        write_kv(l, k, v, slot_mapping);
        tasks.emplace(q, l.k_cache, l.v_cache, block_tables, seq_lens, query_start_loc, scale_,
                      attn, l.kv);
      });
      if (tasks) {
        const auto [begin, end] = share(tasks->size(), tid, n);
        TaskStream mine(begin, end);
        guarded([&] { tasks->run(mine); });
      }
#pragma omp barrier
      serial([&] {
        if (tasks) tasks->merge_partials();  // rows whose context was split (few long decodes)
        l.o.prepare(attn2d, acts);
      });
      linear(l.o, hidden);
      serial([&] {
        fused_add_rms_norm(hidden, residual, l.post_norm, eps_);
        l.gate_up.prepare(hidden, acts);
      });
      linear(l.gate_up, gate_up);
      serial([&] { l.down.prepare(silu_and_mul(gate_up), acts); });
      linear(l.down, hidden);
    }  // after an error the remaining layers still run (on garbage) so no thread skips a barrier
    if (logits) {
      serial([&] {
        fused_add_rms_norm(hidden, residual, final_norm_, eps_);
        head_->prepare(hidden, acts);
      });
      const auto [begin, end] = share(head_->num_tiles(), tid, n);
      guarded([&] {
        head_->tiles(acts, M, begin, end, *logits);
        if (token_ids) {  // this thread's columns, which it just wrote
          const int64_t first = begin * kGemvTileRows, last = std::min(end * kGemvTileRows, logits->size(1));
          for (int64_t m = 0; m < M; ++m) argmax_parts[m * n + tid] = argmax_span(*logits, m, first, last);
        }
      });
#pragma omp barrier
      if (token_ids)
        serial([&] {
          int64_t* out = token_ids->data_ptr<int64_t>();
          for (int64_t m = 0; m < M; ++m) {
            ArgmaxSpan best;
            for (int t = 0; t < n; ++t) best.merge(argmax_parts[m * n + t]);
            out[m] = best.index;
          }
        });
    }
  }
  errors.rethrow();
  if (!logits) fused_add_rms_norm(hidden, residual, final_norm_, eps_);
  return hidden;
}
