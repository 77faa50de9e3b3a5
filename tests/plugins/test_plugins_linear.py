"""CPU quantized linears (through the registered ops) against dequantize-then-matmul in fp32."""

import pytest
import torch
from plugins_testlib import canonical_int4, rel_error

from qkiln.errors import RecipeError
from qkiln.plugins import (cpu_native, fp8_w8a8_linear, prepare_fp8_w8a8, prepare_w4a16,
                           prepare_w8a16, w4a16_linear, w8a16_linear)
from qkiln.plugins.cpu_linear import INT4_GEMV_ROWS, SMALL_M, dense_linear, int4_gemv_rows
from qkiln.plugins.packed_weights import onednn_pack
from qkiln.plugins.reference import (dequantize_grouped, reference_fp8_w8a8_linear,
                                     reference_w4a16_linear, reference_w8a16_linear)

BF16_TOLERANCE = 1.5e-2  # activations and scales go through bf16 on CPU


@pytest.mark.parametrize("is_symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size,in_features", [(32, 256), (64, 256), (128, 576), (64, 576),
                                                    (64, 100), (96, 576), (4096, 576)])
def test_cpu_w4a16_matches_reference(group_size, in_features, is_symmetric):
    """in=576 with group 128 ends in a 64-wide group; in=100 needs padding to 128; groups of 96 and
    4096 (whole-row) are multiples of 32 the recipe allows, native kernels and tinygemm alike."""
    out_features = 40  # not a multiple of 16: exercises tinygemm's row padding
    qweight, scales, zeros = canonical_int4(out_features, in_features, group_size, is_symmetric)
    bias = torch.randn(out_features)
    weight = prepare_w4a16(qweight, scales, zeros, group_size, "cpu", keep_dequantized=True)
    packed_only = prepare_w4a16(qweight, scales, zeros, group_size, "cpu")
    tinygemm = prepare_w4a16(qweight, scales, zeros, group_size, "cpu", use_native=False)  # no-compiler path
    for rows in (1, 3, 33):  # decode rows use tinygemm, 33 rows the dequantized GEMM
        x = torch.randn(rows, in_features)
        expected = reference_w4a16_linear(x, qweight, scales, zeros, group_size, bias)
        for w in (weight, packed_only, tinygemm):
            actual = w4a16_linear(x, w, bias)
            assert actual.shape == expected.shape and actual.dtype == x.dtype
            assert rel_error(actual, expected) < BF16_TOLERANCE


def test_int4_steps_past_the_gemv_row_limit_take_the_dense_copy(monkeypatch):
    """Up to int4_gemv_rows rows the int4 kernel serves a weight even when it has a many-row form;
    a row more and the form's GEMM does (cpu_linear.py: the measured crossovers): the dense copy's
    bf16 GEMM (8 rows; 16 where the copy is held in fp32, without a fast bf16 GEMM), or on an AMX
    CPU the AMX int4 GEMM (8 rows), which gives the same bits."""
    qweight, scales, zeros = canonical_int4(96, 576, 64, True)
    monkeypatch.setenv("QKILN_AMX_CODES", "1")  # on an AMX CPU: the codes, not a copy
    many_rows = prepare_w4a16(qweight, scales, zeros, 64, "cpu", keep_dequantized=True)
    packed_only = prepare_w4a16(qweight, scales, zeros, 64, "cpu")
    monkeypatch.setenv("QKILN_AMX_CODES", "0")
    with_copy = prepare_w4a16(qweight, scales, zeros, 64, "cpu", keep_dequantized=True)
    assert with_copy.dequantized is not None and many_rows.many_rows_form
    limit = int4_gemv_rows(with_copy.dequantized)
    assert limit == (SMALL_M if with_copy.dequantized.dtype == torch.float32 else INT4_GEMV_ROWS)
    # An fp32 copy holds the GEMV's own weights (exact), and the GEMM then keeps fp32 activations
    # and their sums: the paths differ in the order of those, which bf16 outputs would mostly
    # round away.
    dtype = torch.float32 if with_copy.dequantized.dtype == torch.float32 else torch.bfloat16
    for rows in (limit, limit + 1):
        x = torch.randn(rows, 576, dtype=dtype)
        kernel = w4a16_linear(x, packed_only)
        rows_in = x if dtype == torch.float32 else x.to(torch.bfloat16)  # fp32 copy: fp32 rows
        dense = dense_linear(rows_in, with_copy.dequantized, out_features=96,
                             fp32_out=dtype == torch.float32).to(dtype)
        assert not torch.equal(kernel, dense)  # the two paths are told apart by their bits
        expected = kernel if rows <= limit else dense
        assert torch.equal(w4a16_linear(x, with_copy), expected)
        assert torch.equal(w4a16_linear(x, many_rows), expected)


