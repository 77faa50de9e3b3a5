// The decode stack's forms for steps of more rows than the GEMV kernels take (decode_stack.cpp
// holds the class and the GEMV form; runtime/decode_stack.py says when each applies). Each computes
// what the Python layer loop computes for such a step, bit for bit: int8 activations (opt-in)
// through the int8-activation GEMM, else (exact) the bf16 GEMM on the dequantized weights.

#include <omp.h>

#include <deque>

#include "decode_stack_internal.h"

using namespace decode_stack_detail;

// ---- steps of many rows (int8 activations) --------------------------------------------------------
// The same layer loop for more rows than the GEMV kernels take: each linear is the
// int8-activation GEMM of the Python path (W4A8Gemm: the same quantization and tasks, so the
// same bits), and every row-wise op (norms, RoPE, cache write, SiLU-and-mul, the activation
// quantization) runs on each thread's own share of the rows instead of on thread 0, which at 64
// rows would leave the other threads waiting. Barriers separate the phases as in the GEMV form.
at::Tensor DecodeStack::forward_many_rows(at::Tensor h, const at::Tensor& cos,
                                          const at::Tensor& signed_sin,
                                          const at::Tensor& slot_mapping,
                                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                          const at::Tensor& query_start_loc) const {
  const int64_t M = h.size(0), Hq = num_heads_, Hkv = num_kv_heads_;
  StepBuffers buf(h, Hq, Hkv, head_dim_, layers_.front().gate_up.out_features());
  auto& [residual, hidden, qkv, attn, gate_up, q, k, v, qkv2d, attn2d] = buf;
  Int8Rows acts;  // the current linear's quantized input; sized here for the largest
  std::vector<AttentionTasks> tasks;  // per layer, validated before the region
  tasks.reserve(layers_.size());
  // Per layer: its four linears' tasks, then its attention's. A deque keeps each queue where it
  // was made (TaskQueue cannot move) but not next to the one before it, so always index it:
  // pointer arithmetic from a layer's first queue ran past the deque's 32-queue chunks at layer 6
  // and claimed tasks from whatever lay there (a segfault at 64 decode rows, SmolLM2).
  std::deque<TaskQueue> queues;
  for (const StackLayer& l : layers_) {
    for (const NativeLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      lin->int8_activations()->size(M, acts);
      queues.emplace_back(lin->int8_activations()->num_tasks(M));
    }
    tasks.emplace_back(q, l.k_cache, l.v_cache, block_tables, seq_lens, query_start_loc, scale_, attn, l.kv);
    queues.emplace_back(tasks.back().size());
  }
  FirstError errors;
  const int threads = std::max(1, at::get_num_threads());

#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    auto guarded = [&](auto&& body) { errors.guard(body); };
    // InferenceMode is per thread: the workers' ATen ops (views, copies, the small ops' outputs)
    // on the step's inference tensors need it as the calling thread has it.
    c10::InferenceMode inference_mode;
    const auto [r0, r1] = share(M, tid, n);  // this thread's rows
    auto mine = [&](const at::Tensor& t) { return t.narrow(0, r0, r1 - r0); };
    // This thread's rows of x into the int8 activations of `lin`, then everyone's.
    auto quantize = [&](const NativeLinear& lin, const at::Tensor& x_rows) {
      if (r1 > r0) guarded([&] { lin.int8_activations()->quantize(x_rows, r0, acts); });
#pragma omp barrier
    };
    auto linear = [&](const NativeLinear& lin, TaskQueue& queue, at::Tensor& y) {
      TaskStream mine(queue);
      guarded([&] { lin.int8_activations()->run(acts, M, mine, y); });
#pragma omp barrier
    };
    at::Tensor my_hidden = mine(hidden), my_residual = mine(residual), my_qkv = mine(qkv);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      if (r1 > r0)
        guarded([&] {
          if (i == 0) my_hidden.copy_(rms_norm(my_residual, l.input_norm, eps_));
          else fused_add_rms_norm(my_hidden, my_residual, l.input_norm, eps_);
        });
      // this layer's queues: 0 qkv, 1 o, 2 gate_up, 3 down, 4 attention
      auto queue = [&](int j) -> TaskQueue& { return queues[5 * i + j]; };
      quantize(l.qkv, my_hidden);
      linear(l.qkv, queue(0), qkv2d);
      if (r1 > r0)
        guarded([&] {
          rotary_embedding(my_qkv, mine(cos), mine(signed_sin), Hq + Hkv);
          write_kv(l, mine(k), mine(v), mine(slot_mapping));
        });
#pragma omp barrier
      {
        TaskStream attention(queue(4));
        guarded([&] { tasks[i].run(attention); });
      }
#pragma omp barrier
      quantize(l.o, mine(attn2d));
      linear(l.o, queue(1), hidden);
      if (r1 > r0) guarded([&] { fused_add_rms_norm(my_hidden, my_residual, l.post_norm, eps_); });
      quantize(l.gate_up, my_hidden);
      linear(l.gate_up, queue(2), gate_up);
      at::Tensor act;
      if (r1 > r0) guarded([&] { act = silu_and_mul(mine(gate_up)); });
      quantize(l.down, act);
      linear(l.down, queue(3), hidden);
    }  // after an error the remaining layers still run (on garbage) so no thread skips a barrier
  }
  errors.rethrow();
  fused_add_rms_norm(hidden, residual, final_norm_, eps_);
  return hidden;
}

