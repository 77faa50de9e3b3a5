"""Triton side of FP8 W8A8: fused per-token activation quantization and a decode GEMV.

Same numerics as reference.fake_quantize_fp8_per_token, so the GPU op matches the reference:

    scale[m] = max(amax_k |x[m, k]| / 448, 1e-12)        (IEEE division, fp32)
    x_q[m, k] = fp8_e4m3(clamp(x[m, k] / scale[m], -448, 448))   round to nearest even

`triton_quantize_fp8_per_token` does that in one launch (one program per row, two passes over
the row: amax, then quantize; the second pass reads the row from L2), replacing five torch
kernels in front of `torch._scaled_mm`.

`triton_fp8_gemv` (decode, <= GEMV_MAX_ROWS rows) fuses the quantization into the GEMV itself:
the weight is [N, K] with K contiguous, so one program owns BLOCK_N whole output rows and reads
them along K without splitting K; each program recomputes its row's amax from x (K values, an
L2 hit), so the whole linear is ONE launch:

    out[m, n] = (sum_k x_q[m, k] * w[n, k]) * scale[m] * w_scale[n] (+ bias[n])

Imports triton at module load: ops.py imports it on the first CUDA call.
"""

import torch
import triton
import triton.language as tl

from qkiln.plugins.triton_kv import is_interpreter

_FP8_MAX = tl.constexpr(448.0)
_MIN_SCALE = tl.constexpr(1e-12)
# Rows up to which the fused GEMV replaces quantize + _scaled_mm. Measured on an H200 only at 1
# row (GEMV 10.8 us vs 30.7 for the old torch-quantize path at 4096x4096) and 16 rows (quantize
# kernel + _scaled_mm 16.0 us); 2..8 rows were not measured, and each extra row re-reads the
# weights, so the GEMV stays a one-row path until they are.
GEMV_MAX_ROWS = 1


@triton.jit
def _row_scale(x_row, K, BLOCK_K: tl.constexpr):
    """max(amax |x_row[:K]| / 448, 1e-12) as an fp32 scalar.

    The GEMV passes a block covering the row in one or two loads (fewer serial L2 round trips
    before the first weight load); on an H200 that changed nothing measurable against 512-wide
    blocks (4096x4096: 10.4 -> 10.8 us, 4096x14336: 31.5 -> 30.7 us), so the pre-pass is not
    what keeps the K=14336 GEMV at ~1.9 TB/s.
    """
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.maximum(tl.math.div_rn(tl.max(amax, 0), _FP8_MAX), _MIN_SCALE)


@triton.jit
def _quantize(x, scale):
    """fp32 x -> fp8 e4m3 codes (as fp8), saturating like the reference's clamp."""
    q = tl.math.div_rn(x, scale)
    return tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(X, XQ, XS, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    scale = _row_scale(x_row, K, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        tl.store(XQ + row * stride_qm + rk, _quantize(x, scale), mask=rk < K)
    tl.store(XS + row, scale)


@triton.jit
def _fp8_gemv_kernel(X, W, WS, Bias, Out, N, K, stride_xm, stride_wn, stride_om,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     AMAX_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    x_row = X + row * stride_xm
    scale = _row_scale(x_row, K, AMAX_BLOCK)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # reduced over K once, at the end
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(x_row + rk, mask=k_mask, other=0.0).to(tl.float32)
        x_q = _quantize(x, scale).to(tl.float32)
        w = tl.load(W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += w * x_q[None, :]
    w_scale = tl.load(WS + rn, mask=n_mask, other=0.0)
    out = tl.sum(acc, 1) * scale * w_scale  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(Bias + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_om + rn, out.to(Out.dtype.element_ty), mask=n_mask)


def triton_quantize_fp8_per_token(rows: torch.Tensor):
    """rows [M, K] -> (x_q float8_e4m3fn [M, K], scale fp32 [M, 1]), one launch."""
    num_rows, in_features = rows.shape
    x_q = torch.empty(num_rows, in_features, dtype=torch.float8_e4m3fn, device=rows.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=rows.device)  # [M, 1]
    if num_rows:
        block_k = 32 if is_interpreter() else min(4096, triton.next_power_of_2(in_features))
        _quantize_kernel[(num_rows,)](rows, x_q, scale, in_features, rows.stride(0),
                                      x_q.stride(0), BLOCK_K=block_k, num_warps=8)
    return x_q, scale


def triton_fp8_gemv(rows, weight, weight_scale, bias=None, block_n: int | None = None,
                    block_k: int | None = None, num_warps: int = 4):
    """rows [M, K] (M small) @ (fp8 weight [N, K] * weight_scale [N])^T -> [M, N] rows' dtype."""
    num_rows, in_features = rows.shape
    out_features = weight.shape[0]
    out = torch.empty(num_rows, out_features, dtype=rows.dtype, device=rows.device)  # [M, N]
    if is_interpreter():
        block_n, block_k, amax_block = block_n or 16, block_k or 32, 32
    else:
        block_n, block_k = block_n or 16, block_k or 512
        amax_block = min(8192, triton.next_power_of_2(in_features))
    _fp8_gemv_kernel[(num_rows, triton.cdiv(out_features, block_n))](
        rows, weight, weight_scale, bias if bias is not None else weight_scale, out,
        out_features, in_features, rows.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, AMAX_BLOCK=amax_block,
        num_warps=num_warps)
    return out
