"""Round-to-nearest: error within scale/2, exact on its own grid, partial last groups."""

import pytest
import torch

from qkiln.quant.pack import unpack_int4
from qkiln.quant.rtn import QuantizedWeight, expand_groups, quantize_rtn
from qkiln.quant.scheme import WeightScheme

SCHEMES = [
    WeightScheme(4, symmetric=True, group_size=32),
    WeightScheme(4, symmetric=False, group_size=32),
    WeightScheme(4, symmetric=False, group_size=32, zero_point="float"),
    WeightScheme(4, symmetric=True, group_size=None),
    WeightScheme(8, symmetric=True, group_size=None),
    WeightScheme(8, symmetric=False, group_size=64),
    WeightScheme(4, symmetric=False, group_size=48, scale_dtype="bfloat16"),
    WeightScheme(4, symmetric=True, group_size=32, scale_dtype="float16"),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_dequant_error_within_half_scale(scheme):
    W = torch.randn(24, 80) * torch.rand(24, 1) * 3  # 80 = 2.5 groups of 32: partial last group
    qw = quantize_rtn(W, scheme)
    assert qw.qweight.shape == W.shape
    assert qw.qweight.dtype == (torch.int8 if scheme.symmetric else torch.uint8)
    assert qw.scales.dtype == torch.float32
    half_scale = expand_groups(qw.scales, scheme.group_size, 80) / 2
    error = (qw.dequantize() - W).abs()
    assert (error <= half_scale + 1e-6 * (W.abs() + half_scale)).all()  # fp32 rounding of (q - z) * s


@pytest.mark.parametrize("scheme", SCHEMES[-2:], ids=str)
def test_scales_are_representable_in_scale_dtype(scheme):
    qw = quantize_rtn(torch.randn(8, 64), scheme)
    dtype = getattr(torch, scheme.scale_dtype)
    assert torch.equal(qw.scales.to(dtype).float(), qw.scales)


def _q41_like(rows, cols, group):
    """Weights on a GGUF Q4_1-like grid: w = m + d * q per block, every block using codes 0 and 15."""
    q = torch.randint(0, 16, (rows, cols))
    q[:, ::group], q[:, 1::group] = 0, 15
    d = torch.rand(rows, cols // group) * 0.02 + 1e-3
    m = torch.randn(rows, cols // group) * 0.05  # arbitrary float offsets, often not multiples of d
    return m.repeat_interleave(group, 1) + d.repeat_interleave(group, 1) * q, q


def test_asymmetric_g32_float_zero_is_lossless_on_q4_1_grid():
    W, q = _q41_like(16, 128, 32)
    qw = quantize_rtn(W, WeightScheme(4, symmetric=False, group_size=32, zero_point="float"))
    assert torch.equal(qw.qweight.long(), q)
    assert torch.allclose(qw.dequantize(), W, rtol=0, atol=1e-6)


def test_integer_zero_grid_is_reproduced_exactly():
    q = torch.randint(0, 16, (12, 64))
    q[:, ::32], q[:, 1::32] = 0, 15
    zero = torch.randint(1, 15, (12, 2)).float()
    scale = torch.rand(12, 2) + 0.1
    W = (q - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    qw = quantize_rtn(W, WeightScheme(4, symmetric=False, group_size=32))
    assert torch.equal(qw.qweight.long(), q)
    assert torch.equal(qw.zeros, zero)
    assert torch.allclose(qw.dequantize(), W, rtol=1e-6, atol=1e-6)


def test_partial_last_group_only_sees_its_own_columns():
    scheme = WeightScheme(4, symmetric=False, group_size=32)
    W = torch.randn(8, 80)
    qw = quantize_rtn(W, scheme)
    assert qw.scales.shape == (8, 3)
    tail = quantize_rtn(W[:, 64:], WeightScheme(4, symmetric=False, group_size=16))
    assert torch.equal(qw.scales[:, 2:], tail.scales)
    assert torch.equal(qw.qweight[:, 64:], tail.qweight)
    W2 = W.clone()
    W2[:, :64] *= 10  # other groups change; the last group's parameters must not
    assert torch.equal(quantize_rtn(W2, scheme).scales[:, 2], qw.scales[:, 2])


def test_zero_and_constant_groups_are_exact():
    W = torch.zeros(4, 64)
    W[1] = 0.37
    W[2, 32:] = -1.5
    for scheme in (WeightScheme(4, symmetric=False, group_size=32),
                   WeightScheme(4, symmetric=False, group_size=32, zero_point="float")):
        deq = quantize_rtn(W, scheme).dequantize()
        assert torch.allclose(deq, W, atol=1e-6), scheme
    # symmetric: zeros stay exact; +amax sits half a step past the top code (the 16-level convention)
    qw = quantize_rtn(W, WeightScheme(4, symmetric=True, group_size=32))
    deq = qw.dequantize()
    assert torch.equal(deq[0], W[0]) and torch.equal(deq[3], W[3])
    assert torch.allclose(deq[1], W[1] - qw.scales[1, 0] / 2)


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_observer_never_worse_than_minmax_per_group(symmetric):
    W = torch.randn(16, 80)
    W[torch.rand(16, 80) < 0.03] *= 6  # outliers make shrinking the range worth it
    minmax = WeightScheme(4, symmetric=symmetric, group_size=32)
    mse = WeightScheme(4, symmetric=symmetric, group_size=32, observer="mse")

    def group_error(scheme):
        err = (quantize_rtn(W, scheme).dequantize() - W).abs().pow(2.4)
        return torch.stack([err[:, a:b].sum(1) for a, b in ((0, 32), (32, 64), (64, 80))], dim=1)

    assert (group_error(mse) <= group_error(minmax) * (1 + 1e-5)).all()
    assert group_error(mse).sum() < group_error(minmax).sum()


@pytest.mark.parametrize("dtype,low,high", [(torch.int8, -8, 8), (torch.uint8, 0, 16)], ids=["signed", "unsigned"])
@pytest.mark.parametrize("in_features", [64, 33])
def test_int4_codes_are_held_two_a_byte_and_read_back_exactly(dtype, low, high, in_features):
    # a build holds every layer's codes until it writes the artifact: unpacked, a byte a parameter
    q = torch.randint(low, high, (12, in_features), dtype=dtype)
    scales = torch.rand(12, 1)
    zeros = None if dtype == torch.int8 else torch.full((12, 1), 7.0)
    qw = QuantizedWeight(q, scales, zeros, None, 4)
    assert qw.packed_int4.shape == (12, (in_features + 1) // 2) and qw.packed_int4.dtype == torch.uint8
    assert qw.qweight.dtype == dtype and torch.equal(qw.qweight, q) and qw.shape == q.shape
    offset = 8 if dtype == torch.int8 else 0  # the artifact's layout: symmetric codes offset by 8
    assert torch.equal(unpack_int4(qw.packed_int4)[:, :in_features].int(), q.int() + offset)
    expected = (q.float() - (0 if zeros is None else zeros)) * scales
    assert torch.equal(qw.dequantize(), expected)
    read = QuantizedWeight.from_packed_int4(qw.packed_int4, in_features, scales, zeros, None)  # an artifact's
    assert torch.equal(read.qweight, q) and read.shape == q.shape and torch.equal(read.dequantize(), expected)
    q8 = torch.randint(-128, 128, (12, in_features), dtype=torch.int8)
    assert QuantizedWeight(q8, scales, None, None, 8).qweight is q8  # 8-bit codes as given
