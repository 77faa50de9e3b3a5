// qkiln CPU bf16 GEMM for many rows: bf16 activations x bf16 weights, fp32 sums, bf16 out, through
// AVX512-BF16 vdpbf16ps. It serves every dense GEMM of the CPU path above the GEMV row limit: the
// dequantized copies of int4 / int8 weights (exact W4A16 / W8A16: the products of two bf16 are
// exact in fp32) and a model's own bf16 linears, replacing oneDNN's bf16 GEMM there.
//
// Why our own: at 64 rows (an offline decode step) oneDNN reached 190-320 GFLOP/s on SmolLM2's
// shapes (42-71% of the two cores' 452 GFLOP/s bf16 peak), lowest on the narrow q/k/v and o
// projections; this kernel, one simple register block over the whole K, 1.36x oneDNN over all 30
// layers' linears at 64 rows (34.3 vs 46.7 ms, 396 GFLOP/s), 1.38x at 20 rows, 1.04x at 1024 rows
// (427 GFLOP/s, 94% of peak), same weights from memory, 2 threads.
//
// Layout, int32 [N_p / 48, K / 2, 48]: panels of 48 output channels; lane n of pair j of a panel
// holds (w[n][2j], w[n][2j+1]) as two bf16, low half first: the pair vdpbf16ps multiplies with the
// activations' (x[m][2j], x[m][2j+1]), broadcast as one 32-bit word. N_p pads N with zero rows
// (cpu_native.pack_bf16_panels writes it); K is even.
// Blocking: a microkernel keeps 8 rows x 48 channels (24 fp32 registers) over the whole K, the
// panel streaming from L1/L2 and each row's pair broadcast from memory; tasks are (chunk of up to
// 256 rows, panel), so a chunk's activations stay in L2 while its panels go by.
// Rounding: the fp32 sums round to bf16 to nearest even, as oneDNN's output does; the order of the
// sums differs from oneDNN's, so the bits can differ in the last place from a oneDNN GEMM, never
// between calls of this kernel (a task's result does not depend on how tasks are split).
// On a CPU with AMX-BF16 the same panels go through tiles instead (cpu_gemm_bf16_amx.cpp: there
// vdpbf16ps ran at a quarter of what oneDNN's AMX GEMM reached). Without AVX512-BF16 the layout runs
// through plain C++ in vdpbf16ps's order (portable build, tests); the Python side then keeps
// oneDNN for speed (bf16_gemm_isa(), cpu_native.bf16_panels_available).

#include "cpu_gemm_bf16_amx.h"
#include "qkiln_cpu.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QKILN_BF16_GEMM 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 48;     // output channels per panel (3 registers of 16 fp32)
constexpr int64_t kRowChunk = 256;  // rows per task
constexpr int kMR = 8;              // rows per microkernel call

// rows [0, MR) of a: C[m][0..ncols) = sum over pairs j of a[m] pair j . panel pair j.
// With kAhead, the call also fetches `ahead_lines` cache lines from `ahead` into L2, spread evenly
// over its K / 2 steps (see Bf16Gemm::run).
template <int MR, bool kAhead = false>
void micro(const uint16_t* a, int64_t K, const uint32_t* panel, c10::BFloat16* c, int64_t ldc,
           int64_t ncols, const char* ahead = nullptr, int64_t ahead_lines = 0) {
#ifdef QKILN_BF16_GEMM
  __m512 acc[MR][3];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < 3; ++t) acc[m][t] = _mm512_setzero_ps();
  int64_t due = 0;  // Bresenham: ahead_lines fetches over K / 2 steps
  for (int64_t j = 0; j < K / 2; ++j) {
    if constexpr (kAhead)
      for (due += ahead_lines; due >= K / 2; due -= K / 2, ahead += 64)
        _mm_prefetch(ahead, _MM_HINT_T1);
    const uint32_t* w = panel + j * kPanel;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 16),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int m = 0; m < MR; ++m) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + m * K + 2 * j));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], x, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], x, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], x, w2);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < 3 && t * 16 < ncols; ++t) {
      const __mmask16 keep = static_cast<__mmask16>((1u << std::min<int64_t>(16, ncols - t * 16)) - 1);
      _mm256_mask_storeu_epi16(c + m * ldc + t * 16, keep, (__m256i)_mm512_cvtneps_pbh(acc[m][t]));
    }
#else
  const auto widen = [](uint32_t half) {  // bf16 bits -> fp32
    const uint32_t bits = half << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  for (int m = 0; m < MR; ++m)
    for (int64_t n = 0; n < ncols; ++n) {
      float acc = 0.f;
      for (int64_t j = 0; j < K / 2; ++j) {  // vdpbf16ps's order: the odd element first
        const uint32_t w = panel[j * kPanel + n];
        acc += widen(a[m * K + 2 * j + 1]) * widen(w >> 16);
        acc += widen(a[m * K + 2 * j]) * widen(w & 0xFFFF);
      }
      c[m * ldc + n] = c10::BFloat16(acc);
    }
#endif
}

