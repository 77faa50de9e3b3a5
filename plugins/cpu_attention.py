"""CPU paged attention and cache write: the main CPU decode path, plain torch, no SDPA.

Why not `scaled_dot_product_attention`: on CPU in bf16 it is 16-26x slower than matmul + softmax
for decode shapes (DESIGN.md). Here each step gathers the used blocks through the block table
(one index_select per tensor on the block dimension), dequantizes them to fp32 and runs batched
matmuls with an fp32 softmax. Intra-op parallelism is torch's own (torch.get_num_threads()).

    query rows of one kv head h (GQA, group = Hq / Hkv; no repeat_interleave of K/V):
        q[S, Hkv, group, D] @ K[S, Hkv, T, D]^T -> scores[S, Hkv, group, T]

Scales that are constant along the dot product are folded into the query instead of the keys
(scale, fp8 k_scale[h], k_channel_scale[h, d]); fp8 v_scale[h] is applied to the output.
Sequences with one query row (decodes) run as one padded batch; longer ones (prefill chunks)
run one by one in query chunks of at most QUERY_CHUNK rows, each seeing only the keys its causal
mask allows. Every sequence must own at least one query row.
"""

import torch

from qkiln.plugins.kv_cache import FP8_DTYPE, dequantize_int4_groups, quantize_fp8
from qkiln.plugins.kv_cache import quantize_int4_groups

QUERY_CHUNK = 256


def cpu_cache_write(key, value, k_cache, v_cache, k_scale, v_scale, k_group_scale, k_group_min,
                    v_group_scale, v_group_min, k_channel_scale, slot_mapping) -> None:
    """Vectorized write of key/value [N, Hkv, D] into slots slot_mapping [N] (-1 skipped)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k, v = key[valid].float(), value[valid].float()  # [num_valid, Hkv, D]
    if k_channel_scale is not None:
        k = k / k_channel_scale
    for x, cache, head_scale, g_scale, g_min in ((k, k_cache, k_scale, k_group_scale, k_group_min),
                                                 (v, v_cache, v_scale, v_group_scale, v_group_min)):
        if cache.dtype == torch.uint8:
            packed, scale, minimum = quantize_int4_groups(x, x.shape[-1] // g_scale.shape[-1])
            cache.flatten(0, 1).index_copy_(0, slots, packed)
            g_scale.flatten(0, 1).index_copy_(0, slots, scale)
            g_min.flatten(0, 1).index_copy_(0, slots, minimum)
        elif cache.dtype == FP8_DTYPE:
            # index_copy_ has no fp8 kernel on CPU; the bytes are the same through a uint8 view.
            stored = quantize_fp8(x, head_scale).view(torch.uint8)
            cache.view(torch.uint8).flatten(0, 1).index_copy_(0, slots, stored)
        else:
            cache.flatten(0, 1).index_copy_(0, slots, x.to(cache.dtype))


def _gather(cache, g_scale, g_min, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [S, nb] of one cache -> float32 [S, Hkv, nb * block_size, D] (raw, unscaled)."""
    num_seqs, num_blocks = blocks.shape
    tokens = num_blocks * cache.shape[1]
    flat_ids = blocks.flatten()

    def take(t):  # [S, T, Hkv, X] -> [S, Hkv, T, X]
        return t.index_select(0, flat_ids).view(num_seqs, tokens, *t.shape[2:]).transpose(1, 2)

    if cache.dtype == torch.uint8:
        # Transpose the small packed bytes, so dequantization writes the fp32 result in order.
        return dequantize_int4_groups(take(cache).contiguous(), take(g_scale).contiguous(),
                                      take(g_min).contiguous())
    gathered = take(cache)
    out = torch.empty(gathered.shape, dtype=torch.float32)  # [S, Hkv, T, D]
    return out.copy_(gathered)


