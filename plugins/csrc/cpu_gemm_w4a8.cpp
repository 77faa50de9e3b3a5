// qkiln CPU GEMM for many rows with int8 activations (opt-in): int4 or int8 weights x activations
// quantized to int8 per block of 32 input channels, AVX512-VNNI vpdpbusd (u8 x s8, 64 MACs per
// instruction against vdpbf16ps's 32).
//
// Not exact, unlike the W4A16 / W8A16 kernels: each row's activations are rounded to int8 with
// one fp32 scale per 32 channels (llama.cpp's Q8_0, what its Q4_0 and ONNX Runtime GenAI's int4
// CPU path compute with). Measured on SmolLM2 RTN W4 g128 with its int8 head (wiki.test, 16384
// tokens, `qkiln eval --int8-activations`): perplexity 38.478 -> 38.645 (+0.43%) over exact
// W4A16; one scale per token instead (decoder linears only) cost +3.65%.
//
// Activations, per row m and block b of 32 channels (plain C++ rounding, so the torch reference
// in plugins/reference.py gives the same bits):
//     amax = max |x|,  inv = amax > 0 ? 127 / amax : 0,  q = round_half_even(x * inv),
//     sx[m,b] = amax / 127;  xs[m,g] = sum over the blocks b of group g of sx[m,b] * sum_k q
// Weights: unsigned codes u (int4: 0..15, symmetric int4 as q + 8; int8: w + 128) with zero
// point z and scale s per (output channel n, group g of G channels; int8: one group, G = K):
//     y[m,n] = sum_g s[n,g] * sum_{b in g} sx[m,b] * dot_b(u[n], q[m])  -  sum_g s[n,g] z[n,g] xs[m,g]
// Every dot_b is exact in int32; the rest is fp32.
//
// Weights, uint8 [N_p / 48, K / 4, 48, 4]: panels of kPanel = 48 output channels (3 tiles of 16,
// one 512-bit register of int32 sums each), 4 consecutive input channels per channel (vpdpbusd's
// 4-byte groups), so a panel's bytes for input channels 4j..4j+3 are the 192 at
// (panel * K / 4 + j) * 192, tile t's the 64 from t * 64 there. N_p pads N to a multiple of 48
// (zero codes, zero scales). scales and zero_scales (s * z): fp32 [NG, N_p]. K and G are multiples
// of 32; the last group may be shorter (K = 576, G = 128).
// Activation codes, int8 in groups of 4 rows (the microkernel's): row m, channels 4j..4j+3 at
// (m - m % 4) * K + j * 16 + (m % 4) * 4, so a microkernel call reads one stream of weights and
// one of codes at constant offsets (with a row-major copy and tile-major weights, GCC ran out of
// registers for the 7 pointers and reloaded them, and weights, in the loop).
//
// Blocking: a microkernel keeps MR x NR accumulators (4 rows x 3 tiles: 12 int32 block sums in
// registers; the fp32 group sums and totals in L1); tasks are (128-row chunk, panel of 48
// channels), so a chunk's activations stay in L2 while the panels go by, and each microkernel
// call of a task prefetches its share of the next panel's weights (into L2). The zero term goes in
// per group (an FMA), the bias and the store from registers (RowsOut).
// Peak measured on the session-14 host (Zen 5, one core, /tmp microbenchmarks): 7.1 G vpdpbusd a
// second (910 GOPS, two a cycle; vdpbf16ps 6.6 G, 425 GFLOP/s), 820 GOPS with each block's
// convert + FMA into L1 sums, as this kernel does.
// Measured (2 threads, SmolLM2 shapes, noisy hosts): against the oneDNN-packed bf16 GEMM, one
// layer's four linears with cached weights 1.50x at 64 rows, 1.14-1.30x at 1024; the 49152-row
// head 1.3-1.55x (session 10's host). Same-process A/Bs of this kernel's versions, all 30 layers'
// linears (weights from memory, as in a step): finishing rows from registers instead of a pass
// over an fp32 buffer 42.2 -> 39.0 ms at 64 rows (+ head), 508 -> 479 at 1024; then the group
// sums and the spread prefetch 37.4 -> 34.6 ms and 473 -> 432 ms. Session 14 (Zen 5 host, where
// that version ran at ~545 GOPS a core on cached weights, 60% of peak, with block sums spilled to
// the stack): group sums in L1 and the interleaved layouts above, 666 GOPS a core cached (3072 x
// 576, 64 rows); 30 layers 17.42 -> 14.72 ms at 64 rows, head 4.79 -> 2.88 ms; at 1024 rows
// 276.2 -> 200.4 ms, head 79.0 -> 47.7 ms (the bf16 GEMM: 16.3 and 287 ms); outputs identical.
// Tried and not kept: 6 x 2 and 3 x 4 register blocks, broadcasts folded into vpdpbusd (within
// noise or slower; on session 10's host); no row chunks (1024 rows: 1.19x instead of 1.38x).
// Without AVX512-VNNI the same layout runs through plain C++ (tests of the portable build).

