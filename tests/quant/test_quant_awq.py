"""AWQ: the scale search never loses to no scaling, folding keeps the function, clipping helps."""

import pytest
import torch

from qkiln.quant.awq import (apply_clip, fold_scales_into_linear, fold_scales_into_norm, scale_weights,
                             search_clip, search_scales)
from qkiln.quant.rtn import fake_quantize_rtn
from qkiln.quant.scheme import WeightScheme


def _inputs(num_tokens=256, in_features=96, outlier_gain=None):
    x = torch.randn(num_tokens, in_features) * (torch.rand(in_features) + 0.2)
    if outlier_gain:
        x[:, :3] *= outlier_gain  # a few salient channels, as after an RMSNorm in a real LLM
    return x


def _linears(in_features=96):
    return [torch.randn(48, in_features) * 0.1, torch.randn(16, in_features) * 0.1]


def _linear_forward(x, weights):
    return torch.cat([x @ w.t() for w in weights], dim=-1)


@pytest.mark.parametrize("scheme", [WeightScheme(4, symmetric=False, group_size=32),
                                    WeightScheme(4, symmetric=True, group_size=None),
                                    WeightScheme(4, symmetric=False, group_size=64),
                                    WeightScheme(4, symmetric=False, group_size=64, observer="mse")], ids=str)
def test_scale_search_never_above_identity(scheme):
    for outlier_gain in (None, 20.0):
        result = search_scales(_inputs(outlier_gain=outlier_gain), _linears(), scheme, grid_size=10)
        assert result.loss <= result.identity_loss
        assert result.losses[0] == (None, result.identity_loss)
        assert len(result.losses) == 11
        assert result.scales.shape == (96,) and torch.isfinite(result.scales).all()


def test_scale_search_helps_with_salient_channels_and_loss_is_reproducible():
    x, weights = _inputs(outlier_gain=20.0), _linears()
    scheme = WeightScheme(4, symmetric=False, group_size=32)
    result = search_scales(x, weights, scheme)
    assert result.alpha is not None and result.loss < 0.8 * result.identity_loss
    s = result.scales
    quantized_out = _linear_forward(x / s, [fake_quantize_rtn(w, scheme) for w in scale_weights(weights, s)])
    mse = (quantized_out - _linear_forward(x, weights)).pow(2).mean()
    assert float(mse) == pytest.approx(result.loss, rel=1e-3)


def test_forward_fn_loss_matches_the_gram_shortcut():
    x, weights = _inputs(outlier_gain=10.0), _linears()
    scheme = WeightScheme(4, symmetric=True, group_size=32)
    gram_result = search_scales(x, weights, scheme, grid_size=5)
    forward_result = search_scales(x, weights, scheme, grid_size=5, forward_fn=_linear_forward)
    for (a1, l1), (a2, l2) in zip(gram_result.losses, forward_result.losses):
        assert a1 == a2 and l1 == pytest.approx(l2, rel=1e-3)


def test_folding_into_norm_and_previous_linear_keeps_the_function():
    hidden, s = 32, torch.rand(32) * 3 + 0.2
    x, norm_weight, W = torch.randn(10, hidden), torch.rand(hidden) + 0.5, torch.randn(8, hidden)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (normed * norm_weight) @ W.t()
    folded = (normed * fold_scales_into_norm(norm_weight, s)) @ scale_weights([W], s)[0].t()
    assert torch.allclose(folded, expected, rtol=1e-4, atol=1e-4)

    prev_W, prev_b = torch.randn(hidden, 12), torch.randn(hidden)  # e.g. up_proj feeding down_proj
    h = torch.randn(10, 12)
    new_W, new_b = fold_scales_into_linear(prev_W, s, prev_b)
    expected = (h @ prev_W.t() + prev_b) @ W.t()
    assert torch.allclose((h @ new_W.t() + new_b) @ scale_weights([W], s)[0].t(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", [WeightScheme(4, symmetric=True, group_size=32),
                                    WeightScheme(4, symmetric=False, group_size=None)], ids=str)
