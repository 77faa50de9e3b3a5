// The entry points of qkiln's CPU kernels, shared by their sources, the decode stack and the
// Python module (module.cpp). Contracts: the comments at each definition.
#pragma once

#include <torch/extension.h>

#include "task_stream.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// Whether the environment sets `var` to "0": the kernels' comparison switches (QKILN_AMX_PREFILL,
// QKILN_DECODE_SPLIT, QKILN_TILED_PREFILL, QKILN_FIXED16), read per call so one process can
// time both sides.
inline bool switched_off(const char* var) {
  const char* value = std::getenv(var);
  return value && std::strcmp(value, "0") == 0;
}

// cpu_gemv_int4.cpp / cpu_gemv_int8.cpp
at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& c, const c10::optional<at::Tensor>& bias, int64_t G,
                      int64_t out_features);
at::Tensor w8a16_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias);
std::string int4_kernel_isa();
// cpu_gemv_int4_a8.cpp: the native int4 layout x activations rounded to int8 per 32 channels
// (opt-in, not exact; Int4Gemv with int8_activations set)
at::Tensor w4a8_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& c, const c10::optional<at::Tensor>& bias, int64_t G,
                     int64_t out_features);
std::string int4_a8_kernel_isa();
// cpu_gemv_int8_a8.cpp: int8 weights x int8 activations per 32 channels, few rows (opt-in, not
// exact; Int8Gemv with int8_activations set)
at::Tensor w8a8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias);
std::string int8_a8_kernel_isa();

// cpu_gemm_w4a8.cpp: many rows, int8 activations per 32 channels (opt-in, not exact)
at::Tensor w4a8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& zero_scales, const c10::optional<at::Tensor>& bias,
                     int64_t G, int64_t out_features);
std::string w4a8_kernel_isa();

// The quantized activations of one int8-activation linear: q int8 [M rounded up to 4, K] in
// groups of 4 rows interleaved per 4 channels (cpu_gemm_w4a8.cpp's header), sx fp32 [M, K / 32]
// (one scale per block of 32 channels), xs fp32 [M, num_groups] (the zero term's row sums).
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> sx, xs;
};

// One int8-activation linear (cpu_gemm_w4a8.cpp's header), in the steps a caller that owns the
// threads (the decode stack) runs itself: size the buffers (one thread), quantize any partition of
// the rows, then run any partition of the tasks (row chunk x panel of 48 output channels), each
// written to y [M, out_features]. Holds raw pointers: the tensors it was made from must outlive it.
struct W4A8Gemm {
  const uint8_t* w;
  const float *s, *zs, *bias;  // bias fp32 [out_features] or nullptr
  int64_t K, G, NG, N_p, out_features;

  W4A8Gemm(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zero_scales,
           const float* bias_f32, int64_t group_size, int64_t out_features);
  void size(int64_t M, Int8Rows& a) const;  // grows the buffers only: several linears share them
  void quantize(const at::Tensor& x, int64_t first_row, Int8Rows& a) const;  // x [rows, K] -> rows first_row..
  int64_t num_tasks(int64_t M) const;
  void run(const Int8Rows& a, int64_t M, TaskStream& tasks, at::Tensor& y) const;
};

// cpu_gemm_bf16.cpp: many rows, bf16 activations x bf16 weights in 48-channel panels (exact products)
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& panels, int64_t out_features);
std::string bf16_gemm_isa();
std::string decode_attention_isa();  // cpu_attention.cpp
// One bf16 GEMM as tasks (row chunk x panel): check x once, then run any partition of the tasks,
// each written to y [M, N] (contiguous bf16); bf16_gemm has its threads claim them (task_stream.h). The
// constructor validates the panels (NativeLinear::add_dense uses it for that). Holds a raw
// pointer: the panels must outlive it.
struct Bf16Gemm {
  const uint32_t* w;
  int64_t K, N, P;
  Bf16Gemm(const at::Tensor& panels, int64_t out_features);
  void check(const at::Tensor& x) const;  // TORCH_CHECKs: contiguous bf16 [M, K]
  int64_t num_tasks(int64_t M) const;
  void run(const at::Tensor& x, TaskStream& tasks, at::Tensor& y) const;
};
// cpu_gemm_codes_amx.cpp: many rows on AMX-BF16, bf16 activations x a weight's integer codes,
// exact (the dense AMX GEMM's bits): int4 codes of the native GEMV layout with tables bf16
// [out rounded up to 32, num_groups, 16] holding bf16((q - z) * s) for each (channel, group) and
// code q (cpu_native.w4_amx_tables); or int8 codes [out, in], the product left unscaled.
bool codes_amx_ready();  // this build has the path and the process holds the tile state
at::Tensor w4a16_amx_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& tables,
                          int64_t group_size, int64_t out_features);