#include <cmath>
#include <limits>

#include "gemv_common.h"
#include "qkiln_cpu.h"
#include "vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QKILN_W4A8_VNNI 1
#endif

namespace {

constexpr int64_t kBlock = 32;   // input channels per activation scale
constexpr int64_t kTile = 16;    // output channels per register
constexpr int kNR = 3;           // tiles per microkernel
constexpr int kMR = 4;           // rows per microkernel
constexpr int64_t kPanel = kNR * kTile;
constexpr int64_t kRowChunk = 128;
constexpr int64_t kBlockQuads = kBlock / 4;               // channel quads per activation block
constexpr int64_t kPanelQuadBytes = kPanel * 4;           // a panel's weights for one channel quad
constexpr int64_t kBlockPanelBytes = kBlockQuads * kPanelQuadBytes;
constexpr int64_t kQuadBytes = kMR * 4;                   // a row group's codes for one channel quad

// One row's block of 32 values -> codes and *scale; returns sum(codes). The codes go out as 8
// quads of 4 channels, kQuadBytes apart (the interleaved activation layout: the header).
// Rounding as in the header (vcvtps2dq rounds half to even under the default MXCSR, as nearbyint
// does).
template <typename scalar_t>
inline int quantize_block(const scalar_t* x, int8_t* q, float* scale) {
  alignas(16) int8_t codes[kBlock];
#ifdef QKILN_W4A8_VNNI
  const __m512 lo = load(x), hi = load(x + 16);  // exact widening to fp32
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  // max drops a NaN: the sum keeps it, so a NaN activation gives a NaN scale (the reference's)
  if (std::isnan(_mm512_reduce_add_ps(_mm512_add_ps(lo, hi))))
    amax = std::numeric_limits<float>::quiet_NaN();
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_store_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtsepi32_epi8(qlo));
  _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16), _mm512_cvtsepi32_epi8(qhi));
  *scale = amax / 127.f;
  const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
  float v[kBlock], amax = 0.f, total = 0.f;
  for (int i = 0; i < kBlock; ++i) {
    amax = std::max(amax, std::fabs(v[i] = static_cast<float>(x[i])));
    total += v[i];  // std::max drops a NaN; the sum keeps it
  }
  if (std::isnan(total)) amax = std::numeric_limits<float>::quiet_NaN();
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int r = static_cast<int>(std::nearbyint(v[i] * inv));
    codes[i] = static_cast<int8_t>(r);
    sum += r;
  }
  *scale = amax / 127.f;
#endif
  for (int j = 0; j < kBlockQuads; ++j) std::memcpy(q + j * kQuadBytes, codes + 4 * j, 4);
  return sum;
}

// What a microkernel's rows need besides the weights: the header's zero term (zs, xs) and where
// their outputs go (with the bias).
template <typename scalar_t>
struct RowsOut {
  const float* zs;    // zero scales at this panel's first column, group stride N_p
  const float* xs;    // the rows' xs [mr, NG]
  const float* bias;  // at this panel's first column, or nullptr
  scalar_t* out;      // y at (first row, this panel's first column), row stride out_features
  int64_t NG, N_p, out_features, width;  // width: this panel's columns that exist (<= kPanel)
};

