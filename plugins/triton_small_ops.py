"""Triton kernels of the small fused ops on GPU: rms_norm, fused_add_rms_norm, silu_and_mul,
rotary_embedding (ops.py registers them as the CUDA kernels of the `qkiln::` ops).

Why: on the GPU these ops ran as HF-style eager torch code, ~15 elementwise kernels per layer
that each read and write the activations (~2.5 ms of a ~7 ms Llama-3-8B batch-1 step on the
H200); here each op is one kernel, one read and one write. Numerics are the references'
(reference_small_ops.py, i.e. Hugging Face's eager rounding): every value HF rounds to the
activation dtype T is rounded here too (`.to(T).to(fp32)`), statistics in fp32:
    add + RMSNorm   h = R(x + r);  y = R(h / sqrt(sum(h^2) / H + eps));  out = R(w * y)
    SiLU and mul    out = R(R(g / (1 + exp(-g))) * u)
    RoPE            out = R(R(x * cos) + R(roll(x, D/2) * signed_sin))
One program per row (a token; for RoPE a token's heads). Imports triton at module load, so only
ops.py (on CUDA tensors) and tests import it; also runs under TRITON_INTERPRET=1 on CPU tensors
(the interpreter truncates fp32 -> bf16 instead of rounding, so only fp32 is exact there).
"""

import torch
import triton
import triton.language as tl

from qkiln.plugins.reference_small_ops import (reference_fused_add_rms_norm, reference_rms_norm,
                                               reference_rotary_embedding, reference_silu_and_mul)


@triton.jit
def _rms_norm_kernel(X, Residual, W, Out, H, eps, stride_x, stride_r, stride_o,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:  # residual = R(x + residual), the normed input
        r = tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0)
        h = (h + r.to(tl.float32)).to(x.dtype)
        tl.store(Residual + row * stride_r + cols, h, mask=mask)
        h = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    y = (h * inv).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * y).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, I, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    for start in range(0, I, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(GateUp + row * stride_in + cols, mask=mask, other=0.0)
        u = tl.load(GateUp + row * stride_in + I + cols, mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(Out + row * stride_out + cols, (silu * u).to(g.dtype), mask=mask)


@triton.jit
def _rotary_kernel(QKV, Cos, Sin, num_heads, stride_t, stride_h, stride_c,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    cols = tl.arange(0, HALF)[None, :]  # [1, HALF]
    mask = heads < num_heads
    base = QKV + token * stride_t + heads * stride_h
    x1 = tl.load(base + cols, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(Cos + token * stride_c + cols).to(tl.float32)
    c2 = tl.load(Cos + token * stride_c + HALF + cols).to(tl.float32)
    s1 = tl.load(Sin + token * stride_c + cols).to(tl.float32)
    s2 = tl.load(Sin + token * stride_c + HALF + cols).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (a * c1).to(dtype).to(tl.float32) + (b * s1).to(dtype).to(tl.float32)
    y2 = (b * c2).to(dtype).to(tl.float32) + (a * s2).to(dtype).to(tl.float32)
    tl.store(base + cols, y1.to(dtype), mask=mask)
    tl.store(base + HALF + cols, y2.to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [rows, H] view (rows at a common stride, last dim dense)."""
    return x.reshape(-1, x.shape[-1])


# Shapes the kernels do not take (a weight that is not [H], a residual unlike x, an odd gate_up,
# more heads than qkv has) run the reference, which raises where the shapes make no sense: a
# kernel indexes by x's geometry and would read or write past the other tensors.

def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if weight.shape != x.shape[-1:]:
        return reference_rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows, H = _rows(x.contiguous()), x.shape[-1]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, H, eps, rows.stride(0), 0, H,
                                           HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(H))
    return out


def triton_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> None:
    """In place (vLLM's semantics): residual = R(x + residual); x = rms_norm(residual)."""
    if not (x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape
            and residual.dtype == x.dtype and weight.shape == x.shape[-1:]):
        return reference_fused_add_rms_norm(x, residual, weight, eps)
    rows, res, H = _rows(x), _rows(residual), x.shape[-1]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, rows, H, eps, H, H, H,
                                           HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(H))


def triton_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.shape[-1] % 2:
        return reference_silu_and_mul(gate_up)
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = _rows(gate_up)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0],)](rows, out, inter, 2 * inter, inter,
                                               BLOCK=min(1024, triton.next_power_of_2(inter)))
    return out


def triton_rotary_embedding(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                            num_heads: int) -> None:
    """In place on heads [0, num_heads) of qkv [..., H, D] (heads dense, tokens at one stride);
    cos, signed_sin [..., D] or [..., 1, D]. Other layouts run the reference."""
    head_dim = qkv.shape[-1]
    try:
        tokens = qkv.view(-1, *qkv.shape[-2:])  # [N, H, D], still qkv's memory
    except RuntimeError:  # token dims not viewable as one: the reference handles any layout
        return reference_rotary_embedding(qkv, cos, signed_sin, num_heads)
    if (tokens.stride(-1) != 1 or tokens.stride(-2) != head_dim or head_dim & (head_dim - 1)
            or num_heads > tokens.shape[1]):
        return reference_rotary_embedding(qkv, cos, signed_sin, num_heads)
    n = tokens.shape[0]
    cos, signed_sin = cos.reshape(n, head_dim).contiguous(), signed_sin.reshape(n, head_dim).contiguous()
    if n:
        _rotary_kernel[(n,)](tokens, cos, signed_sin, num_heads, tokens.stride(0), head_dim, head_dim,
                             HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(num_heads))
