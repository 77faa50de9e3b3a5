"""Triton side of the paged KV cache: the cache_write kernel and the tile loader attention uses.

Owns the Triton view of the layout described in kv_cache.py (same slots, same int4 nibble order,
same quantization formula, reproduced bit for bit: min rounded down and scale rounded up to
fp16, IEEE division, codes rounded half to even). Imports triton at module load, so only
ops.py (on CUDA tensors) and tests import it. Also runs under TRITON_INTERPRET=1 on CPU tensors,
except fp8 (the interpreter's fp8 conversions are not trusted).

KV_MODE constexpr: 0 = bf16/fp16/fp32 storage, 1 = fp8 with per-head scale, 2 = packed int4.
"""

import torch
import triton
import triton.language as tl

from qkiln.plugins.kv_cache import FP8_MAX, FP16_MAX, cache_head_dim, check_gpu_int4_group, kv_dtype_of

_FP8_MAX = tl.constexpr(FP8_MAX)
_EPS = tl.constexpr(torch.finfo(torch.float32).eps)
_FP16_MAX = tl.constexpr(FP16_MAX)
KV_MODES = {"bf16": 0, "fp16": 0, "fp32": 0, "fp8": 1, "int4": 2}


def is_interpreter() -> bool:
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def load_kv_tile(Cache, GScale, GMin, block_ids, offsets, head, token_mask,
                 stride_cb, stride_cs, stride_ch, stride_gb, stride_gs, stride_gh,
                 KV_MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 GROUP_SIZE: tl.constexpr):
    """Raw (unscaled for fp8) float32 [BLOCK_N, BLOCK_D] tile of tokens (block_ids, offsets)."""
    base = block_ids[:, None] * stride_cb + offsets[:, None] * stride_cs + head * stride_ch
    if KV_MODE == 2 and HEAD_DIM == BLOCK_D:
        # Power-of-two head_dim: each byte and each (scale, min) pair is loaded once, then
        # byte j -> elements (2j, 2j + 1) by join + reshape, groups broadcast by a reshape.
        j = tl.arange(0, BLOCK_D // 2)
        byte = tl.load(Cache + base + j[None, :], mask=token_mask[:, None], other=0)
        q = tl.reshape(tl.join(byte & 15, byte >> 4), (byte.shape[0], BLOCK_D))
        g = tl.arange(0, BLOCK_D // GROUP_SIZE)
        g_off = (block_ids[:, None] * stride_gb + offsets[:, None] * stride_gs
                 + head * stride_gh + g[None, :])
        scale = tl.load(GScale + g_off, mask=token_mask[:, None], other=0.0).to(tl.float32)
        minimum = tl.load(GMin + g_off, mask=token_mask[:, None], other=0.0).to(tl.float32)
        x = tl.reshape(q.to(tl.float32), (q.shape[0], BLOCK_D // GROUP_SIZE, GROUP_SIZE))
        x = x * scale[:, :, None] + minimum[:, :, None]
        return tl.reshape(x, (q.shape[0], BLOCK_D))
    d = tl.arange(0, BLOCK_D)
    mask = token_mask[:, None] & (d[None, :] < HEAD_DIM)
    if KV_MODE == 2:
        # Any even head_dim: each byte is read twice (element 2j and 2j + 1), scales per element.
        byte = tl.load(Cache + base + (d // 2)[None, :], mask=mask, other=0).to(tl.int32)
        q = ((byte >> ((d % 2) * 4)[None, :]) & 15).to(tl.float32)
        g_base = block_ids[:, None] * stride_gb + offsets[:, None] * stride_gs + head * stride_gh
        g_off = g_base + (d // GROUP_SIZE)[None, :]
        scale = tl.load(GScale + g_off, mask=mask, other=0.0).to(tl.float32)
        minimum = tl.load(GMin + g_off, mask=mask, other=0.0).to(tl.float32)
        return q * scale + minimum
    else:
        return tl.load(Cache + base + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _fp16_toward(x, UP: tl.constexpr):
    """fp32 -> the nearest fp16 value at or above (UP) / below x, returned as fp32."""
    h = x.to(tl.float16)
    is_wrong_side = (h.to(tl.float32) < x) if UP else (h.to(tl.float32) > x)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)  # sign-magnitude: negative <=> bits < 0
    if UP:  # -0 (bits -32768) steps to the smallest positive subnormal
        stepped = tl.where(bits == -32768, 1, tl.where(bits < 0, bits - 1, bits + 1))
    else:  # +0 steps to the smallest negative subnormal (0x8001)
        stepped = tl.where(bits == 0, -32767, tl.where(bits < 0, bits + 1, bits - 1))
    stepped = stepped.to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(is_wrong_side, stepped, h).to(tl.float32)


@triton.jit
def _round_half_even(y):
    r = tl.floor(y)
    frac = y - r  # exact
    is_odd = (r.to(tl.int32) & 1) == 1
    return tl.where(frac > 0.5, r + 1.0, tl.where((frac == 0.5) & is_odd, r + 1.0, r))


@triton.jit
def _write_int4(Src, Dst, GScale, GMin, KCS, dst, g_dst, head,
                HAS_KCS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
                GROUPS_P2: tl.constexpr):
    """Quantize one [HEAD_DIM] vector at Src into packed bytes at Dst + dst (see module doc)."""
    g = tl.arange(0, GROUPS_P2)
    j = tl.arange(0, GROUP_SIZE // 2)
    even = g[:, None] * GROUP_SIZE + 2 * j[None, :]  # [groups, group_size / 2] element ids
    mask = even < HEAD_DIM
    x_even = tl.load(Src + even, mask=mask, other=0.0).to(tl.float32)
    x_odd = tl.load(Src + even + 1, mask=mask, other=0.0).to(tl.float32)
    if HAS_KCS:
        kcs = KCS + head * HEAD_DIM + even
        x_even = tl.math.div_rn(x_even, tl.load(kcs, mask=mask, other=1.0))
        x_odd = tl.math.div_rn(x_odd, tl.load(kcs + 1, mask=mask, other=1.0))
    lo = tl.minimum(tl.min(tl.where(mask, x_even, float("inf")), 1),
                    tl.min(tl.where(mask, x_odd, float("inf")), 1))
    hi = tl.maximum(tl.max(tl.where(mask, x_even, -float("inf")), 1),
                    tl.max(tl.where(mask, x_odd, -float("inf")), 1))
    g_mask = g * GROUP_SIZE < HEAD_DIM
    lo = tl.minimum(tl.maximum(lo, -_FP16_MAX), _FP16_MAX)  # fp16 min / scale saturate, not inf
    minimum = _fp16_toward(tl.where(g_mask, lo, 0.0), False)
    scale = tl.math.div_rn(tl.where(g_mask, hi, 0.0) - minimum, 15.0)
    scale = _fp16_toward(tl.minimum(tl.maximum(scale, _EPS), _FP16_MAX), True)
    q_even = _round_half_even(tl.math.div_rn(x_even - minimum[:, None], scale[:, None]))
    q_odd = _round_half_even(tl.math.div_rn(x_odd - minimum[:, None], scale[:, None]))
    q_even = tl.minimum(tl.maximum(q_even, 0.0), 15.0).to(tl.int32)
    q_odd = tl.minimum(tl.maximum(q_odd, 0.0), 15.0).to(tl.int32)
    packed = (q_even | (q_odd << 4)).to(tl.uint8)
    tl.store(Dst + dst + even // 2, packed, mask=mask)
    tl.store(GScale + g_dst + g, scale.to(tl.float16), mask=g_mask)
    tl.store(GMin + g_dst + g, minimum.to(tl.float16), mask=g_mask)


@triton.jit
def _cache_write_kernel(Key, Value, KC, VC, KS, VS, KGS, KGM, VGS, VGM, KCS, Slots,
                        stride_kn, stride_kh, stride_vn, stride_vh,
                        stride_cb, stride_cs, stride_ch, stride_gb, stride_gs, stride_gh,
                        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        KV_MODE: tl.constexpr, GROUP_SIZE: tl.constexpr,
                        GROUPS_P2: tl.constexpr, HAS_KCS: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(Slots + token).to(tl.int64)
    if slot < 0:  # padding row
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block_id * stride_cb + offset * stride_cs + head * stride_ch
    k_src = Key + token * stride_kn + head * stride_kh
    v_src = Value + token * stride_vn + head * stride_vh
    if KV_MODE == 2:
        g_dst = block_id * stride_gb + offset * stride_gs + head * stride_gh
        _write_int4(k_src, KC, KGS, KGM, KCS, dst, g_dst, head,
                    HAS_KCS, HEAD_DIM, GROUP_SIZE, GROUPS_P2)
        _write_int4(v_src, VC, VGS, VGM, KCS, dst, g_dst, head,
                    False, HEAD_DIM, GROUP_SIZE, GROUPS_P2)
    else:
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        k = tl.load(k_src + d, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_src + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_KCS:
            k = tl.math.div_rn(k, tl.load(KCS + head * HEAD_DIM + d, mask=mask, other=1.0))
        if KV_MODE == 1:  # IEEE division, as torch does: the same inputs give the same bytes
            k = tl.minimum(tl.maximum(tl.math.div_rn(k, tl.load(KS + head)), -_FP8_MAX), _FP8_MAX)
            v = tl.minimum(tl.maximum(tl.math.div_rn(v, tl.load(VS + head)), -_FP8_MAX), _FP8_MAX)
        tl.store(KC + dst + d, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + dst + d, v.to(VC.dtype.element_ty), mask=mask)


def cache_strides(cache: torch.Tensor, g_scale: torch.Tensor | None) -> tuple:
    """(block, slot, head) strides of a cache tensor and of its int4 group tensors (0 if none)."""
    group = (0, 0, 0) if g_scale is None else tuple(g_scale.stride()[:3])
    return tuple(cache.stride()[:3]) + group


def triton_cache_write(key, value, k_cache, v_cache, k_scale, v_scale, k_group_scale,
                       k_group_min, v_group_scale, v_group_min, k_channel_scale,
                       slot_mapping) -> None:
    """Launch one program per (token, kv head); same contract as reference_cache_write."""
    kv_mode = KV_MODES[kv_dtype_of(k_cache)]
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if value.shape != key.shape or key.shape[1:] != (k_cache.shape[2], cache_head_dim(k_cache)):
        # the kernel addresses rows by the cache's geometry: another shape would write past them
        raise ValueError(f"cache_write: key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                         f"[tokens, {k_cache.shape[2]}, {cache_head_dim(k_cache)}] for this cache")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    assert k_cache.stride() == v_cache.stride()
    groups = k_group_scale.shape[-1] if kv_mode == 2 else 1
    if kv_mode == 2:
        check_gpu_int4_group(head_dim, head_dim // groups)
    dummy = k_cache  # placeholder pointer for absent optional tensors (never read)
    _cache_write_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache,
        *(t if t is not None else dummy for t in (k_scale, v_scale, k_group_scale, k_group_min,
                                                   v_group_scale, v_group_min, k_channel_scale)),
        slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *cache_strides(k_cache, k_group_scale),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        KV_MODE=kv_mode, GROUP_SIZE=head_dim // groups, GROUPS_P2=triton.next_power_of_2(groups),
        HAS_KCS=k_channel_scale is not None)
