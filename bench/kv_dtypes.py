"""`qkiln bench kv-dtypes`: what the KV cache's storage costs in speed and buys in room, in one run.

    qkiln bench kv-dtypes --json kv_dtypes.json --plot bench-plots/

One W4A16 artifact per KV scheme, the same weights: `w4a16-rtn` (the KV cache in the model's bf16),
`w4a16-rtn+kv-fp8` (e4m3, calibrated per-head scales and key offset) and `w4a16-rtn+kv-int4`
(group 16, fp16 scale and minimum per token, head and group), each built once under `--work-dir`
(KV calibration on `--num-samples` samples of the default calibration set) and reused. For each,
on the same token ids: batch-1 decode tokens/s (latency.py's definition) and offline throughput
(`num_requests` x `input_len` in / `output_len` out, continuous batching), the KV bytes a token
takes over all layers and the tokens a `--kv-cache-mib` budget holds. Ratios are to the bf16 cache
of the same run; the engines are loaded up front and the repeats take turns between the three.
What the schemes cost in accuracy: `qkiln bench quality` (quant/kv.py quotes it).
"""

import gc
from pathlib import Path

from .cpu_compare import batch1_engine, ensure_artifact, offline_engine
from .latency import run_latency
from .report import fmt, log, make_report, plot_bars, print_table, summarize, write_report
from .roofline import kv_bytes_per_token
from .throughput import load_model, run_throughput, set_threads
from .workload import check_at_least, load_tokenizer, make_workload

KV_RECIPES = {"bf16": "w4a16-rtn", "fp8": "w4a16-rtn+kv-fp8", "int4": "w4a16-rtn+kv-int4"}


def _engines(artifact: Path, tput_wl, args: dict) -> dict:
    loaded = load_model(str(artifact), "auto", args["int8_activations"])
    offline = offline_engine(loaded, tput_wl, args)
    return {"kv_bytes_per_token": round(kv_bytes_per_token(offline)),  # the cache as allocated
            "batch1": batch1_engine(loaded, args), "offline": offline}


def _merge(single_runs: list[dict]) -> dict:
    """One-repeat summaries (run_latency / run_throughput with 1 repeat) -> one summary per figure."""
    return {key: summarize([run[key]["median"] for run in single_runs])
            for key, value in single_runs[0].items() if isinstance(value, dict) and "median" in value}


def run_kv_dtypes(model: str, work_dir: Path, args: dict) -> dict:
    """Every engine is loaded first and the repeats take turns (bf16, fp8, int4, bf16, ...; the
    batch-1 rounds, then the offline ones), so a drift of the shared host lands on all three rows
    alike instead of on whichever ran last."""
    artifacts = {kv: ensure_artifact(model, None, work_dir, recipe, args["num_samples"])
                 for kv, recipe in KV_RECIPES.items()}
    tokenizer = load_tokenizer(str(artifacts["bf16"]))
    decode_wl = make_workload(tokenizer, 1, args["input_len"], args["output_len"], seed=args["seed"])
    tput_wl = make_workload(tokenizer, args["num_requests"], args["input_len"], args["output_len"],
                            seed=args["seed"] + 1)
    engines = {}
    for kv, path in artifacts.items():
        log(f"[kv {kv}] loading {path}")
        engines[kv] = _engines(path, tput_wl, args)
    runs = {kv: {"batch1": [], "offline": []} for kv in engines}
    for i in range(args["repeats"]):
        for kv, e in engines.items():
            runs[kv]["batch1"].append(run_latency(e["batch1"], decode_wl, 1,
                                                  label=f"kv {kv} batch-1 (round {i + 1}/{args['repeats']})"))
    for i in range(args["repeats"]):
        for kv, e in engines.items():
            runs[kv]["offline"].append(run_throughput(e["offline"], tput_wl, 1, warmup=i == 0,
                                                      label=f"kv {kv} offline (round {i + 1}/{args['repeats']})"))
    rows = {kv: {"artifact": str(artifacts[kv]), "kv_bytes_per_token": e["kv_bytes_per_token"],
                 "tokens_in_budget": args["kv_cache_mib"] * (1 << 20) // e["kv_bytes_per_token"],
                 "batch1_decode": _merge(runs[kv]["batch1"]), "offline_throughput": _merge(runs[kv]["offline"])}
            for kv, e in engines.items()}
    del engines
    gc.collect()
    base = rows["bf16"]
    for row in rows.values():
        row["decode_vs_bf16"] = (row["batch1_decode"]["decode_tokens_per_s"]["median"]
                                 / base["batch1_decode"]["decode_tokens_per_s"]["median"])
        row["offline_vs_bf16"] = (row["offline_throughput"]["output_tokens_per_s"]["median"]
                                  / base["offline_throughput"]["output_tokens_per_s"]["median"])
    return {"kv_dtypes": rows}


