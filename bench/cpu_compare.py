"""`qkiln bench cpu-compare`: the plugins issue's CPU comparison table on SmolLM2-135M, in one command.

    qkiln bench cpu-compare --json cpu_compare.json --plot bench-plots/

Measures, in one process and on the same token ids (random ids, `ignore_eos`, greedy):
- batch-1 decode tokens/s (`input_len` prompt, `output_len` tokens; latency.py's definition) for
  Hugging Face `generate` in bf16, qkiln on a W4A16 artifact (also with its native decode stack
  off: `qkiln-w4a16-python-layers`; and with `--int8-activations`, many-row steps computing with
  int8 activations per 32 channels: `qkiln-w4a16-int8act`, reported as such, not exact) and qkiln
  on the bf16 source, plus llama.cpp (same GGUF) and ONNX Runtime GenAI (`--ort-model`, a folder
  `qkiln bench ort-model` builds) when installed;
- offline throughput, `num_requests` x `input_len` in / `output_len` out: qkiln (all requests at
  once, continuous batching) against HF static batching at each of `--hf-batch-sizes`, of which
  the best median is the baseline, and ONNX Runtime GenAI static batching at the same sizes;
- memory bandwidth (a large copy) and each batch-1 decode as % of its weights-plus-KV roofline;
- the ratios the issue sets targets for: W4A16 decode >= 8x HF, W4A16 throughput >= 4x best HF.
  HF's and qkiln W4A16's batch-1 repeats run in turn (HF, qkiln, HF, ...), so that the decode
  ratio compares the two under the same host load; each round's ratio is printed too.

The W4A16 artifact is `--artifact`, or built once with the `w4a16-rtn` preset (no calibration;
int8 lm_head) under `--work-dir` and reused while its manifest's source hash and scheme still match.
Every figure is a median over `--repeats` with min/max; progress goes to stderr, the table to
stdout. Takes ~13 minutes on 2 threads (the HF static-batch sweep dominates), ~17 with ORT GenAI's
static batches and llama.cpp; measure on a quiet machine.
"""

import gc
import os
import sys
from pathlib import Path

import torch

from qkiln.plugins import cpu_native
from qkiln.runtime.source import resolve_source

from .baselines import hf_latency, hf_throughput, llama_cpp_latency, load_hf_model
from .ort_genai import ort_genai_latency, ort_genai_throughput
from .latency import engine_roofline, run_latency
from .report import fmt, log, make_report, plot_bars, print_table, summarize, write_report
from .roofline import decode_roofline, measure_bandwidth, percent_of_roofline, weight_bytes
from .throughput import load_model, make_engine, parse_int_list, run_throughput, set_threads
from .workload import check_at_least, load_tokenizer, make_workload

W4A16_RECIPE = "w4a16-rtn"
TARGETS = {"decode_w4a16_vs_hf": 8.0, "throughput_w4a16_vs_best_hf": 4.0}
_NOT_RUN = {"skipped": "not requested"}


def ensure_artifact(model: str, artifact: Path | None, work_dir: Path, recipe: str = W4A16_RECIPE,
                    num_samples: int | None = None) -> Path:
    """`artifact` if given; else a cached build of `model` with preset `recipe` (calibrating on
    `num_samples` samples where it calibrates), rebuilt when its source, scheme or calibration changed."""
    from qkiln.compile.artifact import is_artifact_dir, read_manifest
    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset
    from qkiln.runtime.source import file_sha256, source_files

    source = resolve_source(model)
    files = source_files(source)
    if artifact is not None:
        # Its rows are compared with Hugging Face's on `model`: say so when they are other weights.
        built_from = read_manifest(artifact).source
        if built_from.get("sha256") != file_sha256(files):
            log(f"warning: {artifact} was built from {built_from.get('name', 'another model')}, not from the "
                f"files of --model {model}: the baseline rows measure another model")
        return artifact
    out = work_dir / f"{source.stem}-{recipe}"
    built = preset(recipe)
    if num_samples is not None:
        built = built.with_overrides(calibration={"num_samples": num_samples})
    if is_artifact_dir(out):
        m = read_manifest(out)
        wanted = built.to_dict()  # the calibration too: a --num-samples 4 run reused a 1-sample build
        if m.source.get("sha256") == file_sha256(files) and \
                all(m.recipe.get(key) == wanted.get(key) for key in ("scheme", "calibration")):
            log(f"reusing artifact {out}")
            return out
    log(f"building {out} ({recipe})")
    build(str(source), built, out, overwrite=True, progress=False, log=log)
    return out


