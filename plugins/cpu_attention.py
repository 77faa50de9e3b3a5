"""CPU paged attention and cache write: the main CPU decode path, plain torch, no SDPA.

Native first: for float, fp8 and int4 caches without key smoothing, attention (decodes and
prefill chunks) and the cache write run csrc/cpu_attention.cpp and cpu_kv_write.cpp
(cpu_native.native_ops(): K/V read through the block tables, no gather copies; fp8 widened in
registers, its per-head scales folded into the scores and the output; int4 rows dequantized tile
by tile into L1, once for the whole GQA group). Key smoothing, and int4 at head dims other than
32/64/128, keep the torch code below.

Why not `scaled_dot_product_attention`: on CPU in bf16 it is 16-26x slower than matmul + softmax
for decode shapes (DESIGN.md). Here each call gathers the context's slots through the block
table (one index_select per tensor), dequantizes them to fp32 and runs batched matmuls with an
fp32 softmax. Intra-op parallelism is torch's own (torch.get_num_threads()).

    query rows of one kv head h (GQA, group = Hq / Hkv; no repeat_interleave of K/V):
        q[S, Hkv, group, D] @ K[S, Hkv, T, D]^T -> scores[S, Hkv, group, T]

Scales that are constant along the dot product are folded into the query instead of the keys
(scale, fp8 k_scale[h], k_channel_scale[h, d]); fp8 v_scale[h] is applied to the output.
Sequences with one query row (decodes) run as one padded batch; longer ones (prefill chunks)
run one by one in query chunks of at most QUERY_CHUNK rows, each seeing only the keys its causal
mask allows. Every sequence must own at least one query row.

Per-step work is done once, not once per layer: every layer of a step passes the same
block_tables / seq_lens / query_start_loc / slot_mapping tensors, so the slot indices, masks and
row lists derived from them are memoised on those tensor objects (`_StepIndex`). A decode row's
padding (shorter sequences in a batch) gathers the sequence's own first slot, which is always
written, so no stale or NaN bytes ever enter P @ V; its scores are masked to -inf.
"""

import torch

from qkiln.plugins.cpu_native import native_ops
from qkiln.plugins.kv_cache import FP8_DTYPE, dequantize_int4_groups, quantize_fp8
from qkiln.plugins.kv_cache import quantize_int4_groups

QUERY_CHUNK = 256


class _Memo:
    """The last value derived from a set of tensors, valid while they are the same objects.

    Identity, not contents: the runner builds fresh metadata tensors every step and never writes
    into them (inference tensors have no version counter to detect that). Holding the tensors
    keeps their ids from being reused by new objects.
    """

    def __init__(self):
        self.tensors, self.extra, self.value = (), None, None

    def get(self, tensors: tuple, extra, make):
        if len(self.tensors) != len(tensors) or self.extra != extra or \
                any(a is not b for a, b in zip(self.tensors, tensors)):
            self.tensors, self.extra, self.value = tensors, extra, make()
        return self.value


_write_memo, _step_memo = _Memo(), _Memo()


