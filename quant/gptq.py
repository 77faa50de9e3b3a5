"""GPTQ: second-order weight quantization of one linear layer (Frantar et al. 2022, "GPTQ").

Owns three pure functions, split from any plumbing as in llm-compressor:
`make_empty_hessian`, `accumulate_hessian` (running mean of x x^T over calibration tokens) and
`quantize_weight` (W, H, scheme) -> (QuantizedWeight, GPTQInfo). The caller owns hooks, devices,
layer order and what to do with the info (write `fallback` into the manifest).

Conventions and invariants:
- H here is mean(x x^T) over tokens (the paper's 2XX^T/N without the constant factor, which does
  not change the solution), so tr((W - Q) H (W - Q)^T) is the mean squared output error per token.
- The grid is exactly RTN's (`quant/rtn.py`): the result dequantizes and packs the same way.
  FP8 e4m3 weights (`scheme.type == "float"`) use fp8's grid (`quant/fp8.py`): static per-channel
  (or per-group) scales amax / 448 from the original weights, each column cast to e4m3; the result
  is an `Fp8Weight` with the same scales RTN would give, so kernels need nothing new. GPTQ's update
  rule only needs a per-column quantizer, so the algorithm is unchanged; on SmolLM2, FP8 W8A8's
  perplexity change drops from +3.35% (RTN) to +2.12% (wiki.test.raw, 16384 tokens).
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

from qkiln.quant import fp8
from qkiln.quant.fp8 import Fp8Weight
from qkiln.quant.rtn import (QuantizedWeight, code_dtype, compute_qparams, dequantize_codes, expand_groups,
                             num_groups, qrange, quantize_codes, quantize_rtn)
from qkiln.quant.scheme import GPTQOptions, WeightScheme


@dataclass
class GPTQInfo:
    """What happened to one layer; goes into the manifest's per-layer report."""

    loss: float | None  # tr((W - Q) H (W - Q)^T) with the H passed in (mean squared output error per
    # token); None when H is not finite (the manifest's JSON holds no NaN)
    dampening_frac: float | None  # the dampening that worked (or the last one tried; None: none could be)
    fallback: str | None  # None, or "rtn" when GPTQ could not run
    num_dead_columns: int
    fallback_reason: str | None = None  # why, in words (the build prints it)


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


def quantize_weight(W: torch.Tensor, H: torch.Tensor, scheme: WeightScheme, options: GPTQOptions = GPTQOptions()
                    ) -> tuple[QuantizedWeight | Fp8Weight, GPTQInfo]:
    """Quantize W [out, in] minimising tr((W - Q) H (W - Q)^T): GPTQ, Algorithm 1 (int or fp8 grid)."""
    W_orig, H_orig = W.float(), H.float()
    if not torch.isfinite(H_orig).all():  # no dampening makes it factor: say why, do not retry
        result = _round_to_nearest(W_orig, scheme)
        return result, GPTQInfo(None, None, "rtn", 0,
                                "NaN or Inf in the layer's calibration inputs (the model's forward overflowed?)")
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
        result = _round_to_nearest(W_orig, scheme)
        loss = reconstruction_error(W_orig, result.dequantize(), H_orig)
        return result, GPTQInfo(loss, frac, "rtn", num_dead,
                                f"the Hessian is not positive definite even with dampening {frac:g}")

    W_run = W if perm is None else W[:, perm]  # processing order
    if scheme.type == "float":
        result = _gptq_fp8(W, W_run, U, scheme, options.block_size, perm)
    else:
        result = _gptq_int(W, W_run, U, scheme, options, perm)
    loss = reconstruction_error(W_orig, result.dequantize(), H_orig)
    return result, GPTQInfo(loss, frac, None, num_dead)


