"""Paged KV cache: the per-layer layout, its allocation and sizing, and the KV quantization math.

Owns the `KVCache` dataclass, `allocate_kv_cache`, `kv_bytes_per_block` and the pure-torch
quantize/dequantize formulas that every implementation (reference, CPU, Triton) must reproduce.
It does not know about sequences: the runtime's block manager hands out block ids and builds
block tables and slot mappings.

Layout, per layer (K and V alike; block_size tokens per block):

    k: [num_blocks, block_size, num_kv_heads, head_dim]     bf16 / fp16 / fp32 / fp8 storage
    slot = block_id * block_size + offset   (slot_mapping; slot -1 = padding, never written)

    block_tables[s] = [7, 2, 9], block_size 4, seq_lens[s] = 10:
        position   0  1  2  3 | 4  5  6  7 | 8  9  .  .
        block           7     |     2      |     9         -> slots 28..31, 8..11, 36..37

fp8 (torch.float8_e4m3fn storage, static per-head scales from calibration):

    k_scale, v_scale: fp32 [num_kv_heads]          x ~= float(k[b, o, h, d]) * k_scale[h]

int4 (asymmetric, one scale and min per (slot, head, group), as quant/kv.py defines it: the
"zero" is stored as the group minimum in x's units, held in fp16 like the scale):

    k: uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2]
         byte j = q[2j] | q[2j + 1] << 4                (low nibble = even element)
    k_group_scale, k_group_min: fp16 [num_blocks, block_size, num_kv_heads, head_dim // group_size]
         x ~= q * scale + min,  q in 0..15
         min = fp16 round-down(clamp(min x, +-65504)),
         scale = fp16 round-up(clamp((max x - min) / 15, eps, 65504)),
         q = clamp(round-half-even((x - min) / scale), 0, 15)
    65504 is FP16_MAX, the largest finite fp16: an element below -65504 or above min + 15 * 65504
    saturates to code 0 or 15 instead of making min or scale inf (and every score that reads the
    group NaN); a build refuses calibration data that reaches past +-65504.

Key smoothing (optional, any kv dtype, keys only): k_channel_scale fp32 [num_kv_heads, head_dim].
key / k_channel_scale is what gets stored; readers multiply it back (or, equivalently and
cheaper, multiply the query by it before q.k).

Key offset (optional, any kv dtype, keys only): k_offset fp32 [num_kv_heads, head_dim], a
calibration mean of the post-RoPE keys. The cache write stores key - k_offset (before smoothing
and quantization; `offset_key`) and no reader ever adds it back: q.(k - mu) = q.k - q.mu shifts
every score of one query by the same amount, which softmax ignores. It is not an op argument,
so the kernels do not know about it.

Invariants: every tensor of a layer lives on one device; static scales are set once after
allocation (`cache.k_scale.copy_(calibrated)`), never per step.
"""

import math
from dataclasses import dataclass

import torch

from qkiln.errors import RecipeError

KV_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int4")
_FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FLOAT_NAMES = {dtype: name for name, dtype in _FLOAT_DTYPES.items()}
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT4_MAX = 15
FP16_MAX = 65504.0
_EPS = torch.finfo(torch.float32).eps


# the KVCache fields an artifact stores per layer (model.layers.{i}.self_attn.<name>) when its KV
# scheme has static scales
KV_SCALE_NAMES = ("k_scale", "v_scale", "k_channel_scale", "k_offset")


@dataclass
class KVCache:
    """One decoder layer's K and V blocks plus their quantization parameters (see module doc)."""

    k: torch.Tensor
    v: torch.Tensor
    kv_dtype: str
    group_size: int = 0  # int4 only
    k_scale: torch.Tensor | None = None  # fp8: [num_kv_heads] fp32
    v_scale: torch.Tensor | None = None
    k_group_scale: torch.Tensor | None = None  # int4: [blocks, block_size, kv_heads, groups] fp16
    k_group_min: torch.Tensor | None = None
    v_group_scale: torch.Tensor | None = None
    v_group_min: torch.Tensor | None = None
    k_channel_scale: torch.Tensor | None = None  # [num_kv_heads, head_dim] fp32
    k_offset: torch.Tensor | None = None  # [num_kv_heads, head_dim] fp32; subtracted on write only

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return cache_head_dim(self.k)

    def op_tensors(self) -> tuple:
        """The cache as the flat tuple the registered ops take (order matches their schemas)."""
        return (self.k, self.v, self.k_scale, self.v_scale, self.k_group_scale, self.k_group_min,
                self.v_group_scale, self.v_group_min, self.k_channel_scale)


