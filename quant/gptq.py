"""GPTQ: second-order weight quantization of one linear layer (Frantar et al. 2022, "GPTQ").

Owns three pure functions, split from any plumbing as in llm-compressor:
`make_empty_hessian`, `accumulate_hessian` (running mean of x x^T over calibration tokens) and
`quantize_weight` (W, H, scheme) -> (QuantizedWeight, GPTQInfo). The caller owns hooks, devices,
layer order and what to do with the info (write `fallback` into the manifest).

Conventions and invariants:
- H here is mean(x x^T) over tokens (the paper's 2XX^T/N without the constant factor, which does
  not change the solution), so tr((W - Q) H (W - Q)^T) is the mean squared output error per token.
- The grid is exactly RTN's (`quant/rtn.py`): the result dequantizes and packs the same way.
- With `act_order` columns are processed by decreasing diag(H) (Sec. 4, "Arbitrary Order" remark and
  the reference code's act-order), with *static* groups: group parameters are computed from the
  original weights in the original column order, so the output needs no g_idx.
- Without act_order, group parameters are computed when a group starts, from the weights as
  updated by earlier columns (reference code); blocks are aligned to groups for that.
- Dead inputs (diag(H) == 0) get H_ii = 1 and zero weight: they never see a non-zero input.
- Cholesky failure raises dampening x10 up to `max_damp_retries` times, then falls back to RTN;
  `GPTQInfo.fallback` says so. Nothing fails silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkiln.quant.rtn import (QuantizedWeight, code_dtype, compute_qparams, dequantize_codes, num_groups, qrange,
                             quantize_codes, quantize_rtn)
from qkiln.quant.scheme import GPTQOptions, WeightScheme


@dataclass
class GPTQInfo:
    """What happened to one layer; goes into the manifest's per-layer report."""

    loss: float  # tr((W - Q) H (W - Q)^T) with the H passed in (mean squared output error per token)
    dampening_frac: float  # the dampening that worked (or the last one tried)
    fallback: str | None  # None, or "rtn" when every Cholesky failed
    num_dead_columns: int


