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
                        out_features: int, bias=None, out=None):
    """x [..., K] @ dequantized weight -> [..., N] in x's dtype (layouts in module docstring).

    out, if given, is a [..., N] tensor of x's dtype that receives the result.
    """
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
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
