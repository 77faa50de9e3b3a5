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
// Layout, uint8 [N_p / 16, K / 4, 16, 4]: tiles of 16 output channels (one 512-bit register of
// int32 sums), 4 consecutive input channels per channel (vpdpbusd's 4-byte groups), so tile t's
// bytes for input channels 4j..4j+3 are the 64 bytes at (t * K / 4 + j) * 64. N_p pads N to a
// multiple of kPanel (zero codes, zero scales). scales and zero_scales (s * z): fp32 [NG, N_p].
// K and G are multiples of 32; the last group may be shorter (K = 576, G = 128).
//
// Blocking: a microkernel keeps MR x NR accumulators (4 rows x 3 tiles: 12 int32 block sums and
// 12 fp32 group sums in registers, the totals in L1, one weight register); tasks are (128-row
// chunk, panel of 48 channels), so a chunk's activations stay in L2 while the panels go by, and
// each microkernel call of a task prefetches its share of the next panel's weights (into L2).
// The zero term goes in per group (an FMA), the bias and the store from registers (RowsOut).
// Peak measured here: vpdpbusd 452 GOPS a core (one 512-bit instruction a cycle at 3.5 GHz), and
// FMAs, multiplies and vpdpbusd share those slots: scaling each block's sums by s * sx (a multiply
// and an FMA per accumulator and block) capped the microkernel at 96 / 120 of peak; the group sums
// (one FMA per block, the weight scale per group) at 96 / 111.
// Measured (2 threads, SmolLM2 shapes, noisy host): against the oneDNN-packed bf16 GEMM, one
// layer's four linears with cached weights 1.50x at 64 rows, 1.14-1.30x at 1024; the 49152-row
// head 1.3-1.55x. Same-process A/Bs of this kernel's versions, all 30 layers' linears (weights
// from memory, as in a step): finishing rows from registers instead of a pass over an fp32 buffer
// (a quarter of the kernel's time at 64 rows, profiled) 42.2 -> 39.0 ms at 64 rows (+ head),
// 508 -> 479 at 1024, outputs identical; then the group sums and the spread prefetch 37.4 -> 34.6
// ms and 473 -> 432 ms (465-515 GOPS, 51-57% of the two cores' peak; fp32 outputs are as close to
// the reference as before, median relative error 3.4e-7 vs 3.8e-7).
// Tried and not kept: 6 x 2 and 3 x 4 register blocks, broadcasts folded into vpdpbusd (within
// noise or slower); no row chunks (1024 rows: 1.19x instead of 1.38x).
// Without AVX512-VNNI the same layout runs through plain C++ (tests of the portable build).

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

// One row's block of 32 values -> q and *scale; returns sum(q). Rounding as in the header
// (vcvtps2dq rounds half to even under the default MXCSR, as nearbyint does).
template <typename scalar_t>
inline int quantize_block(const scalar_t* x, int8_t* q, float* scale) {
#ifdef QKILN_W4A8_VNNI
  const __m512 lo = load(x), hi = load(x + 16);  // exact widening to fp32
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
  *scale = amax / 127.f;
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
  float v[kBlock], amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i] = static_cast<float>(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int r = static_cast<int>(std::nearbyint(v[i] * inv));
    q[i] = static_cast<int8_t>(r);
    sum += r;
  }
  *scale = amax / 127.f;
  return sum;
#endif
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