def check_kv_dtype(kv_dtype: str, head_dim: int, group_size: int) -> None:
    """Raise RecipeError unless (kv_dtype, head_dim, group_size) is a layout we can store."""
    if kv_dtype not in KV_DTYPES:
        raise RecipeError(f"unknown kv cache dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "int4" and (group_size < 2 or group_size % 2 or head_dim % group_size):
        raise RecipeError(
            f"int4 kv cache needs an even group_size dividing head_dim={head_dim}, "
            f"got {group_size}; an artifact built with a kv-int4 recipe whose kv_cache.group_size divides it "
            "(e.g. head_dim itself) serves one")


def check_gpu_int4_group(head_dim: int, group_size: int) -> None:
    """The GPU's int4 cache write (triton_kv.py) quantizes a power-of-two group per program: refuse
    others when the cache is made, naming the sizes that fit this head_dim."""
    if group_size & (group_size - 1):
        fits = [g for g in (2, 4, 8, 16, 32, 64, 128, 256) if head_dim % g == 0][-3:]  # the largest
        raise RecipeError(
            f"the GPU's int4 KV cache needs a power-of-two group size, this artifact has {group_size} "
            f"(head_dim {head_dim}); serve it on a CPU or rebuild with kv_cache group_size "
            f"{' or '.join(map(str, fits))}")


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       kv_dtype: str, group_size: int = 32) -> int:
    """Bytes one block takes across all layers (K and V with their per-slot int4 scale/min).

    Static per-head and per-channel scales are per layer, not per block, and are not counted.
    """
    check_kv_dtype(kv_dtype, head_dim, group_size)
    slots = block_size * num_kv_heads
    if kv_dtype == "int4":
        per_tensor = slots * (head_dim // 2 + 2 * 2 * (head_dim // group_size))
    elif kv_dtype == "fp8":
        per_tensor = slots * head_dim
    else:
        per_tensor = slots * head_dim * _FLOAT_DTYPES[kv_dtype].itemsize
    return 2 * per_tensor * num_layers


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, kv_dtype: str, group_size: int = 32,
                      device: str | torch.device = "cpu",
                      has_k_channel_scale: bool = False, has_k_offset: bool = False) -> list[KVCache]:
    """Zero-filled caches, one per layer; static scales start at 1 (set them after calibration)."""
    check_kv_dtype(kv_dtype, head_dim, group_size)
    if kv_dtype == "int4" and torch.device(device).type == "cuda":
        check_gpu_int4_group(head_dim, group_size)
    caches = []
    for _ in range(num_layers):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        cache_args: dict = {"kv_dtype": kv_dtype}
        if kv_dtype == "int4":
            packed = (num_blocks, block_size, num_kv_heads, head_dim // 2)
            groups = (num_blocks, block_size, num_kv_heads, head_dim // group_size)
            cache_args.update(
                k=torch.zeros(packed, dtype=torch.uint8, device=device),
                v=torch.zeros(packed, dtype=torch.uint8, device=device),
                group_size=group_size,
                **{name: torch.zeros(groups, dtype=torch.float16, device=device) for name in
                   ("k_group_scale", "k_group_min", "v_group_scale", "v_group_min")})
        elif kv_dtype == "fp8":
            cache_args.update(
                k=torch.zeros(shape, dtype=FP8_DTYPE, device=device),
                v=torch.zeros(shape, dtype=FP8_DTYPE, device=device),
                k_scale=torch.ones(num_kv_heads, dtype=torch.float32, device=device),
                v_scale=torch.ones(num_kv_heads, dtype=torch.float32, device=device))
        else:
            dtype = _FLOAT_DTYPES[kv_dtype]
            cache_args.update(k=torch.zeros(shape, dtype=dtype, device=device),
                              v=torch.zeros(shape, dtype=dtype, device=device))
        # fp32 whatever torch's default dtype (a caller's bf16 default had rounded calibrated offsets)
        if has_k_channel_scale:
            cache_args["k_channel_scale"] = torch.ones(num_kv_heads, head_dim, dtype=torch.float32, device=device)
        if has_k_offset:
            cache_args["k_offset"] = torch.zeros(num_kv_heads, head_dim, dtype=torch.float32, device=device)
        caches.append(KVCache(**cache_args))
    return caches


def offset_key(key: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The key [N, Hkv, D] a cache write quantizes: key - k_offset (fp32) when the cache has one."""
    if cache.k_offset is None:
        return key
    shifted = key.float() - cache.k_offset  # fp32 into the quantizers, as quant/kv.py simulates
    return shifted if cache.kv_dtype in ("fp8", "int4") else shifted.to(key.dtype)


def kv_dtype_of(k: torch.Tensor) -> str:
    """The kv_dtype name a cache tensor's storage dtype implies (uint8 means packed int4)."""
    if k.dtype == torch.uint8:
        return "int4"
    if k.dtype == FP8_DTYPE:
        return "fp8"
    if k.dtype in _FLOAT_NAMES:
        return _FLOAT_NAMES[k.dtype]
    raise RecipeError(f"kv cache tensor has dtype {k.dtype}; allocate it with allocate_kv_cache")


def cache_head_dim(k: torch.Tensor) -> int:
    """head_dim of a cache tensor [blocks, block_size, kv_heads, last]: int4 packs two a byte."""
    return k.shape[3] * (2 if k.dtype == torch.uint8 else 1)


def float_dtype_name(dtype: torch.dtype) -> str:
    """bf16, fp16 or fp32: the kv_dtype (and --dtype) name of a float dtype."""
    return _FLOAT_NAMES[dtype]


def _round_fp16_toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    """fp32 -> the nearest fp16 value on the `direction` side (+inf: up, -inf: down), as fp16."""
    rounded = x.half()
    is_wrong_side = rounded.float() < x if direction > 0 else rounded.float() > x
    return torch.where(is_wrong_side, torch.nextafter(rounded, torch.full_like(rounded, direction)),
                       rounded)


def quantize_int4_groups(x: torch.Tensor, group_size: int):
    """x [..., D] -> (packed uint8 [..., D/2], scale fp16 [..., D/G], min fp16 [..., D/G]).

    The min rounds down and the scale up to fp16, so a group's extremes stay on the 0..15 grid
    (short of the saturation above); codes round half to even. This is quant/kv.py's quantize_kv_int4 with fp16 parameters, bit
    for bit, so an offline simulation sees exactly what the cache stores.
    """
    groups = x.float().unflatten(-1, (-1, group_size))  # [..., num_groups, group_size]
    minimum = _round_fp16_toward(groups.amin(-1).clamp(-FP16_MAX, FP16_MAX), -math.inf)
    scale = (groups.amax(-1) - minimum.float()) / INT4_MAX
    scale = _round_fp16_toward(scale.clamp(_EPS, FP16_MAX), math.inf)  # >= 2^-23: never zero in fp16
    q = ((groups - minimum.float()[..., None]) / scale.float()[..., None]).round()
    q = q.clamp(0, INT4_MAX).to(torch.uint8).flatten(-2)  # [..., D]
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale, minimum


def dequantize_int4_groups(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_int4_groups: [..., D/2] uint8 -> [..., D] in `dtype` (math in fp32)."""
    q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # [..., D]
    q = q.unflatten(-1, (scale.shape[-1], -1)).float()  # [..., num_groups, group_size]
    x = q * scale.float()[..., None] + minimum.float()[..., None]
    return x.flatten(-2).to(dtype)


def quantize_fp8(x: torch.Tensor, head_scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] / head_scale [H] -> fp8 e4m3, saturating at +-448 instead of producing NaN."""
    return (x.float() / head_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
