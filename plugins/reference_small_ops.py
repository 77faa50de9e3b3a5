"""Plain-torch references for the small fused ops (rms_norm, fused_add_rms_norm, silu_and_mul,
rotary_embedding): the definitions csrc/cpu_small_ops.cpp must reproduce, and the kernels every device
without a native one runs.

Numerics are Hugging Face's eager code, op by op: every product or sum HF computes in the
activation dtype is rounded to it here too (bf16 ops on CPU compute in fp32 and round once), and
RMSNorm's statistics are fp32. In fp32 they equal the model's own torch code exactly.
"""

import torch
from torch import Tensor


def reference_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H] -> weight * R(x * rsqrt(mean(x^2) + eps)), statistics in fp32."""
    h = x.float()
    return weight * (h * h.square().mean(-1, keepdim=True).add_(eps).rsqrt_()).to(x.dtype)


def reference_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: residual = R(x + residual); x = rms_norm(residual) (vLLM's semantics)."""
    residual.add_(x)
    x.copy_(reference_rms_norm(residual, weight, eps))


def reference_silu_and_mul(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2I] -> R(R(silu(gate)) * up) [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reference_rotary_embedding(qkv: Tensor, cos: Tensor, signed_sin: Tensor, num_heads: int) -> None:
    """In place on heads [0, num_heads) of qkv [..., H, D]; cos, signed_sin [..., D] or [..., 1, D]
    (rope.py's tables: sin with its first half negated), in qkv's dtype
    -> R(R(x * cos) + R(roll(x, D/2) * signed_sin))."""
    x = qkv[..., :num_heads, :]  # [..., num_heads, D]
    table_shape = (*x.shape[:-2], 1, x.shape[-1])
    cos, signed_sin = cos.reshape(table_shape), signed_sin.reshape(table_shape)
    x.copy_(x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)
