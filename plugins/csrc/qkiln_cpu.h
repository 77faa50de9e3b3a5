// The entry points of qkiln's CPU kernels, shared by their sources, the decode stack and the
// Python module (module.cpp). Contracts: the comments at each definition.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

// cpu_gemv_int4.cpp / cpu_gemv_int8.cpp
at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& c, const c10::optional<at::Tensor>& bias, int64_t G,
                      int64_t out_features);
at::Tensor w8a16_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias);
std::string int4_kernel_isa();

// One int4 linear in the native layout (cpu_gemv_int4.cpp's header), split into the steps a
// caller that owns the threads (the decode stack) runs itself: prepare the activations once, then
// any partition of the output tiles, each written to y [M, out_features]. Holds raw pointers: the
// tensors it was made from must outlive it.
struct Int4Gemv {
  const uint8_t* w;
  const float *s, *c, *bias;  // bias fp32 [out_features] or nullptr
  int64_t K_p, K, G, num_groups, num_tiles, out_features;

  Int4Gemv(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zero_term,
           const float* bias_f32, int64_t group_size, int64_t in_features, int64_t out_features);
  // x [M, K] -> bf16 bits [M, K_p] and group sums [M, num_groups] (resized to fit).
  void prepare(const at::Tensor& x, std::vector<uint16_t>& xb, std::vector<float>& xsum) const;
  void tiles(const uint16_t* xb, const float* xsum, int64_t M, int64_t begin, int64_t end,
             at::Tensor& y) const;
};
std::string int8_kernel_isa();

// cpu_attention.cpp
void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, at::Tensor& out);
void cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slot_mapping);

// cpu_small_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_embedding(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                      int64_t num_heads);
bool silu_exp_is_torchs();
