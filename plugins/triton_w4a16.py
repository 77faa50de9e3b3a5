"""Triton weight-only GEMM with in-kernel dequantization: W4A16 (grouped) and W8A16 (per channel).

Why our own kernel: on an H200 torch's int4 "tinygemm" is slower than bf16 already at one token
(DESIGN.md), and decode is bound by reading weights, so they must be read packed.

Layouts (made by packed_weights.prepare_*(target="cuda")):

    BITS=4: packed [ceil(K/2), N] uint8, byte (j, n) = q[2j, n] | q[2j + 1, n] << 4
    BITS=8: weight [K, N] int8
    scales [num_groups, N], zeros [num_groups, N] or absent (then q - 8 for int4, q for int8)
    W[k, n] = (q[k, n] - zero[k // G, n]) * scale[k // G, n];  k // G handles a short last group

    out[M, N] = x[M, K] @ W: tile (BLOCK_M x BLOCK_N), loop over K in BLOCK_K steps; with
    SPLIT_K > 1 each program covers one K slice and atomically adds fp32 partials (decode has
    few rows, so the N tiles alone would leave most SMs idle).

When GROUP % BLOCK_K == 0 a K tile never straddles two groups (group edges are multiples of G
even when the last group is short), so one scale row per tile is loaded instead of a full tile.

Decode path (<= GEMV_MAX_ROWS rows): a GEMV without tl.dot (a 16-row MMA tile would be 15/16
padding), grid (row, N tile, K split), one scale/zero row per group-aligned K tile, x split into
the even and odd k of each byte (low and high nibble), no unpacking shuffle:

    acc[j, n] += (x[2j] (lo[j, n] - z[n]) + x[2j+1] (hi[j, n] - z[n])) s[n];   out = sum_j acc

Each program writes fp32 partials [SPLIT_K, M, N]; _split_k_reduce_kernel sums them, adds the
bias and casts (two launches, no memset, no atomics: both replay inside a CUDA graph).
"""

import functools

import torch
import triton
import triton.language as tl

from qkiln.plugins.triton_kv import is_interpreter


