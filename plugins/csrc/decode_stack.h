// The decode stack: every decoder layer of a decode-only step in one native call (decode_stack.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

#include "qkiln_cpu.h"

// A quantized linear in one of the native layouts (plugins/cpu_native.py packs them): int4
// (packed nibbles, tiled fp32 scales, zero term) or int8 (row-major weight, fp32 scales).
// Validated once at construction; the kernels' views (Int4Gemv / Int8Gemv) point into the tensors
// held here, which copies share.
class NativeLinear {
 public:
  NativeLinear(int64_t bits, at::Tensor weight, at::Tensor scales, at::Tensor zero_term,
               c10::optional<at::Tensor> bias, int64_t group_size, int64_t in_features,
               int64_t out_features);

  void prepare(const at::Tensor& x, GemvActs& acts) const;
  void tiles(const GemvActs& acts, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const;
  int64_t num_tiles() const { return int4_ ? int4_->num_tiles : int8_->num_tiles; }
  int64_t out_features() const { return out_features_; }

 private:
  at::Tensor weight_, scales_, zero_term_, bias_f32_;
  int64_t out_features_;
  std::optional<Int4Gemv> int4_;
  std::optional<Int8Gemv> int8_;
};

// One Llama-family decoder layer as the serving model fuses it (runtime/model.py, fusion.py):
// q/k/v as one linear, gate/up as one linear, float, fp8 or int4 paged K/V caches.
struct StackLayer {
  NativeLinear qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;  // RMSNorm weights [hidden], the activation dtype
  at::Tensor k_cache, v_cache;       // [blocks, block_size, Hkv, D] (int4: D / 2 bytes)
  KVParams kv;                       // the cache's scales (fp8) or group scales / minimums (int4)
  at::Tensor k_offset;  // fp32 [Hkv, D] subtracted from keys before the write, or undefined
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
