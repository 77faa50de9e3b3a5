"""qkiln's bf16 GEMM for many rows (csrc/cpu_gemm_bf16.cpp) and its panel layout, against float64.

The products of two bf16 are exact in fp32, so the kernel's only errors are fp32 summation over K
and the output's rounding to bf16 (half an ulp, 2^-9 relative): per element
|y - exact| <= 2^-8 |exact| + K * 2^-23 * sum |x w|."""

import pytest
import torch

from qkiln.plugins import cpu_native

# (rows, out, in): rows not a multiple of the 8-row block (AVX512) or the 16-row tile (AMX); out
# short of, at and past a 48-wide panel; in down to one pair, and not a multiple of 32 (on an AMX
# CPU the AVX512 path then serves); 300 rows span two 256-row chunks.
SHAPES = [(1, 5, 2), (7, 48, 64), (20, 100, 576), (33, 50, 80), (64, 960, 576), (300, 49, 1536)]


def _check(y, x, w):
    exact = x.double() @ w.double().t()
    bound = 2.0 ** -8 * exact.abs() + x.shape[1] * 2.0 ** -23 * (x.double().abs() @ w.double().abs().t())
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all()


def _inputs(rows, out_features, in_features, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(torch.bfloat16)
    return torch.randn(rows, in_features, generator=g).to(torch.bfloat16), w


def test_panels_hold_each_pair_where_the_layout_says():
    w = torch.randn(50, 6).to(torch.bfloat16)
    panels = cpu_native.pack_bf16_panels(w)
    assert panels.shape == (2, 3, 48) and panels.dtype == torch.int32
    bits = w.view(torch.int16).int() & 0xFFFF
    for n in range(50):
        for j in range(3):
            word = panels[n // 48, j, n % 48].item() & 0xFFFFFFFF
            assert word & 0xFFFF == bits[n, 2 * j] and word >> 16 == bits[n, 2 * j + 1]
    assert (panels[1, :, 2:] == 0).all()  # padded channels are zero weights
    with pytest.raises(ValueError, match="even"):
        cpu_native.pack_bf16_panels(torch.randn(4, 5).to(torch.bfloat16))


@pytest.mark.parametrize("rows,out_features,in_features", SHAPES)
def test_bf16_gemm_is_exact_up_to_fp32_sums_and_output_rounding(native_ext, rows, out_features,
                                                                  in_features):
    x, w = _inputs(rows, out_features, in_features)
    y = cpu_native.bf16_gemm(x, cpu_native.pack_bf16_panels(w), out_features)
    _check(y, x, w)


def test_amx_cpus_get_the_amx_path(native_ext):
    """The AMX path builds wherever the CPU has AMX-BF16 (-march=native) and the kernel grants the
    tile state (torch's _init_amx asks the same); elsewhere the AVX512-BF16 or portable path."""
    caps = torch._C._cpu._get_cpu_capability()
    isa = cpu_native.native_extension().bf16_gemm_isa()
    if caps.get("amx_bf16") and caps.get("amx_tile") and torch.cpu._init_amx():
        assert isa == "amx-bf16"
        assert cpu_native.bf16_panels_available(576) and not cpu_native.bf16_panels_available(80)
    else:
        assert isa in ("avx512-bf16", "portable")


def test_bf16_gemm_results_do_not_depend_on_the_thread_count(native_ext):
    x, w = _inputs(70, 200, 576, seed=1)
    panels = cpu_native.pack_bf16_panels(w)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(cpu_native.bf16_gemm(x, panels, 200))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_bf16_gemm_refuses_mismatched_inputs(native_ext):
    x, w = _inputs(4, 50, 64)
    panels = cpu_native.pack_bf16_panels(w)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        cpu_native.native_extension().bf16_gemm(x.float(), panels, 50)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        cpu_native.bf16_gemm(x[:, :32], panels, 50)
    with pytest.raises(RuntimeError, match="panels must be"):
        cpu_native.bf16_gemm(x, panels, 97)  # more channels than the panels hold


def test_portable_build_matches_reference(native_ext):
    """The plain C++ loop for CPUs without AVX512-BF16 (built without AVX-512; cached)."""
    portable = cpu_native.build_portable_extension()
    assert portable.bf16_gemm_isa() == "portable"
    x, w = _inputs(21, 37, 576, seed=2)
    _check(portable.bf16_gemm(x, cpu_native.pack_bf16_panels(w), 37), x, w)
