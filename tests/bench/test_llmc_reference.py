"""bench/llmc_reference.py: the pieces that run without llm-compressor (dense export, calibration
sample export, the skip path, the comparison) on a tiny random model, and the whole path through
llm-compressor only when QKILN_LLMC_PYTHON names an interpreter that has it (skipped otherwise).
"""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import write_tiny_hf_model

from qkiln.bench import llmc_reference
from qkiln.calib_data import load_text_source, sample_token_set, token_sha256
from qkiln.runtime.source import load_source

LLMC_PYTHON = os.environ.get("QKILN_LLMC_PYTHON")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("llmc") / "tiny")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200)))
    return path


def test_calibration_export_is_the_build_token_set(tiny, text_file, tmp_path):
    spec = f"file:{text_file}"
    provenance = llmc_reference.export_calibration(str(tiny), spec, 5, tmp_path / "c.safetensors", seq_len=64, seed=3)
    ids = load_file(str(tmp_path / "c.safetensors"))["input_ids"]
    source = load_source(tiny)
    expected = sample_token_set(load_text_source(spec, None, 3), source.tokenizer, 5, 64, 3).input_ids
    assert ids.dtype == torch.int64 and ids.shape == (5, 64)
    assert ids.tolist() == [list(row) for row in expected]  # the very tokens a build with this spec calibrates on
    assert provenance["token_sha256"] == token_sha256(ids.tolist())


def test_dense_export_loads_back_identical(tiny, tmp_path):
    out = llmc_reference.export_dense_model(str(tiny), tmp_path / "dense")
    a, b = load_source(tiny), load_source(out)
    assert a.config == b.config
    assert set(a.state_dict) == set(b.state_dict)
    for k, v in a.state_dict.items():
        assert torch.equal(v, b.state_dict[k]), k
    assert json.loads((out / "qkiln_source.json").read_text())["sha256"] == a.sha256


def test_rows_skipped_with_a_reason(tiny, tmp_path, capsys):
    assert llmc_reference.llmc_rows(None, tmp_path, calib="unused", source=str(tiny)) == {}
    assert "no --llmcompressor-python" in capsys.readouterr().out
    if llmc_reference.check_interpreter(sys.executable)[0] is None:  # the repo venv has no llmcompressor
        assert llmc_reference.llmc_rows(sys.executable, tmp_path, calib="unused", source=str(tiny)) == {}
        assert "cannot import llmcompressor" in capsys.readouterr().out
    assert llmc_reference.llmc_rows(None, tmp_path, calib="unused", only=["RTN W4 g64"]) == {}  # none selected
    assert not (tmp_path / "dense").exists()


def test_compare_matches_recipes_and_keeps_errors():
    rows = {"unquantized": {"perplexity": 28.0}, "RTN W4 g64": {"perplexity": 38.0},
            "GPTQ W4 g64": {"perplexity": 33.0, "seconds": 600.0, "calibration_seconds": 450.0},
            "llmc GPTQ W4 g64": {"perplexity": 33.3, "seconds": 500.0, "calibration_seconds": 500.0},
            "AWQ W4 g128": {"perplexity": 34.0, "seconds": 10.0},
            "llmc AWQ W4 g128": {"error": "ValueError: 576 % 128"}}
    by_llmc = {c["llmc"]: c for c in llmc_reference.compare({"rows": rows})}
    gptq = by_llmc["llmc GPTQ W4 g64"]
    assert gptq["ours"] == "GPTQ W4 g64"
    assert gptq["perplexity_ours_vs_llmc"] == pytest.approx(33.0 / 33.3 - 1) and gptq["within_1pct"]
    assert gptq["seconds_ratio_ours_over_llmc"] == pytest.approx(1.2) and not gptq["not_slower"]
    assert gptq["calibration_seconds_ratio_ours_over_llmc"] == pytest.approx(0.9)
    assert gptq["llmc_rtn_gap_closed"] == pytest.approx((38.0 - 33.3) / (38.0 - 28.0))
    assert by_llmc["llmc AWQ W4 g128"]["llmc_error"].startswith("ValueError")
    assert "llmc FP8 W8A8 dynamic" not in by_llmc  # neither side has it
    llmc_reference.print_comparison(list(by_llmc.values()))  # prints without a KeyError on partial entries


@pytest.mark.skipif(not LLMC_PYTHON, reason="set QKILN_LLMC_PYTHON to an interpreter with llmcompressor")
def test_full_path_through_llmcompressor(tiny, text_file, tmp_path):
    from qkiln.compile.model_ref import open_model

    only = ["llmc GPTQ W4 g64", "llmc FP8 W8A8 dynamic", "llmc GPTQ FP8 W8A8 dynamic"]
    rows = llmc_reference.llmc_rows(LLMC_PYTHON, tmp_path, calib=f"file:{text_file}", num_samples=2, threads=1,
                                    only=only, source=str(tiny))
    assert sorted(rows) == sorted(only)
    reference = open_model(str(tiny))
    ids = torch.arange(0, 250, 5).reshape(1, -1)  # [1, 50] byte tokens
    expected = reference(ids)
    for name, row in rows.items():
        assert "error" not in row, row.get("error")
        assert row["seconds"] >= row["calibration_seconds"] > 0 and row["peak_rss_mib"] > 0
        logits = open_model(row["artifact"])(ids)
        rel = (logits - expected).norm() / expected.norm()
        assert 0 < rel < 0.5, (name, rel)  # quantized (not the dense weights), yet the same model
