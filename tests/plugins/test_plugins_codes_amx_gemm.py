"""The AMX codes GEMMs for many rows (csrc/cpu_gemm_codes_amx.cpp): the dense AMX GEMM's bits from
the int4 / int8 codes, without the dense bf16 copy. The kernel tests need a CPU with AMX-BF16
(skipped elsewhere); the tables' formula and the fallback to the dense copy are checked everywhere."""

import pytest
import torch

from qkiln.plugins import cpu_native
from qkiln.plugins.cpu_linear import INT4_GEMV_ROWS, cpu_w4a16_linear
from qkiln.plugins.ops import w8a16_linear
from qkiln.plugins.packed_weights import _prepare_w4a16_native, pack_dense, prepare_w8a16

# (rows, out, in, group): rows short of a 16-row tile, between tiles, past a 32-row pass and over
# two 256-row chunks; out short of a 32-channel block and of the GEMV layout's 4-row tile; in with
# a half 64-weight chunk at the end (96, 160); groups 32 / 64 / 128 with a short last group (576).
SHAPES = [(1, 32, 64, 32), (5, 50, 96, 32), (17, 100, 576, 128), (40, 33, 160, 64),
          (64, 960, 576, 128), (64, 576, 1536, 128), (300, 200, 320, 64)]


def _weight(out_features, in_features, group_size, asymmetric, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    num_groups = -(-in_features // group_size)
    scales = (torch.rand(out_features, num_groups, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    zeros = torch.randint(0, 16, scales.shape, generator=g).float() if asymmetric else None
    return q, scales, zeros


def _dense(q, scales, zeros, group_size, dtype=torch.bfloat16):
    """The dense copy's formula (packed_weights._prepare_w4a16_native), in fp32 as the copy is
    computed (pack_dense rounds it to bf16 for the bf16 forms), or rounded to bf16 as the tables are."""
    in_features = q.shape[1]
    z = 8.0 if zeros is None else zeros.repeat_interleave(group_size, 1)[:, :in_features]
    return ((q.float() - z) * scales.float().repeat_interleave(group_size, 1)[:, :in_features]
            ).to(dtype)


@pytest.fixture
def amx(native_ext):
    if not native_ext.codes_amx_ready():
        pytest.skip("the AMX int4 GEMM needs a CPU with AMX-BF16 and the tile state")
    return native_ext


def test_tables_hold_the_dense_copys_values(native_ext):
    q, scales, zeros = _weight(40, 256, 64, asymmetric=True)
    tables = cpu_native.w4_amx_tables(q, scales, zeros, 64)
    assert tables.shape == (64, 4, 16) and tables.dtype == torch.bfloat16
    looked_up = tables[torch.arange(40)[:, None], torch.arange(256)[None] // 64, q.long()]
    assert torch.equal(looked_up, _dense(q, scales, zeros, 64))
    assert (tables[40:] == 0).all()  # channels padded to the 32-channel block


@pytest.mark.parametrize("rows,out_features,in_features,group_size", SHAPES)
@pytest.mark.parametrize("asymmetric", [True, False])
def test_amx_int4_gemm_matches_the_dense_amx_gemm_bit_for_bit(amx, rows, out_features, in_features,
                                                              group_size, asymmetric):
    q, scales, zeros = _weight(out_features, in_features, group_size, asymmetric)
    packed, _, _ = cpu_native.pack_w4a16(q, scales, zeros, group_size)
    tables = cpu_native.w4_amx_tables(q, scales, zeros, group_size)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = cpu_native.w4a16_amx_gemm(x, packed, tables, group_size, out_features)
    dense = _dense(q, scales, zeros, group_size)
    assert torch.equal(y, cpu_native.bf16_gemm(x, cpu_native.pack_bf16_panels(dense), out_features))
    exact = x.double() @ dense.double().t()  # and it is that product, rounded
    assert ((y.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-4).all()


def test_amx_int4_gemm_results_do_not_depend_on_the_thread_count(amx):
    q, scales, zeros = _weight(200, 576, 128, asymmetric=True, seed=2)
    packed, _, _ = cpu_native.pack_w4a16(q, scales, zeros, 128)
    tables = cpu_native.w4_amx_tables(q, scales, zeros, 128)
    x = torch.randn(70, 576).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(cpu_native.w4a16_amx_gemm(x, packed, tables, 128, 200))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_amx_int4_gemm_refuses_mismatched_inputs(amx):
    q, scales, zeros = _weight(50, 128, 64, asymmetric=False)
    packed, _, _ = cpu_native.pack_w4a16(q, scales, zeros, 64)
    tables = cpu_native.w4_amx_tables(q, scales, zeros, 64)
    x = torch.randn(20, 128).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        amx.w4a16_amx_gemm(x.float(), packed, tables, 64, 50)
    with pytest.raises(RuntimeError, match="tables must be"):
        amx.w4a16_amx_gemm(x, packed, tables[:, :1].contiguous(), 64, 50)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        amx.w4a16_amx_gemm(x[:, :112].contiguous(), packed, tables, 64, 50)


def test_native_int4_weights_carry_tables_instead_of_a_dense_copy_where_opted_in(native_ext,
                                                                                 monkeypatch):
    """Opted in on an AMX CPU the many-row form is the tables and the linear gives the dense copy's
    bits; elsewhere, and by default, the dense copy."""
    q, scales, zeros = _weight(96, 576, 128, asymmetric=True, seed=3)
    default = _prepare_w4a16_native(q, scales, zeros, 128, keep_dequantized=True)
    assert default.amx_tables is None and default.dequantized is not None
    monkeypatch.setenv("QKILN_AMX_CODES", "1")
    weight = _prepare_w4a16_native(q, scales, zeros, 128, keep_dequantized=True)
    assert weight.many_rows_form
    x = torch.randn(2, 24, 576).to(torch.bfloat16)  # 48 rows > INT4_GEMV_ROWS
    assert x.shape[0] * x.shape[1] > INT4_GEMV_ROWS
    reference = cpu_w4a16_linear(x, weight.packed, weight.scales, weight.zeros, 128, 576, 96,
                                 dequantized=pack_dense(_dense(q, scales, zeros, 128, torch.float32)))
    y = cpu_w4a16_linear(x, weight.packed, weight.scales, weight.zeros, 128, 576, 96,
                         dequantized=weight.dequantized, amx_tables=weight.amx_tables)
    assert torch.equal(y, reference)
    if native_ext.codes_amx_ready():
        assert weight.amx_tables is not None and weight.dequantized is None
    else:
        assert weight.amx_tables is None and weight.dequantized is not None


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 5, 32), (20, 100, 576), (64, 960, 576),
                                                           (300, 49, 1536)])
def test_amx_int8_gemm_matches_the_dense_amx_gemm_of_the_codes(amx, rows, out_features, in_features):
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    y = cpu_native.int8_codes_amx_gemm(x, codes)
    panels = cpu_native.pack_bf16_panels(codes.to(torch.bfloat16))
    assert torch.equal(y, cpu_native.bf16_gemm(x, panels, out_features))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_native.int8_codes_amx_gemm(x[:, :16].contiguous(), codes[:, :16].contiguous())


def test_native_int8_weights_read_their_codes_where_opted_in(native_ext, monkeypatch):
    codes = torch.randint(-128, 128, (48, 576), dtype=torch.int8)
    scales = torch.rand(48) / 100
    assert not prepare_w8a16(codes, scales, "cpu", keep_dequantized=True).amx_codes  # default
    monkeypatch.setenv("QKILN_AMX_CODES", "1")
    weight = prepare_w8a16(codes, scales, "cpu", keep_dequantized=True)
    assert weight.many_rows_form
    assert weight.amx_codes == native_ext.codes_amx_ready() and \
        (weight.dequantized is None) == weight.amx_codes
    monkeypatch.setenv("QKILN_AMX_CODES", "0")
    with_copy = prepare_w8a16(codes, scales, "cpu", keep_dequantized=True)
    assert not with_copy.amx_codes and with_copy.dequantized is not None
    x = torch.randn(40, 576).to(torch.bfloat16)
    for bias in (None, torch.randn(48)):
        assert torch.equal(w8a16_linear(x, weight, bias), w8a16_linear(x, with_copy, bias))


def test_portable_build_has_no_amx_paths(native_ext):
    portable = cpu_native.build_portable_extension()
    assert not portable.codes_amx_ready()
    assert not portable.amx_prefill_ready()  # csrc/cpu_attention_prefill_amx.cpp
