"""`qkiln bench ...`: the typer sub-app (qkiln/cli.py mounts it as `bench`).

Owns only option parsing: each command passes its options to `main(**options)` of the module
of the same name, imported on use, so `qkiln --help` never imports torch, transformers or
httpx. A `QkilnError` from a benchmark becomes one `error: ...` line and its exit code.
"""

import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from qkiln.errors import exit_on_error

bench_app = typer.Typer(help="Benchmarks: a JSON report (--json), a table on stdout, progress on stderr, "
                             "PNG charts (--plot).", no_args_is_help=True, pretty_exceptions_enable=False,
                        rich_markup_mode=None)  # help texts say [default: ...]


# Options every report-writing command takes the same way.
JsonOut = Annotated[Optional[Path], typer.Option("--json", help="write the JSON report here")]
PlotDir = Annotated[Optional[Path], typer.Option(help="write PNG charts into this directory")]
# qkiln generate / serve take it too (qkiln/cli.py).
Int8Activations = Annotated[bool, typer.Option(
    "--int8-activations", help="CPU, artifacts: activations rounded to int8 per 32 channels (int4 linears at "
                               "every step, int8 ones at up to 16 rows, more with AVX512-VNNI); not exact")]


def _run(module: str, options: dict) -> None:
    with exit_on_error():
        _check_outputs(options.get("json_out"), options.get("plot"))
        _check_packages(module, options)
        importlib.import_module(f"qkiln.bench.{module}").main(**options)


# what a benchmark imports beyond qkiln's own dependencies (the `bench` extra): found missing at the
# start, not after minutes of loading and timing (serve had left its server running)
_HF_BASELINE = ("transformers",)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # in sys.modules without a spec: imported already, or None (blocked)
        return sys.modules.get(name) is not None


def _check_packages(module: str, options: dict) -> None:
    from qkiln.bench.workload import BenchConfigError

    needed = {"serve": ("httpx",), "cpu_compare": _HF_BASELINE}.get(module, ())
    if options.get("hf"):
        needed += _HF_BASELINE
    if options.get("plot") is not None:
        needed += ("matplotlib",)
    missing = sorted({name for name in needed if not _importable(name)})
    if missing:
        hint = "; or leave out --plot" if "matplotlib" in missing else ""
        hint += "; or pass --no-hf" if "transformers" in missing and options.get("hf") else ""
        raise BenchConfigError(f"this benchmark needs {', '.join(missing)}: pip install 'qkiln[bench]' (in a "
                               f"checkout: pip install -e '.[bench]'){hint}")


def _check_outputs(json_out: Path | None, plot: Path | None) -> None:
    """Found out before the benchmark runs (minutes), not when its report is lost at the end."""
    from qkiln.compile.artifact_writer import check_output_file, check_writable_dir

    if json_out is not None:
        check_output_file(json_out, "--json")
    if plot is not None:  # a directory of charts
        check_writable_dir(plot)


@bench_app.command("throughput")
def throughput_command(
    model: Annotated[str, typer.Argument(help="artifact dir or archive (.tar, .tar.gz), or source model (alias, HF dir, .gguf)")],
    num_requests: Annotated[int, typer.Option(help="requests submitted at once")] = 64,
    input_len: Annotated[str, typer.Option(help="prompt tokens: 128, or a uniform range 64:256")] = "128",
    output_len: Annotated[str, typer.Option(help="output tokens: 128, or a uniform range 64:256")] = "128",
    prompts_jsonl: Annotated[Optional[Path], typer.Option(help="real prompts, one {\"prompt\": ...} per line")] = None,
    shared_prefix_len: Annotated[int, typer.Option(help="random tokens shared by every prompt (prefix caching)")] = 0,
    max_num_seqs: Annotated[str, typer.Option(help="engine batch limit; a list 1,8,64 sweeps it")] = "64",
    max_num_batched_tokens: Annotated[int, typer.Option(help="tokens per engine step")] = 1024,
    num_kv_blocks: Annotated[Optional[int], typer.Option(help="KV blocks (default: sized from memory)")] = None,
    kv_dtype: Annotated[Optional[str], typer.Option(help="KV cache dtype (default: the artifact's)")] = None,
    prefix_caching: Annotated[bool, typer.Option(help="enable prefix caching")] = True,
    dtype: Annotated[str, typer.Option(help="activation dtype: auto, bf16, fp32")] = "auto",
    int8_activations: Int8Activations = False,
    repeats: Annotated[int, typer.Option(help="timed repeats (median and spread reported)")] = 3,
    temperature: Annotated[float, typer.Option(help="sampling temperature (0 = greedy)")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling threshold (1 = off)")] = 1.0,
    top_k: Annotated[int, typer.Option(help="sample from the k most likely tokens (-1 = off)")] = -1,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: usable cores)")] = None,
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    json_out: JsonOut = None,
    plot: PlotDir = None,
):
    """Offline throughput: N requests at once through the engine; requests/s and tokens/s."""
    _run("throughput", locals())