at::Tensor int8_codes_amx_gemm(const at::Tensor& x, const at::Tensor& weight);
// One such GEMM; operator() runs it on torch's threads. The steps, for a caller that owns the
// threads: size the repacked activations (acts_size(M) words), repack any partition of the
// 16-row blocks [0, ceil(M / 16)), then run any partition of the tasks (row chunk x block of 32
// channels), each written to y [M, N] (contiguous bf16). Holds raw pointers: the tensors it was
// made from must outlive it.
struct CodesAmxGemm {
  const uint8_t* w;
  const uint16_t* t;  // int4 tables, nullptr for int8
  int64_t bits, K, K_p, G, num_groups, out_p, N;
  static CodesAmxGemm int4(const at::Tensor& packed, const at::Tensor& tables, int64_t group_size,
                           int64_t in_features, int64_t out_features);
  static CodesAmxGemm int8(const at::Tensor& weight);
  int64_t acts_size(int64_t M) const;
  void prepare(const at::Tensor& x, int64_t block_begin, int64_t block_end, uint32_t* acts) const;
  int64_t num_tasks(int64_t M) const;
  void run(const uint32_t* acts, int64_t M, TaskStream& tasks, at::Tensor& y) const;
  at::Tensor operator()(const at::Tensor& x) const;  // x bf16 [M, K] -> bf16 [M, N]
};

// Output rows (weight rows) per tile of the int4 and int8 GEMV layouts (gemv_common.h).
constexpr int64_t kGemvTileRows = 4;

// A linear's activations prepared for its kernel, owned by the caller and reused across calls.
// int4: bf16 = x as bf16 bits [M, K_p], f32 = group sums [M, num_groups]; int8: bf16 = x's bits
// (bf16 x, M >= 2) or f32 = x widened [M, K]; int8 activations (quantize_int8_rows): codes
// [M, K_p] in k order, block_scales [M, K_p / 32], for int4 f32 = the zero term's xs / 8
// [M, num_groups].
struct GemvActs {
  std::vector<uint16_t> bf16;
  std::vector<float> f32;
  std::vector<float> wide;  // int4 on AVX2, fp32 rows: x as fp32 [M, K_p], the kernel's order per 16
  // int4 / int8 on AVX2, bf16 / fp16 rows (cpu_gemv_fixed16.cpp): 16-bit codes in k order, int4
  // [M, K_p] with one power-of-two scale per weight group [M, num_groups] and f32 = the codes'
  // group sums, scaled; int8 [M, K rounded up to 16] with one scale per 128 channels
  std::vector<int16_t> fixed;
  std::vector<float> fixed_scales;
  bool fixed_point = false;  // which of the two forms prepare made
  std::vector<int8_t> codes;
  std::vector<float> block_scales;
};

// x [M, K] (K a multiple of 32, K <= K_p) -> acts.codes / block_scales: each block of 32 channels
// rounded to int8 with scale amax / 127 (plugins/reference.py, quantize_int8_blocks); with G > 0
// also the zero-term sums of weight groups of G channels (cpu_gemv_int4_a8.cpp).
void quantize_int8_rows(const at::Tensor& x, int64_t K_p, int64_t G, GemvActs& acts);