def make_empty_hessian(in_features: int, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.zeros(in_features, in_features, dtype=torch.float32, device=device)  # [in, in]


def accumulate_hessian(H: torch.Tensor, x: torch.Tensor, num_samples: int) -> tuple[torch.Tensor, int]:
    """Fold a batch of inputs x [..., in] into the running mean H = mean(x x^T); returns (H, count).

    Every token counts as one sample. H is updated in place and also returned.
    """
    x = x.reshape(-1, x.shape[-1]).to(torch.float32)  # [num_tokens, in]
    num_new = x.shape[0]
    if num_new == 0:
        return H, num_samples
    total = num_samples + num_new
    H.mul_(num_samples / total)
    H.addmm_(x.t(), x, alpha=1.0 / total)
    return H, total


def reconstruction_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T): the layer-output error GPTQ minimises (Sec. 2, Eq. 1)."""
    delta = W.float() - Q.float()  # [out, in]
    return float(((delta @ H.float()) * delta).sum(dtype=torch.float64))


def _inverse_cholesky(H: torch.Tensor, dampening_frac: float) -> torch.Tensor | None:
    """Upper Cholesky factor of (H + lambda I)^-1 (Sec. 4, "Cholesky Reformulation"), or None."""
    mean_diag = float(torch.diag(H).mean())
    if not mean_diag > 0 or not torch.isfinite(H).all():
        return None
    damped = H + dampening_frac * mean_diag * torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    L, info = torch.linalg.cholesky_ex(damped)
    if int(info) != 0:
        return None
    Hinv = torch.cholesky_inverse(L)
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if int(info) != 0 or not torch.isfinite(U).all():
        return None
    return U


def quantize_weight(W: torch.Tensor, H: torch.Tensor, scheme: WeightScheme,
                    options: GPTQOptions = GPTQOptions()) -> tuple[QuantizedWeight, GPTQInfo]:
    """Quantize W [out, in] minimising tr((W - Q) H (W - Q)^T): GPTQ, Algorithm 1."""
    if scheme.type != "int":
        raise ValueError("GPTQ handles integer schemes; quantize fp8 weights with quant.fp8")
    W_orig, H_orig = W.float(), H.float()
    dead = torch.diag(H_orig) == 0
    H = H_orig.clone()
    H[dead, dead] = 1.0
    W = W_orig.masked_fill(dead.unsqueeze(0), 0.0)  # [out, in]
    num_dead = int(dead.sum())

    perm = None
    if options.act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        H = H[perm][:, perm]

    U, frac = None, options.dampening_frac
    for attempt in range(options.max_damp_retries + 1):
        frac = options.dampening_frac * 10**attempt
        U = _inverse_cholesky(H, frac)
        if U is not None:
            break
    if U is None:
        result = quantize_rtn(W_orig, scheme)
        loss = reconstruction_error(W_orig, result.dequantize(), H_orig)
        return result, GPTQInfo(loss, frac, "rtn", num_dead)

    static = None
    if options.act_order or scheme.group_size is None:
        # per-channel params, and act-order's static groups, come from the unpermuted weights
        static = compute_qparams(W, scheme, scheme.group_size)  # [out, num_groups] each
    codes, scales, zeros = _gptq_loop(W if perm is None else W[:, perm], U, scheme, options.block_size,
                                      perm, static)
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    result = QuantizedWeight(codes.to(code_dtype(scheme.symmetric)), scales, zeros,
                             scheme.group_size, scheme.num_bits)
    loss = reconstruction_error(W_orig, result.dequantize(), H_orig)
    return result, GPTQInfo(loss, frac, None, num_dead)


def _gptq_loop(W: torch.Tensor, U: torch.Tensor, scheme: WeightScheme, block_size: int,
               perm: torch.Tensor | None, static):
    """Column-by-column quantization with lazy block updates (Sec. 4, "Lazy Batch-Updates").

    W [out, in] in processing order (updated in place); U = chol((H + lambda I)^-1, upper) in the
    same order. Returns codes [out, in] (processing order), scales and zeros [out, num_groups].

        block i1..i2:  W1 = W[:, i1:i2]   errors propagate inside the block column by column,
                       then once to W[:, i2:] as one matmul  Err1 @ U[i1:i2, i2:]
    """
    out_features, in_features = W.shape
    qmin, qmax = qrange(scheme.num_bits, scheme.symmetric)
    group_size = scheme.group_size
    if static is not None:
        scales, zeros = static
    else:
        G = num_groups(in_features, group_size)
        scales = torch.empty(out_features, G, device=W.device)
        zeros = None if scheme.symmetric else torch.empty(out_features, G, device=W.device)
        block_size = max(group_size, block_size // group_size * group_size)  # groups never straddle blocks
    order = perm.tolist() if perm is not None else range(in_features)
    group_of = [0] * in_features if group_size is None else [col // group_size for col in order]

    codes = torch.empty(out_features, in_features, device=W.device)  # [out, in], processing order
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        W1 = W[:, i1:i2].clone()
        U1 = U[i1:i2, i1:i2]
        Err1 = torch.empty(out_features, i2 - i1, device=W.device)
        for i in range(i2 - i1):
            col, group = i1 + i, group_of[i1 + i]
            if static is None and col % group_size == 0:
                s, z = compute_qparams(W1[:, i:i + group_size], scheme, None)
                s, z = s[:, 0], None if z is None else z[:, 0]
                scales[:, group] = s
                if zeros is not None:
                    zeros[:, group] = z
            s = scales[:, group]
            z = None if zeros is None else zeros[:, group]
            w = W1[:, i]
            q = quantize_codes(w, s, z, qmin, qmax)
            codes[:, col] = q
            err = (w - dequantize_codes(q, s, z)) / U1[i, i]
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1.0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return codes, scales, zeros
