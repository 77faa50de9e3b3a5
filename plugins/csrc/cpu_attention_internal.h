// What the paged-attention sources share (cpu_attention.cpp: the decode kernels and the task
// split; cpu_attention_prefill.cpp: the tiled prefill kernel): a task's parameters, the block-table
// walk, the prefill kernel's entry.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace attention_detail {

struct Decode {
  const int32_t* tables;
  int64_t max_blocks, block_size, num_kv_heads, head_dim, group;
  float scale;            // scores = scale * q . K (fp8: times k_scale of the head)
  float out_scale = 1.f;  // out = out_scale * (p @ V) / sum(p) (fp8: v_scale of the head)
};

// The cache slots of tokens t0 .. t0 + n - 1 through the block table, times `stride` (1: slot
// indices; Hkv * D: element offsets of the rows). Every tiled kernel walks the table through this.
inline void tile_slots(const int32_t* table, int64_t block_size, int64_t t0, int64_t n, int64_t stride,
                       int64_t* out) {
  for (int64_t i = 0, b = t0 / block_size, o = t0 % block_size; i < n; ++i) {
    out[i] = (table[b] * block_size + o) * stride;
    if (++o == block_size) o = 0, ++b;
  }
}

// A block of R query rows of one sequence (row r sees T_first + r tokens) for one kv head over a
// bf16 cache, D = 32 * NP (cpu_attention_prefill.cpp; instantiated for NP 2, 4 and fp32 / bf16 /
// fp16 outputs; without AVX512-BF16 it does nothing and AttentionTasks does not call it).
template <int NP, typename o_t>
void prefill_block_bf16(const Decode& a, const c10::BFloat16* q, int64_t q_stride,
                        const c10::BFloat16* k_head, const c10::BFloat16* v_head, const int32_t* table,
                        int64_t T_first, int64_t R, o_t* out, int64_t out_stride);

}  // namespace attention_detail
