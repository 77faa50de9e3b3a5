"""KV cache quantization: INT4 per token and head, FP8 per head, static key smoothing and offset.

Owns the math a cache write / read performs and its calibration; not the cache layout, the
paged blocks or the attention kernels (plugins). Tensors are [num_tokens, num_kv_heads, head_dim].

INT4 (asymmetric, per token and head, `group_size` channels along head_dim per group; KIVI,
Liu et al. 2024, Sec. 3.1 quantizes values this way):

    head_dim 64, group 32:  | channels 0..31 -> (scale, zero) | channels 32..63 -> (scale, zero) |
    x_hat = q * scale + zero,  q in [0, 15],  zero = group minimum (an additive offset in x's units,
    bounded by the data), |x - x_hat| <= scale / 2. The cache stores scale and zero in fp16, so zero
    is clamped to +-65504 and scale to at most 65504: an element below -65504 or above
    zero + 15 * 65504 saturates (code 0 or 15) rather than making them inf and attention NaN. A
    build refuses calibration data that reaches past +-65504 (`int4_cache_reach`).
    Codes are packed two per byte along head_dim (`quant/pack.py`, low nibble = even channel).

FP8 e4m3 with one calibrated scale per KV head: scale[h] = amax[h] / 448 over calibration data.

Key offset (keys only, optional; on in the kv-fp8 preset): a static per-(head, channel) mean mu
of the post-RoPE keys (what the cache stores) is subtracted before quantizing and never added
back: q . (k - mu) = q . k - q . mu shifts every score of one query by the same constant, which
softmax ignores. e4m3's error is relative to |element|, so removing the large constant part of
the outlier channels shrinks it; the fp8 scale is then amax|k - mu| / 448. (Values could take an
offset too, added back to the output since probabilities sum to 1; measured, it hurts.)

Key smoothing (keys only, optional): keys have a few large channels (KIVI Sec. 3; KVQuant,
Hooper et al. 2024, Sec. 3.1) that make per-token groups coarse. A static per-(head, channel)
scale c = amax^alpha (SmoothQuant's migration, Xiao et al. 2023, Sec. 4), normalised to geometric
mean 1 per head, divides K before quantization. Being static it works with a paged cache, and
the cache never multiplies back: scores use q * c against the stored K / c (`query_channel_scale`),
since (q * c) . (k / c) == q . k. The simulation (`fake_quant_kv`) multiplies back instead; same
scores.

Measured on SmolLM2-135M (wikitext-2 raw test, 6 windows of 512 tokens, keys after RoPE,
V quantized with the same group, calibration 2k tokens of Jane Austen), perplexity change:
    group           64       32      16
    plain        +10.6%    +4.7%   +1.3%
    smoothing     +3.2%    +3.8%   +1.9%   (alpha 0.5; tying rotate-half pairs made it worse)
so the int4 default is group 16 without smoothing; group 64 with smoothing is the compact choice.
FP8 (wiki.test.raw, first 16384 tokens, 512-token windows, unquantized 28.371; KV scales from
16 x 512 tokens of self:128, post-RoPE keys), perplexity change:
    per-head amax, K and V         +0.51%     (K alone +0.43%, V alone +0.02%)
    per-(head, channel) K scales   +0.62%     (smoothing alpha 1; alpha 0.5: +1.1% on 2048 tokens)
    key offset (mean), V plain     +0.13%     <- kv-fp8 default
    key and value offsets          +0.26%
    (on 2048 tokens the mean offset gave -0.52%, a mid-range offset (min + max) / 2 +0.43%.)
    Built and scored as artifacts by `qkiln bench quality` (scales from the first 16 x 512 tokens
    of the calibration set): per-head amax, wikitext-2 valid: +0.73%; key offset, a wikitext-2
    valid excerpt: +0.26%; key offset, the default mix (bench/results/quant_quality_main.json):
    +0.49%. The calibration text moves the result as much as the method does.
The offset is a mean of post-RoPE keys because the cache stores keys after RoPE; quantizing before
RoPE (KVQuant Sec. 3.2) would need RoPE applied on every read, a kernel change, and was not tried.
Those figures are 512-token windows, which is also where calibration samples stop.

Positions past calibration (`rotation`): RoPE turns each rotate-half pair (i, i + D/2) of a key by
position * theta_i, so a statistic of keys seen at positions 0..L_cal holds further out only for
pairs that barely turn over the model's context. Per pair, with phi_i = theta_i * max_positions
(radians over the context) and n_i the largest pair norm seen (rotation keeps norms), a key
component at any position is bounded by min(n_i + |mu_i|, amax_cal|k_i - mu_i| + phi_i * n_i).
Keys keep an offset channel only where that bound is below the one without it, and the fp8 scale
and smoothing use the bound, not the calibration amax. Measured before this (SmolLM2 W4A16,
kv-fp8 calibrated on 16 x 512 tokens, wiki.test 8192-token window): the offset of slowly turning
pairs, right at positions < 512, pushed k - mu up to 3.6x past the fp8 range further out, ~210k
clamped key elements between positions 4096 and 8192, perplexity +23% against a bf16 cache.
After (`qkiln eval --data wiki.test.raw --eval-tokens 8192`, fp32 simulation, bf16 cache 30.76 /
50.21): one 8192-token window 37.82 -> 31.57 (+2.6%), 512-token windows 50.63 -> 50.91 (+1.4%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkiln.quant.fp8 import FP8_DTYPE, FP8_MAX, cast_to_fp8
from qkiln.quant.pack import pack_int4, unpack_int4
from qkiln.quant.rtn import round_down_to, round_up_to
from qkiln.quant.scheme import KVCacheScheme

# int4 scale / min storage in the paged cache (plugins/kv_cache.py)
CACHE_SCALE_DTYPE = "float16"
FP16_MAX = 65504.0  # the largest finite fp16: int4 zeros and scales are clamped to it

_EPS = torch.finfo(torch.float32).eps
_MIN_RELATIVE_CHANNEL = 1e-3  # channels quieter than this fraction of the head's max are not boosted further


@dataclass
class KVCalibration:
    """Static scales from calibration for one layer's K or V."""

    scale: torch.Tensor | None  # [num_kv_heads] fp8 per-head scale; None for int4
    channel_scale: torch.Tensor | None  # [num_kv_heads, head_dim] key smoothing; None when off / for V
    offset: torch.Tensor | None = None  # [num_kv_heads, head_dim] key offset; None when off / for V


