"""`qkiln bench prefill`: time to first token of one long prompt, qkiln against HF, in one run.

    qkiln bench prefill --prompt-lens 1024,4096 --json prefill.json --plot bench-plots/

Prefill attention costs O(prompt²), so long prompts are where an attention kernel shows. For each
of `--prompt-lens`, one prompt of random token ids (the same ids for every engine): qkiln's time to
its first token (a one-token request on an idle engine, chunked by `--max-num-batched-tokens`;
prefix caching reset between repeats) on a W4A16 artifact, and Hugging Face's one bf16 forward
over the prompt (its prefill; `--no-hf` skips it). Where the AMX prefill attention runs
(plugins/csrc/cpu_attention_prefill_amx.cpp), qkiln is also timed with it off
(`QKILN_AMX_PREFILL=0`: the AVX512 kernels), same process. The repeats take turns between the
engines, so a drift of the shared host lands on all of them alike. Ratios: HF / qkiln and, with
AMX, the AVX512 kernels / AMX.
"""

import gc
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .cpu_compare import ensure_artifact
from .report import fmt, log, make_report, plot_bars, print_table, summarize, write_report
from .throughput import drive, load_model, make_engine, parse_int_list, set_threads
from .workload import BenchConfigError, Workload, check_at_least, make_workload

_AMX_SWITCH = "QKILN_AMX_PREFILL"


@contextmanager
def _amx_prefill(on: bool):
    """The AMX prefill attention on or off for the calls inside (the kernel reads it per call)."""
    before = os.environ.get(_AMX_SWITCH)
    os.environ[_AMX_SWITCH] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_AMX_SWITCH, None)
        else:
            os.environ[_AMX_SWITCH] = before


def _amx_ready() -> bool:
    from qkiln.plugins import cpu_native

    ext = cpu_native.native_extension()
    return ext is not None and ext.amx_prefill_ready()


def _qkiln_ttft(engine, prompt: list[int], amx: bool) -> float:
    engine.kv_manager.reset_prefix_cache()
    with _amx_prefill(amx):
        trace = drive(engine, Workload([prompt], [1]))
    return trace.requests[0].ttft_s


def _hf_prefill(hf_model, prompt: list[int]) -> float:
    """HF generate's first forward: the last position's logits only (logits_to_keep=1), as qkiln's
    TTFT computes them; every position's through the 49152-wide head made HF 9-13% slower."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        hf_model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start


def run_prefill(model: str, artifact: Path, args: dict) -> dict:
    loaded = load_model(str(artifact))
    limit = loaded.model.config.max_position_embeddings
    if max(args["prompt_lens"]) >= limit:
        raise BenchConfigError(f"prompt_lens must stay below the model's {limit} positions, "
                               f"got {max(args['prompt_lens'])}")
    engine = make_engine(loaded, max_num_seqs=1, max_num_batched_tokens=args["max_num_batched_tokens"])
    label = f"qkiln-{loaded.manifest.recipe['name']}" if loaded.manifest is not None else "qkiln"
    sides = {label: True}
    if _amx_ready():
        sides = {f"{label}-amx": True, f"{label}-avx512": False}
    hf_model = None
    if args["hf"]:
        from .baselines import load_hf_model

        log("[hf-bf16] loading transformers model")
        hf_model = load_hf_model(model)
    rows = {}
    for n in args["prompt_lens"]:
        prompt = make_workload(loaded.tokenizer, 1, n, 1, seed=args["seed"]).prompts[0]
        _qkiln_ttft(engine, prompt, True)  # warm-up: the step's buffers at this length
        if hf_model is not None:
            _hf_prefill(hf_model, prompt)  # and HF's, whose first call at a length was 7x its next
        times = {name: [] for name in sides} | ({"hf-bf16": []} if hf_model is not None else {})
        for i in range(args["repeats"]):
            for name, amx in sides.items():
                times[name].append(_qkiln_ttft(engine, prompt, amx))
            if hf_model is not None:
                times["hf-bf16"].append(_hf_prefill(hf_model, prompt))
            log(f"{n}-token prompt, round {i + 1}/{args['repeats']}: "
                + ", ".join(f"{name} {t[-1]:.3f} s" for name, t in times.items()))
        row = {name: {"seconds": summarize(t), "tokens_per_s": summarize([n / x for x in t])}
               for name, t in times.items()}
        first = next(iter(sides))
        if "hf-bf16" in row:
            row["hf_vs_qkiln"] = row["hf-bf16"]["seconds"]["median"] / row[first]["seconds"]["median"]
        if len(sides) == 2:
            row["avx512_vs_amx"] = (row[f"{label}-avx512"]["seconds"]["median"]
                                    / row[f"{label}-amx"]["seconds"]["median"])
        rows[str(n)] = row
    del engine, hf_model
    gc.collect()
    return {"artifact": str(artifact), "amx_prefill": len(sides) == 2, "prompts": rows}


def print_prefill(results: dict, args: dict) -> None:
    first = next(iter(results["prompts"].values()))
    engines = [name for name, value in first.items() if isinstance(value, dict)]  # not the ratios
    table = []
    for n, row in results["prompts"].items():
        table.append([n] + [fmt(row[e]["seconds"], 3) for e in engines]
                     + [f"{row['hf_vs_qkiln']:.2f}x" if "hf_vs_qkiln" in row else "-",
                        f"{row['avx512_vs_amx']:.2f}x" if "avx512_vs_amx" in row else "-"])
    print_table(f"Prefill (time to first token) of one prompt, {args['threads']} threads, seconds",
                ["prompt tokens"] + engines + ["HF / qkiln", "AVX512 / AMX"], table)


def main(model: str = "smollm2-135m", *, artifact: Path | None = None, work_dir: Path | None = None,
         prompt_lens: str = "1024,4096", threads: int = 2, repeats: int = 3, max_num_batched_tokens: int = 1024,
         hf: bool = True, seed: int = 0, json_out: Path | None = None, plot: Path | None = None):
    """Time to first token of one prompt per length: qkiln (AMX prefill attention on / off) and HF."""
    from qkiln.compile.layer_cache import default_cache_dir

    lens = parse_int_list(prompt_lens, "--prompt-lens")
    check_at_least(1, repeats=repeats, max_num_batched_tokens=max_num_batched_tokens, prompt_len=min(lens))
    args = {"threads": set_threads(threads), "repeats": repeats, "prompt_lens": lens,
            "max_num_batched_tokens": max_num_batched_tokens, "hf": hf, "seed": seed}
    built = ensure_artifact(model, artifact, work_dir or default_cache_dir().parent / "bench")
    results = run_prefill(model, built, args)
    report = make_report("prefill", {"model": model, **args}, results)
    write_report(json_out, report)
    print_prefill(results, args)
    if plot:
        for n, row in results["prompts"].items():
            plot_bars(plot / f"prefill_{n}.png", {e: s["seconds"] for e, s in row.items() if isinstance(s, dict)},
                      "seconds to first token", f"prefill of one {n}-token prompt")
    return report