def _fold_query(query, k_scale, k_channel_scale, num_kv_heads: int, scale: float):
    """query [N, Hq, D] -> float32 [N, Hkv, group, D] carrying every per-key constant scale."""
    q = query.float().unflatten(1, (num_kv_heads, -1)) * scale  # [N, Hkv, group, D]
    if k_scale is not None:
        q = q * k_scale[None, :, None, None]
    if k_channel_scale is not None:
        q = q * k_channel_scale[None, :, None, :]
    return q


def _attend(q, k, v, masked):
    """q [B, Hkv, R, D], k/v [B, Hkv, T, D], masked [B, 1, R, T] (True: hidden) -> q's shape."""
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B, Hkv, R, T]
    scores.masked_fill_(masked, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def cpu_paged_attention(query, k_cache, v_cache, k_scale, v_scale, k_group_scale, k_group_min,
                        v_group_scale, v_group_min, k_channel_scale, block_tables, seq_lens,
                        query_start_loc, scale: float):
    """Same contract as reference_paged_attention; fp32 math, output in query's dtype."""
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    q = _fold_query(query, k_scale, k_channel_scale, num_kv_heads, scale)
    out = torch.empty(q.shape, dtype=torch.float32)  # [N, Hkv, group, D]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_ids = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    kv = (k_cache, k_group_scale, k_group_min), (v_cache, v_group_scale, v_group_min)

    def gather(seq_ids, ctx_len):
        num_blocks = -(-ctx_len // block_size)
        blocks = block_tables[seq_ids, :num_blocks].long().clamp(min=0)  # padding ids may be -1
        return [_gather(cache, s, m, blocks) for cache, s, m in kv]

    if decode_ids:
        is_all_decode = len(decode_ids) == len(lens)  # the common step: no row indexing at all
        ids = slice(None) if is_all_decode else torch.tensor(decode_ids)
        rows = slice(None) if is_all_decode else query_start_loc[ids].long()
        k, v = gather(ids, max(lens[s] for s in decode_ids))
        positions = torch.arange(k.shape[2])
        masked = positions[None, :] >= seq_lens[ids].long()[:, None]  # [S_d, T]
        # Slots past a sequence's end hold stale bytes (maybe NaN); 0 * NaN would leak into P @ V.
        v.masked_fill_(masked[:, None, :, None], 0.0)
        # One decode row per sequence: a kv head's rows are its `group` query heads.
        out[rows] = _attend(q[rows], k, v, masked[:, None, None, :])
    for seq_id in sorted(set(range(len(lens))) - set(decode_ids)):
        _prefill(q, out, seq_id, starts, lens[seq_id], gather)
    if v_scale is not None:
        out *= v_scale[None, :, None, None]
    return out.flatten(1, 2).to(query.dtype)


def _prefill(q, out, seq_id: int, starts, ctx_len: int, gather) -> None:
    """One sequence's query rows [q_len] against its context, causal, in chunks of QUERY_CHUNK."""
    q_begin, q_end = starts[seq_id], starts[seq_id + 1]
    first_pos = ctx_len - (q_end - q_begin)  # context position of the first query row
    k, v = gather([seq_id], ctx_len)  # [1, Hkv, T, D]
    for chunk in range(q_begin, q_end, QUERY_CHUNK):
        rows = slice(chunk, min(chunk + QUERY_CHUNK, q_end))
        last_pos = first_pos + rows.stop - q_begin - 1
        q_pos = torch.arange(first_pos + chunk - q_begin, last_pos + 1)  # [R]
        num_keys = last_pos + 1
        masked = torch.arange(num_keys)[None, :] > q_pos[:, None]  # [R, T]
        # Rows of one kv head are (group, position) pairs: [1, Hkv, group * R, D].
        q_rows = q[rows].permute(1, 2, 0, 3)  # [Hkv, group, R, D]
        group, num_rows = q_rows.shape[1], q_rows.shape[2]
        result = _attend(q_rows.reshape(1, q_rows.shape[0], group * num_rows, -1),
                         k[:, :, :num_keys], v[:, :, :num_keys],
                         masked.repeat(group, 1)[None, None])
        out[rows] = result.view(-1, group, num_rows, result.shape[-1]).permute(2, 0, 1, 3)