@dataclass
class KVStats:
    """Running per-(head, channel) statistics of K or V over calibration batches, each [H, D]."""

    minimum: torch.Tensor
    maximum: torch.Tensor
    total: torch.Tensor  # fp64 sum, for the mean
    count: int
    # [H, D/2] largest norm of a rotate-half pair (x_i, x_{i + D/2}); None for an odd head_dim
    pair_norm: torch.Tensor | None = None

    @property
    def amax(self) -> torch.Tensor:
        return torch.maximum(self.minimum.abs(), self.maximum.abs())

    @property
    def mean(self) -> torch.Tensor:
        return (self.total / max(self.count, 1)).float()


def update_kv_stats(stats: KVStats | None, x: torch.Tensor) -> KVStats:
    """Fold x [..., H, D] into the running statistics."""
    x3 = x.detach().float().reshape(-1, *x.shape[-2:])  # [N, H, D]
    half, pair_norm = x3.shape[-1] // 2, None
    if x3.shape[-1] % 2 == 0:
        pair_norm = torch.hypot(x3[..., :half], x3[..., half:]).amax(dim=0) if x3.shape[0] else \
            x3.new_zeros(x3.shape[1], half)  # no tokens: amax of nothing
    current = KVStats(x3.amin(dim=0), x3.amax(dim=0), x3.sum(dim=0, dtype=torch.float64), x3.shape[0],
                      pair_norm)
    if stats is None:
        return current
    pair_norm = None if stats.pair_norm is None else torch.maximum(stats.pair_norm, current.pair_norm)
    return KVStats(torch.minimum(stats.minimum, current.minimum), torch.maximum(stats.maximum, current.maximum),
                   stats.total + current.total, stats.count + current.count, pair_norm)