@bench_app.command("latency")
def latency_command(
    model: Annotated[str, typer.Argument(help="artifact dir or archive (.tar, .tar.gz), or source model (alias, HF dir, .gguf)")],
    input_len: Annotated[int, typer.Option(help="prompt tokens")] = 128,
    output_len: Annotated[int, typer.Option(help="generated tokens (>= 2)")] = 128,
    batch_size: Annotated[str, typer.Option(help="sequences decoded together; a list 1,16 sweeps")] = "1",
    dtype: Annotated[str, typer.Option(help="activation dtype: auto, bf16, fp32")] = "auto",
    kv_dtype: Annotated[Optional[str], typer.Option(help="KV cache dtype (default: the artifact's)")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(help="tokens per engine step")] = 1024,
    roofline: Annotated[bool, typer.Option(help="measure bandwidth and report % of the decode roofline")] = True,
    repeats: Annotated[int, typer.Option(help="timed repeats (median and spread reported)")] = 3,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: usable cores)")] = None,
    seed: Annotated[int, typer.Option(help="prompt seed")] = 0,
    json_out: JsonOut = None,
    plot: PlotDir = None,
):
    """Prefill time and decode tokens/s for given lengths (batch 1 unless --batch-size)."""
    _run("latency", locals())


@bench_app.command("serve")
def serve_command(
    model: Annotated[str, typer.Argument(help="artifact or source model to serve (its tokenizer builds the prompts)")],
    base_url: Annotated[Optional[str], typer.Option(help="target a running server instead of starting one")] = None,
    server_args: Annotated[str, typer.Option(help="extra arguments for `qkiln serve`, one string")] = "",
    num_requests: Annotated[int, typer.Option(help="requests per repeat")] = 64,
    input_len: Annotated[str, typer.Option(help="prompt tokens: 128, or a uniform range 64:256")] = "128",
    output_len: Annotated[str, typer.Option(help="output tokens: 128, or a uniform range 64:256")] = "128",
    prompts_jsonl: Annotated[Optional[Path], typer.Option(help="real prompts, one {\"prompt\": ...} per line")] = None,
    shared_prefix_len: Annotated[int, typer.Option(help="random tokens shared by every prompt (prefix caching)")] = 0,
    concurrency: Annotated[str, typer.Option(help="max requests in flight; 1,4,16 sweeps; 0 = no cap")] = "16",
    request_rate: Annotated[float, typer.Option(help="Poisson arrivals in requests/s (inf: all at once)")] = math.inf,
    goodput: Annotated[Optional[str], typer.Option(help="SLOs in ms, e.g. ttft:500,tpot:50,e2el:5000")] = None,
    prompt_format: Annotated[str, typer.Option(help="send prompts as token `ids` (exact) or decoded `text`")] = "ids",
    repeats: Annotated[int, typer.Option(help="repeats per concurrency (median and spread reported)")] = 3,
    seed: Annotated[int, typer.Option(help="workload and arrival seed")] = 0,
    json_out: JsonOut = None,
    plot: PlotDir = None,
):
    """Online serving: TTFT, TPOT, ITL, E2EL and goodput over HTTP (vLLM benchmark_serving definitions)."""
    _run("serve", locals())


@bench_app.command("cpu-compare")
def cpu_compare_command(
    model: Annotated[str, typer.Option(help="source model (alias, HF dir, .gguf)")] = "smollm2-135m",
    artifact: Annotated[Optional[Path], typer.Option(help="W4A16 artifact (default: build w4a16-rtn once)")] = None,
    work_dir: Annotated[Optional[Path], typer.Option(help="where the built artifact is kept")] = None,
    threads: Annotated[int, typer.Option(help="torch threads for every engine")] = 2,
    repeats: Annotated[int, typer.Option(help="timed repeats per figure (median and spread)")] = 3,
    input_len: Annotated[int, typer.Option(help="prompt tokens")] = 128,
    output_len: Annotated[int, typer.Option(help="generated tokens")] = 128,
    num_requests: Annotated[int, typer.Option(help="requests in the offline throughput run")] = 64,
    hf_batch_sizes: Annotated[str, typer.Option(help="static batch sizes tried for HF generate")] = "16,32,64",
    max_num_batched_tokens: Annotated[int, typer.Option(help="qkiln tokens per engine step (offline)")] = 1024,
    bf16: Annotated[bool, typer.Option(help="also measure qkiln on the bf16 source")] = True,
    int8_activations: Annotated[bool, typer.Option(help="also measure the artifact with int8 activations (W4A8)")] = True,
    ort_model: Annotated[Optional[Path], typer.Option(help="ONNX Runtime GenAI int4 model folder")] = None,
    seed: Annotated[int, typer.Option(help="prompt seed")] = 0,
    json_out: JsonOut = None,
    plot: PlotDir = None,
):
    """Reproduce the CPU comparison table (HF generate vs qkiln W4A16 / bf16, optional llama.cpp, ORT GenAI)."""
    _run("cpu_compare", locals())