def _valid_slots(slot_mapping):
    """(slots, row index or None when every row is written)."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping, None
    return slot_mapping[valid], valid.nonzero().flatten()


def cpu_cache_write(key, value, k_cache, v_cache, k_scale, v_scale, k_group_scale, k_group_min,
                    v_group_scale, v_group_min, k_channel_scale, slot_mapping) -> None:
    """Vectorized write of key/value [N, Hkv, D] into slots slot_mapping [N] (-1 skipped)."""
    ops = _native_for(k_cache, k_channel_scale)
    if ops is not None and key.stride(-1) == 1 and key.stride(-2) == key.shape[-1] and \
            value.stride(-1) == 1 and value.stride(-2) == value.shape[-1]:
        ops.cache_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_group_scale,
                        k_group_min, v_group_scale, v_group_min)
        return
    slots, rows = _write_memo.get((slot_mapping,), None, lambda: _valid_slots(slot_mapping))
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    if k_channel_scale is not None:
        key = key.float() / k_channel_scale
    for x, cache, head_scale, g_scale, g_min in ((key, k_cache, k_scale, k_group_scale, k_group_min),
                                                 (value, v_cache, v_scale, v_group_scale, v_group_min)):
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


_NATIVE_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)
_NATIVE_INT4_HEAD_DIMS = (32, 64, 128)


def native_serves(k_cache, k_channel_scale) -> bool:
    """Whether csrc/cpu_attention.cpp reads and writes this cache: no key smoothing; float or fp8
    storage with head_dim % 16 == 0, or int4 at head_dim 32/64/128."""
    if k_channel_scale is not None:
        return False
    if k_cache.dtype == torch.uint8:
        return 2 * k_cache.shape[-1] in _NATIVE_INT4_HEAD_DIMS
    return k_cache.dtype in _NATIVE_CACHE_DTYPES and k_cache.shape[-1] % 16 == 0


def _native_for(k_cache, k_channel_scale):
    """The native ops when they serve this cache (native_serves), else None."""
    return native_ops() if native_serves(k_cache, k_channel_scale) else None


class _StepIndex:
    """What every layer of one step derives from the step's metadata, computed once."""

    def __init__(self, block_tables, seq_lens, query_start_loc, block_size: int):
        self.starts, self.lens = query_start_loc.tolist(), seq_lens.tolist()
        num_seqs = len(self.lens)
        self.decode_ids = [s for s in range(num_seqs) if self.starts[s + 1] - self.starts[s] == 1]
        self.prefill_ids = [s for s in range(num_seqs) if self.starts[s + 1] - self.starts[s] > 1]
        tables = block_tables.long()
        self.decode_slots = self.decode_mask = self.decode_rows = None
        if self.decode_ids:
            ids = torch.tensor(self.decode_ids)
            lens = seq_lens.long()[ids]  # [S_d]
            positions = torch.arange(max(self.lens[s] for s in self.decode_ids))  # [T]
            masked = positions[None, :] >= lens[:, None]  # [S_d, T]
            positions = positions.masked_fill(masked, 0)  # padding reads the sequence's position 0
            self.decode_slots = _slots(tables[ids], positions, block_size)  # [S_d, T]
            if bool(masked.any()):
                self.decode_mask = masked[:, None, None, :]  # [S_d, 1, 1, T]
            if len(self.decode_ids) != num_seqs:
                self.decode_rows = query_start_loc.long()[ids]
        self.prefill_slots = {s: _slots(tables[s:s + 1], torch.arange(self.lens[s]), block_size)
                              for s in self.prefill_ids}  # [1, T]


