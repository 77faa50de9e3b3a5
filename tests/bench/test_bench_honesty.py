"""What a benchmark's JSON must say to be compared with another run's (probe s50): which kernels
ran, each row's own peak memory, rows that could not run recorded as skipped (not a lost run), and
no artifact reused under another calibration than the run's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from qkiln.bench import cpu_compare
from qkiln.bench.report import make_report, peak_rss_bytes, reset_peak_rss
from tiny_models import write_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_report_says_which_kernels_ran(monkeypatch):
    monkeypatch.setenv("QKILN_DECODE_SPLIT", "0")
    kernels = make_report("x", {}, {})["environment"]["kernels"]
    assert isinstance(kernels["native_extension"], bool) and isinstance(kernels["native_ops"], bool)
    assert kernels["switches"]["QKILN_DECODE_SPLIT"] == "0"


def test_a_row_s_peak_memory_is_its_own():
    big = torch.ones(300 << 20, dtype=torch.uint8)  # 300 MB touched, then freed (glibc unmaps it)
    del big
    before_reset = peak_rss_bytes()
    reset_peak_rss()
    assert peak_rss_bytes() < before_reset - (200 << 20)


def test_a_calibrated_artifact_is_not_reused_under_another_calibration(tmp_path):
    tiny = write_tiny_hf_model(tmp_path / "tiny")
    first = cpu_compare.ensure_artifact(str(tiny), None, tmp_path / "work", "w4a16-gptq", num_samples=2)
    again = cpu_compare.ensure_artifact(str(tiny), None, tmp_path / "work", "w4a16-gptq", num_samples=3)
    assert first == again and json.loads((again / "manifest.json").read_text())["calibration"]["num_samples"] == 3


def test_cpu_compare_without_native_kernels_skips_their_rows_and_keeps_the_run(tmp_path):
    """int8 activations were refused only after every other row ran: no report at all."""
    tiny = write_tiny_hf_model(tmp_path / "tiny")
    code = ("import sys; from pathlib import Path; from qkiln.bench import cpu_compare\n"
            "cpu_compare.main(sys.argv[1], work_dir=Path(sys.argv[2]), threads=1, repeats=1, input_len=8, "
            "output_len=4, num_requests=2, hf_batch_sizes='2', json_out=Path(sys.argv[3]))")
    env = os.environ | {"QKILN_NATIVE_CPU": "0", "PYTHONPATH": str(ROOT / "tests")}
    run = subprocess.run([sys.executable, "-c", code, str(tiny), str(tmp_path / "work"), str(tmp_path / "c.json")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "c.json").read_text())
    decode = report["results"]["batch1_decode"]
    assert "native CPU kernels" in decode["qkiln-w4a16-int8act"]["skipped"]
    assert "no native decode stack" in decode["qkiln-w4a16-python-layers"]["skipped"]
    assert report["results"]["ratios"]["decode_stack_vs_python_layers"] is None
    kernels = report["environment"]["kernels"]
    assert not kernels["native_extension"] and not kernels["native_ops"]
    assert kernels["switches"]["QKILN_NATIVE_CPU"] == "0"


def test_a_many_row_step_s_roofline_counts_the_weights_it_reads(tmp_path):
    """Past 8 rows an int4 linear computes from its dense copy, not its codes: the roofline of a
    batch-16 step counted the 87 MB of codes where it streamed 269 MB of copies."""
    from qkiln.bench import throughput
    from qkiln.bench.roofline import _packed_tensors, weight_bytes
    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset
    from qkiln.runtime.quantized_linear import QuantizedLinear

    tiny = write_tiny_hf_model(tmp_path / "tiny")
    art = build(str(tiny), preset("w4a16-rtn"), tmp_path / "art", use_cache=False, progress=False,
                log=lambda m: None).path
    model = throughput.load_model(str(art)).model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert linears
    for m in linears:  # 64 rows: past every GEMV's, each linear streams its dense copy and only it
        assert [t.data_ptr() for t in _packed_tensors(m, 64)] == [m.packed.dequantized.data_ptr()]
        assert m.packed.dequantized.data_ptr() not in [t.data_ptr() for t in _packed_tensors(m, 1)]
    assert weight_bytes(model, 64) > weight_bytes(model, 1)


def test_a_benchmark_missing_a_package_says_so_before_it_starts(tmp_path):
    """Without httpx `bench serve` had started its server, failed in a traceback and left it running;
    without transformers or matplotlib, other benchmarks failed after minutes of loading or timing."""
    cases = [(["serve", str(tmp_path / "no-model")], "httpx", "qkiln[bench]"),
             (["prefill", "--model", str(tmp_path / "no-model")], "transformers", "--no-hf"),
             (["latency", str(tmp_path / "no-model"), "--plot", str(tmp_path / "plots")], "matplotlib",
              "leave out --plot")]
    for args, package, hint in cases:
        blocked = f"import sys; sys.modules[{package!r}] = None; sys.argv = ['qkiln', 'bench', *{args!r}]; " \
                  "from qkiln.cli import main; main()"
        run = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and f"needs {package}" in run.stderr and hint in run.stderr, run.stderr
        assert "Traceback" not in run.stderr and "starting server" not in run.stderr