@bench_app.command("prefill")
def prefill_command(
    model: Annotated[str, typer.Option(help="source model (alias, HF dir, .gguf)")] = "smollm2-135m",
    artifact: Annotated[Optional[Path], typer.Option(help="W4A16 artifact (default: build w4a16-rtn once)")] = None,
    work_dir: Annotated[Optional[Path], typer.Option(help="where the built artifact is kept")] = None,
    prompt_lens: Annotated[str, typer.Option(help="prompt tokens, one prompt per length: 1024,4096")] = "1024,4096",
    threads: Annotated[int, typer.Option(help="torch threads")] = 2,
    repeats: Annotated[int, typer.Option(help="timed repeats per engine (median and spread)")] = 3,
    max_num_batched_tokens: Annotated[int, typer.Option(help="qkiln tokens per engine step (prefill chunk)")] = 1024,
    hf: Annotated[bool, typer.Option(help="also time HF's bf16 forward over each prompt")] = True,
    seed: Annotated[int, typer.Option(help="prompt seed")] = 0,
    json_out: JsonOut = None,
    plot: PlotDir = None,
):
    """Time to first token of one long prompt: qkiln (AMX prefill attention on / off) and HF bf16."""
    _run("prefill", locals())


@bench_app.command("ort-model")
def ort_model_command(
    out: Annotated[Path, typer.Argument(help="folder to write (genai_config.json, model.onnx)")],
    model: Annotated[str, typer.Option(help="source model (alias, HF dir, .gguf)")] = "smollm2-135m",
):
    """Build the ONNX Runtime GenAI int4 CPU folder cpu-compare's --ort-model reads (needs
    onnxruntime-genai, onnx and onnx-ir installed; see bench/ort_genai.py)."""
    with exit_on_error():
        from qkiln.bench.ort_genai import build_ort_model

        build_ort_model(model, out)


@bench_app.command("onnx-engine")
def onnx_engine_command(
    artifact: Annotated[Path, typer.Argument(help="artifact directory or archive with engines/onnx/ (build --engine onnx)")],
    levels: Annotated[str, typer.Option(help="MatMulNBits accuracy levels to time: 0 float .. 4 int8 activations")] = "0,4",
    context: Annotated[int, typer.Option(help="decode at this context; prefill this many tokens")] = 128,
    repeats: Annotated[int, typer.Option(help="timed rounds (medians reported)")] = 5,
    threads: Annotated[int, typer.Option(help="threads for ONNX Runtime and qkiln's kernels")] = 2,
    json_out: JsonOut = None,
):
    """An artifact's ONNX engine under ONNX Runtime: decode and prefill step times, and how many
    int4 linears ran as the packed MatMulNBits."""
    _run("onnx_engine", locals())


@bench_app.command("kv-dtypes")
def kv_dtypes_command(
    model: Annotated[str, typer.Option(help="source model (alias, HF dir, .gguf)")] = "smollm2-135m",
    work_dir: Annotated[Optional[Path], typer.Option(help="where the built artifacts are kept")] = None,
    threads: Annotated[int, typer.Option(help="torch threads")] = 2,
    repeats: Annotated[int, typer.Option(help="timed repeats per figure (median and spread)")] = 3,
    input_len: Annotated[int, typer.Option(help="prompt tokens")] = 128,
    output_len: Annotated[int, typer.Option(help="generated tokens")] = 128,
    num_requests: Annotated[int, typer.Option(help="requests in the offline throughput run")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(help="tokens per engine step (offline)")] = 1024,
    num_samples: Annotated[int, typer.Option(help="KV calibration samples for the fp8 / int4 builds")] = 32,
    kv_cache_mib: Annotated[int, typer.Option(help="KV budget the tokens-held column is for")] = 512,
    int8_activations: Int8Activations = False,
    seed: Annotated[int, typer.Option(help="prompt seed")] = 0,
    json_out: JsonOut = None,
    plot: PlotDir = None,
):
    """One W4A16 model with a bf16, fp8 and int4 KV cache: speed and KV room, same run."""
    _run("kv_dtypes", locals())


