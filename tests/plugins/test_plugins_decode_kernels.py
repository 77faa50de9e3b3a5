"""Decode-path kernels against the reference: W4A16/W8A16 GEMV (split-K) and fused FP8 W8A8.

On the GPU when there is one, else under TRITON_INTERPRET (tiny shapes). The interpreter's fp8
conversions are wrong (codes off by a whole binade were seen with triton 3.6), so on CPU only the
fp8 scales are checked; fp8 codes and the fp8 GEMV are checked on the GPU (and by
bench/gpu_check.py).
"""

import pytest
import torch
from plugins_testlib import TOLERANCE, rel_error

from qkiln.plugins import prepare_w4a16, prepare_w8a16
from qkiln.plugins.reference import (fake_quantize_fp8_per_token, reference_fp8_w8a8_linear,
                                     reference_w4a16_linear, reference_w8a16_linear)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.fixture(scope="module")
def kernels():
    from qkiln.plugins import triton_fp8, triton_kv, triton_w4a16

    if DEVICE == "cpu" and not triton_kv.is_interpreter():
        pytest.skip("no GPU and the Triton kernels were imported without TRITON_INTERPRET=1")
    return triton_w4a16, triton_fp8


def _int4(out_features, in_features, group_size, is_symmetric):
    num_groups = -(-in_features // group_size)
    scales = torch.rand(out_features, num_groups) * 0.02 + 0.005
    if is_symmetric:
        return torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8), scales, None
    return (torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8), scales,
            torch.rand(out_features, num_groups) * 15)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("is_symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size,in_features", [(32, 96), (64, 160), (32, 95)])
def test_w4a16_gemv_matches_reference(kernels, group_size, in_features, is_symmetric, split_k):
    """160 with group 64 ends in a 32-wide group; 95 is odd (a padded last byte row)."""
    qweight, scales, zeros = _int4(40, in_features, group_size, is_symmetric)
    x = torch.randn(2, in_features)
    bias = torch.randn(40)
    expected = reference_w4a16_linear(x, qweight, scales, zeros, group_size, bias)
    w = prepare_w4a16(qweight.to(DEVICE), scales.to(DEVICE),
                      zeros.to(DEVICE) if zeros is not None else None, group_size, "cuda",
                      dtype=DTYPE)
    out = torch.full((2, 40), float("nan"), dtype=DTYPE, device=DEVICE)
    kernels[0].triton_wna16_gemv(x.to(DEVICE, DTYPE), w.packed, w.scales, w.zeros, group_size, 4,
                                 in_features, 40, (16, 16, split_k), bias.to(DEVICE, DTYPE), out)
    assert rel_error(out.cpu(), expected) < TOLERANCE[DTYPE]


def test_w4a16_linear_routes_one_row_to_the_gemv_and_both_paths_agree(kernels):
    qweight, scales, zeros = _int4(24, 128, 32, False)
    w = prepare_w4a16(qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 32, "cuda",
                      dtype=DTYPE)
    args = (w.packed, w.scales, w.zeros, 32, 4, 128, 24)
    assert kernels[0].GEMV_MAX_ROWS >= 1
    assert kernels[0].gemv_config(3, 24, 128, 32, DEVICE) is not None
    for x in (torch.randn(1, 1, 128), torch.randn(1, 3, 128)):  # leading dims are kept
        x = x.to(DEVICE, DTYPE)
        expected = reference_w4a16_linear(x.cpu().float(), qweight, scales, zeros, 32)
        for use_gemv in (None, True, False):
            out = kernels[0].triton_wna16_linear(x, *args, use_gemv=use_gemv)
            assert out.shape == (*x.shape[:-1], 24)
            assert rel_error(out.cpu(), expected) < TOLERANCE[DTYPE]


def test_w8a16_gemv_matches_reference(kernels):
    qweight = torch.randint(-128, 128, (24, 80), dtype=torch.int8)
    scales = torch.rand(24) * 0.01 + 0.001
    x = torch.randn(1, 80)
    w = prepare_w8a16(qweight, scales, "cuda")
    out = kernels[0].triton_wna16_gemv(x.to(DEVICE), w.weight.to(DEVICE), w.scales.to(DEVICE),
                                       None, 128, 8, 80, 24, (16, 16, 2))
    expected = reference_w8a16_linear(x, qweight, scales)
    assert rel_error(out.cpu(), expected) < TOLERANCE[torch.float32]


def _fp8_weight(out_features, in_features):
    w = torch.randn(out_features, in_features)
    w_scale = w.abs().amax(dim=1) / 448
    return (w / w_scale[:, None]).to(torch.float8_e4m3fn), w_scale


def test_fused_fp8_quantization_matches_reference(kernels):
    x = torch.randn(5, 100) * torch.rand(5, 1) * 10
    x[3] = 0.0  # an all-zero row takes the 1e-12 floor
    x_q, scale = kernels[1].triton_quantize_fp8_per_token(x.to(DEVICE))
    want_q, want_scale = fake_quantize_fp8_per_token(x)
    assert torch.equal(scale.cpu(), want_scale)
    if DEVICE == "cuda":
        assert torch.equal(x_q.cpu().view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter's fp8 conversions are wrong")
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_gemv_matches_reference(kernels, rows):
    weight, w_scale = _fp8_weight(40, 100)
    x = torch.randn(rows, 100)
    bias = torch.randn(40)
    out = kernels[1].triton_fp8_gemv(x.to(DEVICE, DTYPE), weight.to(DEVICE),
                                     w_scale.to(DEVICE), bias.to(DEVICE, DTYPE))
    expected = reference_fp8_w8a8_linear(x, weight, w_scale, bias)
    assert rel_error(out.cpu(), expected) < TOLERANCE[torch.bfloat16]