def test_clip_search_never_above_unclipped_and_helps_heavy_tails(scheme):
    x = _inputs(in_features=80)  # partial last group with group 32
    W = torch.randn(24, 80) * 0.1
    W[torch.rand(24, 80) < 0.02] *= 8  # heavy tails: clipping a few outliers pays
    result = search_clip(x, W, scheme, grid_size=20, max_shrink=0.5)
    assert result.loss < result.loss_unclipped
    groups = ((0, 32), (32, 64), (64, 80)) if scheme.group_size else ((0, 80),)
    org_max = torch.stack([W[:, a:b].abs().amax(1) for a, b in groups], 1)
    org_min = torch.stack([W[:, a:b].amin(1) for a, b in groups], 1)
    lower = -result.max_val if result.min_val is None else result.min_val
    assert (result.max_val <= org_max).all() and (lower >= -org_max).all()
    if scheme.symmetric:  # +-f*max|w| with f >= 0.5
        assert result.min_val is None or torch.equal(result.min_val, -result.max_val)
        assert (result.max_val >= 0.5 * org_max - 1e-6).all()
    else:  # either family (+-f*max|w| or f*[min, max]): each end at most halved
        org_top = torch.stack([W[:, a:b].amax(1) for a, b in groups], 1)
        assert (result.max_val >= 0.5 * org_top.clamp(min=0) - 1e-6).all()
        assert (lower <= 0.5 * org_min.clamp(max=0) + 1e-6).all()
    clipped = apply_clip(W, result.max_val, scheme.group_size, result.min_val)
    assert clipped.shape == W.shape and (clipped.abs() <= W.abs()).all()
    assert awq_clip_error(x, W, clipped, scheme) == pytest.approx(result.loss, rel=1e-4)


def awq_clip_error(x, W, clipped, scheme):
    """Sum over groups of mean_t (x_g . (Q(clipped)_g - w_g))^2, per output channel (search_clip's loss)."""
    D = fake_quantize_rtn(clipped, scheme) - W
    x2 = x.reshape(-1, x.shape[-1])
    size = scheme.group_size or W.shape[1]
    total = sum(((x2[:, a:a + size] @ D[:, a:a + size].t()) ** 2).mean(0).sum() for a in range(0, W.shape[1], size))
    return float(total) / W.shape[0]


def test_asymmetric_clip_can_shrink_both_ends():
    # groups far off-centre: clipping +-max|w| can only cut the large side; f*[min, max] cuts both
    x = _inputs(in_features=64)
    W = torch.rand(16, 64) * 0.1 + 0.02
    W[torch.rand(16, 64) < 0.03] = -0.3
    scheme = WeightScheme(4, symmetric=False, group_size=32)
    result = search_clip(x, W, scheme)
    symmetric_only = search_clip(x, W, WeightScheme(4, symmetric=False, group_size=32), max_shrink=0.0)
    assert result.loss <= symmetric_only.loss_unclipped and result.min_val is not None


def test_awq_pipeline_beats_rtn_on_salient_inputs():
    x, weights = _inputs(outlier_gain=20.0), _linears()
    scheme = WeightScheme(4, symmetric=False, group_size=32)
    reference = _linear_forward(x, weights)
    rtn_mse = (_linear_forward(x, [fake_quantize_rtn(w, scheme) for w in weights]) - reference).pow(2).mean()
    s = search_scales(x, weights, scheme).scales
    quantized = []
    for w in scale_weights(weights, s):
        clip = search_clip(x / s, w, scheme)
        quantized.append(fake_quantize_rtn(apply_clip(w, clip.max_val, scheme.group_size, clip.min_val), scheme))
    awq_mse = (_linear_forward(x / s, quantized) - reference).pow(2).mean()
    assert awq_mse < rtn_mse


