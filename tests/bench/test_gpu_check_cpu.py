"""bench/gpu_check.py's sections that run without a GPU, on a tiny shape with DEVICE = "cpu": the
random-weight model builder for each format, the offline engine loop (GraphRunner without graphs on
CPU), the HF baseline and the final table. The script runs once per lent H200, with minutes of
device time; an error these can show must not first show there. The CUDA-only sections (copy
bandwidth, op checks, kernel timings, graph replays) need the GPU and are not run here; what main
records when they fail, and its refusal to start without a GPU, are.
"""

import pytest
import torch

from qkiln.bench import gpu_check

# hidden, layers, heads, kv_heads, head_dim, ffn, vocab, tied: hidden 128 is one int4 group
TINY = (128, 2, 4, 2, 32, 256, 512, False)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setitem(gpu_check.SHAPES, "tiny", TINY)
    return gpu_check


def test_model_builder_counts_the_bytes_a_step_reads(on_cpu):
    hidden, layers, heads, kv_heads, head_dim, ffn, vocab, _ = TINY
    per_layer = hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim + 3 * ffn)
    _, bf16_bytes, config = on_cpu.build_model("tiny", "bf16")
    assert config.num_hidden_layers == layers
    assert bf16_bytes == 2 * (layers * per_layer + vocab * hidden)  # bf16 weights + untied head
    for fmt in ("fp8", "w4a16"):  # quantized layers, the bf16 head as is
        model, quantized_bytes, _ = on_cpu.build_model("tiny", fmt)
        if fmt == "w4a16":  # (fp8 on the CPU is served as bf16: the same bytes)
            assert 2 * vocab * hidden < quantized_bytes < bf16_bytes
        logits = model(torch.randint(0, vocab, (1, 5)))
        assert logits.shape == (1, 5, vocab) and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "w4a16"])
def test_offline_section_finishes_every_request(on_cpu, fmt):
    result = {}
    on_cpu.section_offline(result, on_cpu.Budget(120), fmt, 6, max_seconds=60, shape="tiny")
    (row,) = result["offline"]
    assert row["complete"] and row["finished"] == 6 and row["fmt"] == fmt
    assert row["output_tok_s"] > 0 and row["total_tok_s"] > row["output_tok_s"]


def test_hf_section_and_table(on_cpu, capsys):
    result = {"device": "cpu", "bandwidth_tb_s": 0.0}
    on_cpu.section_hf(result, on_cpu.Budget(120), ["tiny"])
    assert result["hf"]["tiny"] > 0
    on_cpu.section_offline(result, on_cpu.Budget(120), "w4a16", 2, max_seconds=60, shape="tiny")
    on_cpu.print_table(result)
    table = capsys.readouterr().out
    assert "tiny" in table and "offline tiny w4a16" in table


def test_section_status_counts_failed_rows():
    status, tally = gpu_check.section_status, gpu_check.RowTally
    assert status(12.3, None) == "ok 12s"  # a section that raises nothing and catches nothing
    assert status(3, tally(num_ok=3)) == "ok 3/3 rows 3s"
    assert status(3, tally()) == "no rows ran 3s"  # the budget skipped them all
    partial = status(3, tally(num_ok=2, errors=["fp8 gemv: OutOfMemoryError", "bf16: later"]))
    assert partial == "failed 2/4 rows 3s: fp8 gemv: OutOfMemoryError"
    assert len(status(1, tally(errors=["x" * 500]))) == 200  # the JSON entry stays short


def test_a_section_whose_every_row_failed_is_recorded_failed(monkeypatch, tmp_path, capfd):
    """The probe's case on a CPU host: copy bandwidth fails, every decode model fails to build;
    the JSON says so, and that the rooflines' bandwidth was assumed. (capfd: main's faulthandler
    needs a real stderr.)"""
    import faulthandler
    import json

    def fail_build(shape, fmt, num_layers=None):
        raise RuntimeError(f"no {fmt} here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(gpu_check, "build_model", fail_build)
    monkeypatch.setenv("OUT", str(tmp_path))
    skip = ("checks,kernels,decode-8b,decode-8b-torch-small-ops,offline-fp8,offline-fp8-kvfp8,hf,pytest,"
            "offline-bf16")
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--budget-s", "120", "--skip", skip])
    try:
        gpu_check.main()
    finally:
        faulthandler.cancel_dump_traceback_later()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["sections"]["bandwidth"].startswith("failed: ")
    assert report["sections"]["decode-1b"].startswith("failed 3/3 rows ")
    assert report["row_errors"]["decode-1b"] == [f"llama3.2-1b {fmt}: RuntimeError: no {fmt} here"
                                                 for fmt in gpu_check.FORMATS]
    assert report["bandwidth_source"] == "assumed 4.17 TB/s (an earlier H200 run's copy)"
    assert "bandwidth assumed 4.17 TB/s" in capfd.readouterr().out


def test_without_cuda_main_exits_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["gpu_check.py"])
    with pytest.raises(SystemExit) as exited:
        gpu_check.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
