"""FP8 (e4m3, OCP "fn" variant, max 448) weights and activations: scales, casts, fake quantization.

Owns `Fp8Weight` and the scale rules; no GEMMs (those are plugins). torch CPU casts to and from
float8_e4m3fn, so everything here runs anywhere.

Rules and invariants:
- Weights: scale = amax / 448 per output channel, or per (channel, group) along in_features when a
  group size is given (finer scales; the last group may be shorter, as for integer weights).
  Values are divided by their scale, clamped to +-448 (the cast would otherwise saturate or give
  NaN depending on the torch version) and cast; w_hat = fp8.float() * scale.
- Activations: dynamic = one scale per token (amax over the last dim / 448), static = one
  calibrated per-tensor scale from the largest |x| seen (`update_amax`, `static_scale`); values
  beyond a static scale's range are clipped, which is what a static scale means.
- Error bound: e4m3 has 3 mantissa bits, so an in-range value is off by at most 2^-4 of its
  magnitude, or by half the smallest subnormal step (2^-10 * scale) near zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkiln.quant.rtn import expand_groups, group_minmax, round_up_to
from qkiln.quant.scheme import ActivationScheme, WeightScheme

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_EPS = torch.finfo(torch.float32).eps
# The floor of a dynamic per-token scale: the serving kernels' (plugins/reference.py, triton_fp8.py),
# which may not import this module. fp32 eps here made every token with amax below 448 * eps
# (~5e-5) score differently in the simulation than it is served (tests/test_formats_agree.py).
DYNAMIC_SCALE_MIN = 1e-12


@dataclass
class Fp8Weight:
    """An fp8 linear weight: e4m3 values plus fp32 scales."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scales: torch.Tensor  # [out, num_groups] fp32 (num_groups 1: per channel)
    group_size: int | None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape  # [out, in]

    def dequantize(self) -> torch.Tensor:
        scale = expand_groups(self.scales, self.group_size, self.weight.shape[1])
        return self.weight.float() * scale  # [out, in]


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, clamped to the e4m3 range and cast (scale broadcasts against x)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def weight_scales(W: torch.Tensor, group_size: int | None = None, scale_dtype: str = "float32") -> torch.Tensor:
    """amax / 448 per output channel (or per group) of W [out, in] -> [out, num_groups] fp32."""
    wmin, wmax = group_minmax(W.float(), group_size)
    amax = torch.maximum(wmin.abs(), wmax.abs())  # [out, num_groups]
    return round_up_to((amax / FP8_MAX).clamp(min=_EPS), scale_dtype)


def quantize_weight_fp8(W: torch.Tensor, group_size: int | None = None,
                        scale_dtype: str = "float32") -> Fp8Weight:
    """Per-channel (or per-group) e4m3 round-to-nearest quantization of W [out, in]."""
    W = W.float()
    scales = weight_scales(W, group_size, scale_dtype)
    q = cast_to_fp8(W, expand_groups(scales, group_size, W.shape[1]))
    return Fp8Weight(q, scales, group_size)


def quantize_weight_scheme(W: torch.Tensor, scheme: WeightScheme) -> Fp8Weight:
    return quantize_weight_fp8(W, scheme.group_size, scheme.scale_dtype)


def dynamic_token_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-token scale for x [..., hidden] -> [..., 1] fp32."""
    return (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=DYNAMIC_SCALE_MIN)


def quantize_activation_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hidden] -> (fp8 values, per-token scales [..., 1])."""
    scale = dynamic_token_scale(x)
    return cast_to_fp8(x, scale), scale


def update_amax(amax: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Running max of |x| over calibration batches (a 0-dim fp32 tensor)."""
    current = x.detach().float().abs().amax()
    return current if amax is None else torch.maximum(amax, current)


def static_scale(amax: torch.Tensor) -> torch.Tensor:
    """Static per-tensor scale from the calibrated amax (0-dim fp32)."""
    return (amax.float() / FP8_MAX).clamp(min=_EPS)


def quantize_activation_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return cast_to_fp8(x, scale)


def fake_quantize_weight_fp8(W: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    return quantize_weight_scheme(W, scheme).dequantize()


def fake_quantize_activation(x: torch.Tensor, scheme: ActivationScheme,
                             scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize x in its own dtype; static schemes need the calibrated `scale`."""
    if scheme.dynamic:
        q, token_scale = quantize_activation_dynamic(x)
        return (q.float() * token_scale).to(x.dtype)
    if scale is None:
        raise ValueError("a static activation scheme needs its calibrated scale (fp8.static_scale)")
    return (quantize_activation_static(x, scale).float() * scale).to(x.dtype)
