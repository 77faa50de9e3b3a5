"""qkiln's own CPU kernels (cpu_native.py, csrc/cpu_gemv_int4.cpp, cpu_gemv_int8.cpp) against the fp32 references.

Error bounds: the int4 kernel for fp32 rows rounds them to bf16 (AVX-512 BF16, portable) or keeps
them (AVX2) and is otherwise exact up to fp32 summation, so against the reference fed the same
activations it must agree to EXACT_TOLERANCE; against unrounded fp32 activations, and with bf16
outputs, to BF16_TOLERANCE (bf16 rows on AVX2: test_plugins_cpu_fixed16.py).
The int8 kernel never rounds activations (bf16 ones are used as they are, fp16/fp32 ones widened
to fp32), so it is exact up to fp32 summation and the output rounding. Skips (saying why) when the extension cannot build.
"""

from pathlib import Path

import pytest
import torch
from plugins_testlib import (assert_int4_within_bound, assert_within_fixed_point_bound, canonical_int4,
                             fixed16_compiled, rel_error)

from qkiln.plugins import cpu_native, prepare_w4a16, prepare_w8a16, w4a16_linear, w8a16_linear
from qkiln.plugins.reference import reference_w4a16_linear, reference_w8a16_linear

EXACT_TOLERANCE = 2e-5  # fp32 sums over <= 1536 exact products
BF16_TOLERANCE = 1.5e-2  # bf16 activations or outputs: 2^-8 relative per value
# (out, in, group): in=576/group 128 ends in a 64-wide group; in=96/group 64 ends in a half
# chunk; group 32 splits every 64-weight chunk into two groups; out=37 pads the last tile.
SHAPES = [(40, 576, 128), (37, 576, 64), (37, 96, 64), (16, 256, 32), (12, 1536, 128)]


def unsigned(qweight, zeros):
    return qweight.int() + 8 if zeros is None else qweight.int()


def test_packing_places_each_nibble_where_the_layout_says():
    q = torch.randint(0, 16, (6, 96), dtype=torch.int32)
    packed, scales, zero_term = cpu_native.pack_w4a16(q, torch.rand(6, 2), None, 64)
    assert packed.shape == (2, 2, 4, 32) and scales.shape == (2, 2, 4)
    assert zero_term.shape == (2, 2, 4) and (zero_term[1, :, 2:] == 0).all()  # padded rows add nothing
    words = packed.int()[..., 0::2] | (packed.int()[..., 1::2] << 8)  # [tile, chunk, row, 16]
    for o in range(6):
        for k in range(96):
            chunk, n, j = k // 64, (k % 64) // 16, k % 16
            word = words[o // 4, chunk, o % 4, j].item()
            assert (word >> (4 * n)) & 15 == q[o, k].item()


@pytest.mark.parametrize("is_symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("out_features,in_features,group_size", SHAPES)
def test_int4_kernel_is_exact_for_bf16_activations(native_ext, out_features, in_features, group_size,
                                                   is_symmetric):
    qweight, scales, zeros = canonical_int4(out_features, in_features, group_size, is_symmetric)
    packed, tiled, zero_term = cpu_native.pack_w4a16(unsigned(qweight, zeros), scales, zeros,
                                                     group_size)
    bias = torch.randn(out_features)
    for rows in (1, 3, 16):
        x = torch.randn(rows, in_features)
        multiplied = x if native_ext.int4_kernel_isa() == "avx2" else x.to(torch.bfloat16).float()
        expected = reference_w4a16_linear(multiplied, qweight, scales, zeros, group_size, bias)
        actual = cpu_native.w4a16_gemm(x, packed, tiled, zero_term, bias, group_size,
                                       out_features)
        assert actual.dtype == torch.float32 and actual.shape == (rows, out_features)
        assert rel_error(actual, expected) < EXACT_TOLERANCE
        unrounded = reference_w4a16_linear(x, qweight, scales, zeros, group_size, bias)
        assert rel_error(actual, unrounded) < BF16_TOLERANCE
        out_bf16 = cpu_native.w4a16_gemm(x.to(torch.bfloat16), packed, tiled, zero_term, bias,
                                         group_size, out_features)
        assert out_bf16.dtype == torch.bfloat16
        assert rel_error(out_bf16, expected) < BF16_TOLERANCE


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_w4a16_op_uses_the_native_layout(native_ext, rows):
    qweight, scales, zeros = canonical_int4(40, 576, 128, is_symmetric=False)
    weight = prepare_w4a16(qweight, scales, zeros, 128, "cpu", keep_dequantized=True)
    assert cpu_native.is_native_w4a16(weight.scales) and weight.zeros.dtype == torch.float32
    x = torch.randn(2, rows, 576).to(torch.bfloat16)  # leading dims are kept
    bias = torch.randn(40)
    actual = w4a16_linear(x, weight, bias)
    assert actual.shape == (2, rows, 40) and actual.dtype == torch.bfloat16
    expected = reference_w4a16_linear(x.float(), qweight, scales, zeros, 128, bias)
    assert rel_error(actual, expected) < BF16_TOLERANCE


# Output rounding bound per element: the int8 kernel is exact up to fp32 summation, so the only
# visible error is the final rounding to the output dtype (half an ulp, 2^-9 bf16 / 2^-12 fp16).
OUTPUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}


def assert_int8_exact(actual, x, qweight, scales, bias, module=None):
    """Elementwise: |actual - reference| <= output rounding + fp32 summation noise; bf16 / fp16 rows
    through a build with the fixed-point kernel: within its bound (test_plugins_cpu_fixed16.py)."""
    if module is not None and x.dtype != torch.float32 and fixed16_compiled(module):
        weight = qweight.double() * scales.double()[:, None]
        return assert_within_fixed_point_bound(actual, x, weight, bias, 128)
    expected = (x.double() @ qweight.double().t()) * scales.double() + bias.double()
    diff = (actual.double() - expected).abs()
    bound = expected.abs() * OUTPUT_ROUNDING[actual.dtype] + 1e-6 * expected.abs().max()
    assert (diff <= bound).all(), (diff - bound).max().item()


# (out, in): 37 pads the last 4-row tile; in=200 and in=33 end in masked partial steps.
@pytest.mark.parametrize("out_features,in_features", [(37, 200), (8, 576), (6, 33)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])  # 5, 16: the tile converted once, reused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_int8_kernel_is_exact_without_rounding_activations(native_ext, out_features, in_features,
                                                           rows, dtype):
    qweight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    qweight[0, :3] = -128  # the extreme value is exact in bf16 too
    scales = torch.rand(out_features) * 0.01 + 0.001
    bias = torch.randn(out_features)
    weight = prepare_w8a16(qweight, scales, "cpu")
    assert weight.scales.dtype == torch.float32  # the native kernel's marker
    x = torch.randn(rows, in_features).to(dtype)  # fp16/fp32 x is NOT rounded to bf16
    actual = w8a16_linear(x, weight, bias)
    assert actual.dtype == dtype and actual.shape == (rows, out_features)
    assert_int8_exact(actual, x, qweight, scales, bias, native_ext)
    assert rel_error(actual, reference_w8a16_linear(x.float(), qweight, scales, bias)) < \
        (EXACT_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE)


