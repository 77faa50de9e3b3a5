// qkiln CPU elementwise ops for the bf16 serving path (add + RMSNorm, SiLU-and-mul, rotary
// embedding). Built with the other kernels by plugins/cpu_native.py (-ffp-contract=off: a product
// HF rounds to bf16 must not fuse into an FMA). Reference: plugins/reference_small_ops.py.
//
// ---- elementwise ops: Hugging Face's eager rounding, op by op -----------------------------------
// Every intermediate that HF's bf16/fp16 code rounds to the activation dtype T is rounded here too
// (R = round to T, float math between):
//     add + RMSNorm   h = R(x + r);  y = R(h * 1 / sqrt(sum(h^2) / H + eps));  out = R(w * y)
//     SiLU and mul    out = R(R(g / (1 + exp(-g))) * u)           exp: torch's own Sleef_expf16_u10
//     RoPE            out = R(R(x * cos) + R(roll(x, D/2) * signed_sin))
// Only the fp32 order of sum(h^2) differs from torch, so results are bit-identical except where
// that changes a rounding. -ffp-contract=off keeps the compiler from fusing a rounded product
// into an FMA.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include "qkiln_cpu.h"
#include "vec.h"

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // below this, one thread: a parallel region costs more

template <typename F>
void for_rows(int64_t rows, int64_t width, const F& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) body(r);
                   });
}

// One row: (residual ? h = R(x + residual) -> residual : h = x); x_out = R(w * R(h * inv_rms)).
template <typename T>
void norm_row(const T* x, T* residual, const T* w, T* out, int64_t H, float eps) {
  Vf sumsq = set1(0.f);
  const T* h = x;
  if (residual) {
    for (int64_t i = 0; i < H; i += kW) store(residual + i, add(load(x + i, H - i), load(residual + i, H - i)), H - i);
    h = residual;
  }
  for (int64_t i = 0; i < H; i += kW) {
    const Vf v = load(h + i, H - i);
    sumsq = add(sumsq, mul(v, v));
  }
  // torch: mean = sum / H, then + eps, then rsqrt (1 / sqrt, two roundings).
  const float inv = 1.f / std::sqrt(reduce_add(sumsq) / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; i += kW) {
    const Vf y = round_to<T>(mul(load(h + i, H - i), set1(inv)));
    store(out + i, mul(load(w + i, H - i), y), H - i);
  }
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 &&
              x.size(-1) == weight.size(0) && x.dtype() == weight.dtype(),
              "rms_norm: x must be contiguous [..., H] and weight [H] of x's dtype");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  QKILN_DISPATCH(x.scalar_type(), "qkiln_rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, H, [&](int64_t r) {
      norm_row<scalar_t>(xp + r * H, nullptr, wp, op + r * H, H, static_cast<float>(eps));
    });
  });
  return out;
}

// vLLM's fused_add_rms_norm: residual = R(x + residual); x = rms_norm(residual) * weight.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.dtype() == x.dtype(),
              "fused_add_rms_norm: residual must be contiguous and match x");
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  QKILN_DISPATCH(x.scalar_type(), "qkiln_add_rms_norm", [&] {
    scalar_t *xp = x.data_ptr<scalar_t>(), *rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    for_rows(rows, H, [&](int64_t r) {
      norm_row<scalar_t>(xp + r * H, rp + r * H, wp, xp + r * H, H, static_cast<float>(eps));
    });
  });
}

// gate_up [..., 2I] contiguous -> R(R(silu(gate)) * up) [..., I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_and_mul: needs a contiguous [..., 2 * I] tensor");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, gate_up.options());
  silu_and_mul_out(gate_up, out);
  return out;
}

// out [..., I] (contiguous, gate_up's dtype) = silu(gate) * up of a contiguous [..., 2 * I].
void silu_and_mul_out(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t I = gate_up.size(-1) / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) == 2 * I && out.is_contiguous() &&
                  out.scalar_type() == gate_up.scalar_type() && out.numel() == rows * I,
              "silu_and_mul_out: needs contiguous [..., 2 * I] in and [..., I] out of one dtype");
  QKILN_DISPATCH(gate_up.scalar_type(), "qkiln_silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, 2 * I, [&](int64_t r) {
      const scalar_t *g = in + r * 2 * I, *u = g + I;
      for (int64_t i = 0; i < I; i += kW) {
        const Vf x = load(g + i, I - i);
        const Vf silu = round_to<scalar_t>(div(x, add(set1(1.f), vexp(sub(set1(0.f), x)))));
        store(op + r * I + i, mul(silu, load(u + i, I - i)), I - i);
      }
    });
  });
}

// In place: x[m, n] = x[m, n] * scales[n] taken in fp32 and rounded once into x's dtype, the bits
// of torch's x.mul_(scales) for a bf16 x and fp32 scales, which goes through a promoted temporary
// (64 x 49152 logits on 2 threads: torch 29.6 ms in place, 6.2 ms out of place and cast; this 0.63).
// x [M, N] contiguous float/bf16/fp16, scales [N] contiguous fp32.
void scale_columns_(at::Tensor& x, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && scales.dim() == 1 && scales.is_contiguous() &&
              scales.scalar_type() == at::kFloat && scales.size(0) == x.size(1),
              "scale_columns_: needs contiguous x [M, N] and fp32 scales [N]");
  const int64_t M = x.size(0), N = x.size(1);
  const float* sp = scales.data_ptr<float>();
  QKILN_DISPATCH(x.scalar_type(), "qkiln_scale_columns", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    for_rows(M, N, [&](int64_t m) {
      scalar_t* row = base + m * N;
      for (int64_t n = 0; n < N; n += kW)
        store(row + n, mul(load(row + n, N - n), load(sp + n, N - n)), N - n);
    });
  });
}

