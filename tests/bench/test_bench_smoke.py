"""Every benchmark runs end to end on a tiny random model and writes a report with the fields the
bench issue asks for, holding plausible values (finite, > 0, exact token counts). No timing
assertions: the numbers themselves are noise on a shared CI machine.
"""

import importlib.util
import json
import math
import os

import pytest
import torch
from typer.testing import CliRunner

from tiny_models import write_tiny_hf_model

from qkiln.bench import cpu_compare, kv_dtypes, latency, prefill, serve, throughput
from qkiln.bench.report import summarize
from qkiln.bench.roofline import kv_bytes_per_token, measure_bandwidth, weight_bytes
from qkiln.bench.serve import compute_metrics, parse_goodput
from qkiln.bench.serve_client import RequestResult
from qkiln.bench.workload import BenchConfigError, make_workload, parse_length, sampleable_token_ids
from qkiln.errors import RequestError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("bench") / "tiny")


def _positive(stat) -> bool:
    value = stat["median"] if isinstance(stat, dict) else stat
    return value is not None and math.isfinite(value) and value > 0


def _check_envelope(report: dict, benchmark: str):
    assert report["benchmark"] == benchmark
    env = report["environment"]
    assert env["versions"]["torch"] and env["machine"]["num_cpus"] >= 1
    assert "revision" in env["git"]
    json.dumps(report)  # the whole report is JSON as written


def test_workload_is_exact_seeded_and_free_of_special_tokens(tiny):
    from qkiln.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny)
    special = set(tok.backend.get_added_tokens_decoder())
    w = make_workload(tok, 5, 7, "2:4", shared_prefix_len=3, seed=1)
    assert [len(p) for p in w.prompts] == [10] * 5
    assert all(2 <= n <= 4 for n in w.output_lens)
    assert len({tuple(p[:3]) for p in w.prompts}) == 1  # the shared prefix
    assert not special & {t for p in w.prompts for t in p}
    assert make_workload(tok, 5, 7, "2:4", shared_prefix_len=3, seed=1).prompts == w.prompts
    assert make_workload(tok, 5, 7, "2:4", shared_prefix_len=3, seed=2).prompts != w.prompts
    assert len(sampleable_token_ids(tok)) == 256  # 256 byte tokens; BOS/EOS excluded
    with pytest.raises(BenchConfigError):
        parse_length("9:3", "input_len")


def test_workload_from_jsonl(tiny, tmp_path):
    from qkiln.runtime.tokenizer import Tokenizer

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt_token_ids": [1, 2, 3], "output_len": 9}\n')
    w = make_workload(Tokenizer.from_dir(tiny), 4, output_len=5, prompts_jsonl=path, seed=0)
    assert sorted(len(p) for p in w.prompts) == [3, 3, 5, 5]  # "hello" is 5 byte tokens
    assert sorted(w.output_lens) == [5, 5, 9, 9]
    assert w.description["output_len"] == "5:9 (from the file)"  # what ran, not --output-len alone


def test_summaries_and_metrics():
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (2.5, 1.0, 4.0, 1.75, 3.25, 4)
    fast = RequestResult(True, 4, output_tokens=5, ttft_s=0.1, e2el_s=0.5, itl_s=[0.1] * 4)
    slow = RequestResult(True, 4, output_tokens=3, ttft_s=0.9, e2el_s=1.1, itl_s=[0.1, 0.1])
    failed = RequestResult(False, 4, error="HTTP 400")
    assert fast.tpot_s == pytest.approx(0.1)
    m = compute_metrics([fast, slow, failed], 2.0, parse_goodput("ttft:500,tpot:200"))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["goodput"] == pytest.approx(0.5)  # only `fast` meets TTFT <= 500 ms
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["ttft"]["median_ms"] == pytest.approx(500.0)
    with pytest.raises(BenchConfigError):
        parse_goodput("latency:5")


def test_throughput_report_and_plot(tiny, tmp_path):
    report = throughput.main(str(tiny), num_requests=3, input_len="4:8", output_len="3", max_num_seqs="1,4",
                             repeats=1, threads=1, json_out=tmp_path / "t.json", plot=tmp_path / "plots")
    _check_envelope(json.loads((tmp_path / "t.json").read_text()), "throughput")
    runs = report["results"]["runs"]
    assert [r["max_num_seqs"] for r in runs] == [1, 4]
    for r in runs:
        assert r["num_output_tokens"]["median"] == 9  # 3 requests x 3 tokens, ignore_eos
        for key in ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s",
                    "elapsed_s", "num_steps", "peak_rss_bytes"):
            assert _positive(r[key]), key
    assert (tmp_path / "plots" / "throughput_vs_concurrency.png").stat().st_size > 0