def update_kv_amax(amax: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Running per-(head, channel) max of |x| over calibration batches; x [N, H, D] -> [H, D]."""
    current = x.detach().float().abs().reshape(-1, *x.shape[-2:]).amax(dim=0)  # [H, D]
    return current if amax is None else torch.maximum(amax, current)


def key_channel_scale(amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Smoothing scale c [H, D] = amax^alpha, geometric mean 1 per head."""
    a = amax.float()
    floor = (a.amax(dim=-1, keepdim=True) * _MIN_RELATIVE_CHANNEL).clamp(min=_EPS)
    c = torch.maximum(a, floor).pow(alpha)
    return c / c.log().mean(dim=-1, keepdim=True).exp()


def query_channel_scale(channel_scale: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per-query-head copy [num_heads, D] of the key smoothing scale [num_kv_heads, D] (GQA).

    A kernel reading a cache of K / c multiplies q by this once per query instead of scaling K back.
    """
    return channel_scale.repeat_interleave(num_heads // channel_scale.shape[0], dim=0)


def kv_scales_from_amax(amax: torch.Tensor, scheme: KVCacheScheme, is_key: bool,
                        offset: torch.Tensor | None = None) -> KVCalibration:
    """Static scales from the calibrated per-channel amax [H, D] (of x - offset when offset is set)."""
    channel_scale = None
    if is_key and scheme.key_smoothing:
        channel_scale = key_channel_scale(amax, scheme.key_smoothing_alpha)
    scale = None
    if scheme.dtype == "fp8":
        smoothed = amax.float() if channel_scale is None else amax.float() / channel_scale
        scale = (smoothed.amax(dim=-1) / FP8_MAX).clamp(min=_EPS)  # [H]
    return KVCalibration(scale, channel_scale, offset)


def kv_scales_from_stats(stats: KVStats, scheme: KVCacheScheme, is_key: bool,
                         rotation: torch.Tensor | None = None) -> KVCalibration:
    """Static scales (and the key offset, when the scheme asks for it) from calibration statistics.

    rotation [D]: for post-RoPE keys, the angle each channel's pair turns over the model's context
    (the module doc): the scales and offset then hold at every position, not only calibration's."""
    if is_key and rotation is not None and stats.pair_norm is not None:
        return _position_robust_key_scales(stats, scheme, rotation)
    if not (is_key and scheme.key_offset):
        return kv_scales_from_amax(stats.amax, scheme, is_key)
    offset = stats.mean  # [H, D]
    shifted_amax = torch.maximum(stats.maximum - offset, offset - stats.minimum)  # amax of K - offset
    return kv_scales_from_amax(shifted_amax, scheme, is_key, offset)


def key_bound_at_any_position(stats: KVStats, rotation: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """[H, D] bound on |k - offset| for keys at any position (the module doc): calibration's amax
    plus the drift of a pair turning by rotation [D], or the pair's norm plus |offset|."""
    pair_norm = stats.pair_norm.repeat(1, 2)  # [H, D]: channel i and i + D/2 share their pair's
    shifted = torch.maximum(stats.maximum - offset, offset - stats.minimum)
    return torch.minimum(shifted + rotation.float() * pair_norm, pair_norm + offset.abs())


def _position_robust_key_scales(stats: KVStats, scheme: KVCacheScheme, rotation: torch.Tensor) -> KVCalibration:
    plain = key_bound_at_any_position(stats, rotation, torch.zeros_like(stats.minimum))
    if not scheme.key_offset:
        return kv_scales_from_amax(plain, scheme, is_key=True)
    mean = stats.mean
    with_offset = key_bound_at_any_position(stats, rotation, mean)
    keep = with_offset < plain  # the offset shrinks this channel wherever the key may be
    offset = torch.where(keep, mean, torch.zeros_like(mean))
    return kv_scales_from_amax(torch.where(keep, with_offset, plain), scheme, is_key=True, offset=offset)


def int4_cache_reach(stats: KVStats, calibration: KVCalibration) -> float:
    """The largest |element| an int4 cache stores for this K or V on the calibration data (after the
    key offset and smoothing): its fp16 group minimum and scale must hold it (FP16_MAX)."""
    low, high = stats.minimum, stats.maximum  # [H, D]
    if calibration.offset is not None:
        low, high = low - calibration.offset, high - calibration.offset
    reach = torch.maximum(low.abs(), high.abs())
    if calibration.channel_scale is not None:
        reach = reach / calibration.channel_scale
    return float(reach.max())


def calibrate_kv_scales(samples: torch.Tensor, scheme: KVCacheScheme, is_key: bool) -> KVCalibration:
    """Static scales from calibration K or V samples [N, H, D] (all at once)."""
    return kv_scales_from_stats(update_kv_stats(None, samples), scheme, is_key)


def quantize_kv_int4(x: torch.Tensor, group_size: int, channel_scale: torch.Tensor | None = None,
                     scale_dtype: str = CACHE_SCALE_DTYPE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H, D] -> (packed uint8 [N, H, D/2], scale [N, H, D/g], zero [N, H, D/g]), fp32 params."""
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % group_size or group_size % 2:
        raise ValueError(f"group_size {group_size} must be even and divide head_dim {head_dim}")
    xf = x.float() if channel_scale is None else x.float() / channel_scale
    grouped = xf.reshape(num_tokens, num_heads, head_dim // group_size, group_size)  # [N, H, D/g, g]
    reach = FP16_MAX if scale_dtype == "float16" else math.inf  # fp16 parameters saturate there
    zero = round_down_to(grouped.amin(dim=-1).clamp(-reach, reach), scale_dtype)  # [N, H, D/g]
    scale = (grouped.amax(dim=-1) - zero) / 15.0
    scale = round_up_to(scale.clamp(_EPS, reach), scale_dtype)
    q = ((grouped - zero.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return pack_int4(q.reshape(num_tokens, num_heads, head_dim)), scale, zero


def dequantize_kv_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                       channel_scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                       ) -> torch.Tensor:
    """Inverse of `quantize_kv_int4` up to the rounding: -> [N, H, D] in `dtype`."""
    q = unpack_int4(packed).float()  # [N, H, D]
    num_tokens, num_heads, head_dim = q.shape
    grouped = q.reshape(num_tokens, num_heads, head_dim // group_size, group_size)
    x = (grouped * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).reshape(q.shape)
    if channel_scale is not None:
        x = x * channel_scale
    return x.to(dtype)


def quantize_kv_fp8(x: torch.Tensor, scale: torch.Tensor, channel_scale: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """x [N, H, D] -> float8_e4m3fn [N, H, D] with per-head scale [H]; values past the range clip."""
    xf = x.float() if channel_scale is None else x.float() / channel_scale
    return cast_to_fp8(xf, scale.float().reshape(-1, 1))


def dequantize_kv_fp8(q: torch.Tensor, scale: torch.Tensor, channel_scale: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    assert q.dtype == FP8_DTYPE
    x = q.float() * scale.float().reshape(-1, 1)
    if channel_scale is not None:
        x = x * channel_scale
    return x.to(dtype)


def fake_quant_kv(x: torch.Tensor, scheme: KVCacheScheme, calibration: KVCalibration | None = None
                  ) -> torch.Tensor:
    """What a cache write then read returns for x [..., H, D], in x's dtype (simulated execution)."""
    shape = x.shape
    x3 = x.reshape(-1, *shape[-2:])  # [N, H, D]
    channel_scale = None if calibration is None else calibration.channel_scale
    offset = None if calibration is None else calibration.offset
    if offset is not None:  # the cache stores K - offset; adding it back shifts every score of a query alike
        x3 = x3.float() - offset
    if scheme.dtype == "int4":
        # the cache's storage precision, whatever an older manifest recorded: the report, `qkiln
        # eval`, the runtime and the engines compute one thing
        packed, scale, zero = quantize_kv_int4(x3, scheme.group_size, channel_scale, CACHE_SCALE_DTYPE)
        out = dequantize_kv_int4(packed, scale, zero, scheme.group_size, channel_scale)
    else:
        if calibration is None or calibration.scale is None:
            raise ValueError("an fp8 KV scheme needs calibrated per-head scales (kv.calibrate_kv_scales)")
        out = dequantize_kv_fp8(quantize_kv_fp8(x3, calibration.scale, channel_scale), calibration.scale,
                                channel_scale)
    if offset is not None:
        out = out + offset
    return out.reshape(shape).to(x.dtype)
