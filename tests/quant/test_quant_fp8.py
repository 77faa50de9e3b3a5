"""FP8 e4m3: scales from amax, error within the format's bound, static and dynamic activations."""

import pytest
import torch

from qkiln.quant.fp8 import (FP8_DTYPE, FP8_MAX, fake_quantize_activation, quantize_activation_dynamic,
                             quantize_weight_fp8, static_scale, update_amax)
from qkiln.quant.rtn import expand_groups
from qkiln.quant.scheme import ActivationScheme


def _within_e4m3_bound(x, x_hat, scale):
    # 3 mantissa bits: half an ulp is <= |x| / 16; subnormal steps are 2^-9 * scale
    bound = torch.maximum(x.abs() / 16, 2.0**-10 * scale) * (1 + 1e-5)
    return bool(((x_hat - x).abs() <= bound).all())


@pytest.mark.parametrize("group_size", [None, 32])
def test_weight_error_within_e4m3_bound(group_size):
    W = torch.randn(16, 80) * torch.rand(16, 1) * 4
    W[3, 7] = 50.0  # an outlier only affects its own channel / group
    fw = quantize_weight_fp8(W, group_size)
    assert fw.weight.dtype == FP8_DTYPE
    assert fw.scales.shape == (16, 1 if group_size is None else 3)
    scale = expand_groups(fw.scales, group_size, 80)
    assert _within_e4m3_bound(W, fw.dequantize(), scale)
    assert fw.weight.float().abs().amax() == FP8_MAX  # every group's amax lands on +-448


def test_per_channel_scale_is_amax_over_448():
    W = torch.randn(8, 32)
    fw = quantize_weight_fp8(W)
    assert torch.allclose(fw.scales[:, 0], W.abs().amax(dim=1) / FP8_MAX)


def test_dynamic_activation_scales_per_token():
    x = torch.randn(3, 5, 64) * torch.rand(3, 5, 1) * 10
    q, scale = quantize_activation_dynamic(x)
    assert scale.shape == (3, 5, 1) and q.dtype == FP8_DTYPE
    assert _within_e4m3_bound(x, q.float() * scale, scale)
    fake = fake_quantize_activation(x.bfloat16(), ActivationScheme(dynamic=True))
    assert fake.dtype == torch.bfloat16 and fake.shape == x.shape


def test_static_activation_scale_from_calibrated_amax_and_clipping():
    batches = [torch.randn(4, 32) * (i + 1) for i in range(3)]
    amax = None
    for batch in batches:
        amax = update_amax(amax, batch)
    assert amax == torch.cat(batches).abs().max()
    scale = static_scale(amax)
    scheme = ActivationScheme(dynamic=False)
    x = batches[1]
    assert _within_e4m3_bound(x, fake_quantize_activation(x, scheme, scale), scale)
    beyond = torch.tensor([[float(amax) * 3, -float(amax) * 3]])
    assert torch.allclose(fake_quantize_activation(beyond, scheme, scale), torch.tensor([[1.0, -1.0]]) * amax)
    with pytest.raises(ValueError):
        fake_quantize_activation(x, scheme)
