// The decode stack: every decoder layer of a decode-only step in one native call (decode_stack.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

// A quantized linear in one of the native layouts (plugins/cpu_native.py packs them): int4
// (packed nibbles, tiled fp32 scales, zero term) or int8 (row-major weight, fp32 scales).
struct NativeLinear {
  int64_t bits;  // 4 or 8
  at::Tensor weight, scales, zero_term;  // zero_term: int4 only (undefined for int8)
  c10::optional<at::Tensor> bias;
  int64_t group_size, out_features;  // group_size: int4 only

  at::Tensor operator()(const at::Tensor& x) const;  // x [M, in] -> [M, out_features]
};

// One Llama-family decoder layer as the serving model fuses it (runtime/model.py, fusion.py):
// q/k/v as one linear, gate/up as one linear, float paged K/V caches without scales.
struct StackLayer {
  NativeLinear qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;  // RMSNorm weights [hidden], the activation dtype
  at::Tensor k_cache, v_cache;       // [blocks, block_size, Hkv, D]
};

class DecodeStack {
 public:
  DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps);

  // Embeddings h [M, hidden] (one row per sequence, all decodes) -> hidden after the final norm.
  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<StackLayer> layers_;
  at::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};