void NativeLinear::add_dense(at::Tensor weight) {
  const int64_t K = in_features();
  if (weight.scalar_type() == at::kInt) {  // qkiln's bf16 panels (cpu_gemm_bf16.cpp)
    TORCH_CHECK(Bf16Gemm(weight, out_features_).K == K,
                "NativeLinear.add_dense: the panels' in_features do not match");
  } else {  // bf16 (plain or oneDNN-packed), or widened to fp32 (packed_weights.pack_dense)
    TORCH_CHECK((weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) &&
                    weight.dim() == 2 && weight.size(0) == out_features_ && weight.size(1) == K,
                "NativeLinear.add_dense: needs bf16 panels or the bf16 / fp32 weight "
                "[out_features, in_features]");
  }
  dense_ = std::move(weight);
}

void NativeLinear::add_amx_codes(c10::optional<at::Tensor> tables) {
  TORCH_CHECK(tables.has_value() == bool(int4_),
              "NativeLinear.add_amx_codes: int4 codes need their tables, int8 codes none");
  if (int4_) {
    amx_tables_ = *tables;
    amx_ = CodesAmxGemm::int4(weight_, amx_tables_, int4_->G, int4_->K, out_features_);
  } else {
    amx_ = CodesAmxGemm::int8(weight_);
  }
}

