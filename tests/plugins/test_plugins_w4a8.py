"""The opt-in int8-activation kernels (csrc/cpu_gemm_w4a8.cpp, the many-row GEMM;
csrc/cpu_gemv_int4_a8.cpp and cpu_gemv_int8_a8.cpp, the GEMVs of int4 and int8 weights) against
plugins/reference.py.

The kernel and the reference round activations to int8 with the same fp32 operations, so the
only differences are fp32 summation order and the output rounding: fp32 outputs must agree to
FP32_TOLERANCE, bf16 / fp16 outputs to HALF_TOLERANCE (2^-8 relative per value). Inputs are
fresh random numbers every run. Skips (saying why) when the extension cannot build.
"""

import pytest
import torch
from plugins_testlib import canonical_int4, rel_error

from qkiln.plugins import cpu_native, prepare_w4a16, prepare_w8a16, w4a16_linear, w8a16_linear
from qkiln.plugins.packed_weights import int8_act_panels_fast
from qkiln.plugins.reference import (fake_quantize_int8_blocks, quantize_int8_blocks,
                                     reference_w4a8_linear, reference_w4a16_linear,
                                     reference_w8a16_linear)

FP32_TOLERANCE = 1e-5
HALF_TOLERANCE = 1.5e-2
# (out, in, group): in=576/group 128 ends in a 64-wide group; group 32 is one activation block
# per weight group; group == in is one group (the int8 head's form); out=37 and 100 pad the
# last 48-channel panel; 1 output channel is all padding but one.
SHAPES = [(40, 576, 128), (37, 576, 32), (100, 96, 96), (1, 64, 64), (48, 1536, 128)]


def unsigned(qweight, zeros):
    """Canonical int4 -> (codes 0..15, zero points) as the kernel reads them."""
    if zeros is None:
        return (qweight.int() + 8).to(torch.uint8), torch.full((qweight.shape[0], 1), 8.0)
    return qweight, zeros


def test_activation_quantization_is_blockwise_int8():
    x = torch.randn(5, 96) * torch.rand(5, 96) * 10
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    q, scale = quantize_int8_blocks(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 3) and q.abs().max() <= 127
    assert scale[1, 1] == 0 and (q[1, 32:64] == 0).all()
    blocks = x.reshape(5, 3, 32).abs().amax(-1)
    assert torch.equal(q.reshape(5, 3, 32).abs().amax(-1) == 127, blocks > 0)  # each block uses the range
    error = (fake_quantize_int8_blocks(x) - x).abs().reshape(5, 3, 32)
    assert (error <= scale[..., None] / 2 + 1e-6).all()  # rounded to the nearest step


