"""Triton paged attention: a split-context decode kernel and a variable-length prefill kernel.

Both read K/V through block tables with `load_kv_tile` (triton_kv.py), dequantizing fp8/int4 in
registers, and use the online softmax of FlashAttention (Dao et al. 2022, Alg. 1) in fp32 with
exp2. Scales constant along the head dimension are folded into the query (softmax scale * log2 e,
fp8 k_scale[h], k_channel_scale[h, d]); fp8 v_scale[h] multiplies the output.

Rows of one program are (query token, query head) pairs of ONE kv head, so GQA reads each K/V
tile once for all `group = Hq / Hkv` query heads:

    decode  (num_tokens == num_seqs, one row per sequence), grid (seq, kv_head, partition):
        context  [0 ........ P ........ 2P ....... ctx)      P = partition size
        program    part 0  |   part 1   |  part 2 ...        (flash-decoding: Dao et al. 2023)
        each writes unnormalized (acc, max, sum) -> _reduce_kernel merges the partitions.
    prefill (anything else, e.g. chunks mixed with decodes), grid (q tile, kv_head):
        tile t of sequence s starts at  query_start_loc[s] // BLOCK_Q + s   (a monotone upper
        bound, so the grid N // BLOCK_Q + S needs no host sync; spare programs exit at once)
        row m = (token m // group, head m % group), BLOCK_Q = BLOCK_M // group tokens per tile,
        causal: query token i of a q_len chunk sits at context position ctx - q_len + i.

No host synchronisation: grid sizes depend only on shapes, so both launch under CUDA graphs.
Every sequence must own at least one query row.
"""

import torch
import triton
import triton.language as tl