// Rows q[0..MR) times one panel of weights w (kNR tiles, K / 4 groups of 64 bytes each) -> y.
// Per block of 32 channels the int32 dot products are scaled by the row's activation scale into a
// group sum (one FMA each); per weight group the sum is scaled by the weight scale and the zero
// term taken off (two FMAs each, into the fp32 totals kept in L1; see the header for why).
#ifdef QKILN_W4A8_VNNI
template <int MR, typename scalar_t>
void panel_rows(const int8_t* q, const float* sx, int64_t K, int64_t G, const uint8_t* w,
                const float* s, int64_t N_p, const uint8_t* next, int part, int parts,
                const RowsOut<scalar_t>& o) {
  const int64_t B = K / kBlock, quads = K / 4, blocks_per_group = G / kBlock;
  alignas(64) float total[MR][kPanel];
  for (int64_t b0 = 0, g = 0; b0 < B; b0 += blocks_per_group, ++g) {
    __m512 group_sum[MR][kNR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < kNR; ++n) group_sum[m][n] = _mm512_setzero_ps();
    for (int64_t b = b0; b < std::min(B, b0 + blocks_per_group); ++b) {
      __m512i dot[MR][kNR];
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < kNR; ++n) dot[m][n] = _mm512_setzero_si512();
      const uint8_t* wb = w + b * (kBlock / 4) * 64;
      const int8_t* qb = q + b * kBlock;
      if (next && b % parts == part)  // this call's share of the next panel, into L2
        for (int n = 0; n < kNR; ++n)
          for (int j = 0; j < kBlock / 4; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(next + (n * quads + b * kBlock / 4 + j) * 64),
                         _MM_HINT_T1);
      for (int j = 0; j < kBlock / 4; ++j)  // a constant trip count: unrolled, sums in registers
        for (int n = 0; n < kNR; ++n) {
          const __m512i wv = _mm512_loadu_si512(wb + (n * quads + j) * 64);
          for (int m = 0; m < MR; ++m) {
            int32_t x4;
            std::memcpy(&x4, qb + m * K + 4 * j, 4);
            dot[m][n] = _mm512_dpbusd_epi32(dot[m][n], wv, _mm512_set1_epi32(x4));
          }
        }
      for (int m = 0; m < MR; ++m) {
        const __m512 row_scale = _mm512_set1_ps(sx[m * B + b]);
        for (int n = 0; n < kNR; ++n)
          group_sum[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][n]), row_scale, group_sum[m][n]);
      }
    }
    for (int n = 0; n < kNR; ++n) {
      const __m512 sw = _mm512_loadu_ps(s + g * N_p + n * kTile);
      const __m512 zw = _mm512_loadu_ps(o.zs + g * o.N_p + n * kTile);
      for (int m = 0; m < MR; ++m) {
        __m512 t = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(total[m] + n * kTile);
        t = _mm512_fmadd_ps(group_sum[m][n], sw, t);
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
  const int64_t B = K / kBlock, quads = K / 4;
  for (int m = 0; m < mr; ++m) {
    float total[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) {
      const uint8_t* wc = w + (c / kTile) * quads * 64 + (c % kTile) * 4;
      total[c] = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
          dot += static_cast<int32_t>(wc[(k / 4) * 64 + k % 4]) * q[m * K + k];
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
                  packed.size(0) * kTile == N_p && packed.size(2) == kTile && packed.size(3) == 4 &&
                  N_p % kPanel == 0,
              "w4a8_gemm: packed must be contiguous uint8 [N_p / 16, K / 4, 16, 4], N_p % 48 == 0");
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
  if (static_cast<int64_t>(a.q.size()) < M * K) a.q.resize(M * K);
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
      for (int64_t b = 0; b < B; ++b) {
        float scale;
        const int sum = quantize_block(xp + i * K + b * kBlock, a.q.data() + m * K + b * kBlock, &scale);
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
void W4A8Gemm::run(const Int8Rows& a, int64_t M, int64_t begin, int64_t end, at::Tensor& y) const {
  const int64_t B = K / kBlock, panels = N_p / kPanel;
  QKILN_DISPATCH(y.scalar_type(), "qkiln_w4a8", [&] {
    scalar_t* out = y.data_ptr<scalar_t>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = (task % panels) * kPanel, chunk = task / panels;
      const int64_t m_begin = chunk * kRowChunk, m_end = std::min(M, m_begin + kRowChunk);
      // This thread's next task is usually the next panel: its blocks are fetched a share per
      // microkernel call (all in the first call stalled that call).
      const uint8_t* next = task + 1 < end && (task + 1) % panels ? w + (n0 + kPanel) * K : nullptr;
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
  at::parallel_for(0, gemm.num_tasks(M), 1, [&](int64_t b, int64_t e) { gemm.run(a, M, b, e, y); });
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