def test_fp32_rows_past_the_gemv_limit_keep_fp32(monkeypatch):
    """An fp32 model's int4 linear: the many-row copy, where it is held in fp32 (no fast bf16 GEMM;
    forced here on any CPU), holds the weights the GEMV computes with, not their bf16 rounding, and
    its fp32 sums are not rounded to bf16: a prompt's rows and its decode rows agree to fp32
    rounding (they were ~2^-9 apart, which moved an fp32 SmolLM2 W4A16's prompt logprobs), and
    neither rounds the fp32 rows themselves."""
    from qkiln.plugins import packed_weights

    monkeypatch.setattr(packed_weights, "onednn_bf16_available", lambda: False)
    monkeypatch.setattr(cpu_native, "bf16_panels_available", lambda in_features: False)
    qweight, scales, zeros = canonical_int4(96, 576, 64, False)
    with_copy = prepare_w4a16(qweight, scales, zeros, 64, "cpu", keep_dequantized=True)
    if with_copy.dequantized is None:
        pytest.skip("no native int4 layout here (the copy is built beside the native kernels)")
    packed_only = prepare_w4a16(qweight, scales, zeros, 64, "cpu")
    x = torch.randn(SMALL_M + 4, 576)
    if cpu_native.native_extension().int4_kernel_isa() != "avx2":
        x = x.bfloat16().float()  # the AVX-512 GEMV rounds fp32 rows to bf16 (the copy does not)
    many = w4a16_linear(x, with_copy)  # the fp32 GEMM
    gemv = w4a16_linear(x, packed_only)  # the GEMV
    assert many.dtype == torch.float32 and not torch.equal(many, gemv)  # two paths, two sum orders
    torch.testing.assert_close(many, gemv, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("keep_dequantized", [False, True])
def test_fp32_rows_through_an_int8_weight_stay_fp32(keep_dequantized):
    """fp32 activations through an int8 weight (an fp32 model's lm_head scoring a prompt) are not
    rounded to bf16 at any row count: many rows agree with the exact product, and with the rows
    one at a time (decode), to fp32 rounding. The many-row forms had rounded the activations and
    the product to bf16 (SmolLM2's head: logits up to 0.27 off)."""
    qweight = torch.randint(-128, 128, (48, 96), dtype=torch.int8)
    scales = torch.rand(48) * 0.01 + 0.001
    weight = prepare_w8a16(qweight, scales, "cpu", keep_dequantized=keep_dequantized)
    if weight.scales.dtype != torch.float32:
        pytest.skip("no native int8 layout here (QKILN_NATIVE_CPU=0 or no compiler)")
    x = torch.randn(SMALL_M + 24, 96)
    many = w8a16_linear(x, weight)
    one_by_one = torch.cat([w8a16_linear(x[i:i + 1], weight) for i in range(x.shape[0])])
    exact = x.double() @ (qweight.double() * scales.double()[:, None]).T
    assert many.dtype == torch.float32
    assert (many.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    torch.testing.assert_close(many, one_by_one, rtol=1e-5, atol=1e-5)


def test_cpu_w4a16_keeps_leading_dims_and_bf16():
    qweight, scales, zeros = canonical_int4(32, 128, 64, is_symmetric=False)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    actual = w4a16_linear(x, prepare_w4a16(qweight, scales, zeros, 64, "cpu"))
    assert actual.shape == (2, 3, 32) and actual.dtype == torch.bfloat16
    expected = reference_w4a16_linear(x.float(), qweight, scales, zeros, 64)
    assert rel_error(actual, expected) < BF16_TOLERANCE


def test_w4a16_prepare_rejects_what_it_cannot_pack():
    qweight, scales, zeros = canonical_int4(32, 128, 16, is_symmetric=False)
    with pytest.raises(RecipeError, match="group_size"):
        prepare_w4a16(qweight, scales, zeros, 16, "cpu", use_native=False)
    with pytest.raises(RecipeError, match="symmetric"):
        prepare_w4a16(qweight, scales, None, 16, "cuda")  # uint8 q without zeros
    with pytest.raises(RecipeError, match="target"):
        prepare_w4a16(qweight, scales, zeros, 16, "tpu")


def test_cuda_layout_packs_pairs_along_in_features():
    qweight, scales, zeros = canonical_int4(16, 64, 32, is_symmetric=True)
    weight = prepare_w4a16(qweight, scales, None, 32, "cuda")
    q = (qweight.int() + 8).t()  # [in, out], offset so nibbles are unsigned
    assert torch.equal((weight.packed & 15).int(), q[0::2]) and torch.equal(
        (weight.packed >> 4).int(), q[1::2])
    assert weight.scales.shape == (2, 16) and weight.zeros is None


@pytest.mark.parametrize("keep_dequantized", [False, True])
@pytest.mark.parametrize("rows", [2, 40])
def test_cpu_w8a16_matches_reference(rows, keep_dequantized):
    qweight = torch.randint(-128, 128, (48, 96), dtype=torch.int8)
    scales = torch.rand(48) * 0.01 + 0.001
    bias = torch.randn(48)
    x = torch.randn(rows, 96)
    weight = prepare_w8a16(qweight, scales, "cpu", keep_dequantized=keep_dequantized)
    assert weight.many_rows_form == keep_dequantized  # a dense copy, or AMX reading the codes
    actual = w8a16_linear(x, weight, bias)
    assert rel_error(actual, reference_w8a16_linear(x, qweight, scales, bias)) < BF16_TOLERANCE


def test_torch_int8_path_takes_weights_at_any_offset():
    """torch's _weight_int8pack_mm (the path without qkiln's kernels) loads the weight with
    16-byte aligned loads above 4 rows and crashed the process on an artifact's int8 head, which
    safetensors hands over zero-copy at an odd offset: prepare_w8a16 copies such a weight."""
    qweight = torch.randint(-128, 128, (48, 96), dtype=torch.int8)
    scales = torch.rand(48) * 0.01 + 0.001
    odd = torch.empty(48 * 96 + 1, dtype=torch.int8)[1:].view(48, 96)
    odd.copy_(qweight)
    assert odd.data_ptr() % 16  # the case: not aligned
    weight = prepare_w8a16(odd, scales, "cpu", use_native=False)
    assert weight.weight.data_ptr() % 64 == 0 and torch.equal(weight.weight, qweight)
    x = torch.randn(5, 96)  # more than 4 rows: the aligned-load path
    assert rel_error(w8a16_linear(x, weight), reference_w8a16_linear(x, qweight, scales)) < BF16_TOLERANCE


@pytest.mark.parametrize("rows", [2, 40])
def test_cpu_fp8_w8a8_matches_reference(rows):
    w = torch.randn(48, 96)
    weight_scale = w.abs().amax(dim=1) / 448
    weight = (w / weight_scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(rows, 96) * torch.rand(rows, 1) * 4  # per-token ranges differ
    expected = reference_fp8_w8a8_linear(x, weight, weight_scale)
    prepared = prepare_fp8_w8a8(weight, weight_scale, "cpu")
    assert prepared.weight.dtype == torch.bfloat16 and prepared.weight_scale is None
    assert rel_error(fp8_w8a8_linear(x, prepared), expected) < BF16_TOLERANCE
    # The canonical fp8 weight is accepted as well (dequantized per call).
    direct = torch.ops.qkiln.fp8_w8a8_linear(x, weight, weight_scale, None)
    assert rel_error(direct, expected) < BF16_TOLERANCE
    # And the fake quantization matters: it is not a plain bf16 GEMM of x.
    plain = x @ (weight.float() * weight_scale[:, None]).t()
    assert rel_error(plain, expected) > 1e-4


@pytest.mark.parametrize("static", [False, True])
def test_fp8_w8a8_group_wise_weight_scales(static):
    """Group-wise fp8 weight scales ([out, ceil(in / group)], the last group shorter): served from the
    dequantized weight on the CPU and by the CUDA op's device-agnostic branch (run here on CPU tensors)."""
    from qkiln.plugins.ops import _cuda_fp8_w8a8_linear
    from qkiln.plugins.reference import fake_quantize_fp8_activations

    w = torch.randn(48, 80) * torch.linspace(0.1, 4, 80)  # column ranges differ: groups matter
    group = 32
    scales = torch.stack([w[:, g:g + group].abs().amax(dim=1) / 448 for g in range(0, 80, group)], dim=1)
    full = scales.repeat_interleave(group, dim=1)[:, :80]
    weight = (w / full).to(torch.float8_e4m3fn)
    x, bias = torch.randn(5, 80) * 3, torch.randn(48)
    input_scale = torch.tensor(2.0 / 448) if static else None
    expected = fake_quantize_fp8_activations(x, input_scale) @ (weight.float() * full).t() + bias
    prepared = prepare_fp8_w8a8(weight, scales, "cpu", input_scale=input_scale, group_size=group)
    assert rel_error(fp8_w8a8_linear(x, prepared, bias), expected) < BF16_TOLERANCE
    dequantized = (weight.float() * full).to(torch.bfloat16)
    assert rel_error(_cuda_fp8_w8a8_linear(x, dequantized, None, bias, input_scale), expected) < BF16_TOLERANCE
    with pytest.raises(RecipeError, match="group_size"):
        prepare_fp8_w8a8(weight, scales, "cpu")  # group-wise scales without their group size


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cpu_fp8_w8a8_static_activations_use_the_calibrated_scale(rows):
    w = torch.randn(48, 96)
    weight_scale = w.abs().amax(dim=1) / 448
    weight = (w / weight_scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * torch.rand(rows, 1) * 4
    x[:, 0] = 8.0  # past the calibrated range in every row, so static and per-token scales differ
    input_scale = torch.tensor(3.0 / 448)  # calibrated on smaller inputs: the largest values clip
    expected = reference_fp8_w8a8_linear(x, weight, weight_scale, input_scale=input_scale)
    prepared = prepare_fp8_w8a8(weight, weight_scale, "cpu", input_scale=input_scale)
    assert rel_error(fp8_w8a8_linear(x, prepared), expected) < BF16_TOLERANCE
    direct = torch.ops.qkiln.fp8_w8a8_linear(x, weight, weight_scale, None, input_scale)
    assert rel_error(direct, expected) < BF16_TOLERANCE
    # static is not per token: the same call without the scale computes something else
    assert rel_error(reference_fp8_w8a8_linear(x, weight, weight_scale), expected) > 1e-3
    with pytest.raises(RecipeError, match="one value"):
        prepare_fp8_w8a8(weight, weight_scale, "cpu", input_scale=torch.ones(2))


def _plain(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_dense() if weight.is_mkldnn else weight


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN without bf16")
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_packed_bf16_copies_compute_what_the_plain_weights_do(rows, monkeypatch):
    """The many-row GEMMs read packed copies: the int4 / int8 ones in qkiln's bf16 panels where
    that kernel serves this CPU (else oneDNN-packed), fp8 oneDNN-packed. oneDNN's packing gives
    the plain weight's bits; the panels the same exact products summed in another order, so within
    the bf16 output's rounding of them. (int4 with a dense copy: on an AMX CPU only without the
    AMX int4 GEMM, test_plugins_w4_amx_gemm.py.)"""
    monkeypatch.setenv("QKILN_AMX_CODES", "0")
    qweight, scales, zeros = canonical_int4(40, 576, 64, is_symmetric=True)
    w4 = prepare_w4a16(qweight, scales, zeros, 64, "cpu", keep_dequantized=True)
    w8 = prepare_w8a16(torch.randint(-128, 128, (48, 576), dtype=torch.int8), torch.rand(48) / 100, "cpu",
                       keep_dequantized=True)
    fp8 = prepare_fp8_w8a8(torch.randn(48, 576).to(torch.float8_e4m3fn), torch.rand(48), "cpu")
    panels = cpu_native.bf16_panels_available(576)
    for copy in (w4.dequantized, w8.dequantized):
        assert copy.dtype == torch.int32 if panels else copy.is_mkldnn
    assert fp8.weight.is_mkldnn
    plain4 = dequantize_grouped(qweight, scales, None, 64).to(torch.bfloat16)
    plain8 = w8.weight.to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    for bias in (None, torch.randn(48)):
        b40 = None if bias is None else bias[:40]
        results = [(w4a16_linear(x, w4, b40), torch.ops.qkiln.w4a16_linear(
                        x, w4.packed, w4.scales, w4.zeros, 64, 576, 40, b40, plain4)),
                   (w8a16_linear(x, w8, bias), torch.ops.qkiln.w8a16_linear(
                        x, w8.weight, w8.scales, bias, plain8))]
        for packed, plain in results:
            if rows <= 16 or not panels:  # GEMV kernels (no copy read) or oneDNN-packed copies
                assert torch.equal(packed, plain)
            else:
                assert rel_error(packed, plain) < 2.0 ** -7
        assert torch.equal(fp8_w8a8_linear(x, fp8, bias),
                           torch.ops.qkiln.fp8_w8a8_linear(x, _plain(fp8.weight), None, bias))
    assert torch.equal(_plain(onednn_pack(plain8)), plain8)


@pytest.mark.parametrize("in_features", [33, 100, 104])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_torch_int8_path_takes_any_width(in_features, rows):
    """torch's _weight_int8pack_mm reads whole vectors along in_features: at a width not a multiple
    of 16 it returned NaN / 1e32 for one row and crashed the process for more. Those widths take
    the GEMM instead."""
    qweight = torch.randint(-128, 128, (37, in_features), dtype=torch.int8)
    scales = torch.rand(37) * 0.01 + 0.001
    weight = prepare_w8a16(qweight, scales, "cpu", use_native=False)
    x = torch.randn(rows, in_features)
    assert rel_error(w8a16_linear(x, weight), reference_w8a16_linear(x, qweight, scales)) < BF16_TOLERANCE
