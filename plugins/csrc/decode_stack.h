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

  // Adds the int8-activation layout (plugins/packed_weights.py's W4A8Weight) that steps of many
  // rows compute with, as the Python path does above its GEMV row limit.
  void add_int8_activations(at::Tensor packed, at::Tensor scales, at::Tensor zero_scales,
                            int64_t group_size);
  // The GEMV rounds activations to int8 (Int4Gemv / Int8Gemv::int8_activations), as the Python
  // path does for a W4A16Weight / W8A16Weight with int8_activations (an int4 weight must be
  // packed for it).
  void use_int8_activations();
  // Adds the dense form exact steps of many rows compute with, as the Python path does above its
  // GEMV row limit (plugins/cpu_linear.py): the weight dequantized to bf16, in qkiln's panels
  // (int32, cpu_gemm_bf16.cpp), plain [out, in] or pre-packed for oneDNN (int8: the codes, the
  // per-channel scales applied to the product).
  void add_dense(at::Tensor weight);
  // Or, on AMX, the codes themselves through cpu_gemm_codes_amx.cpp (the dense copy's bits
  // without the copy): int4 with its lookup tables, int8 without.
  void add_amx_codes(c10::optional<at::Tensor> tables);
  // x [M, in] -> [M, out] in x's dtype through that dense form: the Python path's calls, so the
  // same bits. Called outside any parallel region (the GEMM splits over the threads itself).
  at::Tensor dense(const at::Tensor& x) const;
  bool has_dense() const { return dense_.defined() || amx_.has_value(); }

  void prepare(const at::Tensor& x, GemvActs& acts) const;
  void tiles(const GemvActs& acts, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const;
  int64_t num_tiles() const { return int4_ ? int4_->num_tiles : int8_->num_tiles; }
  int64_t out_features() const { return out_features_; }
  int64_t in_features() const { return int4_ ? int4_->K : int8_->K; }
  const W4A8Gemm* int8_activations() const { return w4a8_ ? &*w4a8_ : nullptr; }

 private:
  at::Tensor weight_, scales_, zero_term_, bias_, bias_f32_, dense_;
  at::Tensor w4a8_packed_, w4a8_scales_, w4a8_zero_scales_, amx_tables_;
  int64_t out_features_;
  std::optional<Int4Gemv> int4_;
  std::optional<Int8Gemv> int8_;
  std::optional<W4A8Gemm> w4a8_;
  std::optional<CodesAmxGemm> amx_;
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
  // max_gemv_rows: steps of up to this many rows run the GEMV kernels; larger ones need every
  // linear's int8-activation layout (int8_activations()) or its dense form (dense_rows()).
  DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps, int64_t max_gemv_rows);

  // Embeddings h [M, hidden] (one row per sequence, all decodes) -> hidden after the final norm.
  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc) const;

  // The token embedding [vocab, hidden] and the RoPE tables [max_positions, 1, head_dim] (cos and
  // signed sin, runtime/rope.py) that inputs() reads, all in the activation dtype.
  void set_inputs(at::Tensor embedding, at::Tensor cos, at::Tensor signed_sin);
  // A step's (h, cos, signed_sin) for forward / logits from its token ids and positions (int64
  // [M] each): rows of those tables, copied without a dispatcher call per op.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> inputs(const at::Tensor& ids,
                                                        const at::Tensor& positions) const;

  // The lm_head in a native layout: logits() runs it in the layers' parallel region.
  void set_head(NativeLinear head);
  bool has_head() const { return head_.has_value(); }

  // forward, then the head's logits [M, vocab] and, with `argmax`, each row's argmax (int64 [M],
  // argmax_rows' result; else an undefined tensor), for steps of up to max_gemv_rows() rows: each
  // thread takes the argmax of the logits it wrote, so no thread reads another's.
  std::tuple<at::Tensor, at::Tensor> logits(at::Tensor h, const at::Tensor& cos,
                                            const at::Tensor& signed_sin,
                                            const at::Tensor& slot_mapping,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens,
                                            const at::Tensor& query_start_loc, bool argmax) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool int8_activations() const { return int8_activations_; }
  bool dense_rows() const { return dense_rows_; }
  int64_t max_gemv_rows() const { return max_gemv_rows_; }

 private:
  // The GEMV form (up to max_gemv_rows_ rows) of forward, and of logits when `logits` is given:
  // returns the hidden states after the final norm; fills *logits and *token_ids (argmax) then.
  at::Tensor forward_gemv(at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          at::Tensor* logits, at::Tensor* token_ids) const;

  // forward for steps of more than max_gemv_rows_ rows (int8 activations; decode_stack_rows.cpp).
  at::Tensor forward_many_rows(at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc) const;

  // The same for exact steps of many rows: every linear's dense form (decode_stack_rows.cpp).
  at::Tensor forward_dense_rows(at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc) const;

  std::vector<StackLayer> layers_;
  std::optional<NativeLinear> head_;
  at::Tensor embedding_, cos_, signed_sin_;  // set_inputs
  at::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_, max_gemv_rows_;
  double eps_, scale_;
  bool int8_activations_;  // every linear has its int8-activation layout
  bool dense_rows_;        // every linear has its dense form
};