def _slots(tables, positions, block_size: int) -> torch.Tensor:
    """tables [S, max_blocks] long, positions [S, T] or [T] -> slot ids [S, T]."""
    return tables.gather(1, (positions // block_size).expand(tables.shape[0], -1)) * block_size \
        + positions % block_size


def _gather(cache, g_scale, g_min, slots: torch.Tensor) -> torch.Tensor:
    """Slots [S, T] of one cache -> float32 [S, Hkv, T, D] (raw, unscaled)."""
    num_seqs, tokens = slots.shape
    flat = slots.flatten()

    def take(t):  # [blocks, block_size, Hkv, X] -> [S, Hkv, T, X]
        return t.flatten(0, 1).index_select(0, flat).view(num_seqs, tokens, *t.shape[2:]).transpose(1, 2)

    if cache.dtype == torch.uint8:
        # Transpose the small packed bytes, so dequantization writes the fp32 result in order.
        return dequantize_int4_groups(take(cache).contiguous(), take(g_scale).contiguous(),
                                      take(g_min).contiguous())
    if cache.dtype == FP8_DTYPE:
        cache = cache.view(torch.uint8)  # index_select has no fp8 kernel on CPU either
        gathered = take(cache).view(FP8_DTYPE)
    else:
        gathered = take(cache)
    out = torch.empty(gathered.shape, dtype=torch.float32)  # [S, Hkv, T, D]
    return out.copy_(gathered)


def _fold_query(query, k_scale, k_channel_scale, num_kv_heads: int, scale: float):
    """query [N, Hq, D] -> float32 [N, Hkv, group, D] carrying every per-key constant scale."""
    q = query.unflatten(1, (num_kv_heads, -1)).float() * scale  # [N, Hkv, group, D]
    if k_scale is not None:
        q = q * k_scale[None, :, None, None]
    if k_channel_scale is not None:
        q = q * k_channel_scale[None, :, None, :]
    return q


def _attend(q, k, v, masked):
    """q [B, Hkv, R, D], k/v [B, Hkv, T, D], masked [B, 1, R, T] or None (True: hidden) -> q's shape."""
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B, Hkv, R, T]
    if masked is not None:
        scores.masked_fill_(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)
    # a NaN / inf value makes every row of its head non-finite, so a finite result (the common
    # case, checked on the output: smaller than v for decodes) proves v had none
    if masked is None or bool(torch.isfinite(out).all()):
        return out
    return _attend_past_non_finite(probs, v, masked)


def _attend_past_non_finite(probs, v, masked):
    """probs @ v where some values are NaN / inf (one request's overflow): a hidden key has
    probability 0, but 0 * NaN is NaN, so a later position's overflow made the earlier rows of its
    chunk NaN too; their KV then went into the prefix cache under clean tokens' hashes, and every
    request sharing that prefix failed. Rows that see such a value stay non-finite."""
    finite = torch.isfinite(v).all(-1)  # [B, Hkv, T]
    out = torch.matmul(probs, torch.where(finite[..., None], v, 0.0))
    sees_non_finite = (~finite[:, :, None, :] & ~masked).any(-1)  # [B, Hkv, R]
    return out.masked_fill(sees_non_finite[..., None], float("nan"))


def cpu_paged_attention(query, k_cache, v_cache, k_scale, v_scale, k_group_scale, k_group_min,
                        v_group_scale, v_group_min, k_channel_scale, block_tables, seq_lens,
                        query_start_loc, scale: float):
    """Same contract as reference_paged_attention; fp32 math, output in query's dtype."""
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    ops = _native_for(k_cache, k_channel_scale)
    dense_heads = query.stride(-1) == 1 and query.stride(-2) == query.shape[-1]
    if ops is not None and dense_heads:  # decodes and prefill chunks alike
        out = torch.empty(query.shape, dtype=query.dtype)
        ops.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                            k_scale, v_scale, k_group_scale, k_group_min, v_group_scale, v_group_min)
        return out
    if query.shape[0] == 0:  # no rows (the native kernels and the reference return this too)
        return torch.empty(query.shape, dtype=query.dtype)
    step = _step_memo.get((block_tables, seq_lens, query_start_loc), block_size,
                          lambda: _StepIndex(block_tables, seq_lens, query_start_loc, block_size))
    q = _fold_query(query, k_scale, k_channel_scale, num_kv_heads, scale)
    kv = (k_cache, k_group_scale, k_group_min), (v_cache, v_group_scale, v_group_min)
    if not step.prefill_ids:  # the common step: decodes only, no row indexing at all
        k, v = (_gather(cache, s, m, step.decode_slots) for cache, s, m in kv)
        out = _attend(q, k, v, step.decode_mask)  # [S, Hkv, group, D]
    else:
        out = torch.empty(q.shape, dtype=torch.float32)  # [N, Hkv, group, D]
        if step.decode_ids:
            k, v = (_gather(cache, s, m, step.decode_slots) for cache, s, m in kv)
            out[step.decode_rows] = _attend(q[step.decode_rows], k, v, step.decode_mask)
        for seq_id in step.prefill_ids:
            k, v = (_gather(cache, s, m, step.prefill_slots[seq_id]) for cache, s, m in kv)
            _prefill(q, out, seq_id, step.starts, step.lens[seq_id], k, v)
    if v_scale is not None:
        out *= v_scale[None, :, None, None]
    return out.flatten(1, 2).to(query.dtype)


def _prefill(q, out, seq_id: int, starts, ctx_len: int, k, v) -> None:
    """One sequence's query rows [q_len] against its context k/v [1, Hkv, T, D], causal, chunked."""
    q_begin, q_end = starts[seq_id], starts[seq_id + 1]
    first_pos = ctx_len - (q_end - q_begin)  # context position of the first query row
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