// Row m's finished values for columns c..c+15 (zero term taken off) -> y, with the bias.
template <typename scalar_t>
inline void store_row(Vf v, const RowsOut<scalar_t>& o, int m, int64_t c) {
  const int64_t width = std::min<int64_t>(kW, o.width - c);
  if (width <= 0) return;
  if (o.bias) v = add(v, load(o.bias + c, width));
  store(o.out + m * o.out_features + c, v, width);
}

// Rows 0..MR of one row group's codes q (kQuadBytes a channel quad) times one panel of weights w
// (kPanelQuadBytes a channel quad) -> y. Per block of 32 channels the int32 dot products are
// scaled by the row's activation scale into a group sum (one FMA each); per weight group the sum
// is scaled by the weight scale and the zero term taken off (two FMAs each, into the fp32 totals
// kept in L1; see the header for why). Both sums live in L1: beside the 12 block sums in
// registers, GCC spilled block sums inside the vpdpbusd loop. noinline: inlined into run(), GCC
// ran out of registers for the loop's pointers.
#ifdef QKILN_W4A8_VNNI
template <int MR, typename scalar_t>
__attribute__((noinline)) void panel_rows(const int8_t* q, const float* sx, int64_t K, int64_t G,
                                          const uint8_t* w, const float* s, int64_t N_p,
                                          const uint8_t* next, int part, int parts,
                                          const RowsOut<scalar_t>& o) {
  const int64_t B = K / kBlock, blocks_per_group = G / kBlock;
  alignas(64) float total[MR][kPanel], group_sum[MR][kPanel];
  int64_t fetch = part;  // the next block whose share of `next` this call fetches
  for (int64_t b0 = 0, g = 0; b0 < B; b0 += blocks_per_group, ++g) {
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < kPanel; c += kTile) _mm512_store_ps(group_sum[m] + c, _mm512_setzero_ps());
    for (int64_t b = b0; b < std::min(B, b0 + blocks_per_group); ++b) {
      const uint8_t* wb = w + b * kBlockPanelBytes;
      const int8_t* qb = q + b * kBlockQuads * kQuadBytes;
      if (next && b == fetch) {  // this call's share of the next panel, into L2
        fetch += parts;
        for (int64_t i = 0; i < kBlockPanelBytes; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + b * kBlockPanelBytes + i), _MM_HINT_T1);
      }
      __m512i dot[MR][kNR];
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < kNR; ++n) dot[m][n] = _mm512_setzero_si512();
      for (int j = 0; j < kBlockQuads; ++j)  // a constant trip count: unrolled, sums in registers
        for (int n = 0; n < kNR; ++n) {
          const __m512i wv = _mm512_loadu_si512(wb + j * kPanelQuadBytes + n * 64);
          for (int m = 0; m < MR; ++m) {
            int32_t x4;
            std::memcpy(&x4, qb + j * kQuadBytes + m * 4, 4);
            dot[m][n] = _mm512_dpbusd_epi32(dot[m][n], wv, _mm512_set1_epi32(x4));
          }
        }
      for (int m = 0; m < MR; ++m) {
        const __m512 row_scale = _mm512_set1_ps(sx[m * B + b]);
        for (int n = 0; n < kNR; ++n) {
          float* sum = group_sum[m] + n * kTile;
          _mm512_store_ps(sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][n]), row_scale,
                                               _mm512_load_ps(sum)));
        }
      }
    }
    for (int n = 0; n < kNR; ++n) {
      const __m512 sw = _mm512_loadu_ps(s + g * N_p + n * kTile);
      const __m512 zw = _mm512_loadu_ps(o.zs + g * o.N_p + n * kTile);
      for (int m = 0; m < MR; ++m) {
        __m512 t = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(total[m] + n * kTile);
        t = _mm512_fmadd_ps(_mm512_load_ps(group_sum[m] + n * kTile), sw, t);
        t = _mm512_fnmadd_ps(zw, _mm512_set1_ps(o.xs[m * o.NG + g]), t);
        _mm512_store_ps(total[m] + n * kTile, t);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kNR; ++n) store_row(_mm512_load_ps(total[m] + n * kTile), o, m, n * kTile);
}

