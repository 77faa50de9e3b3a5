"""The int4 and int8 GEMVs for bf16 / fp16 activations on AVX2 hosts (csrc/cpu_gemv_fixed16.cpp):
16-bit fixed point per group of channels (int4: the weight group; int8: 128), against fp64.

Each output must sit within half an ulp of its dtype of the exact value (the output rounding),
plus what the fixed point may move it (half a step 2^(e - 15) per activation, e the exponent of
its group's amax, times |w|), plus fp32 slack. Activations within 2^7 of their group's amax are
exact, so there the fixed-point term is zero. On AVX-512 BF16 hosts the main build runs the bf16
kernels instead (fp16 rows rounded to bf16, inf rows inf: not these kernels' bounds), so there these
tests run the build without AVX-512 (cpu_native.build_portable_extension), which is the AVX2 one.
"""

import math

import pytest
import torch
from plugins_testlib import assert_int4_within_bound, assert_within_fixed_point_bound, canonical_int4

from qkiln.plugins import cpu_native

@pytest.fixture(scope="module")
def native_ext(native_ext):
    """The build whose GEMVs are these kernels: the main one on an AVX2 host, else the one without
    AVX-512 (they failed on a Zen 4 host against the main build's bf16 kernels: session 48)."""
    if native_ext.int4_kernel_isa() == "avx2":
        return native_ext
    portable = cpu_native.build_portable_extension()
    if portable.int4_kernel_isa() != "avx2":
        pytest.skip("the 16-bit fixed-point GEMVs need AVX2 and FMA")
    return portable


# (out, in, group): a half chunk (96), a shorter last group (576 / 128), groups of 32 inside a
# chunk, 12 rows padding a tile, one group per row (576 / 576)
SHAPES = [(40, 576, 128), (37, 96, 64), (16, 256, 32), (12, 1536, 128), (8, 576, 576)]


def int4_case(out, K, group, symmetric):
    qweight, scales, zeros = canonical_int4(out, K, group, is_symmetric=symmetric)
    unsigned = qweight.int() + 8 if zeros is None else qweight.int()
    return (qweight, scales, zeros), cpu_native.pack_w4a16(unsigned, scales, zeros, group)