template <int MR = kMR>
void rows_tail(int64_t rows, const uint16_t* a, int64_t K, const uint32_t* panel,
               c10::BFloat16* c, int64_t ldc, int64_t ncols) {
  if constexpr (MR > 0) {
    if (rows == MR) return micro<MR>(a, K, panel, c, ldc, ncols);
    rows_tail<MR - 1>(rows, a, K, panel, c, ldc, ncols);
  }
}

}  // namespace

Bf16Gemm::Bf16Gemm(const at::Tensor& panels, int64_t out_features)
    : w(reinterpret_cast<const uint32_t*>(panels.data_ptr<int32_t>())), K(2 * panels.size(1)),
      N(out_features), P(panels.size(0)) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kInt && panels.is_contiguous() &&
                  panels.size(2) == kPanel && out_features > 0 && P * kPanel >= out_features &&
                  (P - 1) * kPanel < out_features,
              "bf16 GEMM: panels must be contiguous int32 [ceil(out / 48), in / 2, 48]");
}

int64_t Bf16Gemm::num_tasks(int64_t M) const { return (M + kRowChunk - 1) / kRowChunk * P; }

void Bf16Gemm::run(const at::Tensor& x, TaskStream& tasks, at::Tensor& y) const {
  const int64_t M = x.size(0);
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  c10::BFloat16* c = y.data_ptr<c10::BFloat16>();
  const int64_t lines = K / 2 * kPanel * 4 / 64;  // one panel
  // The panel of the task this thread runs next, fetched into L2 during this one (nullptr: none).
  auto next_panel = [&](int64_t task) {
    return task < 0 ? nullptr : reinterpret_cast<const char*>(w + (task % P) * (K / 2) * kPanel);
  };
  if (K % 32 == 0 && amx_bf16_ready()) {  // cpu_gemm_bf16_amx.cpp: the same tasks through tiles
    const AmxTiles tiles;
    for (; !tasks.done(); tasks.advance()) {
      const int64_t task = tasks.task(), chunk = task / P, p = task % P, n0 = p * kPanel;
      const int64_t r0 = chunk * kRowChunk, r1 = std::min(M, r0 + kRowChunk);
      const char* next = next_panel(tasks.ahead());
      amx_bf16_panel(a + r0 * K, r1 - r0, K, w + p * (K / 2) * kPanel, c + r0 * N + n0, N,
                     std::min(kPanel, N - n0), next, next ? lines : 0);
    }
    return;
  }
  for (; !tasks.done(); tasks.advance()) {
    const int64_t task = tasks.task(), chunk = task / P, p = task % P, n0 = p * kPanel;
    const int64_t r0 = chunk * kRowChunk, r1 = std::min(M, r0 + kRowChunk);
    const int64_t ncols = std::min(kPanel, N - n0);
    const uint32_t* panel = w + p * (K / 2) * kPanel;
    int64_t m = r0;
    // The next task's panel is fetched into L2 during this task, spread over its microkernel
    // calls: a panel left to the hardware prefetcher arrived while its first call waited on DRAM.
    // 30 layers of SmolLM2's linears from memory, 2 threads, same-process A/B: 64 rows 22.8 ->
    // 20.5 ms, 20 rows 10.4 -> 8.4, 1024 rows 358 -> 351; the 49152-row head at 64 rows 7.1 -> 6.2.
    const int64_t calls = (r1 - r0) / kMR;
    const char* next = next_panel(tasks.ahead());
    for (int64_t call = 0; call < calls; ++call, m += kMR) {
      const int64_t first = call * lines / calls, last = (call + 1) * lines / calls;
      if (next) micro<kMR, true>(a + m * K, K, panel, c + m * N + n0, N, ncols, next + 64 * first, last - first);
      else micro<kMR>(a + m * K, K, panel, c + m * N + n0, N, ncols);
    }
    if (m < r1) rows_tail(r1 - m, a + m * K, K, panel, c + m * N + n0, N, ncols);
  }
}

void Bf16Gemm::check(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  x.size(1) == K,
              "bf16 GEMM: x must be contiguous bf16 [M, ", K, "]");
}

// x bf16 [M, K] @ W^T -> bf16 [M, out_features], W in the panel layout above.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  const Bf16Gemm gemm(panels, out_features);
  gemm.check(x);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  // Claims, not fixed shares (task_stream.h): same-process A/B, 30 SmolLM2 layers from memory,
  // 2 threads, AMX host: 1024 rows 256.4 -> 241.3 and 365.6 -> 307.5 ms, 64 rows 22.7 -> 22.0 and
  // 26.7 -> 27.3; the head at 1024 rows 89.4 -> 79.6 and 103.3 -> 98.5.
  TaskQueue queue(gemm.num_tasks(x.size(0)));
  at::parallel_for(0, gemm.num_tasks(x.size(0)), 1, [&](int64_t, int64_t) {
    TaskStream tasks(queue);
    gemm.run(x, tasks, y);
  });
  return y;
}

std::string bf16_gemm_isa() {
  if (amx_bf16_ready()) return "amx-bf16";  // for K a multiple of 32; avx512-bf16 otherwise
#ifdef QKILN_BF16_GEMM
  return "avx512-bf16";
#else
  return "portable";
#endif
}