template <typename scalar_t>
void panel(int mr, const int8_t* q, const float* sx, int64_t K, int64_t G, const uint8_t* w,
           const float* s, int64_t N_p, const uint8_t* next, int part, int parts,
           const RowsOut<scalar_t>& o) {
  switch (mr) {
    case 1: panel_rows<1>(q, sx, K, G, w, s, N_p, next, part, parts, o); break;
    case 2: panel_rows<2>(q, sx, K, G, w, s, N_p, next, part, parts, o); break;
    case 3: panel_rows<3>(q, sx, K, G, w, s, N_p, next, part, parts, o); break;
    default: panel_rows<4>(q, sx, K, G, w, s, N_p, next, part, parts, o); break;
  }
}
#else
template <typename scalar_t>
void panel(int mr, const int8_t* q, const float* sx, int64_t K, int64_t G, const uint8_t* w,
           const float* s, int64_t N_p, const uint8_t* /*next*/, int /*part*/, int /*parts*/,
           const RowsOut<scalar_t>& o) {
  const int64_t B = K / kBlock;
  for (int m = 0; m < mr; ++m) {
    float total[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) {
      total[c] = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
          dot += static_cast<int32_t>(w[(k / 4) * kPanelQuadBytes + c * 4 + k % 4]) *
                 q[(k / 4) * kQuadBytes + m * 4 + k % 4];
        total[c] += static_cast<float>(dot) * (s[(b * kBlock / G) * N_p + c] * sx[m * B + b]);
      }
      for (int64_t g = 0; g < o.NG; ++g) total[c] -= o.zs[g * o.N_p + c] * o.xs[m * o.NG + g];
    }
    for (int64_t c = 0; c < kPanel; c += kW) store_row(load(total + c), o, m, c);
  }
}
#endif

}  // namespace

W4A8Gemm::W4A8Gemm(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zero_scales,
                   const float* bias_f32, int64_t group_size, int64_t out_features)
    : bias(bias_f32), K(packed.size(1) * 4), G(group_size), NG(scales.size(0)), N_p(scales.size(1)),
      out_features(out_features) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) * kPanel == N_p && packed.size(2) == kPanel && packed.size(3) == 4,
              "w4a8_gemm: packed must be contiguous uint8 [N_p / 48, K / 4, 48, 4]");
  TORCH_CHECK(scales.dtype() == at::kFloat && zero_scales.dtype() == at::kFloat &&
                  scales.is_contiguous() && zero_scales.is_contiguous() &&
                  scales.sizes() == zero_scales.sizes() && scales.dim() == 2,
              "w4a8_gemm: scales and zero scales must be fp32 [num_groups, N_p]");
  TORCH_CHECK(K % kBlock == 0 && G % kBlock == 0 && NG == (K + G - 1) / G && out_features <= N_p,
              "w4a8_gemm: in_features and group size must be multiples of 32 matching the scales");
  w = packed.data_ptr<uint8_t>();
  s = scales.data_ptr<float>();
  zs = zero_scales.data_ptr<float>();
}

void W4A8Gemm::size(int64_t M, Int8Rows& a) const {
  const int64_t rows = (M + kMR - 1) / kMR * kMR;  // whole row groups
  if (static_cast<int64_t>(a.q.size()) < rows * K) a.q.resize(rows * K);
  if (static_cast<int64_t>(a.sx.size()) < M * (K / kBlock)) a.sx.resize(M * (K / kBlock));
  if (static_cast<int64_t>(a.xs.size()) < M * NG) a.xs.resize(M * NG);
}

