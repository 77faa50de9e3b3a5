"""Plain reference implementations of every qkiln op: what the fast paths are tested against.

Written for clarity, not speed: per-token and per-sequence Python loops, math in float64 for
attention and float32 for linears. They take the same flat arguments as the registered ops
(see ops.py), except the linears, which take the *canonical* quantized form:

    qweight [out, in]  uint8 0..15 (asymmetric int4) or int8 -8..7 (symmetric int4) / int8 (w8a16)
    scales  [out, num_groups]      zeros [out, num_groups] or None (symmetric)
    W[o, i] = (qweight[o, i] - zeros[o, i // group_size]) * scales[o, i // group_size]
    (the last group may be shorter than group_size: in=576 with group 128 has groups 128x4 + 64)

Must not import triton or anything outside torch and qkiln.
"""

import torch

from qkiln.plugins.kv_cache import FP8_DTYPE, FP8_MAX, dequantize_int4_groups, quantize_fp8
from qkiln.plugins.kv_cache import kv_dtype_of, quantize_int4_groups


def reference_cache_write(key, value, k_cache, v_cache, k_scale, v_scale, k_group_scale,
                          k_group_min, v_group_scale, v_group_min, k_channel_scale,
                          slot_mapping) -> None:
    """Quantize and store key/value [N, Hkv, D] one token at a time at slot_mapping [N]."""
    kv_dtype = kv_dtype_of(k_cache)
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        k = key[token].float()  # [Hkv, D]
        if k_channel_scale is not None:
            k = k / k_channel_scale
        for x, cache, head_scale, g_scale, g_min in (
                (k, k_cache, k_scale, k_group_scale, k_group_min),
                (value[token].float(), v_cache, v_scale, v_group_scale, v_group_min)):
            if kv_dtype == "int4":
                packed, scale, minimum = quantize_int4_groups(x, x.shape[-1] // g_scale.shape[-1])
                cache[block_id, offset] = packed
                g_scale[block_id, offset] = scale
                g_min[block_id, offset] = minimum
            elif kv_dtype == "fp8":
                cache[block_id, offset] = quantize_fp8(x, head_scale)
            else:
                cache[block_id, offset] = x.to(cache.dtype)


def _dequantize_slots(cache, slots, head_scale, g_scale, g_min) -> torch.Tensor:
    """Float64 [len(slots), Hkv, D] values stored at the given slots."""
    flat = cache.flatten(0, 1)[slots]
    if cache.dtype == torch.uint8:
        x = dequantize_int4_groups(flat, g_scale.flatten(0, 1)[slots], g_min.flatten(0, 1)[slots])
    elif cache.dtype == FP8_DTYPE:
        x = flat.float() * head_scale[:, None]
    else:
        x = flat.float()
    return x.double()


REFERENCE_QUERY_ROWS = 256


def reference_paged_attention(query, k_cache, v_cache, k_scale, v_scale, k_group_scale,
                              k_group_min, v_group_scale, v_group_min, k_channel_scale,
                              block_tables, seq_lens, query_start_loc, scale: float):
    """Causal attention of each sequence's query rows (its last q_len positions) over its context.
    """
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for seq_id, ctx_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[seq_id], starts[seq_id + 1]
        q_len = q_end - q_begin
        blocks = block_tables[seq_id].tolist()
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                              for p in range(ctx_len)], dtype=torch.long)
        k = _dequantize_slots(k_cache, slots, k_scale, k_group_scale, k_group_min)
        v = _dequantize_slots(v_cache, slots, v_scale, v_group_scale, v_group_min)
        if k_channel_scale is not None:
            k = k * k_channel_scale.double()
        k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]: query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        # REFERENCE_QUERY_ROWS query rows at a time: each row's result is its own, and float64
        # [Hq, q_len, ctx] scores for a whole 4096-token prefill took 2.5 GB (quadratic)
        for r0 in range(0, q_len, REFERENCE_QUERY_ROWS):
            r1 = min(r0 + REFERENCE_QUERY_ROWS, q_len)
            q = query[q_begin + r0:q_begin + r1].double()  # [rows, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, rows, ctx]
            q_pos = torch.arange(ctx_len - q_len + r0, ctx_len - q_len + r1)[:, None]
            hidden = torch.arange(ctx_len)[None, :] > q_pos  # [rows, ctx]
            scores.masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            # a hidden key's NaN / inf value must not reach the rows it is hidden from (0 * NaN is
            # NaN); a row that sees one stays non-finite
            finite = torch.isfinite(v).all(-1)  # [ctx, H]
            rows = torch.einsum("hqk,khd->qhd", probs, torch.where(finite[..., None], v, 0.0))
            sees = (~finite.t()[:, None, :] & ~hidden[None]).any(-1).t()  # [rows, H]
            out[q_begin + r0:q_begin + r1] = rows.masked_fill(sees[..., None], float("nan")).to(query.dtype)
    return out


