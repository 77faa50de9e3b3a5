// What the paged-attention sources share (cpu_attention.cpp: the task split and the op;
// cpu_attention_decode_*.cpp, cpu_attention_int4.cpp: the decode kernels; cpu_attention_prefill*.cpp:
// the prefill kernels): a task's parameters, the block-table walk, the prefill kernels' entries.
#pragma once

#include <torch/extension.h>

#include "qkiln_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

// Where the build has AVX512-BF16 and BW, the bf16 attention kernels (decode_heads_bf16,
// decode_head_int4, prefill_block_bf16 and the prefixes served to it) are compiled; elsewhere their
// entries are stubs AttentionTasks never calls (kBf16Heads). Every attention source tests this one
// macro, so the condition cannot drift between them.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define QKILN_ATTENTION_BF16 1
#endif

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

// body(t, row) for tokens 0 .. T - 1 of one kv head (head: its slice of slot 0), each row found
// through the block table: the row-by-row kernels' walk (decode_head, decode_group_bf16).
template <typename kv_t, typename F>
inline void for_each_row(const kv_t* head, const int32_t* table, int64_t block_size, int64_t row_stride,
                         int64_t T, F&& body) {
  for (int64_t t0 = 0, b = 0; t0 < T; t0 += block_size, ++b) {
    const kv_t* row = head + table[b] * block_size * row_stride;
    for (int64_t t = t0, end = std::min(T, t0 + block_size); t < end; ++t, row += row_stride) body(t, row);
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

struct KVParams;  // qkiln_cpu.h

namespace attention_detail {

using ::switched_off;  // qkiln_cpu.h

constexpr int64_t kMaxInt4HeadDim = 128;

// One packed int4 cache row of D (<= kMaxInt4HeadDim) elements -> fp32, x = q * scale + min per
// group (cpu_attention_int4.cpp; the int4 kernels and AmxPrefill's staging use it).
void dequantize_int4_row(const uint8_t* packed, const c10::Half* scale, const c10::Half* minimum,
                         int64_t D, int64_t group, float* out);

// The same row rounded to bf16 (round to nearest even), the form the prefill kernels read an int4
// prefix in (serve_int4_prefix, AmxPrefill's staging); the int4 error is ~2^4 times the rounding's.
void int4_row_as_bf16(const uint8_t* packed, const c10::Half* scale, const c10::Half* minimum, int64_t D,
                      int64_t group, c10::BFloat16* out);

// Sequences with this many query rows in a step take the AMX prefill kernel where it runs
// (cpu_attention_prefill_amx.cpp); fewer rows stay on the per-block kernels.
constexpr int64_t kAmxMinRows = 16;

// Whether this build compiled the AMX prefill kernel and the process holds the tile state.
bool amx_prefill_ready();

// The prefill rows paged_attention serves on AMX (cpu_attention_prefill_amx.cpp): every sequence
// with kAmxMinRows+ rows, when the query is bf16, the cache bf16, fp8 e4m3fn or int4 (with the
// params paged_attention has checked), head_dim 64 or 128 and AMX is ready; none otherwise.
// The tables / lens / starts arrays and the params' tensors must outlive it.
class AmxPrefill {
 public:
  AmxPrefill(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const int32_t* tables, int64_t max_blocks, const int32_t* seq_lens, const int32_t* starts,
             int64_t num_seqs, float scale, const KVParams& params, at::Tensor& out);
  bool served_any() const { return !seqs_.empty(); }
  const uint8_t* served() const { return served_.data(); }  // per sequence: 1 where run() writes its rows
  void run();                      // stages K / V, then serves the rows (two parallel phases)

 private:
  struct Staged {
    int64_t seq, offset, T_pad;  // offset: of its staged K^T (and V) in elements, all kv heads
  };
  struct Task {
    int64_t seq, h, index;  // index into seqs_, kv head, 64-token chunk (staging) or 16-row tile
  };
  void widen_row(bool value, int64_t row, uint16_t* out) const;  // fp8 / int4 cache row -> bf16
  void stage(const Task& task);
  template <typename o_t>
  void rows(const Task& task, o_t* out) const;

  at::Tensor query_, k_cache_, v_cache_, out_;
  const int32_t* tables_;
  int64_t max_blocks_;
  const int32_t *lens_, *starts_;
  float scale_;
  const float *k_scale_ = nullptr, *v_scale_ = nullptr;  // fp8 caches: per kv head
  at::Tensor k_group_scale_, k_group_min_, v_group_scale_, v_group_min_;  // int4 caches
  std::vector<uint8_t> served_;
  std::vector<Staged> seqs_;
  std::vector<Task> stage_tasks_, row_tasks_;
  // per sequence and kv head: [T_pad * D] each; not zeroed, stage() writes every element
  std::unique_ptr<uint16_t[]> staged_k_, staged_v_;
};

}  // namespace attention_detail