from qkiln.plugins.triton_kv import KV_MODES, cache_strides, is_interpreter, load_kv_tile
from qkiln.plugins.kv_cache import cache_head_dim, kv_dtype_of

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_query(Q, rows, heads, row_mask, stride_qn, stride_qh, KS, KCS, kv_head, softmax_scale,
                KV_MODE: tl.constexpr, HAS_KCS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    q = q * (softmax_scale * _LOG2E)
    if KV_MODE == 1:
        q = q * tl.load(KS + kv_head)
    if HAS_KCS:
        q = q * tl.load(KCS + kv_head * HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0)[None, :]
    if not DOT_FP32:
        q = q.to(Q.dtype.element_ty)
    return q


@triton.jit
def _attend_tiles(q, acc, m_i, l_i, K, V, KGS, KGM, VGS, VGM, bt_row, kv_head, start, end, q_pos,
                  stride_cb, stride_cs, stride_ch, stride_gb, stride_gs, stride_gh,
                  CAUSAL: tl.constexpr, KV_MODE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_SIZE: tl.constexpr, DOT_FP32: tl.constexpr):
    """Online-softmax accumulation over context positions [start, end) of one sequence. CAUSAL:
    also which rows saw a NaN / inf value (`sees_bad`, 1 or 0): a key hidden from a row has p = 0,
    but 0 * NaN is NaN, so one position's overflow made the earlier rows of its tile NaN too (and
    the prefix cache then kept their KV); non-finite values enter the product as 0 instead, and the
    caller makes the rows that saw one NaN."""
    sees_bad = tl.zeros_like(l_i)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        block_ids = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        offsets = t % BLOCK_SIZE
        k = load_kv_tile(K, KGS, KGM, block_ids, offsets, kv_head, t_mask, stride_cb, stride_cs,
                         stride_ch, stride_gb, stride_gs, stride_gh, KV_MODE, HEAD_DIM, BLOCK_D,
                         GROUP_SIZE)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        valid = t_mask[None, :]
        if CAUSAL:
            valid = valid & (t[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(V, VGS, VGM, block_ids, offsets, kv_head, t_mask, stride_cb, stride_cs,
                         stride_ch, stride_gb, stride_gs, stride_gh, KV_MODE, HEAD_DIM, BLOCK_D,
                         GROUP_SIZE)
        if CAUSAL:
            finite = (v == v) & (tl.abs(v.to(tl.float32)) != float("inf"))  # [BLOCK_N, BLOCK_D]
            bad_key = tl.max(tl.where(finite, 0.0, 1.0), 1)  # [BLOCK_N]
            sees_bad = tl.maximum(sees_bad, tl.max(tl.where(valid, bad_key[None, :], 0.0), 1))
            v = tl.where(finite, v, 0.0).to(v.dtype)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, m_i, l_i, sees_bad


@triton.jit
def _decode_kernel(Q, K, V, KS, VS, KGS, KGM, VGS, VGM, KCS, BT, SL, PartO, PartM, PartL, Out,
                   softmax_scale, stride_qn, stride_qh, stride_on, stride_oh,
                   stride_cb, stride_cs, stride_ch, stride_gb, stride_gs, stride_gh, stride_bt,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   PARTITION_SIZE: tl.constexpr, NUM_PARTITIONS: tl.constexpr,
                   KV_MODE: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_KCS: tl.constexpr,
                   DOT_FP32: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_mask = g < GROUP
    q = _load_query(Q, seq + 0 * g, heads, row_mask, stride_qn, stride_qh, KS, KCS, kv_head,
                    softmax_scale, KV_MODE, HAS_KCS, HEAD_DIM, BLOCK_D, DOT_FP32)
    ctx = tl.load(SL + seq)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, ctx)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc, m_i, l_i, _ = _attend_tiles(
        q, acc, m_i, l_i, K, V, KGS, KGM, VGS, VGM, BT + seq * stride_bt, kv_head, start, end, g,
        stride_cb, stride_cs, stride_ch, stride_gb, stride_gs, stride_gh, False, KV_MODE, HEAD_DIM,
        BLOCK_D, BLOCK_SIZE, BLOCK_N, GROUP_SIZE, DOT_FP32)
    if NUM_PARTITIONS == 1:
        out = acc / l_i[:, None]
        if KV_MODE == 1:
            out = out * tl.load(VS + kv_head)
        mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
        tl.store(Out + seq * stride_on + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask)
    else:
        part_id = (seq * tl.num_programs(1) * GROUP + heads) * NUM_PARTITIONS + part
        tl.store(PartO + part_id[:, None] * BLOCK_D + d[None, :], acc, mask=row_mask[:, None])
        tl.store(PartM + part_id, m_i, mask=row_mask)
        tl.store(PartL + part_id, l_i, mask=row_mask)


@triton.jit
def _reduce_kernel(PartO, PartM, PartL, VS, Out, stride_on, stride_oh, GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PARTITIONS: tl.constexpr,
                   BLOCK_P: tl.constexpr, KV_MODE: tl.constexpr):
    """Merge partitions: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_mask = p < NUM_PARTITIONS
    part_id = (seq * tl.num_programs(1) + head) * NUM_PARTITIONS + p
    m = tl.load(PartM + part_id, mask=p_mask, other=-float("inf"))
    l = tl.load(PartL + part_id, mask=p_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # empty partitions have m = -inf: weight 0
    acc = tl.load(PartO + part_id[:, None] * BLOCK_D + d[None, :], mask=p_mask[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    if KV_MODE == 1:
        out = out * tl.load(VS + head // GROUP)
    tl.store(Out + seq * stride_on + head * stride_oh + d, out.to(Out.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_seqs"])  # keep it a runtime int32, even when it is 1
def _prefill_kernel(Q, K, V, KS, VS, KGS, KGM, VGS, VGM, KCS, BT, SL, QSL, Out, softmax_scale,
                    num_seqs, stride_qn, stride_qh, stride_on, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_gb, stride_gs, stride_gh, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr, GROUP_SIZE: tl.constexpr,
                    HAS_KCS: tl.constexpr, DOT_FP32: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Binary search: the last sequence whose first tile (qsl[s] // BLOCK_Q + s) is <= tile.
    lo = num_seqs * 0  # int32 tensors, so the loop-carried types never change
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        is_before = tl.load(QSL + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(is_before, mid, lo)
        hi = tl.where(is_before, hi, mid - 1)
    seq = lo
    q_begin = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_begin
    local = tile - (q_begin // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    ctx = tl.load(SL + seq)
    m = tl.arange(0, BLOCK_M)
    token = local * BLOCK_Q + m // GROUP  # token index inside this sequence's chunk
    heads = kv_head * GROUP + m % GROUP
    row_mask = (m < BLOCK_Q * GROUP) & (token < q_len)
    q_pos = ctx - q_len + token
    q = _load_query(Q, q_begin + token, heads, row_mask, stride_qn, stride_qh, KS, KCS, kv_head,
                    softmax_scale, KV_MODE, HAS_KCS, HEAD_DIM, BLOCK_D, DOT_FP32)
    end = tl.minimum(ctx, ctx - q_len + (local + 1) * BLOCK_Q)  # last position in tile + 1
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc, m_i, l_i, sees_bad = _attend_tiles(
        q, acc, m_i, l_i, K, V, KGS, KGM, VGS, VGM, BT + seq * stride_bt, kv_head, 0, end, q_pos,
        stride_cb, stride_cs, stride_ch, stride_gb, stride_gs, stride_gh, True, KV_MODE, HEAD_DIM,
        BLOCK_D, BLOCK_SIZE, BLOCK_N, GROUP_SIZE, DOT_FP32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = tl.where(sees_bad[:, None] > 0, float("nan"), out)
    if KV_MODE == 1:
        out = out * tl.load(VS + kv_head)
    d = tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    tl.store(Out + (q_begin + token)[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=mask)


_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def triton_paged_attention(query, k_cache, v_cache, k_scale, v_scale, k_group_scale, k_group_min,
                           v_group_scale, v_group_min, k_channel_scale, block_tables, seq_lens,
                           query_start_loc, scale: float, partition_size: int | None = None,
                           out: torch.Tensor | None = None):
    """Same contract as reference_paged_attention.

    partition_size overrides the decode split; out (like query) receives the result, e.g. a
    static buffer for CUDA graphs.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads, block_size = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:  # the kernels give each kv head num_heads // num_kv_heads query heads
        raise ValueError(f"paged_attention: {num_heads} query heads cannot share {num_kv_heads} kv heads "
                         "(query heads must be a multiple of kv heads)")
    if head_dim != cache_head_dim(k_cache):  # the kernels read head_dim values a cache row
        raise ValueError(f"paged_attention: query head_dim {head_dim} but the cache holds "
                         f"{cache_head_dim(k_cache)} a head")
    query = query if query.stride(-1) == 1 else query.contiguous()
    if out is None:
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and out.stride(-1) == 1
    kv_mode = KV_MODES[kv_dtype_of(k_cache)]
    interpret = is_interpreter()
    group = num_heads // num_kv_heads
    dummy = k_cache  # pointer for absent optional tensors (never read)
    tensors = [t if t is not None else dummy for t in (
        k_scale, v_scale, k_group_scale, k_group_min, v_group_scale, v_group_min, k_channel_scale)]
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
               *cache_strides(k_cache, k_group_scale), block_tables.stride(0))
    consts = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                  BLOCK_SIZE=block_size, KV_MODE=kv_mode,
                  GROUP_SIZE=head_dim // k_group_scale.shape[-1] if kv_mode == 2 else 1,
                  HAS_KCS=k_channel_scale is not None,
                  DOT_FP32=interpret or query.dtype == torch.float32)
    block_n = 16 if interpret else 64
    if num_tokens == num_seqs:
        max_ctx = block_tables.shape[1] * block_size
        if partition_size is None:  # enough programs to fill the GPU twice over
            parts = max(1, 2 * _num_sms(query.device) // max(1, num_seqs * num_kv_heads))
            partition_size = triton.cdiv(triton.cdiv(max_ctx, parts), block_n) * block_n
        num_parts = triton.cdiv(max_ctx, partition_size)
        part_o = torch.empty(num_seqs, num_heads, num_parts, consts["BLOCK_D"],
                             dtype=torch.float32, device=query.device)
        part_m = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32,
                             device=query.device)
        part_l = torch.empty_like(part_m)
        _decode_kernel[(num_seqs, num_kv_heads, num_parts)](
            query, k_cache, v_cache, *tensors, block_tables, seq_lens, part_o, part_m, part_l, out,
            scale, *strides, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            PARTITION_SIZE=partition_size, NUM_PARTITIONS=num_parts, **consts)
        if num_parts > 1:
            _reduce_kernel[(num_seqs, num_heads)](
                part_o, part_m, part_l, tensors[1], out, out.stride(0), out.stride(1),
                GROUP=group, HEAD_DIM=head_dim, BLOCK_D=consts["BLOCK_D"],
                NUM_PARTITIONS=num_parts, BLOCK_P=triton.next_power_of_2(num_parts),
                KV_MODE=kv_mode)
        return out
    block_m = max(16 if interpret else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        query, k_cache, v_cache, *tensors, block_tables, seq_lens, query_start_loc, out, scale,
        num_seqs, *strides, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, **consts)
    return out