def test_disabled_by_environment(native_ext, monkeypatch, capsys):
    monkeypatch.setenv("QKILN_NATIVE_CPU", "0")
    monkeypatch.setattr(cpu_native, "_extension", cpu_native._MISSING)
    assert cpu_native.native_extension() is None
    assert "QKILN_NATIVE_CPU=0" in capsys.readouterr().err
    weight = prepare_w4a16(*canonical_int4(16, 64, 32, is_symmetric=True), 32, "cpu")
    assert weight.scales.dtype == torch.bfloat16  # torch's tinygemm layout instead


@pytest.mark.parametrize("name, value", [("QKILN_NATIVE_CPU", "false"), ("QKILN_NATIVE_CPU", "off"),
                                         ("QKILN_DECODE_SPLIT", "no")])
def test_a_switch_spelt_otherwise_is_refused_before_anything_compiles(monkeypatch, name, value):
    """Only "0" switched a kernel off: QKILN_NATIVE_CPU=false went on to the 5-minute compile."""
    from qkiln.errors import QkilnError

    monkeypatch.setenv(name, value)
    monkeypatch.setattr(cpu_native, "_extension", cpu_native._MISSING)
    monkeypatch.setattr(cpu_native, "_build", lambda flags: pytest.fail("compiled"))
    with pytest.raises(QkilnError, match=f"{name}='{value}': qkiln's switches take 1 \\(on\\) or 0 \\(off\\)"):
        cpu_native.native_extension()


def test_portable_build_matches_reference(native_ext):
    """The kernels for CPUs without AVX512-BF16 (a build without AVX-512, cached after once): the
    AVX2 int4 kernel where the compiler targets AVX2, else plain C++; every row count of its
    microkernels, a K with a half chunk (608) and symmetric / asymmetric groups."""
    portable = cpu_native.build_portable_extension()
    assert portable.int4_kernel_isa() in ("avx2", "portable")
    for out, K, group, symmetric in [(37, 576, 128, False), (40, 608, 32, True), (9, 1536, 64, False)]:
        qweight, scales, zeros = canonical_int4(out, K, group, is_symmetric=symmetric)
        packed, tiled, zero_term = cpu_native.pack_w4a16(unsigned(qweight, zeros), scales, zeros,
                                                         group)
        for rows in (1, 2, 3, 4, 7):
            x = torch.randn(rows, K)
            multiplied = x if portable.int4_kernel_isa() == "avx2" else x.to(torch.bfloat16).float()
            expected = reference_w4a16_linear(multiplied, qweight, scales, zeros, group)
            actual = portable.w4a16_gemm(x, packed, tiled, zero_term, None, group, out)
            assert rel_error(actual, expected) < EXACT_TOLERANCE, (out, K, group, rows)
            x = x.to(torch.bfloat16)  # the fixed-point kernel on AVX2
            actual = portable.w4a16_gemm(x, packed, tiled, zero_term, None, group, out)
            assert_int4_within_bound(actual, x, qweight, scales, zeros, group, torch.zeros(out))
    assert portable.int8_kernel_isa() == "fallback"
    q8, s8, b8 = torch.randint(-128, 128, (37, 100), dtype=torch.int8), torch.rand(37), torch.zeros(37)
    for rows, dtype in [(2, torch.float32), (5, torch.bfloat16), (1, torch.float16)]:
        x8 = torch.randn(rows, 100).to(dtype)
        assert_int8_exact(portable.w8a16_gemm(x8, q8, s8, None), x8, q8, s8, b8, portable)
    for logits in argmax_cases():
        assert torch.equal(portable.argmax_rows(logits), logits.argmax(dim=-1))