@pytest.mark.parametrize("observer", ["minmax", "mse"])
def test_awq_layer_loss_never_above_rtn_and_deterministic(observer):
    """Scales + clipping, then the scheme's own RTN: the linears' output error on the same inputs is
    never above plain RTN's (identity is a candidate of both searches), and reruns are bit-identical."""
    torch.manual_seed(0)
    x, weights = _inputs(outlier_gain=8.0, in_features=80), [torch.randn(40, 80) * 0.1]
    scheme = WeightScheme(4, symmetric=False, group_size=32, observer=observer)
    reference = _linear_forward(x, weights)
    rtn_mse = (_linear_forward(x, [fake_quantize_rtn(w, scheme) for w in weights]) - reference).pow(2).mean()

    def run():
        s = search_scales(x, weights, scheme, grid_size=10).scales
        w = scale_weights(weights, s)[0]
        clip = search_clip(x / s, w, scheme, grid_size=10)
        return s, fake_quantize_rtn(apply_clip(w, clip.max_val, scheme.group_size, clip.min_val), scheme)

    (s, q), (s2, q2) = run(), run()
    assert torch.equal(s, s2) and torch.equal(q, q2)
    awq_mse = (_linear_forward(x / s, [q]) - reference).pow(2).mean()
    assert awq_mse <= rtn_mse


def test_gqa_shared_scales_fold_into_v_rows_and_keep_attention():
    """v -> o with GQA: o_proj's channels of the query heads reading one KV head share a scale, so
    dividing v_proj's rows by it and multiplying o_proj's columns keeps the block's output."""
    from qkiln.quant.awq import gqa_shared_index

    torch.manual_seed(0)
    heads, kv_heads, head_dim, hidden, tokens = 4, 2, 8, 24, 10
    shared = gqa_shared_index(heads, kv_heads, head_dim)
    assert shared.shape == (heads * head_dim,) and int(shared.max()) == kv_heads * head_dim - 1
    Wv, Wo = torch.randn(kv_heads * head_dim, hidden), torch.randn(hidden, heads * head_dim)
    x, probs = torch.randn(tokens, hidden), torch.softmax(torch.randn(heads, tokens, tokens), -1)

    def block(Wv, Wo):
        v = (x @ Wv.t()).view(tokens, kv_heads, head_dim).transpose(0, 1)  # [kv_heads, tokens, head_dim]
        v = v.repeat_interleave(heads // kv_heads, dim=0)  # [heads, tokens, head_dim]
        return (probs @ v).transpose(0, 1).reshape(tokens, -1) @ Wo.t()

    o_in = (probs @ (x @ Wv.t()).view(tokens, kv_heads, head_dim).transpose(0, 1).repeat_interleave(2, 0))
    o_in = o_in.transpose(0, 1).reshape(tokens, -1)  # [tokens, heads * head_dim]: o_proj's input
    result = search_scales(o_in, [Wo], WeightScheme(4, symmetric=False, group_size=16), grid_size=5, shared=shared)
    assert result.shared_scales.shape == (kv_heads * head_dim,)
    assert torch.equal(result.scales, result.shared_scales[shared]) and result.loss <= result.identity_loss
    s_rows = torch.rand(kv_heads * head_dim) + 0.5  # any shared scale keeps the function
    new_Wv, _ = fold_scales_into_linear(Wv, s_rows)
    new_Wo = scale_weights([Wo], s_rows[shared])[0]
    assert torch.allclose(block(new_Wv, new_Wo), block(Wv, Wo), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_clipping_before_gptq_with_mse_range_hurts(seed):
    """Why the w4a16-awq preset (AWQ scales, then GPTQ with the MSE range) skips AWQ's clip: the MSE
    observer already searches each group's range, and clipping first rewrites the weights GPTQ
    reconstructs, so the output error against the original weights is larger with the clip."""
    from qkiln.quant.awq import gram
    from qkiln.quant.gptq import quantize_weight, reconstruction_error

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 96, generator=g) * (torch.rand(96, generator=g) + 0.2)
    W = torch.randn(48, 96, generator=g) * 0.1
    W[torch.rand(48, 96, generator=g) < 0.02] *= 8  # heavy tails: AWQ's clip search does clip here
    H = gram(x)
    clip = search_clip(x, W, WeightScheme(4, symmetric=False, group_size=32))
    clipped = apply_clip(W, clip.max_val, 32, clip.min_val)
    assert not torch.equal(clipped, W)
    scheme = WeightScheme(4, symmetric=False, group_size=32, observer="mse")
    plain = reconstruction_error(W, quantize_weight(W, H, scheme)[0].dequantize(), H)
    after_clip = reconstruction_error(W, quantize_weight(clipped, H, scheme)[0].dequantize(), H)
    assert plain < after_clip