@triton.jit
def _wna16_kernel(X, W, S, Z, Out, M, N, K, stride_xm, stride_om, k_per_split,
                  GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                  GROUP_ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < k_end
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if BITS == 4:
            # One load per byte; byte row j holds k = 2j (low nibble) and 2j + 1 (high).
            rp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(W + rp[:, None].to(tl.int64) * N + rn[None, :],
                           mask=(2 * rp < k_end)[:, None] & n_mask[None, :], other=0)
            pairs = tl.permute(tl.join(byte & 15, byte >> 4), (0, 2, 1))  # [BK/2, 2, BN]
            q = tl.reshape(pairs, (BLOCK_K, BLOCK_N)).to(tl.float32)
        else:
            q = tl.load(W + rk[:, None].to(tl.int64) * N + rn[None, :], mask=w_mask,
                        other=0).to(tl.float32)
        if GROUP_ALIGNED:
            g_off = (k0 // GROUP) * N + rn[None, :]  # [1, BLOCK_N]: one group per K tile
            g_mask = n_mask[None, :]
        else:
            g_off = (rk // GROUP)[:, None] * N + rn[None, :]
            g_mask = w_mask
        scale = tl.load(S + g_off, mask=g_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            w = (q - tl.load(Z + g_off, mask=g_mask, other=0.0).to(tl.float32)) * scale
        elif BITS == 4:
            w = (q - 8.0) * scale
        else:
            w = q * scale
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out_ptr = Out + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    out_mask = (rm[:, None] < M) & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptr, acc, mask=out_mask)


@triton.jit
def _wna16_gemv_kernel(X, W, S, Z, Part, M, N, K, stride_xm, k_per_split,
                       GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """ROWS = weight rows per K tile (BLOCK_K / 2 bytes for int4); acc stays 2-D until the end,
    so the only cross-thread reduction is the last one."""
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    x_row = X + row.to(tl.int64) * stride_xm
    for k0 in range(k_begin, k_end, BLOCK_K):
        g_off = (k0 // GROUP) * N + rn  # BLOCK_K divides GROUP: one group per tile
        scale = tl.load(S + g_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_ZEROS:
            zero = tl.load(Z + g_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        elif BITS == 4:
            zero = 8.0
        else:
            zero = 0.0
        j = tl.arange(0, ROWS)
        if BITS == 4:
            # Byte row j holds k = k0 + 2j (low nibble) and k0 + 2j + 1 (high nibble).
            k_even = k0 + 2 * j
            x_even = tl.load(x_row + k_even, mask=k_even < k_end, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + k_even + 1, mask=k_even + 1 < k_end, other=0.0).to(tl.float32)
            byte = tl.load(W + (k0 // 2 + j)[:, None].to(tl.int64) * N + rn[None, :],
                           mask=(k_even < k_end)[:, None] & n_mask[None, :], other=0)
            lo = (byte & 15).to(tl.float32)  # [ROWS, BLOCK_N]
            hi = (byte >> 4).to(tl.float32)
            acc += (x_even[:, None] * (lo - zero) + x_odd[:, None] * (hi - zero)) * scale
        else:
            rk = k0 + j
            x = tl.load(x_row + rk, mask=rk < k_end, other=0.0).to(tl.float32)
            q = tl.load(W + rk[:, None].to(tl.int64) * N + rn[None, :],
                        mask=(rk < k_end)[:, None] & n_mask[None, :], other=0).to(tl.float32)
            acc += x[:, None] * (q - zero) * scale
    tl.store(Part + (pid_k * M + row).to(tl.int64) * N + rn, tl.sum(acc, 0), mask=n_mask)


@triton.jit
def _split_k_reduce_kernel(Part, Bias, Out, M, N, stride_om, SPLIT_K: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(Part + (split * M + row).to(tl.int64) * N + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Out + row.to(tl.int64) * stride_om + rn, acc.to(Out.dtype.element_ty), mask=n_mask)


# Rows up to which triton_wna16_linear takes the GEMV. H200, 4096x4096: 1 row 11.0 us (GEMM
# 20.2, bf16 13.5); 16 rows forced through the GEMV 92 us (GEMM 21.0: with that many row tiles
# there is no split-K left and each program walks all of K). 2..8 rows were not measured.
GEMV_MAX_ROWS = 1


def gemv_config(num_rows: int, out_features: int, in_features: int, group: int, device,
                block_n: int | None = None, programs_per_sm: int = 2) -> tuple | None:
    """(BLOCK_N, BLOCK_K, SPLIT_K) of the decode GEMV, or None when the group size rules it out.

    SPLIT_K doubles until there are `programs_per_sm` programs per SM (memory-bound: bytes in
    flight, not arithmetic, set the speed), keeping at least two K tiles per split.
    """
    block_k = 16 if is_interpreter() else 128
    while block_k > 16 and group % block_k:
        block_k //= 2
    if group % block_k:
        return None
    # 64 columns, two programs per SM: the best of BLOCK_N 64/128/256 x 1/2/4 per SM measured on
    # an H200 at 4096x4096 (10.8 us against 12.4-15.0 for the others; bf16 cuBLAS 12.6 us).
    block_n = block_n or (16 if is_interpreter() else 64)
    tiles = num_rows * triton.cdiv(out_features, block_n)
    target = 1 if is_interpreter() else programs_per_sm * _num_sms(device)
    split_k = 1
    while tiles * split_k < target and in_features // (split_k * 2) >= 2 * block_k:
        split_k *= 2
    return block_n, block_k, split_k


def triton_wna16_gemv(rows, weight, scales, zeros, group: int, bits: int, in_features: int,
                      out_features: int, config: tuple, bias=None, out=None):
    """rows [M, K] (M small) -> [M, N] in rows' dtype; `out` [M, N] receives it if given."""
    block_n, block_k, split_k = config
    num_rows = rows.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    partials = torch.empty(split_k, num_rows, out_features, dtype=torch.float32,
                           device=rows.device)  # [SPLIT_K, M, N]
    _wna16_gemv_kernel[(num_rows, triton.cdiv(out_features, block_n), split_k)](
        rows, weight, scales, zeros if zeros is not None else scales, partials, num_rows,
        out_features, in_features, rows.stride(0), k_per_split, GROUP=group, BITS=bits,
        HAS_ZEROS=zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        ROWS=block_k // 2 if bits == 4 else block_k)
    if out is None:
        out = torch.empty(num_rows, out_features, dtype=rows.dtype, device=rows.device)
    reduce_n = 16 if is_interpreter() else 1024
    _split_k_reduce_kernel[(num_rows, triton.cdiv(out_features, reduce_n))](
        partials, bias if bias is not None else partials, out, num_rows, out_features,
        out.stride(0), SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK_N=reduce_n)
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config(num_rows: int, out_features: int, in_features: int, group: int, device) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) for a problem size; small tiles in the interpreter."""
    if is_interpreter():
        return 16, 16, min(32, group), 1
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    block_n = 64 if num_rows <= 32 else 128
    block_k = min(128, group) if group & (group - 1) == 0 and group >= 16 else 64
    tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n)
    num_sms = _num_sms(device)
    split_k = 1
    while tiles * split_k * 2 <= 2 * num_sms and in_features // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return block_m, block_n, block_k, split_k


def triton_wna16_linear(x, weight, scales, zeros, group: int, bits: int, in_features: int,
                        out_features: int, bias=None, out=None, use_gemv: bool | None = None):
    """x [..., K] @ dequantized weight -> [..., N] in x's dtype (layouts in module docstring).

    out, if given, is a [..., N] tensor of x's dtype that receives the result. use_gemv: None
    takes the GEMV for <= GEMV_MAX_ROWS rows when the group size allows; True/False force it.
    """
    if group <= 0:  # the kernels divide k by it; per-channel weights pass group = in_features
        raise ValueError(f"wna16_linear: group size {group}; per-channel weights use in_features")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    if use_gemv is None:
        use_gemv = 0 < num_rows <= GEMV_MAX_ROWS
    gemv = gemv_config(num_rows, out_features, in_features, group, x.device) if use_gemv else None
    if gemv is not None:
        flat_out = None if out is None else out.view(num_rows, out_features)
        result = triton_wna16_gemv(rows, weight, scales, zeros, group, bits, in_features,
                                   out_features, gemv, bias, flat_out)
        return out if out is not None else result.reshape(*x.shape[:-1], out_features)
    block_m, block_n, block_k, split_k = _config(num_rows, out_features, in_features, group,
                                                 x.device)
    # Each split covers whole K tiles, and whole groups when tiles align with groups.
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    direct = split_k == 1 and bias is None and out is not None
    if split_k > 1:
        result = torch.zeros(num_rows, out_features, dtype=torch.float32, device=x.device)
    elif direct:
        result = out.view(num_rows, out_features)
    else:
        result = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n), split_k)
    _wna16_kernel[grid](
        rows, weight, scales, zeros if zeros is not None else scales, result, num_rows,
        out_features, in_features, rows.stride(0), result.stride(0), k_per_split,
        GROUP=group, BITS=bits, HAS_ZEROS=zeros is not None, GROUP_ALIGNED=group % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        DOT_FP32=is_interpreter() or x.dtype == torch.float32)
    if direct:
        return out
    if bias is not None:
        result = result + bias
    result = result.to(x.dtype).reshape(*x.shape[:-1], out_features)
    return result if out is None else out.copy_(result)