def print_kv_dtypes(results: dict, args: dict) -> None:
    rows = [[kv, f"{r['kv_bytes_per_token']:,}", f"{r['tokens_in_budget']:,}",
             f"{fmt(r['batch1_decode']['decode_tokens_per_s'])} ({r['decode_vs_bf16']:.2f}x)",
             f"{fmt(r['offline_throughput']['output_tokens_per_s'])} ({r['offline_vs_bf16']:.2f}x)"]
            for kv, r in results["kv_dtypes"].items()]
    print_table(f"KV cache dtype, W4A16 weights, {args['threads']} threads: batch-1 decode "
                f"({args['input_len']}-token prompt) and offline throughput ({args['num_requests']} x "
                f"{args['input_len']} in / {args['output_len']} out)"
                + (", int8 activations" if args["int8_activations"] else ""),
                ["kv cache", "KV bytes/token", f"tokens in {args['kv_cache_mib']} MiB",
                 "batch-1 decode tok/s", "offline output tok/s"], rows)


def main(model: str = "smollm2-135m", *, work_dir: Path | None = None, threads: int = 2, repeats: int = 3,
         input_len: int = 128, output_len: int = 128, num_requests: int = 64, max_num_batched_tokens: int = 1024,
         num_samples: int = 32, kv_cache_mib: int = 512, int8_activations: bool = False, seed: int = 0,
         json_out: Path | None = None, plot: Path | None = None):
    """Batch-1 decode and offline throughput of one W4A16 model with a bf16, fp8 and int4 KV cache."""
    from qkiln.compile.layer_cache import default_cache_dir

    check_at_least(1, repeats=repeats, input_len=input_len, num_requests=num_requests,
                   num_samples=num_samples, kv_cache_mib=kv_cache_mib)
    check_at_least(2, output_len=output_len)
    args = {"threads": set_threads(threads), "repeats": repeats, "input_len": input_len, "output_len": output_len,
            "num_requests": num_requests, "max_num_batched_tokens": max_num_batched_tokens,
            "num_samples": num_samples, "kv_cache_mib": kv_cache_mib, "int8_activations": int8_activations,
            "seed": seed}
    results = run_kv_dtypes(model, work_dir or default_cache_dir().parent / "bench", args)
    report = make_report("kv-dtypes", {"model": model, **args}, results)
    write_report(json_out, report)
    print_kv_dtypes(results, args)
    if plot:
        rows = results["kv_dtypes"]
        plot_bars(plot / "kv_dtypes_decode.png", {kv: r["batch1_decode"]["decode_tokens_per_s"]
                                                  for kv, r in rows.items()}, "tokens/s", "batch-1 decode by KV dtype")
        plot_bars(plot / "kv_dtypes_throughput.png", {kv: r["offline_throughput"]["output_tokens_per_s"]
                                                      for kv, r in rows.items()}, "output tokens/s",
                  "offline throughput by KV dtype")
    return report