namespace {

// bf16 rows [M, in] @ weight^T, the call cpu_linear.dense_linear makes for a oneDNN-packed
// (MkldnnCPU), plain or fp32-widened weight: oneDNN's linear or at::linear.
at::Tensor onednn_gemm(const at::Tensor& rows, const at::Tensor& weight) {
  if (weight.scalar_type() == at::kFloat) return at::linear(rows.to(at::kFloat), weight).to(at::kBFloat16);
  if (!weight.is_mkldnn()) return at::linear(rows, weight);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{rows, weight, c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

at::Tensor NativeLinear::dense(const at::Tensor& x) const {
  const at::Tensor rows = x.to(at::kBFloat16);
  const bool panels = dense_.defined() && dense_.scalar_type() == at::kInt;  // else oneDNN or plain
  at::Tensor out = amx_    ? (*amx_)(rows)
                   : panels ? bf16_gemm(rows, dense_, out_features_)
                            : onednn_gemm(rows, dense_);
  if (int8_) {  // per-channel scales commute with the GEMM; in place unless a bias follows
    if (bias_.defined()) out = out * scales_;
    else scale_columns_(out, scales_);
  }
  if (bias_.defined()) out = out + bias_;
  return out.to(x.scalar_type());
}

// ---- exact steps of many rows (dense weights) -----------------------------------------------------
// Each linear is the Python path's bf16 GEMM on its dequantized weight (NativeLinear::dense:
// qkiln's panels or oneDNN), which splits over the threads itself, so the GEMMs run between
// parallel regions rather than in one: per layer, a region for the input norm, one for RoPE + cache write then (after a barrier)
// the attention tasks, one for the post-attention norm and one for SiLU-and-mul, every row-wise op
// on each thread's share of the rows. What this saves over the Python layer loop is the modules,
// the custom-op dispatch and the single-threaded small ops around 120 GEMMs a step.
at::Tensor DecodeStack::forward_dense_rows(at::Tensor h, const at::Tensor& cos,
                                           const at::Tensor& signed_sin,
                                           const at::Tensor& slot_mapping,
                                           const at::Tensor& block_tables,
                                           const at::Tensor& seq_lens,
                                           const at::Tensor& query_start_loc) const {
  const int64_t M = h.size(0), Hq = num_heads_, Hkv = num_kv_heads_, D = head_dim_;
  at::Tensor residual = h, hidden = at::empty_like(h);
  at::Tensor attn = at::empty({M, Hq, D}, h.options()), attn2d = attn.view({M, Hq * D});
  at::Tensor act = at::empty({M, layers_.front().gate_up.out_features() / 2}, h.options());
  FirstError errors;
  const int threads = std::max(1, at::get_num_threads());
  // body(thread id, thread count) on every thread of one region, then the first error raised.
  auto each_thread = [&](auto&& body) {
#pragma omp parallel num_threads(threads)
    {
      // InferenceMode is per thread: the workers' ATen ops on the step's inference tensors need it.
      c10::InferenceMode inference_mode;
      body(omp_get_thread_num(), omp_get_num_threads());
    }
    errors.rethrow();
  };
  auto row_op = [&](auto&& op) {  // op(first row, row count) on each thread's nonempty share
    each_thread([&](int tid, int n) {
      const auto [r0, r1] = share(M, tid, n);
      if (r1 > r0) errors.guard([&] { op(r0, r1 - r0); });
    });
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    const StackLayer& l = layers_[i];
    row_op([&](int64_t r0, int64_t rows) {
      at::Tensor mine = hidden.narrow(0, r0, rows), res = residual.narrow(0, r0, rows);
      if (i == 0) mine.copy_(rms_norm(res, l.input_norm, eps_));
      else fused_add_rms_norm(mine, res, l.input_norm, eps_);
    });
    const at::Tensor qkv = l.qkv.dense(hidden).view({M, Hq + 2 * Hkv, D});
    const AttentionTasks tasks(qkv.narrow(1, 0, Hq), l.k_cache, l.v_cache, block_tables, seq_lens,
                               query_start_loc, scale_, attn, l.kv);
    TaskQueue queue(tasks.size());
    each_thread([&](int tid, int n) {
      const auto [r0, r1] = share(M, tid, n);
      if (r1 > r0)
        errors.guard([&] {
          at::Tensor mine = qkv.narrow(0, r0, r1 - r0);
          rotary_embedding(mine, cos.narrow(0, r0, r1 - r0), signed_sin.narrow(0, r0, r1 - r0), Hq + Hkv);
          write_kv(l, mine.narrow(1, Hq, Hkv), mine.narrow(1, Hq + Hkv, Hkv), slot_mapping.narrow(0, r0, r1 - r0));
        });
#pragma omp barrier
      TaskStream mine(queue);
      errors.guard([&] { tasks.run(mine); });
    });
    hidden = l.o.dense(attn2d);
    row_op([&](int64_t r0, int64_t rows) {
      at::Tensor mine = hidden.narrow(0, r0, rows), res = residual.narrow(0, r0, rows);
      fused_add_rms_norm(mine, res, l.post_norm, eps_);
    });
    const at::Tensor gate_up = l.gate_up.dense(hidden);
    row_op([&](int64_t r0, int64_t rows) {
      at::Tensor mine = act.narrow(0, r0, rows);
      silu_and_mul_out(gate_up.narrow(0, r0, rows), mine);
    });
    hidden = l.down.dense(act);
  }
  fused_add_rms_norm(hidden, residual, final_norm_, eps_);
  return hidden;
}