def batch1_engine(loaded, args: dict):
    """The batch-1 decode engine the CPU benchmarks measure: one sequence, its prompt in one step."""
    return make_engine(loaded, max_num_seqs=1, max_num_batched_tokens=max(1024, args["input_len"]))


def offline_engine(loaded, tput_wl, args: dict):
    """Every request of the offline workload at once (continuous batching)."""
    return make_engine(loaded, max_num_seqs=tput_wl.num_requests,
                       max_num_batched_tokens=args["max_num_batched_tokens"])


def _batch1_latency(name: str, loaded, decode_wl, bandwidth: float, args: dict) -> dict:
    """Batch-1 decode of a loaded qkiln model, with its roofline."""
    engine = batch1_engine(loaded, args)
    lat = run_latency(engine, decode_wl, args["repeats"], label=f"{name} batch-1")
    lat["roofline"] = engine_roofline(engine, bandwidth, 1, args["input_len"], args["output_len"],
                                      lat["decode_tokens_per_s"]["median"])
    del engine
    gc.collect()
    return lat


def _qkiln_rows(name: str, model: str, decode_wl, tput_wl, bandwidth: float, args: dict,
                int8_activations: bool = False) -> tuple[dict, dict]:
    """Batch-1 latency (with roofline) and offline throughput of one qkiln model."""
    log(f"[{name}] loading {model}")
    loaded = load_model(model, "auto", int8_activations)
    lat = _batch1_latency(name, loaded, decode_wl, bandwidth, args)
    return lat, _offline(name, loaded, tput_wl, args)


def _offline(name: str, loaded, tput_wl, args: dict) -> dict:
    """Offline throughput of a loaded qkiln model (the caller drops the model after)."""
    engine = offline_engine(loaded, tput_wl, args)
    tput = run_throughput(engine, tput_wl, args["repeats"], label=f"{name} offline")
    del engine
    gc.collect()
    return tput


def _batch1_in_turn(hf, loaded, decode_wl, bandwidth: float, args: dict) -> tuple[dict, dict]:
    """HF's and qkiln W4A16's batch-1 decode, one repeat of each in turn (HF, qkiln, HF, ...).

    Why: measured one after the other, minutes apart, the ratio took whatever the host's load did
    in between (session 47, the same artifact: 153 tok/s in a cpu-compare run 15 minutes after HF's
    batch-1, 206-221 in `bench latency` runs within the hour). In turn, a drift weighs on both alike;
    `paired_ratios` holds each round's qkiln / HF."""
    engine = batch1_engine(loaded, args)
    rounds = args["repeats"]
    hf_runs, qkiln_runs = [], []
    for i in range(rounds):
        hf_runs.append(hf_latency(hf, decode_wl, 1, label=f"hf-bf16 batch-1 round {i + 1}/{rounds}"))
        qkiln_runs.append(run_latency(engine, decode_wl, 1, label=f"qkiln-w4a16 batch-1 round {i + 1}/{rounds}"))
    hf_lat, qkiln_lat = _merge_rounds(hf_runs), _merge_rounds(qkiln_runs)
    hf_lat["roofline"] = _hf_roofline(hf, bandwidth, args, hf_lat["decode_tokens_per_s"]["median"])
    qkiln_lat["roofline"] = engine_roofline(engine, bandwidth, 1, args["input_len"], args["output_len"],
                                            qkiln_lat["decode_tokens_per_s"]["median"])
    qkiln_lat["paired_ratios"] = [q["decode_tokens_per_s"]["median"] / h["decode_tokens_per_s"]["median"]
                                  for q, h in zip(qkiln_runs, hf_runs)]
    del engine
    gc.collect()
    return hf_lat, qkiln_lat