@bench_app.command("kernels")
def kernels_command(
    threads: Annotated[int, typer.Option(help="torch threads")] = 2,
    repeats: Annotated[int, typer.Option(help="timed repeats per kernel (median and spread)")] = 15,
    rows: Annotated[str, typer.Option(help="activation rows per call, e.g. 1,16")] = "1,16",
    num_layers: Annotated[int, typer.Option(help="distinct layers in the decode-step figure")] = 30,
    step_rows: Annotated[int, typer.Option(help="rows in the decode-step figure (64: offline)")] = 1,
    json_out: JsonOut = None,
):
    """CPU quantized-GEMM kernels on SmolLM2 shapes: qkiln's native vs torch's tinygemm / int8pack / bf16."""
    from qkiln.bench.throughput import parse_int_list

    with exit_on_error():
        _check_outputs(json_out, None)
        from qkiln.bench.cpu_kernels import run_cpu_kernels

        run_cpu_kernels(json_out, threads, repeats, tuple(parse_int_list(rows, "--rows")), num_layers,
                        step_rows)


@bench_app.command("quality")
def quality_command(
    json_out: Annotated[Path, typer.Option("--json", help="write the JSON report here")] = Path("quant_quality.json"),
    plot: Annotated[Optional[Path], typer.Option(help="write a PNG bar chart here")] = None,
    calib: Annotated[Optional[str], typer.Option(help="calibration source for the main rows (default: the recipe default)")] = None,
    num_samples: Annotated[int, typer.Option(help="calibration samples of 512 tokens")] = 128,
    awq_num_samples: Annotated[Optional[int], typer.Option(help="calibration samples for the AWQ rows")] = None,
    max_tokens: Annotated[int, typer.Option(help="evaluation tokens (wiki.test.raw)")] = 16384,
    only: Annotated[Optional[str], typer.Option(help="comma-separated row names (exact)")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: all cores)")] = None,
    workdir: Annotated[Optional[Path], typer.Option("--workdir", "--work-dir", help="keep the row artifacts here")] = None,
    reuse: Annotated[bool, typer.Option("--reuse", help="keep rows already built in --workdir")] = False,
    data_dir: Annotated[Optional[Path], typer.Option(
        help="folder holding data/wikitext-2-raw, data/wikitext-2, data/janeausten "
             "(default: $QKILN_SHARED_DIR, else ../shared beside the checkout)")] = None,
    llmcompressor_python: Annotated[Optional[Path], typer.Option(
        help="an interpreter with llmcompressor (its own venv, see bench/llmc_reference.py): adds its rows")] = None,
    llmc_workdir: Annotated[Optional[Path], typer.Option(help="where llm-compressor's rows are built")] = None,
):
    """Quantization quality on SmolLM2-135M: one row per recipe (ppl, KL, top-1, time, RSS)."""
    argv = ["--json", str(json_out), "--num-samples", str(num_samples), "--max-tokens", str(max_tokens)]
    argv += (["--calib", calib] if calib else []) + (["--plot", str(plot)] if plot else [])
    argv += (["--only", only] if only else []) + (["--threads", str(threads)] if threads else [])
    argv += (["--awq-num-samples", str(awq_num_samples)] if awq_num_samples else [])
    argv += (["--workdir", str(workdir)] if workdir else []) + (["--reuse"] if reuse else [])
    argv += ["--data-dir", str(data_dir)] if data_dir else []
    argv += ["--llmcompressor-python", str(llmcompressor_python)] if llmcompressor_python else []
    argv += ["--llmc-workdir", str(llmc_workdir)] if llmc_workdir else []
    with exit_on_error():
        _check_outputs(json_out, None)
        importlib.import_module("qkiln.bench.quant_quality").main(argv)


@bench_app.command("build-memory")
def build_memory_command(
    source: Annotated[str, typer.Argument(help="source model: alias (smollm2-135m), HF dir or .gguf")],
    recipe: Annotated[str, typer.Option(help="preset or recipe file, as qkiln build's")] = "w4a16-gptq+kv-int4",
    num_samples: Annotated[Optional[int], typer.Option(help="calibration samples [default: the recipe's]")] = None,
    eval_data: Annotated[Optional[str], typer.Option(help="evaluation data for the accuracy report [default: the recipe's]")] = None,
    engine: Annotated[Optional[str], typer.Option(help="also write and check this engine: onnx")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="do not echo the build's progress")] = False,
    json_out: JsonOut = None,
    plot: PlotDir = None,
):
    """Peak resident memory of `qkiln build` (one run, no layer cache), by step and per parameter;
    --plot draws it over time (build_memory.png)."""
    _run("build_memory", locals())
