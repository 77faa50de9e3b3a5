"""Fake quantization: quantize-then-dequantize in the input's dtype, for simulated execution.

Owns the entry points the lean model's simulated mode calls, one per tensor kind, so `qkiln eval`
can score any scheme before a kernel exists. Each returns a tensor of the input's shape and
dtype whose values are exactly what the quantized format would give back (same grid, same
rounding as the real quantizers: they are called, not re-implemented).
"""

from __future__ import annotations

import torch

from qkiln.quant.fp8 import fake_quantize_activation, fake_quantize_weight_fp8
from qkiln.quant.kv import KVCalibration, fake_quant_kv
from qkiln.quant.rtn import QuantizedWeight, fake_quantize_rtn
from qkiln.quant.scheme import WeightScheme

# activations and KV have their fake-quant next to their quantizers; re-exported so callers need one module
__all__ = ["fake_quantize_weight", "dequantized_like", "fake_quantize_activation", "fake_quant_kv", "KVCalibration"]


def fake_quantize_weight(W: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize of W [out, in] (int or fp8 per the scheme)."""
    if scheme.type == "float":
        return fake_quantize_weight_fp8(W, scheme).to(W.dtype)
    return fake_quantize_rtn(W, scheme).to(W.dtype)


def dequantized_like(quantized: QuantizedWeight, like: torch.Tensor) -> torch.Tensor:
    """The weight a GPTQ / AWQ / RTN result stands for, in `like`'s dtype and device."""
    return quantized.dequantize().to(dtype=like.dtype, device=like.device)
