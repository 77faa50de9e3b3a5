"""AWQ: activation-aware per-channel scaling and weight clipping (Lin et al. 2023, "AWQ").

Owns the two searches as pure functions over tensors, and the folding helpers. The caller
(compile/) owns which linears share an input, what precedes them, hooks and layer order.

Per group of linears sharing one input x [N, in] (e.g. q/k/v after input_layernorm):
  1. `search_scales` (Sec. 3.2): s = x_mean^a / w_mean^(1-a) for a on a grid (AutoAWQ's "duo"
     form; a = 0..(grid-1)/grid), normalised by sqrt(max(s) * min(s)); the loss of a candidate is
     the MSE between the full-precision output and the output of Q(W * s) applied to x / s. The
     identity (s = 1, no scaling) is always a candidate, so the chosen loss is never above it.
  2. The caller scales each weight, `W * s` (`scale_weights`), and folds 1/s into what produced x:
     `fold_scales_into_norm` (RMSNorm weight) or `fold_scales_into_linear` (a previous linear's
     rows, e.g. up_proj before down_proj). The full-precision function is unchanged.
  3. `search_clip` (AutoAWQ's weight clipping, the paper's released recipe): per output channel
     and group, shrink the range over a grid and keep what minimises that group's share of the
     output error on x / s; `apply_clip` clamps. Then quantize (RTN or GPTQ) as usual. Before GPTQ
     with an MSE range observer the clip is better skipped (it picks each group's range itself, and
     a clip rewrites the weights GPTQ reconstructs): compile/recipe.py's w4a16-awq does.

Loss without a `forward_fn`: the linears' outputs are linear in W, so the MSE over all tokens
and outputs equals sum_i tr(D_i G D_i^T) / sum_i out_i with G = x^T x / N and
D_i = Q(W_i * s) / s - W_i: every token counts and nothing [N, out]-sized is materialised.
With `forward_fn(x, weights) -> out` (module-level loss) the caller's function is run instead.
Everything is deterministic: no random subsampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from qkiln.quant.rtn import expand_groups, fake_quantize_rtn, group_minmax, group_ranges, num_groups
from qkiln.quant.scheme import WeightScheme

ForwardFn = Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


@dataclass
class AWQScaleResult:
    scales: torch.Tensor  # [in] fp32; multiply the weights by it, divide the input by it
    alpha: float | None  # the chosen exponent; None when no scaling (identity) won
    loss: float
    identity_loss: float  # loss with s = 1, the bar the result never exceeds
    losses: list[tuple[float | None, float]]  # (alpha, loss) per candidate, identity first
    shared_scales: torch.Tensor | None = None  # [num_shared] with `shared`: scales[i] = shared_scales[shared[i]]


@dataclass
class AWQClipResult:
    max_val: torch.Tensor  # [out, num_groups] upper clip threshold
    loss: float  # output error with clipping (same units as loss_unclipped)
    loss_unclipped: float
    min_val: torch.Tensor | None = None  # [out, num_groups] lower threshold; None: -max_val


def activation_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean |x| per input channel: x [..., in] -> [in]."""
    return x.reshape(-1, x.shape[-1]).float().abs().mean(dim=0)


def weight_mean(weights: Sequence[torch.Tensor], group_size: int | None) -> torch.Tensor:
    """Mean over all output rows of |w| normalised by its group's max |w|: -> [in]."""
    W = torch.cat([w.float() for w in weights], dim=0).abs()  # [sum(out), in]
    group_max = torch.stack([W[:, a:b].amax(dim=1) for a, b in group_ranges(W.shape[1], group_size)], dim=1)
    normalised = W / expand_groups(group_max, group_size, W.shape[1]).clamp(min=1e-12)
    return normalised.mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float, duo_scaling: bool) -> torch.Tensor:
    s = x_mean.clamp(min=1e-8).pow(alpha)
    if duo_scaling:
        s = s / w_mean.clamp(min=1e-8).pow(1.0 - alpha)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def gram(x: torch.Tensor) -> torch.Tensor:
    """G = x^T x / N for x [..., in] -> [in, in] (fp32)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    return x2.t() @ x2 / max(x2.shape[0], 1)


def _linear_loss(weights: Sequence[torch.Tensor], quantized: Sequence[torch.Tensor], G: torch.Tensor) -> float:
    total, count = 0.0, 0
    for W, Q in zip(weights, quantized):
        D = Q - W  # [out, in]
        total += float(((D @ G) * D).sum())
        count += W.shape[0]
    return total / count


def _shared_mean(values: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Mean of values [in] over the channels sharing each scale: -> [num_shared]."""
    num = int(shared.max()) + 1
    sums = torch.zeros(num, dtype=values.dtype).index_add_(0, shared, values)
    counts = torch.zeros(num, dtype=values.dtype).index_add_(0, shared, torch.ones_like(values))
    return sums / counts.clamp(min=1)


