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
//
// runtime/decode_stack.py decides when a model and a step qualify (native linears everywhere,
// float caches, decodes only, M <= 16) and builds this object once per engine.

#include "decode_stack.h"

#include <cmath>

#include "qkiln_cpu.h"

at::Tensor NativeLinear::operator()(const at::Tensor& x) const {
  if (bits == 4) return w4a16_gemm(x, weight, scales, zero_term, bias, group_size, out_features);
  return w8a16_gemm(x, weight, scales, bias);
}

DecodeStack::DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
      scale_(1.0 / std::sqrt(static_cast<double>(head_dim))) {
  TORCH_CHECK(!layers_.empty() && num_heads % num_kv_heads == 0 && head_dim % 16 == 0,
              "DecodeStack: needs layers, Hq % Hkv == 0 and head_dim % 16 == 0");
  const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
  for (const StackLayer& l : layers_) {
    TORCH_CHECK(l.qkv.out_features == qkv_width && l.o.out_features == final_norm_.size(0) &&
                    l.gate_up.out_features % 2 == 0 && l.down.out_features == final_norm_.size(0),
                "DecodeStack: linear shapes do not match the attention geometry");
    TORCH_CHECK(l.k_cache.dim() == 4 && l.k_cache.size(2) == num_kv_heads &&
                    l.k_cache.size(3) == head_dim,
                "DecodeStack: caches must be [blocks, block_size, Hkv, D]");
  }
}

at::Tensor DecodeStack::forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(0) == seq_lens.size(0),
              "DecodeStack.forward: h must be contiguous [num_seqs, hidden] (decodes only)");
  const int64_t M = h.size(0), Hq = num_heads_, Hkv = num_kv_heads_, D = head_dim_;
  at::Tensor residual = h;
  h = rms_norm(h, layers_.front().input_norm, eps_);
  bool first = true;
  for (const StackLayer& l : layers_) {
    if (!first) fused_add_rms_norm(h, residual, l.input_norm, eps_);
    first = false;
    at::Tensor qkv = l.qkv(h).view({M, Hq + 2 * Hkv, D});
    rotary_embedding(qkv, cos, signed_sin, Hq + Hkv);
    at::Tensor k = qkv.narrow(1, Hq, Hkv), v = qkv.narrow(1, Hq + Hkv, Hkv);
    at::Tensor k_cache = l.k_cache, v_cache = l.v_cache;
    cache_write(k, v, k_cache, v_cache, slot_mapping);
    at::Tensor attn = at::empty({M, Hq, D}, h.options());
    paged_attention(qkv.narrow(1, 0, Hq), k_cache, v_cache, block_tables, seq_lens,
                    query_start_loc, scale_, attn);
    h = l.o(attn.view({M, Hq * D}));
    fused_add_rms_norm(h, residual, l.post_norm, eps_);
    h = l.down(silu_and_mul(l.gate_up(h)));
  }
  fused_add_rms_norm(h, residual, final_norm_, eps_);
  return h;
}