void W4A8Gemm::quantize(const at::Tensor& x, int64_t first_row, Int8Rows& a) const {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K,
              "w4a8_gemm: x must be contiguous [M, in_features]");
  const int64_t B = K / kBlock;
  QKILN_DISPATCH(x.scalar_type(), "qkiln_w4a8_quantize", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for (int64_t i = 0; i < x.size(0); ++i) {
      const int64_t m = first_row + i;
      std::fill(a.xs.begin() + m * NG, a.xs.begin() + (m + 1) * NG, 0.f);
      // Row m's quads in its row group (the header's layout): at (m - m % 4) * K + quad * 16 + m % 4 * 4.
      int8_t* q_row = a.q.data() + (m - m % kMR) * K + (m % kMR) * 4;
      for (int64_t b = 0; b < B; ++b) {
        float scale;
        const int sum = quantize_block(xp + i * K + b * kBlock, q_row + b * kBlockQuads * kQuadBytes,
                                       &scale);
        a.sx[m * B + b] = scale;
        a.xs[m * NG + b * kBlock / G] += scale * static_cast<float>(sum);
      }
    }
  });
}

int64_t W4A8Gemm::num_tasks(int64_t M) const {
  return (M + kRowChunk - 1) / kRowChunk * (N_p / kPanel);
}

// Tasks [begin, end) of num_tasks(M): task = row chunk * panels + panel.
void W4A8Gemm::run(const Int8Rows& a, int64_t M, TaskStream& tasks, at::Tensor& y) const {
  const int64_t B = K / kBlock, panels = N_p / kPanel;
  QKILN_DISPATCH(y.scalar_type(), "qkiln_w4a8", [&] {
    scalar_t* out = y.data_ptr<scalar_t>();
    for (; !tasks.done(); tasks.advance()) {
      const int64_t task = tasks.task(), n0 = (task % panels) * kPanel, chunk = task / panels;
      const int64_t m_begin = chunk * kRowChunk, m_end = std::min(M, m_begin + kRowChunk);
      // The panel of this thread's next task: its blocks are fetched a share per microkernel call
      // (all in the first call stalled that call).
      const uint8_t* next = tasks.ahead() >= 0 ? w + (tasks.ahead() % panels) * kPanel * K : nullptr;
      const int parts = static_cast<int>((m_end - m_begin + kMR - 1) / kMR);
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, m_end - m0));
        const RowsOut<scalar_t> rows_out{zs + n0, a.xs.data() + m0 * NG, bias ? bias + n0 : nullptr,
                                         out + m0 * out_features + n0, NG, N_p, out_features,
                                         std::min<int64_t>(kPanel, out_features - n0)};
        panel(mr, a.q.data() + m0 * K, a.sx.data() + m0 * B, K, G, w + n0 * K, s + n0, N_p, next,
              static_cast<int>((m0 - m_begin) / kMR), parts, rows_out);
      }
    }
  });
}

// x [M, K] float/bf16/fp16 contiguous -> y [M, out_features] in x's dtype (layout: the header).
at::Tensor w4a8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& zero_scales, const c10::optional<at::Tensor>& bias,
                     int64_t G, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "w4a8_gemm: x must be contiguous [M, in_features]");
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const W4A8Gemm gemm(packed, scales, zero_scales, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                      G, out_features);
  TORCH_CHECK(x.size(1) == gemm.K, "w4a8_gemm: x's in_features do not match the packed weight");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  thread_local Int8Rows rows;  // reused per calling thread, as the GEMV activation buffers
  Int8Rows& a = rows;  // (the name inside the parallel region would be each worker's own)
  gemm.size(M, a);
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) { gemm.quantize(x.narrow(0, m0, m1 - m0), m0, a); });
  TaskQueue queue(gemm.num_tasks(M));
  at::parallel_for(0, gemm.num_tasks(M), 1, [&](int64_t, int64_t) {
    TaskStream tasks(queue);
    gemm.run(a, M, tasks, y);
  });
  return y;
}

// Which w4a8 kernel this build compiled: "avx512vnni" or "portable".
std::string w4a8_kernel_isa() {
#ifdef QKILN_W4A8_VNNI
  return "avx512vnni";
#else
  return "portable";
#endif
}