// In place on heads [0, num_heads) of qkv [N, H_total, D] (rows at any stride, heads dense);
// cos, signed_sin [N, D] contiguous, qkv's dtype (runtime/rope.py's tables).
void rotary_embedding(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                      int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2) &&
              qkv.size(2) % 2 == 0 && num_heads <= qkv.size(1),
              "rotary_embedding: qkv must be [N, H, D] with dense heads, even D");
  const int64_t N = qkv.size(0), D = qkv.size(2), half = D / 2;
  for (const at::Tensor* t : {&cos, &signed_sin})
    TORCH_CHECK(t->is_contiguous() && t->numel() == N * D && t->dtype() == qkv.dtype(),
                "rotary_embedding: cos/sin must be contiguous [N, D] in qkv's dtype");
  QKILN_DISPATCH(qkv.scalar_type(), "qkiln_rope", [&] {
    using T = scalar_t;
    T* base = qkv.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *sp = signed_sin.data_ptr<T>();
    for_rows(N, num_heads * D, [&](int64_t n) {
      const T *c = cp + n * D, *s = sp + n * D;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x = base + n * qkv.stride(0) + h * D;
        for (int64_t i = 0; i < half; i += kW) {
          const int64_t m = half - i;
          const Vf x1 = load(x + i, m), x2 = load(x + half + i, m);
          const Vf y1 = add(round_to<T>(mul(x1, load(c + i, m))), round_to<T>(mul(x2, load(s + i, m))));
          const Vf y2 = add(round_to<T>(mul(x2, load(c + half + i, m))),
                            round_to<T>(mul(x1, load(s + half + i, m))));
          store(x + i, y1, m);
          store(x + half + i, y2, m);
        }
      }
    });
  });
}

namespace {

// The first index of the largest of row[0, V), NaN counting as the largest (torch.argmax's rule).
// Widening to fp32 keeps order and ties, so bf16 logits need no fp32 copy first.
template <typename T>
int64_t argmax_row(const T* row, int64_t V) {
  int64_t best = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // as vec.h's Vf
  // Per lane: strict > keeps the lane's first maximum; across lanes the smallest index among
  // the lanes holding the maximum. Lanes past V never compare (masked), and the first
  // vector's padding holds -inf with index INT32_MAX, never chosen over a real lane. NaN is
  // rare: detected per vector, then found by a plain scan.
  const __m512i step = _mm512_set1_epi32(16);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t first_n = std::min<int64_t>(V, 16);
  const __mmask16 first = lanes(first_n);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best_v = _mm512_mask_mov_ps(neg_inf, first, load(row, first_n));
  __m512i best_i = _mm512_mask_mov_epi32(
      _mm512_set1_epi32(std::numeric_limits<int32_t>::max()), first, idx);
  __mmask16 nan = _mm512_cmp_ps_mask(best_v, best_v, _CMP_UNORD_Q);
  for (int64_t i = 16; i < V; i += 16) {
    idx = _mm512_add_epi32(idx, step);
    const int64_t n = std::min<int64_t>(V - i, 16);
    const __mmask16 valid = lanes(n);
    const __m512 v = load(row + i, n);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, v, best_v, _CMP_GT_OQ);
    best_v = _mm512_mask_mov_ps(best_v, gt, v);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
  }
  if (nan) {
    while (!std::isnan(static_cast<float>(row[best]))) ++best;
  } else {
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best_v));
    const __mmask16 at_top = _mm512_cmp_ps_mask(best_v, top, _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(at_top, best_i);
  }
#else
  float best_value = static_cast<float>(row[0]);
  for (int64_t i = 1; i < V && !std::isnan(best_value); ++i) {
    const float value = static_cast<float>(row[i]);
    if (value > best_value || std::isnan(value)) best = i, best_value = value;
  }
#endif
  return best;
}

}  // namespace

// logits [M, V] contiguous (fp32, bf16 or fp16) -> int64 [M]: argmax_row of each row. torch's CPU
// argmax reads ~0.6 G floats/s (76 us for SmolLM2's 49152-token vocabulary, 5.7 ms for 64 rows: a
// greedy step's sampling).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: needs contiguous [M, V] logits with V > 0");
  const int64_t M = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V < std::numeric_limits<int32_t>::max(), "argmax_rows: V must fit int32");
  at::Tensor out = at::empty({M}, logits.options().dtype(at::kLong));
  int64_t* result = out.data_ptr<int64_t>();
  QKILN_DISPATCH(logits.scalar_type(), "qkiln_argmax_rows", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    for_rows(M, V, [&](int64_t r) { result[r] = argmax_row(x + r * V, V); });
  });
  return out;
}

ArgmaxSpan argmax_span(const at::Tensor& logits, int64_t row, int64_t begin, int64_t end) {
  ArgmaxSpan best;
  if (end <= begin) return best;
  QKILN_DISPATCH(logits.scalar_type(), "qkiln_argmax_span", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>() + row * logits.size(1);
    best.index = begin + argmax_row(x + begin, end - begin);
    best.value = static_cast<float>(x[best.index]);
  });
  return best;
}

void ArgmaxSpan::merge(const ArgmaxSpan& later) {
  if (later.index < 0 || std::isnan(value)) return;
  if (index < 0 || std::isnan(later.value) || later.value > value) *this = later;
}

bool silu_exp_is_torchs() { return exp_is_torchs(); }