def dequantize_grouped(qweight, scales, zeros, group_size: int) -> torch.Tensor:
    """Canonical grouped int weight -> float32 [out, in]; handles a shorter last group."""
    in_features = qweight.shape[1]
    scale = scales.float().repeat_interleave(group_size, dim=1)[:, :in_features]
    q = qweight.float()
    if zeros is not None:
        q = q - zeros.float().repeat_interleave(group_size, dim=1)[:, :in_features]
    return q * scale


def _linear(x, weight, bias):
    out = x.float() @ weight.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def reference_w4a16_linear(x, qweight, scales, zeros, group_size: int, bias=None):
    """x [..., in] @ dequantized(W)^T in float32 (canonical int4 form, see module doc)."""
    return _linear(x, dequantize_grouped(qweight, scales, zeros, group_size), bias)


def reference_w8a16_linear(x, qweight, scales, bias=None):
    """x [..., in] @ (int8 [out, in] * scales [out])^T in float32."""
    return _linear(x, qweight.float() * scales.float()[:, None], bias)


INT8_BLOCK = 32  # input channels per activation scale of the int8-activation linears


def quantize_int8_blocks(x: torch.Tensor):
    """x [..., in] (in % 32 == 0) -> (q int8 [..., in], scale fp32 [..., in / 32]), one scale per
    32 channels: q = round_half_even(x * (127 / amax)), scale = amax / 127 (0 for an all-zero
    block), the exact fp32 operations of csrc/cpu_gemm_w4a8.cpp."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // INT8_BLOCK, INT8_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor: `127.0 / amax` would run as reciprocal(amax) * 127, two
    # roundings where the kernel's 127.f / amax has one, and now and then a code off by one.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).to(torch.int8).reshape(x.shape)
    return q, (amax / 127.0).squeeze(-1)


def fake_quantize_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded through quantize_int8_blocks, back in float32 (what those linears compute with)."""
    q, scale = quantize_int8_blocks(x)
    blocks = q.float().reshape(*x.shape[:-1], -1, INT8_BLOCK) * scale[..., None]
    return blocks.reshape(x.shape)


def reference_w4a8_linear(x, qweight, scales, zeros, group_size: int, bias=None):
    """Canonical grouped int4 (or int8 with one group, `zeros` None) weights x activations rounded
    to int8 per 32 channels (fake_quantize_int8_blocks), float32 GEMM."""
    weight = dequantize_grouped(qweight, scales, zeros, group_size)
    return _linear(fake_quantize_int8_blocks(x), weight, bias).to(x.dtype)


def fake_quantize_fp8_per_token(x: torch.Tensor):
    """Dynamic per-token fp8: (x_q fp8 [..., in], scale fp32 [..., 1]) with x ~= x_q * scale."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static fp8 activations: x / scale (one calibrated fp32 scale), clipped to +-448 and cast;
    quant/fp8.quantize_activation_static's rounding."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fake_quantize_fp8_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values x rounds to as fp8: per token, or with the calibrated per-tensor `input_scale`."""
    if input_scale is None:
        x_q, x_scale = fake_quantize_fp8_per_token(x)
    else:
        x_q, x_scale = quantize_fp8_static(x, input_scale), input_scale.float()
    return x_q.float() * x_scale


def reference_fp8_w8a8_linear(x, weight, weight_scale, bias=None, input_scale=None):
    """fp8 e4m3 weight [out, in] with per-channel scale [out]; activations quantized per token, or
    with the calibrated per-tensor `input_scale` (static)."""
    w = weight.float() * weight_scale.float()[:, None]
    out = fake_quantize_fp8_activations(x, input_scale) @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