def search_scales(x: torch.Tensor, weights: Sequence[torch.Tensor], scheme: WeightScheme, *,
                  grid_size: int = 20, duo_scaling: bool = True,
                  forward_fn: ForwardFn | None = None, shared: torch.Tensor | None = None) -> AWQScaleResult:
    """Best per-input-channel scale for linears [out_i, in] that all read x [..., in] (Sec. 3.2).

    `forward_fn(x, weights)` receives x in the shape given here (scaled by 1/s on the last dim) and
    the weights in the order given, fake-quantized; without it the loss is the linears' own output.
    `shared` [in] (long) ties channels to one scale each, e.g. o_proj's channels of the query heads
    that read one KV head (GQA) share that v_proj row's scale; the statistics are averaged per tie.
    """
    weights = [w.float() for w in weights]
    x2 = x.reshape(-1, x.shape[-1]).float()  # [N, in]
    x_mean, w_mean = activation_mean(x2), weight_mean(weights, scheme.group_size)
    if shared is not None:
        x_mean, w_mean = _shared_mean(x_mean, shared), _shared_mean(w_mean, shared)
    if forward_fn is None:
        G = gram(x2)

        def loss_of(s: torch.Tensor) -> float:
            return _linear_loss(weights, [fake_quantize_rtn(W * s, scheme) / s for W in weights], G)
    else:
        x_in = x.float()  # the caller's shape, e.g. [batch, seq, in] for a module with attention
        reference = forward_fn(x_in, weights).float()

        def loss_of(s: torch.Tensor) -> float:
            out = forward_fn(x_in / s, [fake_quantize_rtn(W * s, scheme) for W in weights]).float()
            return float((out - reference).pow(2).mean())

    def expand(s: torch.Tensor) -> torch.Tensor:
        return s if shared is None else s[shared]

    identity = torch.ones_like(x_mean)
    identity_loss = loss_of(expand(identity))
    best = (identity_loss, None, identity)
    losses: list[tuple[float | None, float]] = [(None, identity_loss)]
    for i in range(grid_size):
        alpha = i / grid_size
        s = candidate_scales(x_mean, w_mean, alpha, duo_scaling)
        loss = loss_of(expand(s))
        losses.append((alpha, loss))
        if loss == loss and loss < best[0]:  # NaN never wins
            best = (loss, alpha, s)
    return AWQScaleResult(expand(best[2]), best[1], best[0], identity_loss, losses,
                          None if shared is None else best[2])


def gqa_shared_index(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[num_heads * head_dim] index into v_proj's rows [num_kv_heads * head_dim]: query head h reads
    KV head h // (num_heads / num_kv_heads) (repeat_interleave), so o_proj's channel (h, d) carries
    v_proj's row (h // rep, d) and scaling that row by 1/s scales all of them."""
    rep = num_heads // num_kv_heads
    heads = torch.arange(num_heads).repeat_interleave(head_dim) // rep  # [num_heads * head_dim]
    return heads * head_dim + torch.arange(head_dim).repeat(num_heads)


def scale_weights(weights: Sequence[torch.Tensor], s: torch.Tensor) -> list[torch.Tensor]:
    """W * s on input channels, for every linear reading the scaled input."""
    return [w * s.to(w.dtype) for w in weights]


def fold_scales_into_norm(norm_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """RMSNorm weight [in] / s: the norm now emits x / s."""
    return norm_weight / s.to(norm_weight.dtype)


def fold_scales_into_linear(prev_W: torch.Tensor, s: torch.Tensor, prev_bias: torch.Tensor | None = None):
    """Previous linear [in, prev_in] (its rows are the scaled channels) / s -> (W', bias')."""
    s = s.to(prev_W.dtype)
    return prev_W / s.unsqueeze(1), None if prev_bias is None else prev_bias / s


def search_clip(x: torch.Tensor, W: torch.Tensor, scheme: WeightScheme, *, grid_size: int = 20,
                max_shrink: float = 0.5) -> AWQClipResult:
    """Per (output channel, group) clip range minimising that group's output error on x [..., in].

    Candidates, for i < max_shrink * grid (i = 0 is no clipping), f = 1 - i/grid:
    [-f * max|w|, f * max|w|] (AutoAWQ's, the only family for symmetric grids) and, for asymmetric
    grids, also [f * min w, f * max w] (both ends shrink, as llm-compressor's MSE observer does),
    which AutoAWQ's symmetric clamp cannot reach when a group's min and max differ in size.
    A group's error is mean_t (x_t,g . (q_g - w_g))^2, from the group's block of the Gram matrix.
    """
    W = W.float()
    out_features, in_features = W.shape
    ranges = group_ranges(in_features, scheme.group_size)
    G = gram(x)
    blocks = [G[a:b, a:b] for a, b in ranges]
    wmin, wmax = group_minmax(W, scheme.group_size)  # [out, num_groups]
    org_max = torch.maximum(wmin.abs(), wmax.abs())
    best_err = torch.full((out_features, num_groups(in_features, scheme.group_size)), float("inf"), device=W.device)
    best_min, best_max = -org_max, org_max.clone()
    unclipped = None
    candidates = []
    for i in range(max(1, int(max_shrink * grid_size))):
        f = 1.0 - i / grid_size
        candidates.append((-org_max * f, org_max * f))
        if not scheme.symmetric and i > 0:
            candidates.append((wmin * f, wmax * f))
    for lo, hi in candidates:
        Q = fake_quantize_rtn(apply_clip(W, hi, scheme.group_size, lo), scheme)
        D = Q - W  # [out, in]
        err = torch.stack([((D[:, a:b] @ block) * D[:, a:b]).sum(dim=1) for (a, b), block in zip(ranges, blocks)],
                          dim=1)  # [out, num_groups]
        if unclipped is None:
            unclipped = float(err.sum()) / out_features
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_min, best_max = torch.where(better, lo, best_min), torch.where(better, hi, best_max)
    return AWQClipResult(best_max, float(best_err.sum()) / out_features, unclipped, best_min)


def apply_clip(W: torch.Tensor, max_val: torch.Tensor, group_size: int | None,
               min_val: torch.Tensor | None = None) -> torch.Tensor:
    """Clamp W [out, in] to [min_val, max_val] [out, num_groups] of its group (min_val = -max_val if None)."""
    upper = expand_groups(max_val.to(W.dtype), group_size, W.shape[1])
    lower = -upper if min_val is None else expand_groups(min_val.to(W.dtype), group_size, W.shape[1])
    return torch.maximum(torch.minimum(W, upper), lower)