def _round_to_nearest(W: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight | Fp8Weight:
    return fp8.quantize_weight_scheme(W, scheme) if scheme.type == "float" else quantize_rtn(W, scheme)


def _unpermute(codes: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return codes if perm is None else codes[:, torch.argsort(perm)]


def _gptq_fp8(W, W_run, U, scheme: WeightScheme, block_size: int, perm) -> Fp8Weight:
    """fp8 e4m3 columns with static scales from the unpermuted weights (no g_idx needed)."""
    scales = fp8.weight_scales(W, scheme.group_size, scheme.scale_dtype)  # [out, num_groups]
    col_scale = expand_groups(scales, scheme.group_size, W.shape[1])  # [out, in]
    if perm is not None:
        col_scale = col_scale[:, perm]

    def quantize_column(col, W1, i):
        s = col_scale[:, col]
        values = fp8.cast_to_fp8(W1[:, i], s).float()  # e4m3 values, exact in fp32
        return values, values * s

    codes = _gptq_loop(W_run, U, block_size, quantize_column)
    return Fp8Weight(_unpermute(codes, perm).to(fp8.FP8_DTYPE), scales, scheme.group_size)


def _gptq_int(W, W_run, U, scheme: WeightScheme, options: GPTQOptions, perm) -> QuantizedWeight:
    """Integer grid; group params static (act-order / per channel) or made when a group starts."""
    out_features, in_features = W.shape
    qmin, qmax = qrange(scheme.num_bits, scheme.symmetric)
    group_size, block_size = scheme.group_size, options.block_size
    if options.act_order or group_size is None:
        # per-channel params, and act-order's static groups, come from the unpermuted weights
        scales, zeros = compute_qparams(W, scheme, group_size)  # [out, num_groups] each
        dynamic = False
    else:
        G = num_groups(in_features, group_size)
        scales = torch.empty(out_features, G, device=W.device)
        zeros = None if scheme.symmetric else torch.empty(out_features, G, device=W.device)
        block_size = max(group_size, block_size // group_size * group_size)  # groups never straddle blocks
        dynamic = True
    order = perm.tolist() if perm is not None else range(in_features)
    group_of = [0] * in_features if group_size is None else [col // group_size for col in order]

    def quantize_column(col, W1, i):
        group = group_of[col]
        if dynamic and col % group_size == 0:
            s, z = compute_qparams(W1[:, i:i + group_size], scheme, None)
            scales[:, group] = s[:, 0]
            if zeros is not None:
                zeros[:, group] = z[:, 0]
        s, z = scales[:, group], None if zeros is None else zeros[:, group]
        q = quantize_codes(W1[:, i], s, z, qmin, qmax)
        return q, dequantize_codes(q, s, z)

    codes = _gptq_loop(W_run, U, block_size, quantize_column)
    return QuantizedWeight(_unpermute(codes, perm).to(code_dtype(scheme.symmetric)), scales, zeros,
                           group_size, scheme.num_bits)


def _gptq_loop(W: torch.Tensor, U: torch.Tensor, block_size: int, quantize_column) -> torch.Tensor:
    """Column-by-column quantization with lazy block updates (Sec. 4, "Lazy Batch-Updates").

    W [out, in] in processing order (updated in place); U = chol((H + lambda I)^-1, upper) in the
    same order. `quantize_column(col, W1, i)` quantizes column `col` (= W1[:, i] of the current
    block) -> (codes [out], dequantized [out]). Returns the codes [out, in] in processing order.

        block i1..i2:  W1 = W[:, i1:i2]   errors propagate inside the block column by column,
                       then once to W[:, i2:] as one matmul  Err1 @ U[i1:i2, i2:]
    """
    out_features, in_features = W.shape
    codes = torch.empty(out_features, in_features, device=W.device)  # [out, in], processing order
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        W1 = W[:, i1:i2].clone()
        U1 = U[i1:i2, i1:i2]
        Err1 = torch.empty(out_features, i2 - i1, device=W.device)
        for i in range(i2 - i1):
            q, w_hat = quantize_column(i1 + i, W1, i)
            codes[:, i1 + i] = q
            err = (W1[:, i] - w_hat) / U1[i, i]
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1.0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return codes