def _merge_rounds(rounds: list[dict]) -> dict:
    """One-repeat summaries ({figure: summarize([x])}) -> one summary over all the rounds."""
    return {key: summarize([r[key]["median"] for r in rounds]) for key in rounds[0]}


def _python_layers_latency(artifact: str, decode_wl, bandwidth: float, args: dict) -> dict:
    """Batch-1 decode of the same artifact with the native decode stack off (the Python layer
    loop, QKILN_DECODE_STACK=0, read when an engine is built): the stack's own gain, same run."""
    previous = os.environ.get("QKILN_DECODE_STACK")
    os.environ["QKILN_DECODE_STACK"] = "0"
    try:
        return _batch1_latency("qkiln-w4a16 python layers", load_model(artifact, "auto"), decode_wl,
                               bandwidth, args)
    finally:
        if previous is None:
            del os.environ["QKILN_DECODE_STACK"]
        else:
            os.environ["QKILN_DECODE_STACK"] = previous


def _hf_roofline(hf, bandwidth: float, args: dict, decode_tokens_per_s: float) -> dict:
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Qwen3 sets its own
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2  # K and V, bf16
    roof = decode_roofline(bandwidth, weight_bytes(hf), kv_per_token, 1, args["input_len"] + args["output_len"] / 2)
    roof["percent_of_roofline"] = percent_of_roofline(decode_tokens_per_s, roof)
    return roof


def _best_static_batch(by_batch: dict) -> dict:
    """The static batch size with the best median output tokens/s, with every size's figures."""
    measured = {b: r for b, r in by_batch.items() if "skipped" not in r}
    if not measured:
        return next(iter(by_batch.values()))
    best = max(measured, key=lambda b: measured[b]["output_tokens_per_s"]["median"])
    return {**measured[best], "best_batch_size": best, "by_batch_size": by_batch}


def _ort_rows(decode_wl, tput_wl, args: dict) -> tuple[dict, dict]:
    log("[ort-genai] batch-1 decode")
    lat = ort_genai_latency(args["ort_model"], decode_wl, args["repeats"])
    if "skipped" in lat:
        return lat, lat
    log("[ort-genai] offline, static batches")
    return lat, _best_static_batch({b: ort_genai_throughput(args["ort_model"], tput_wl, b, args["repeats"])
                                    for b in args["hf_batch_sizes"]})


def _ratio(a: dict, b: dict, key: str) -> float | None:
    if "skipped" in a or "skipped" in b:
        return None
    return a[key]["median"] / b[key]["median"]