@pytest.mark.parametrize("out_features,in_features,group_size", SHAPES)
@pytest.mark.parametrize("is_symmetric", [True, False])
def test_kernel_matches_reference(native_ext, out_features, in_features, group_size, is_symmetric):
    qweight, scales, zeros = canonical_int4(out_features, in_features, group_size, is_symmetric)
    codes, zero_points = unsigned(qweight, zeros)
    zp = zero_points.expand_as(scales) if zero_points.shape[1] == 1 else zero_points
    packed, s, zs = cpu_native.pack_w4a8(codes, scales, zp)
    assert packed.shape == (-(-out_features // 48), in_features // 4, 48, 4)
    bias = torch.randn(out_features)
    for rows, dtype in [(17, torch.float32), (64, torch.bfloat16), (130, torch.float16), (5, torch.float32)]:
        x = torch.randn(rows, in_features).to(dtype)
        for b in (None, bias):
            expected = reference_w4a8_linear(x.float(), qweight, scales, zeros, group_size, b)
            actual = native_ext.w4a8_gemm(x, packed, s, zs, b, group_size, out_features)
            assert actual.dtype == dtype and actual.shape == (rows, out_features)
            tolerance = FP32_TOLERANCE if dtype == torch.float32 else HALF_TOLERANCE
            assert rel_error(actual, expected) < tolerance, (rows, dtype, b is None)


# (out, in, group) for the GEMV over the native int4 layout: in=96 and 160 end in half a 64-weight
# chunk; group 32 / 64 / 128 / in put weight-group ends at either half of a chunk.
GEMV_SHAPES = [(40, 576, 128), (37, 96, 32), (9, 160, 64), (64, 1536, 128), (5, 576, 576)]


@pytest.mark.parametrize("out_features,in_features,group_size", GEMV_SHAPES)
@pytest.mark.parametrize("is_symmetric", [True, False])
def test_gemv_over_the_int4_layout_matches_reference(native_ext, out_features, in_features,
                                                     group_size, is_symmetric):
    """csrc/cpu_gemv_int4_a8.cpp: the native int4 GEMV layout read with int8 activation codes; rows
    1-4 take one pass, 5 and 16 several, 21 is what it would do for many rows."""
    qweight, scales, zeros = canonical_int4(out_features, in_features, group_size, is_symmetric)
    codes, zero_points = unsigned(qweight, zeros)
    packed, s, c = cpu_native.pack_w4a16(codes, scales, None if zeros is None else zeros, group_size,
                                         int8_activations=True)
    bias = torch.randn(out_features)
    for rows, dtype in [(1, torch.float32), (2, torch.bfloat16), (3, torch.float16),
                        (4, torch.float32), (5, torch.bfloat16), (16, torch.float32), (21, torch.float32)]:
        x = torch.randn(rows, in_features).to(dtype)
        x[0, :32] = 0  # an all-zero block: scale 0
        for b in (None, bias):
            expected = reference_w4a8_linear(x.float(), qweight, scales, zeros, group_size, b)
            actual = native_ext.w4a8_gemv(x, packed, s, c, b, group_size, out_features)
            assert actual.dtype == dtype and actual.shape == (rows, out_features)
            tolerance = FP32_TOLERANCE if dtype == torch.float32 else HALF_TOLERANCE
            assert rel_error(actual, expected) < tolerance, (rows, dtype, b is None)
    exact = reference_w4a16_linear(x.float(), qweight, scales, zeros, group_size)
    assert rel_error(native_ext.w4a8_gemv(x, packed, s, c, None, group_size, out_features), exact) > 1e-4


@pytest.mark.parametrize("out_features,in_features", [(37, 96), (64, 576), (6, 32), (49, 1536)])
def test_int8_weight_gemv_matches_reference(native_ext, out_features, in_features):
    """csrc/cpu_gemv_int8_a8.cpp: the native int8 weight as it is (row-major, per-channel scales)
    with int8 activation codes; out=37 / 6 / 49 end in a partial 4-row tile (its plain path)."""
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    weight[0, :32] = -128  # |q| = 128 takes vpmaddubsw's whole unsigned range
    scales = torch.rand(out_features) * 0.01 + 1e-3
    bias = torch.randn(out_features)
    for rows, dtype in [(1, torch.float32), (2, torch.bfloat16), (3, torch.float16),
                        (4, torch.float32), (5, torch.bfloat16), (16, torch.float32)]:
        x = torch.randn(rows, in_features).to(dtype)
        x[0, :32] = 0  # an all-zero block: scale 0
        x[-1, -32:] = 127.0  # a block that is all its maximum: codes 127 against weights -128
        for b in (None, bias):
            expected = reference_w4a8_linear(x.float(), weight, scales[:, None], None, in_features, b)
            actual = native_ext.w8a8_gemv(x, weight, scales, b)
            assert actual.dtype == dtype and actual.shape == (rows, out_features)
            tolerance = FP32_TOLERANCE if dtype == torch.float32 else HALF_TOLERANCE
            assert rel_error(actual, expected) < tolerance, (rows, dtype, b is None)
    x = torch.randn(3, in_features)
    exact = reference_w8a16_linear(x, weight, scales)
    assert rel_error(native_ext.w8a8_gemv(x, weight, scales, None), exact) > 1e-4
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native_ext.w8a8_gemv(torch.randn(1, 48), torch.ones(out_features, 48, dtype=torch.int8), scales, None)


def test_kernel_refuses_mismatched_layouts(native_ext):
    qweight, scales, zeros = canonical_int4(48, 96, 32, is_symmetric=False)
    packed, s, zs = cpu_native.pack_w4a8(qweight, scales, zeros)
    with pytest.raises(RuntimeError, match="in_features"):
        native_ext.w4a8_gemm(torch.randn(20, 96), packed, s, zs, None, 48, 48)  # group not a multiple of 32
    with pytest.raises(RuntimeError, match="packed"):
        native_ext.w4a8_gemm(torch.randn(20, 64), packed, s, zs, None, 32, 48)


def test_front_doors_round_int4_rows_always_and_int8_rows_when_few_or_paneled(native_ext):
    qweight, scales, zeros = canonical_int4(60, 576, 128, is_symmetric=True)
    weight = prepare_w4a16(qweight, scales, zeros, 128, "cpu", keep_dequantized=True,
                           int8_activations=True)
    assert weight.int8_activations and weight.dequantized is None  # no bf16 copy
    assert (weight.int8_act is not None) == int8_act_panels_fast()  # else the GEMV takes all rows
    many, few = torch.randn(3, 20, 576).to(torch.bfloat16), torch.randn(2, 576).to(torch.bfloat16)
    for x in (many, few):  # <= 16 rows: the int8-activation GEMV over the int4 layout
        assert rel_error(w4a16_linear(x, weight),
                         reference_w4a8_linear(x.float(), qweight, scales, zeros, 128)) < HALF_TOLERANCE
        exact = reference_w4a16_linear(x.float(), qweight, scales, zeros, 128)
        assert rel_error(w4a16_linear(x, weight), exact) > 1e-3  # activations were rounded

    # int8 weights round few rows always (their GEMV), many only where the panels GEMM is fast
    # (AVX512-VNNI).
    q8, s8 = torch.randint(-128, 128, (50, 576), dtype=torch.int8), torch.rand(50) * 0.01
    head = prepare_w8a16(q8, s8, "cpu", keep_dequantized=True, int8_activations=True)
    panels = int8_act_panels_fast()
    assert head.int8_activations
    assert (head.int8_act is not None, head.dequantized is None) == (panels, panels)
    expected = reference_w4a8_linear(many.float(), q8, s8[:, None], None, 576) if panels \
        else reference_w8a16_linear(many.float(), q8, s8)
    assert rel_error(w8a16_linear(many, head), expected) < HALF_TOLERANCE
    rounded = reference_w4a8_linear(few.float(), q8, s8[:, None], None, 576)
    assert rel_error(w8a16_linear(few, head), rounded) < HALF_TOLERANCE
    assert rel_error(w8a16_linear(few, head), reference_w8a16_linear(few.float(), q8, s8)) > 1e-3


@pytest.mark.parametrize("rows", [1, 20])
def test_a_nan_activation_gives_nan_as_the_reference_does(native_ext, rows):
    """SIMD max drops a NaN, so a row holding one was rounded to finite codes (outputs ~3e6):
    hiding a divergence upstream. Its row must come out NaN, the others untouched."""
    qweight, scales, zeros = canonical_int4(40, 576, 128, is_symmetric=False)
    q8, s8 = torch.randint(-128, 128, (50, 576), dtype=torch.int8), torch.rand(50) * 0.01
    x = torch.randn(rows, 576).to(torch.bfloat16)
    x[0, 100] = float("nan")
    for weight, linear in ((prepare_w4a16(qweight, scales, zeros, 128, "cpu", keep_dequantized=True,
                                          int8_activations=True), w4a16_linear),
                           (prepare_w8a16(q8, s8, "cpu", keep_dequantized=True, int8_activations=True),
                            w8a16_linear)):
        out = linear(x, weight)
        assert out[0].isnan().all() and out[1:].isfinite().all()


def test_shapes_the_kernel_cannot_take_keep_the_exact_path(native_ext):
    qweight, scales, zeros = canonical_int4(16, 80, 32, is_symmetric=True)  # 80 % 32 != 0
    weight = prepare_w4a16(qweight, scales, zeros, 32, "cpu", keep_dequantized=True,
                           int8_activations=True)
    assert weight.int8_act is None and not weight.int8_activations and weight.dequantized is not None


def test_portable_build_matches_reference(native_ext):
    """The plain C++ fallback for CPUs without AVX512-VNNI (built without AVX-512; cached)."""
    portable = cpu_native.build_portable_extension()
    assert portable.w4a8_kernel_isa() == "portable"
    qweight, scales, zeros = canonical_int4(37, 576, 128, is_symmetric=False)
    packed, s, zs = cpu_native.pack_w4a8(qweight, scales, zeros)
    x = torch.randn(21, 576)
    expected = reference_w4a8_linear(x, qweight, scales, zeros, 128)
    assert rel_error(portable.w4a8_gemm(x, packed, s, zs, None, 128, 37), expected) < FP32_TOLERANCE