def argmax_cases():
    """argmax_rows's cases in fp32, bf16 and fp16 (rounding to 16 bits makes more ties)."""
    for logits in _fp32_argmax_cases():
        yield from (logits, logits.bfloat16(), logits.half())


def _fp32_argmax_cases():
    """Logits whose argmax has a trap: ties (first wins), NaN (the first NaN wins), all -inf,
    lengths around the 16-lane vector, many rows."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run
    yield torch.randn(5, 49152, generator=g)
    for width in (1, 7, 16, 17, 33):
        yield torch.randn(3, width, generator=g)
    ties = torch.randint(0, 4, (64, 100), generator=g).float()  # many equal maxima per row
    yield ties
    with_nan = torch.randn(4, 70, generator=g)
    with_nan[0, 50] = with_nan[0, 60] = float("nan")
    with_nan[1, 0] = float("nan")
    with_nan[2, 69] = float("nan")
    yield with_nan
    yield torch.full((2, 40), float("-inf"))
    signed_zero = torch.zeros(1, 20)
    signed_zero[0, :5] = -0.0
    yield signed_zero


def test_argmax_rows_is_torchs_argmax(native_ext):
    from qkiln.plugins import ops

    for logits in argmax_cases():
        assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    strided = torch.randn(8, 64)[:, ::2]  # not contiguous: torch's own path, same answer
    assert torch.equal(ops.argmax(strided), strided.argmax(dim=-1))


def test_the_build_folder_is_per_cpu(monkeypatch):
    """-march=native code run on a CPU without its instructions dies of SIGILL: a home folder shared
    over NFS had handed every node the first node's build. The folder's name now covers the CPU's
    feature flags (as /proc/cpuinfo lists them), besides the checkout, torch and its headers."""
    features = cpu_native._cpu_features()
    assert features
    here = cpu_native.extension_name([])
    assert cpu_native.extension_name([]) == here  # stable: loaded again, not rebuilt
    monkeypatch.setattr(cpu_native, "_cpu_features", lambda: features.replace("avx2", "").strip() + " other")
    assert cpu_native.extension_name([]) != here


def test_a_killed_build_leaves_no_lock_that_blocks_later_loads(native_ext, tmp_path, capsys):
    """A compile stopped mid-way (Ctrl-C, a `timeout`) left torch's lock file behind, and every
    later load waited on it forever with nothing said. qkiln's own flock dies with its holder, and
    a load waiting on it says so (it had said "compiling ... once" and then loaded in seconds)."""
    import signal
    import subprocess
    import sys
    import threading

    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(cpu_native.extension_name([]), verbose=False))
    (folder / "lock").touch()  # what a killed torch build leaves
    loaded = subprocess.run([sys.executable, "-c", "from qkiln.plugins import cpu_native; "
                             "assert cpu_native.native_extension() is not None"], timeout=300)
    assert loaded.returncode == 0 and not (folder / "lock").exists()

    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(120)"), str(tmp_path / "qkiln-build.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    entered = threading.Event()

    def build():
        with cpu_native._build_lock(tmp_path):
            entered.set()

    thread = threading.Thread(target=build)
    thread.start()
    assert not entered.wait(1.0)  # another process is building: wait for it
    assert "waiting for another process compiling" in capsys.readouterr().err
    holder.send_signal(signal.SIGKILL)  # ... which dies mid-build
    holder.wait()
    assert entered.wait(30)
    thread.join()


def test_the_declared_ninja_is_found_without_an_activated_venv(monkeypatch):
    """`.venv/bin/qkiln` runs with the venv's bin folder off PATH: torch found no ninja there and the
    kernels fell back to torch's, asking to `pip install ninja` (installed)."""
    from torch.utils.cpp_extension import verify_ninja_availability

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError):
        verify_ninja_availability()
    cpu_native._ninja_on_path()
    verify_ninja_availability()