def run_cpu_compare(model: str, artifact: Path | None, work_dir: Path, args: dict) -> dict:
    """Every measurement of the table; `args` holds the sizes and options (see `main`)."""
    artifact = ensure_artifact(model, artifact, work_dir)
    log("measuring memory bandwidth")
    bandwidth = measure_bandwidth()
    bw = bandwidth["bytes_per_s"]["median"]
    tokenizer = load_tokenizer(str(artifact))
    decode_wl = make_workload(tokenizer, 1, args["input_len"], args["output_len"], seed=args["seed"])
    tput_wl = make_workload(tokenizer, args["num_requests"], args["input_len"], args["output_len"],
                            seed=args["seed"] + 1)
    decode, offline = {}, {}
    log("[hf-bf16] loading transformers model")
    hf = load_hf_model(model, torch.bfloat16)
    log(f"[qkiln-w4a16] loading {artifact}")
    w4a16 = load_model(str(artifact), "auto")
    decode["hf-bf16"], decode["qkiln-w4a16"] = _batch1_in_turn(hf, w4a16, decode_wl, bw, args)
    by_batch = {b: hf_throughput(hf, tput_wl, b, args["repeats"], label="hf-bf16") for b in args["hf_batch_sizes"]}
    offline["hf-bf16"] = _best_static_batch(by_batch)
    del hf
    gc.collect()
    offline["qkiln-w4a16"] = _offline("qkiln-w4a16", w4a16, tput_wl, args)
    del w4a16
    # without qkiln's native kernels (switched off, or no compiler) there is no decode stack to turn
    # off, and int8 activations are refused: those rows are skipped with the reason, as a missing
    # comparator is (the int8 refusal had ended the run after every other row, with no report)
    no_stack = None if cpu_native.native_ops() is not None else \
        {"skipped": "no native decode stack here (qkiln's native CPU ops switched off or not built)"}
    no_int8 = None if cpu_native.native_extension() is not None else \
        {"skipped": "int8 activations need qkiln's native CPU kernels (QKILN_NATIVE_CPU=0, or they did not build)"}
    decode["qkiln-w4a16-python-layers"] = no_stack or _python_layers_latency(str(artifact), decode_wl, bw, args)
    if args["include_int8_activations"] and no_int8:
        decode["qkiln-w4a16-int8act"] = offline["qkiln-w4a16-int8act"] = no_int8
    elif args["include_int8_activations"]:  # the same artifact, many-row steps with int8 activations
        decode["qkiln-w4a16-int8act"], offline["qkiln-w4a16-int8act"] = _qkiln_rows(
            "qkiln-w4a16-int8act", str(artifact), decode_wl, tput_wl, bw, args, int8_activations=True)
    if args["include_bf16"]:
        decode["qkiln-bf16"], offline["qkiln-bf16"] = _qkiln_rows("qkiln-bf16", model, decode_wl, tput_wl, bw, args)
    log("[llama.cpp] batch-1 decode")
    decode["llama.cpp"] = llama_cpp_latency(resolve_source(model), decode_wl, args["threads"], args["repeats"])
    decode["ort-genai-int4"], offline["ort-genai-int4"] = _ort_rows(decode_wl, tput_wl, args)
    ratios = {"decode_w4a16_vs_hf": _ratio(decode["qkiln-w4a16"], decode["hf-bf16"], "decode_tokens_per_s"),
              "throughput_w4a16_vs_best_hf": _ratio(offline["qkiln-w4a16"], offline["hf-bf16"],
                                                    "output_tokens_per_s"),
              "throughput_w4a16_int8act_vs_best_hf": _ratio(offline.get("qkiln-w4a16-int8act", _NOT_RUN),
                                                            offline["hf-bf16"], "output_tokens_per_s"),
              "decode_stack_vs_python_layers": _ratio(decode["qkiln-w4a16"], decode["qkiln-w4a16-python-layers"],
                                                      "decode_tokens_per_s"),
              "decode_w4a16_vs_llama_cpp": _ratio(decode["qkiln-w4a16"], decode["llama.cpp"], "decode_tokens_per_s"),
              "decode_w4a16_vs_ort_genai": _ratio(decode["qkiln-w4a16"], decode["ort-genai-int4"],
                                                  "decode_tokens_per_s"),
              "throughput_w4a16_vs_ort_genai": _ratio(offline["qkiln-w4a16"], offline["ort-genai-int4"],
                                                      "output_tokens_per_s"),
              "throughput_w4a16_int8act_vs_ort_genai": _ratio(offline.get("qkiln-w4a16-int8act", _NOT_RUN),
                                                              offline["ort-genai-int4"], "output_tokens_per_s")}
    results = {"artifact": str(artifact), "bandwidth": bandwidth, "batch1_decode": decode,
               "offline_throughput": offline, "ratios": ratios, "targets": TARGETS}
    return results | {"caveats": caveats(results, args["repeats"])}


def caveats(results: dict, repeats: int) -> list[str]:
    """What makes this run's figures unfit to compare (printed under the table, kept in the JSON)."""
    notes = []
    if repeats < 3:
        notes.append(f"{repeats} repeat(s): each figure is a single run or two, not a median, and a 'met' "
                     "verdict means little; compare runs of --repeats 3 or more on a quiet host")
    above = [name for name, row in results["batch1_decode"].items()
             if row.get("roofline", {}).get("percent_of_roofline", 0) > 100]
    if above:
        bw = results["bandwidth"]["bytes_per_s"]
        notes.append(f"{', '.join(above)} above 100% of the roofline: the copy bandwidth ({bw['median'] / 1e9:.1f} "
                     f"GB/s, {bw['min'] / 1e9:.1f}-{bw['max'] / 1e9:.1f}) was measured low, likely on a busy host; "
                     "the % column is not meaningful this run")
    return notes