def in_range_activations(rows, K, dtype):
    """Random signs and magnitudes within 2^7 (bf16) / 2^4 (fp16) of any group's amax: every
    value exact in the fixed point."""
    low = 1.0 if dtype == torch.bfloat16 else 6.5  # magnitudes in [low, 100)
    magnitude = low * torch.exp(torch.rand(rows, K) * math.log(100.0 / low))
    return (magnitude * (torch.randint(0, 2, (rows, K)) * 2 - 1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("out,K,group", SHAPES)
def test_fixed_point_int4_gemv_is_within_its_bound(native_ext, out, K, group, symmetric, dtype):
    (qweight, scales, zeros), (packed, tiled, zero_term) = int4_case(out, K, group, symmetric)
    bias = torch.randn(out)
    for rows in (1, 2, 3, 5, 16):  # every microkernel width (4 activation rows a pass at most)
        x = torch.randn(rows, K).to(dtype)
        x[0, 3] *= 300  # one outlier: the rest of its group loses low bits
        actual = native_ext.w4a16_gemm(x, packed, tiled, zero_term, bias, group, out)
        assert actual.dtype == dtype and actual.shape == (rows, out)
        assert_int4_within_bound(actual, x, qweight, scales, zeros, group, bias)
        x = in_range_activations(rows, K, dtype)
        actual = native_ext.w4a16_gemm(x, packed, tiled, zero_term, bias, group, out)
        assert_int4_within_bound(actual, x, qweight, scales, zeros, group, bias, exact_activations=True)


def test_fixed_point_switch_gives_the_fp32_kernels(native_ext, monkeypatch):
    """QKILN_FIXED16=0: bf16 rows through the fp32 FMA kernels, exact products (the A/B switch)."""
    (qweight, scales, zeros), (packed, tiled, zero_term) = int4_case(40, 576, 128, False)
    q8, s8 = torch.randint(-128, 128, (40, 576), dtype=torch.int8), torch.rand(40) * 0.01
    x = torch.randn(3, 576).to(torch.bfloat16)
    monkeypatch.setenv("QKILN_FIXED16", "0")
    switched = native_ext.w4a16_gemm(x, packed, tiled, zero_term, None, 128, 40)
    widened = native_ext.w4a16_gemm(x.float(), packed, tiled, zero_term, None, 128, 40)
    assert torch.equal(switched, widened.to(torch.bfloat16))
    assert_int4_within_bound(switched, x, qweight, scales, zeros, 128, torch.zeros(40),
                             exact_activations=True)
    switched = native_ext.w8a16_gemm(x, q8, s8, None)
    assert torch.equal(switched, native_ext.w8a16_gemm(x.float(), q8, s8, None).to(torch.bfloat16))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_activation_makes_its_row_nan(native_ext, bad):
    _, (packed, tiled, zero_term) = int4_case(40, 576, 128, False)
    q8, s8 = torch.randint(-128, 128, (40, 580), dtype=torch.int8), torch.rand(40) * 0.01
    x = torch.randn(3, 580).to(torch.bfloat16)
    x[1, 500] = bad  # the short last group / block
    for out in (native_ext.w4a16_gemm(x[:, :576], packed, tiled, zero_term, None, 128, 40),
                native_ext.w8a16_gemm(x, q8, s8, None)):
        assert out[1].isnan().all()
        assert out[[0, 2]].isfinite().all()


def test_groups_past_the_int32_limit_take_the_fp32_kernel(native_ext):
    """One group of 35200 channels, every code 15 and every activation the largest code
    (32640): a lane of dot(q, xi) would sum 4400 products of 489600, past int32, so these rows
    must take the fp32 kernel (exact products)."""
    K = 35200
    qweight = torch.full((4, K), 15, dtype=torch.uint8)
    scales, zeros = torch.rand(4, 1) * 0.02 + 0.005, torch.zeros(4, 1)
    packed, tiled, zero_term = cpu_native.pack_w4a16(qweight.int(), scales, zeros, K)
    x = torch.full((1, K), 1.9921875, dtype=torch.bfloat16)  # 0x3FFF: amax just under 2
    actual = native_ext.w4a16_gemm(x, packed, tiled, zero_term, None, K, 4)
    # each fp32 lane sums K / 16 = 2200 products in turn: up to 2200 roundings of 2^-24 (the default
    # 1e-5 slack failed 1 run in ~7 at 1.04x on a Zen 4 host, session 48)
    assert_int4_within_bound(actual, x, qweight, scales, zeros, K, torch.zeros(4), exact_activations=True,
                             slack=K / 16 * 2.0 ** -24)


# (out, in): 37 pads the last tile; 200, 33 and 300 end in a part of 16 channels (the scalar
# tail), 300 in a short block; 576 is SmolLM2's lm_head width
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("out,K", [(37, 200), (8, 576), (6, 33), (9, 300)])
def test_fixed_point_int8_gemv_is_within_its_bound(native_ext, out, K, dtype):
    qweight = torch.randint(-128, 128, (out, K), dtype=torch.int8)
    qweight[0, :3] = -128
    scales, bias = torch.rand(out) * 0.01 + 0.001, torch.randn(out)
    weight = qweight.double() * scales.double()[:, None]
    for rows in (1, 2, 3, 5, 16):
        x = torch.randn(rows, K).to(dtype)
        x[-1, K // 2] *= 300
        actual = native_ext.w8a16_gemm(x, qweight, scales, bias)
        assert actual.dtype == dtype and actual.shape == (rows, out)
        assert_within_fixed_point_bound(actual, x, weight, bias, 128)
        x = in_range_activations(rows, K, dtype)
        assert_within_fixed_point_bound(native_ext.w8a16_gemm(x, qweight, scales, bias), x, weight,
                                        bias, 128, exact_activations=True)