def test_shared_prefix_is_reported_as_cache_hits(tiny, capsys):
    """One sequence at a time: every request after the first finds the 2-block prefix cached."""
    report = throughput.main(str(tiny), num_requests=3, input_len="4", output_len="2", shared_prefix_len=32,
                             max_num_seqs="1", repeats=1, threads=1)
    assert report["results"]["runs"][0]["prefix_cache_hit_rate"]["median"] > 0
    assert "in 32+4 / out 2" in capsys.readouterr().out  # the prompts' length, prefix included


def test_sampled_throughput_records_its_sampling(tiny, tmp_path):
    report = throughput.main(str(tiny), num_requests=3, input_len="4", output_len="3", temperature=0.8, top_p=0.9,
                             top_k=20, repeats=1, threads=1)
    assert report["config"]["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20}
    assert report["results"]["runs"][0]["num_output_tokens"]["median"] == 9
    with pytest.raises(RequestError, match="top_p must be in"):
        throughput.main(str(tmp_path / "never-loaded"), top_p=0)


def test_lengths_past_the_context_are_refused_not_cut(tiny):
    """The engine stops a sequence at the context (1024 here): the table would name an output
    length that was never run."""
    with pytest.raises(BenchConfigError, match="1020 prompt \\+ 8 output tokens does not fit the 1024"):
        latency.main(str(tiny), input_len=1020, output_len=8, repeats=1, threads=1, roofline=False)


def test_latency_report_with_roofline(tiny, tmp_path):
    report = latency.main(str(tiny), input_len=8, output_len=4, batch_size="1,2", repeats=1, threads=1,
                          json_out=tmp_path / "l.json")
    _check_envelope(report, "latency")
    assert _positive(report["results"]["bandwidth"]["bytes_per_s"])
    for r in report["results"]["runs"]:
        for key in ("prefill_s", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_ms", "e2e_s"):
            assert _positive(r[key]), key
        roof = r["roofline"]
        assert _positive(roof["percent_of_roofline"]) and roof["bytes_per_step"] > roof["weight_bytes"]


def test_roofline_byte_counts(tiny, tmp_path):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset

    art = build(str(tiny), preset("w4a16-rtn"), tmp_path / "art", use_cache=False, progress=False,
                log=lambda m: None).path
    dense = throughput.make_engine(throughput.load_model(str(tiny)), num_kv_blocks=4)
    packed = throughput.make_engine(throughput.load_model(str(art)), num_kv_blocks=4)
    # tiny llama: 2 layers x (K + V) x 2 kv heads x head_dim 32 x 2 bytes (bf16)
    assert kv_bytes_per_token(dense) == 2 * 2 * 2 * 32 * 2
    assert weight_bytes(packed.model) < 0.5 * weight_bytes(dense.model)  # int4 linears, bf16 tied embedding
    # The bf16 source's linears are oneDNN-packed (no data pointer) and its tied head a packed copy of
    # the embedding, which decode then only gathers from: every source tensor once, in bf16.
    from qkiln.runtime.source import load_source

    assert weight_bytes(dense.model) == 2 * sum(t.numel() for t in load_source(str(tiny)).state_dict.values())
    assert _positive(measure_bandwidth(num_bytes=8 << 20, num_repeats=2)["bytes_per_s"])


def test_cpu_compare_tiny(tiny, tmp_path):
    args = dict(work_dir=tmp_path / "work", threads=1, repeats=1, input_len=8, output_len=4, num_requests=4,
                hf_batch_sizes="2,4", json_out=tmp_path / "c.json", plot=tmp_path / "plots")
    report = cpu_compare.main(str(tiny), **args)
    _check_envelope(report, "cpu-compare")
    res = report["results"]
    for name in ("hf-bf16", "qkiln-w4a16", "qkiln-bf16", "qkiln-w4a16-int8act"):
        assert _positive(res["batch1_decode"][name]["decode_tokens_per_s"]), name
        assert _positive(res["batch1_decode"][name]["roofline"]["percent_of_roofline"]), name
        assert _positive(res["offline_throughput"][name]["output_tokens_per_s"]), name
    assert "skipped" in res["batch1_decode"]["llama.cpp"]  # the tiny model is not a GGUF file
    for figures in ("batch1_decode", "offline_throughput"):  # not installed, or no --ort-model
        reason = res[figures]["ort-genai-int4"]["skipped"]
        assert "not installed" in reason or "no ONNX Runtime GenAI model folder" in reason
    assert res["ratios"]["throughput_w4a16_vs_ort_genai"] is None
    assert res["offline_throughput"]["hf-bf16"]["best_batch_size"] in (2, 4)
    assert _positive(res["ratios"]["decode_w4a16_vs_hf"]) and _positive(res["ratios"]["throughput_w4a16_vs_best_hf"])
    rounds = res["batch1_decode"]["qkiln-w4a16"]["paired_ratios"]  # HF and qkiln batch-1 measured in turn
    assert len(rounds) == 1 and rounds[0] == pytest.approx(res["ratios"]["decode_w4a16_vs_hf"])
    assert _positive(res["batch1_decode"]["qkiln-w4a16-python-layers"]["decode_tokens_per_s"])
    assert _positive(res["ratios"]["decode_stack_vs_python_layers"])
    assert _positive(res["ratios"]["throughput_w4a16_int8act_vs_best_hf"])
    assert (tmp_path / "plots" / "cpu_compare_decode.png").is_file()
    assert res["caveats"][0].startswith("1 repeat(s): each figure is a single run")  # said under the table
    built = cpu_compare.ensure_artifact(str(tiny), None, tmp_path / "work")  # reused, not rebuilt
    assert str(built) == res["artifact"]


def test_cpu_compare_against_onnxruntime_genai(tiny, tmp_path):
    # Optional comparator (not in CI's install): its builder makes the int4 folder from the same
    # weights, and cpu-compare reports its batch-1 and static-batch figures and the ratios to them.
    for module in ("onnxruntime_genai", "onnx", "onnx_ir"):
        pytest.importorskip(module)
    from qkiln.bench.ort_genai import build_ort_model

    folder = build_ort_model(str(tiny), tmp_path / "ort")
    assert (folder / "genai_config.json").is_file() and not (tmp_path / "ort.partial").exists()
    with pytest.raises(BenchConfigError, match="already exists"):
        build_ort_model(str(tiny), folder)
    report = cpu_compare.main(str(tiny), work_dir=tmp_path / "work", threads=1, repeats=1, input_len=8,
                              output_len=4, num_requests=4, hf_batch_sizes="2,4", bf16=False,
                              int8_activations=False, ort_model=folder)
    res = report["results"]
    assert _positive(res["batch1_decode"]["ort-genai-int4"]["decode_tokens_per_s"])
    ort_offline = res["offline_throughput"]["ort-genai-int4"]
    assert ort_offline["best_batch_size"] in (2, 4)
    assert _positive(ort_offline["prefill_s"]) and _positive(ort_offline["decode_tokens_per_s"])
    assert _positive(res["ratios"]["decode_w4a16_vs_ort_genai"])
    assert _positive(res["ratios"]["throughput_w4a16_vs_ort_genai"])


def test_kv_dtypes_tiny(tiny, tmp_path):
    report = kv_dtypes.main(str(tiny), work_dir=tmp_path / "work", threads=1, repeats=1, input_len=8, output_len=4,
                            num_requests=4, num_samples=2, json_out=tmp_path / "k.json", plot=tmp_path / "plots")
    _check_envelope(report, "kv-dtypes")
    rows = report["results"]["kv_dtypes"]
    assert list(rows) == ["bf16", "fp8", "int4"]
    for kv, row in rows.items():
        assert _positive(row["batch1_decode"]["decode_tokens_per_s"]), kv
        assert _positive(row["offline_throughput"]["output_tokens_per_s"]), kv
        assert _positive(row["offline_vs_bf16"]) and row["tokens_in_budget"] > 0
    # bf16 2 bytes an element; fp8 1; int4 half a byte plus an fp16 scale and minimum per 16
    assert rows["bf16"]["kv_bytes_per_token"] == 2 * rows["fp8"]["kv_bytes_per_token"]
    assert rows["int4"]["kv_bytes_per_token"] == rows["fp8"]["kv_bytes_per_token"] * (0.5 + 4 / 16)
    assert rows["bf16"]["decode_vs_bf16"] == 1.0
    assert (tmp_path / "plots" / "kv_dtypes_throughput.png").is_file()


def test_prefill_tiny(tiny, tmp_path):
    report = prefill.main(str(tiny), work_dir=tmp_path / "work", prompt_lens="40,100", threads=1, repeats=2,
                          max_num_batched_tokens=32, json_out=tmp_path / "p.json", plot=tmp_path / "plots")
    _check_envelope(report, "prefill")
    rows = report["results"]["prompts"]
    assert list(rows) == ["40", "100"]
    for n, row in rows.items():
        engines = [e for e, v in row.items() if isinstance(v, dict)]
        assert "hf-bf16" in engines and len(engines) in (2, 3), engines  # qkiln: AMX on / off, or one
        assert all(e == "hf-bf16" or e.startswith("qkiln-w4a16-rtn") for e in engines), engines  # the recipe built
        for e in engines:
            assert row[e]["seconds"]["n"] == 2 and _positive(row[e]["seconds"]), (n, e)
            secs = row[e]["seconds"]  # the median of n / seconds lies within n / its extremes, however noisy
            assert int(n) / secs["max"] * 0.999 <= row[e]["tokens_per_s"]["median"] <= int(n) / secs["min"] * 1.001
        assert _positive(row["hf_vs_qkiln"])
    assert (tmp_path / "plots" / "prefill_100.png").is_file()
    with pytest.raises(BenchConfigError, match="below the model's 1024 positions"):
        prefill.main(str(tiny), work_dir=tmp_path / "work", prompt_lens="2000", threads=1, repeats=1, hf=False)


@pytest.mark.skipif(importlib.util.find_spec("qkiln.runtime.server") is None, reason="runtime/server.py absent")
def test_an_artifact_archive_is_benchmarked_as_it_is(tiny, tmp_path):
    """`bench throughput A.tar` took the archive for a source model and was refused."""
    from qkiln.bench.workload import load_tokenizer
    from qkiln.compile.artifact_archive import write_archive
    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset

    built = build(str(tiny), preset("w4a16-rtn"), tmp_path / "a", use_cache=False, progress=False, log=lambda m: None)
    archive = str(write_archive(built.path, tmp_path / "a.tar"))
    report = throughput.main(archive, num_requests=2, input_len="4", output_len="3", max_num_seqs="2", repeats=1,
                             threads=1)
    assert report["config"]["model"] == archive  # the report names what was given, not a temporary folder
    assert report["results"]["runs"][0]["num_output_tokens"]["median"] == 6
    assert load_tokenizer(archive).encode("hello") == load_tokenizer(str(built.path)).encode("hello")


def test_serve_against_a_started_server(tiny, tmp_path):
    report = serve.main(str(tiny), num_requests=3, input_len="4:6", output_len="3", concurrency="1,0",
                        goodput="ttft:600000,e2el:600000", repeats=1, json_out=tmp_path / "s.json",
                        plot=tmp_path / "plots")
    _check_envelope(report, "serve")
    for r in report["results"]["runs"]:
        assert r["completed"]["median"] == 3 and r["failed"]["median"] == 0
        for key in ("request_throughput", "output_throughput", "total_token_throughput", "goodput", "duration_s"):
            assert _positive(r[key]), key
        assert _positive(r["ttft"]["median_ms"]) and _positive(r["e2el"]["p99_ms"])
        assert len(r["samples"]["ttft_ms"]) == 3
    # each level its own prompts: the same ones again came from the server's prefix cache
    assert len({r["seed"] for r in report["results"]["runs"]}) == 2
    assert (tmp_path / "plots" / "serve_ttft_cdf.png").is_file()


def test_latency_counts_only_tokens_decoded_after_the_batch_prefilled():
    """A batch whose prompts take several steps decodes its first sequences meanwhile: those
    tokens are not decode throughput (they were counted, over the time after: +10-33%)."""
    from qkiln.bench.throughput import RequestTiming, RunTrace

    steps = [float(t) for t in range(1, 11)]  # one step a second
    early = RequestTiming(8, num_output_tokens=10, ttft_s=1.0, e2e_s=10.0)
    late = RequestTiming(8, num_output_tokens=8, ttft_s=3.0, e2e_s=10.0)
    figures = latency.latency_figures(RunTrace(10.0, 10, [early, late], steps))
    assert figures["prefill_s"] == 3.0 and figures["decode_tokens_per_s"] == 14 / 7  # steps 4..10, both


def test_poisson_arrivals_end_with_the_last_request(monkeypatch):
    """The run waited one more random gap after sending the last request, counted in its duration."""
    import asyncio
    import random

    from qkiln.bench import serve_client
    from qkiln.bench.workload import Workload

    async def instant(client, url, payload, prompt_len):
        return RequestResult(prompt_len=prompt_len, output_tokens=1, success=True)

    monkeypatch.setattr(serve_client, "send_completion", instant)
    workload = Workload([[1], [2], [3]], [1, 1, 1])
    _, duration = asyncio.run(serve_client.run_load("http://127.0.0.1:9", "m", workload, None, 2.0, 5,
                                                    workload.prompts))
    rng = random.Random(5)
    gaps = [rng.expovariate(2.0) for _ in range(3)]
    assert sum(gaps[:2]) <= duration < sum(gaps[:2]) + 0.5 * gaps[2]


def test_cli_wiring_and_errors(tiny):
    from qkiln.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["bench", "throughput", str(tiny), "--num-requests", "2", "--input-len", "4",
                             "--output-len", "2", "--repeats", "1", "--threads", "1"])
    assert ok.exit_code == 0, ok.output
    assert "output tok/s" in ok.stdout
    bad = runner.invoke(app, ["bench", "throughput", str(tiny), "--input-len", "0"])
    assert bad.exit_code == 2 and "error: input_len must be" in bad.output
    for option, value in (("--max-num-batched-tokens", "0"), ("--threads", "-1"), ("--num-kv-blocks", "-5")):
        bad = runner.invoke(app, ["bench", "throughput", str(tiny), "--num-requests", "2", option, value])
        assert bad.exit_code == 2 and f"error: {option} must be >= 1" in bad.output, bad.output
    long = runner.invoke(app, ["bench", "throughput", str(tiny), "--num-requests", "2", "--input-len", "1020",
                               "--output-len", "8", "--repeats", "1"])
    assert long.exit_code == 2 and "1020 prompt + 8 output tokens" in long.output, long.output  # not the warm-up's 4
    unwritable = tiny / "model.safetensors" / "report.json"  # a file where a folder should be
    for command in (["throughput", str(tiny), "--num-requests", "2"], ["kernels"]):
        lost = runner.invoke(app, ["bench", *command, "--json", str(unwritable)])
        assert lost.exit_code == 6 and "is a file, not a folder" in lost.output and "tok/s" not in lost.output, lost.output
    assert runner.invoke(app, ["bench", "cpu-compare", "--help"]).exit_code == 0
    assert runner.invoke(app, ["bench", "kv-dtypes", "--help"]).exit_code == 0
    assert runner.invoke(app, ["bench", "prefill", "--help"]).exit_code == 0
    assert runner.invoke(app, ["bench", "ort-model", "--help"]).exit_code == 0
    # a misspelt row measured only the unquantized model, exit 0
    misspelt = runner.invoke(app, ["bench", "quality", "--only", "RTN W4 G128", "--json", "/dev/null"])
    assert misspelt.exit_code == 2 and "no row named 'RTN W4 G128'" in misspelt.output, misspelt.output


def test_cpu_kernels_report(tmp_path):
    from qkiln.cli import app

    out = tmp_path / "kernels.json"
    result = CliRunner().invoke(app, ["bench", "kernels", "--repeats", "1", "--num-layers", "1", "--rows", "1,20",
                                      "--step-rows", "20", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    per_shape = report["results"]["per_shape"]
    assert any("49152" in key for key in per_shape)  # the lm_head shape is measured
    for stats in per_shape.values():
        assert stats["tinygemm"]["median"] > 0 and stats["bf16"]["median"] > 0
    step = report["results"]["decode_step"]
    assert report["config"]["step_rows"] == 20 and step["bf16"]["median"] > 0
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # the oneDNN-packed copy, side by side
        assert step["bf16_onednn"]["median"] > 0


def test_a_comparator_that_crashes_costs_its_row_not_the_run():
    """llama.cpp runs in a child process: its death (SIGABRT here, SIGSEGV seen) is a skipped row."""
    from qkiln.bench.baselines import run_in_child

    assert run_in_child("sqrt", math.sqrt, 6.25) == 2.5
    assert "died 2 times" in run_in_child("abort", os.abort)["skipped"]


def test_onnx_engine_tiny(tiny, tmp_path):
    pytest.importorskip("onnxruntime")
    import dataclasses

    from qkiln.bench import onnx_engine
    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset

    recipe = preset("w4a16-rtn")
    recipe = dataclasses.replace(recipe, evaluation=dataclasses.replace(recipe.evaluation, data=None))
    artifact = build(str(tiny), recipe, tmp_path / "a", use_cache=False, progress=False, log=lambda m: None,
                     engines=("onnx",)).path
    report = onnx_engine.main(artifact, levels="0,4", context=20, repeats=1, threads=1, json_out=tmp_path / "o.json")
    _check_envelope(report, "onnx-engine")
    results = report["results"]
    assert results["int4_linears"] > 0 and set(results["levels"]) == {"0", "4"}
    for row in results["levels"].values():
        assert _positive(row["decode_ms"]) and _positive(row["prefill_ms"])
        assert row["matmulnbits"] == results["int4_linears"]  # every int4 linear ran packed
    with pytest.raises(BenchConfigError, match="levels"):
        onnx_engine.main(artifact, levels="7", context=20, repeats=1, threads=1, json_out=None)


def test_quality_refuses_missing_data_files_before_building(tmp_path, monkeypatch):
    """The texts are first read after every row is built (hours): a missing one must stop the run first."""
    from qkiln.bench import quant_quality
    from qkiln.cli import app

    def no_build(*args):
        raise AssertionError("a row was built before the data files were checked")

    monkeypatch.setattr(quant_quality, "_build_in_subprocess", no_build)
    monkeypatch.delenv("QKILN_SHARED_DIR", raising=False)
    empty = CliRunner().invoke(app, ["bench", "quality", "--only", "RTN W4 g128", "--data-dir", str(tmp_path),
                                     "--json", str(tmp_path / "q.json")])
    assert empty.exit_code == 2 and "--data-dir" in empty.output, empty.output
    assert str(tmp_path / "data/wikitext-2-raw/wiki.test.raw") in empty.output.replace("\n", "")
    for name in ("wikitext-2-raw/wiki.test.raw", "janeausten/persuasion.txt"):  # evaluation texts only
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_text("text\n")
    monkeypatch.setenv("QKILN_SHARED_DIR", str(tmp_path))
    with pytest.raises(BenchConfigError) as refused:  # this row calibrates on a novel that is not there
        quant_quality.main(["--only", "GPTQ W4 g128 calib=novels", "--json", str(tmp_path / "q.json")])
    assert str(refused.value).startswith(f"missing data file(s): {tmp_path / 'data/janeausten/emma.txt'};")
    assert not (tmp_path / "q.json").exists()


def test_build_memory_tiny(tiny, tmp_path, capsys):
    from qkiln.bench import build_memory

    text = tmp_path / "calib.txt"
    text.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 100)
    report = build_memory.main(str(tiny), "w4a16-gptq", num_samples=2, eval_data=str(text), engine=None,
                               json_out=tmp_path / "m.json", quiet=True, plot=tmp_path / "plots")
    _check_envelope(report, "build-memory")
    r = report["results"]
    times = [t for t, *_ in r["timeline"]]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= r["seconds"]
    assert max(b for _, b, _ in r["timeline"]) == max(s["peak_bytes"] or 0 for s in r["steps"])  # thinned, not lost
    assert all(0 < anon <= rss for _, rss, anon in r["timeline"])
    assert r["peak_anon_bytes"] == max(s["peak_anon_bytes"] or 0 for s in r["steps"]) > r["idle_anon_bytes"] > 0
    assert (tmp_path / "plots" / "build_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s["step"] for s in r["steps"]] == ["start python", "load source", "calibration data", "quantize weights",
                                               "evaluate accuracy", "artifact tensors", "write artifact"]
    assert r["peak_bytes"] >= max(s["peak_bytes"] or 0 for s in r["steps"]) > r["idle_bytes"] > 0
    from safetensors.torch import load_file

    assert r["num_parameters"] == sum(t.numel() for t in load_file(str(tiny / "model.safetensors")).values())
    assert json.loads((tmp_path / "m.json").read_text())["results"]["bytes_per_parameter"] > 0
    assert "load source" in capsys.readouterr().out


def test_a_failed_build_under_build_memory_says_so(tiny, tmp_path):
    from qkiln.bench import build_memory
    from qkiln.errors import QkilnError

    with pytest.raises(QkilnError, match="the build failed"):
        build_memory.main(str(tmp_path / "missing"), "w4a16-rtn", None, None, None, None, quiet=True)