def print_comparison(results: dict, args: dict) -> None:
    rows, skipped = [], []
    for name, lat in results["batch1_decode"].items():
        tput = results["offline_throughput"].get(name)
        if tput is not None and "skipped" in tput:
            if "skipped" not in lat:
                skipped.append(f"{name} offline: skipped, {tput['skipped']}")
            tput = None
        if "skipped" in lat:
            skipped.append(f"{name}: skipped, {lat['skipped']}")
            continue
        roof = lat.get("roofline")
        batch = f" (batch {tput['best_batch_size']})" if tput and "best_batch_size" in tput else ""
        rows.append([name, fmt(lat["decode_tokens_per_s"]), f"{roof['percent_of_roofline']:.1f}%" if roof else "-",
                     fmt(lat["prefill_s"], scale=1000.0), fmt(tput["output_tokens_per_s"]) + batch if tput else "-"])
    print_table(f"CPU comparison, {args['threads']} threads: batch-1 decode ({args['input_len']}-token prompt, "
                f"{args['output_len']} tokens) and offline throughput ({args['num_requests']} x {args['input_len']} "
                f"in / {args['output_len']} out)",
                ["engine", "batch-1 decode tok/s", "% roofline", "prefill ms", "offline output tok/s"], rows)
    for line in skipped:
        print(line)
    bw = results["bandwidth"]["bytes_per_s"]
    print(f"memory bandwidth (copy): {fmt(bw, 2, scale=1e-9)} GB/s")
    for key, value in results["ratios"].items():
        target = results["targets"].get(key)
        verdict = "" if target is None or value is None else (" (target >= %gx: %s)" % (
            target, "met" if value >= target else "NOT met"))
        print(f"{key}: {'-' if value is None else f'{value:.2f}x'}{verdict}")
    rounds = results["batch1_decode"]["qkiln-w4a16"].get("paired_ratios")
    if rounds:
        print(f"decode_w4a16_vs_hf by round (measured in turn): {', '.join(f'{r:.2f}x' for r in rounds)}")
    for note in results.get("caveats", []):
        print(f"note: {note}")
    sys.stdout.flush()


def _plots(results: dict, directory: Path) -> None:
    decode = {n: r["decode_tokens_per_s"] for n, r in results["batch1_decode"].items() if "skipped" not in r}
    plot_bars(directory / "cpu_compare_decode.png", decode, "tokens/s", "batch-1 decode")
    offline = {n: r["output_tokens_per_s"] for n, r in results["offline_throughput"].items() if "skipped" not in r}
    plot_bars(directory / "cpu_compare_throughput.png", offline, "output tokens/s", "offline throughput")


def main(model: str = "smollm2-135m", *,
         artifact: Path | None = None, work_dir: Path | None = None, threads: int = 2, repeats: int = 3,
         input_len: int = 128, output_len: int = 128, num_requests: int = 64, hf_batch_sizes: str = "16,32,64",
         max_num_batched_tokens: int = 1024, bf16: bool = True, int8_activations: bool = True,
         ort_model: Path | None = None, seed: int = 0,
         json_out: Path | None = None, plot: Path | None = None):
    """Reproduce the CPU comparison table (HF generate vs qkiln W4A16 / bf16, optional llama.cpp, ORT GenAI)."""
    from qkiln.compile.layer_cache import default_cache_dir

    check_at_least(1, repeats=repeats, input_len=input_len, num_requests=num_requests)
    check_at_least(2, output_len=output_len)
    args = {"threads": set_threads(threads), "repeats": repeats, "input_len": input_len, "output_len": output_len,
            "num_requests": num_requests, "hf_batch_sizes": parse_int_list(hf_batch_sizes, "--hf-batch-sizes"),
            "max_num_batched_tokens": max_num_batched_tokens, "include_bf16": bf16,
            "include_int8_activations": int8_activations, "ort_model": ort_model,
            "seed": seed}
    results = run_cpu_compare(model, artifact, work_dir or default_cache_dir().parent / "bench", args)
    report = make_report("cpu-compare", {"model": model, **args}, results)
    write_report(json_out, report)
    print_comparison(results, args)
    if plot:
        _plots(results, plot)
    return report