// The int4 and int8 GEMVs for bf16 / fp16 activations on AVX2 hosts without AVX512-BF16: 16-bit
// fixed point (cpu_gemv_fixed16.cpp); fp32 activations and the other hosts use the kernels of
// cpu_gemv_int4.cpp / cpu_gemv_int8.cpp.
#if defined(__AVX2__) && defined(__FMA__) && \
    !(defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__))
#define QKILN_FIXED16 1
#endif

// One int4 linear in the native layout (cpu_gemv_int4.cpp's header), split into the steps a
// caller that owns the threads (the decode stack) runs itself: prepare the activations once, then
// any partition of the output tiles, each written to y [M, out_features]. Holds raw pointers: the
// tensors it was made from must outlive it.
struct Int4Gemv {
  const uint8_t* w;
  const float *s, *c, *bias;  // bias fp32 [out_features] or nullptr
  int64_t K_p, K, G, num_groups, num_tiles, out_features;
  // Round activations to int8 per 32 channels (cpu_gemv_int4_a8.cpp; opt-in, not exact). The
  // tensors must then be packed for that kernel (its header): it can't read the exact layout.
  bool int8_activations = false;

  Int4Gemv(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zero_term,
           const float* bias_f32, int64_t group_size, int64_t in_features, int64_t out_features);
  void prepare(const at::Tensor& x, GemvActs& acts) const;  // x [M, K]
  void tiles(const GemvActs& acts, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const;

 private:  // the int8-activation forms of prepare and tiles (cpu_gemv_int4_a8.cpp)
  void prepare_int8(const at::Tensor& x, GemvActs& acts) const;
  void tiles_int8(const GemvActs& acts, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const;
  // the 16-bit fixed-point forms (cpu_gemv_fixed16.cpp): groups up to kMaxFixedGroup channels
  // keep every lane of dot(q, xi) in int32 (G / 8 products of at most 15 * 32767 each)
  static constexpr int64_t kMaxFixedGroup = 32768;
  bool fixed_point_for(const at::Tensor& x) const;
  void prepare_fixed(const at::Tensor& x, GemvActs& acts) const;
  void tiles_fixed(const GemvActs& acts, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const;
};

// One int8 linear (row-major int8 weight [out, K], fp32 scales [out]; cpu_gemv_int8.cpp), in the
// same two steps as Int4Gemv.
struct Int8Gemv {
  const int8_t* w;
  const float *s, *bias;  // bias fp32 [out_features] or nullptr
  int64_t K, out_features, num_tiles;
  // Round activations to int8 per 32 channels (cpu_gemv_int8_a8.cpp; opt-in, not exact).
  bool int8_activations = false;

  Int8Gemv(const at::Tensor& weight, const at::Tensor& scales, const float* bias_f32);
  void prepare(const at::Tensor& x, GemvActs& acts) const;  // x [M, K]
  void tiles(const GemvActs& acts, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const;

 private:  // the int8-activation forms (cpu_gemv_int8_a8.cpp)
  void prepare_int8(const at::Tensor& x, GemvActs& acts) const;
  void tiles_int8(const GemvActs& acts, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const;
  // the 16-bit fixed-point forms (cpu_gemv_fixed16.cpp), one activation scale per kFixedBlock
  // channels (a lane of dot(q, xi) sums 16 products of at most 128 * 32767: int32)
  static constexpr int64_t kFixedBlock = 128;
  bool fixed_point_for(const at::Tensor& x) const;
  void prepare_fixed(const at::Tensor& x, GemvActs& acts) const;
  void tiles_fixed(const GemvActs& acts, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const;
};
std::string int8_kernel_isa();

// cpu_attention.cpp
// A cache's quantization parameters (plugins/kv_cache.py), absent for float caches: fp8 k_scale /
// v_scale fp32 [Hkv]; int4 (uint8 cache of packed pairs) group scale / min fp16
// [blocks, block_size, Hkv, head_dim / group].
struct KVParams {
  c10::optional<at::Tensor> k_scale, v_scale, k_group_scale, k_group_min, v_group_scale, v_group_min;
  void check(const at::Tensor& k_cache, int64_t head_dim, const char* op) const;  // TORCH_CHECKs
};
// head_dim of a cache [blocks, block_size, Hkv, last]: last, or 2 * last for int4 (uint8, packed pairs).
inline int64_t cache_head_dim(const at::Tensor& cache) {
  return cache.size(3) * (cache.scalar_type() == at::kByte ? 2 : 1);
}
void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, at::Tensor& out,
                     const KVParams& params = {});
// paged_attention as tasks (row block x kv head group) a caller spreads over its own threads (the decode
// stack); paged_attention itself has torch's threads claim them. Validates in the
// constructor, so run() cannot fail. The index tensors must outlive it.
class AttentionTasks {
 public:
  AttentionTasks(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 const at::Tensor& query_start_loc, double scale, at::Tensor& out,
                 const KVParams& params = {},
                 const uint8_t* skip_seqs = nullptr);  // per sequence: 1 where AmxPrefill serves it
  int64_t size() const;
  void run(TaskStream& tasks) const;  // any partition of [0, size()), or claims on a TaskQueue
  // After every task ran: the rows whose context was split into parts get their output from the
  // parts' (one thread; a no-op without splits, which only decode steps of < 8 rows make).
  void merge_partials() const;

 private:
  struct RowBlock {  // query rows [first, first + count) of sequence seq
    int64_t seq, first, count;
    int64_t part = -1;  // a one-row block split by context: tokens [part * split_tokens_, ...)
    int64_t partial = -1;  // then: its index in partial_out_ / partial_lse_
  };
  struct SplitRow {  // a decode row served in `parts` parts, partials [first, first + parts)
    int64_t row, parts, first;
  };
  void split_decodes(int64_t block_size);
  int64_t causal_len(const RowBlock& b, int64_t i) const {  // the tokens row i of b attends to
    return lens_[b.seq] - (starts_[b.seq + 1] - starts_[b.seq]) + 1 + i;
  }
  at::Tensor query_, k_cache_, v_cache_, out_;
  at::Tensor k_scale_, v_scale_;  // fp8 caches: fp32 [Hkv]; undefined otherwise
  at::Tensor k_group_scale_, k_group_min_, v_group_scale_, v_group_min_;  // int4 caches only
  bool int4_ = false;
  const int32_t *tables_ = nullptr, *lens_ = nullptr, *starts_ = nullptr;
  int64_t max_blocks_ = 0;
  float scale_;
  std::vector<RowBlock> blocks_;
  bool bf16_heads_ = false;      // decode_heads_bf16 serves the rows (bf16 query, bf16/fp8 cache, D 64/128)
  int64_t heads_per_task_ = 1;  // consecutive kv heads one task serves (> 1 only with bf16_heads_)
  bool prefill_tiled_ = false;   // prefill_block_bf16 serves multi-row blocks (bf16 q; bf16/fp8 cache)
  bool group_bf16_ = false;      // decode_group_bf16 serves the rows (AVX2; bf16 query and cache, D 64/128)
  int64_t split_tokens_ = 0;     // context tokens per part of a split decode row (0: no splits)
  std::vector<SplitRow> splits_;
  at::Tensor partial_out_, partial_lse_;  // fp32 [parts, Hq, D], [parts, Hq]
};
// cpu_kv_write.cpp
void cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slot_mapping, const KVParams& params = {});

// cpu_small_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void silu_and_mul_out(const at::Tensor& gate_up, at::Tensor& out);
void rotary_embedding(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                      int64_t num_heads);
at::Tensor argmax_rows(const at::Tensor& logits);
// The first largest of logits[row, begin:end) (NaN the largest), with its column, for threads
// that each take a span of a row: merging the spans in column order gives argmax_rows' result.
struct ArgmaxSpan {
  int64_t index = -1;  // -1: an empty span
  float value = 0.f;
  void merge(const ArgmaxSpan& later);  // `later` covers columns after this one's
};
ArgmaxSpan argmax_span(const at::Tensor& logits, int64_t row, int64_t begin, int64_t end);
void scale_columns_(at::Tensor& x, const at::Tensor& scales);
bool silu_exp_is_torchs();
