"""`qkiln bench throughput`: offline throughput, every request submitted at once (vLLM's
benchmark_throughput setting), driven through the public engine API (`add_request` / `step`).

Owns `drive` (one timed pass of a workload through an `LLMEngine`, recording when each request
got its first token and finished; the other in-process benchmarks reuse it), `make_engine` and
`run_throughput`. Reports requests/s, input, output and total tokens/s, elapsed time, engine
steps, prefix-cache hit rate and peak memory; each a median over repeats with its spread.

Invariants: the timed region is add_request .. last step (admission, prefill, decode,
sampling and detokenization all count, as in vLLM); one untimed warmup pass runs first; the
prefix cache is reset between repeats, so every repeat sees the same cold cache (hits inside a
repeat, from `--shared-prefix-len`, are what the hit rate reports). Outputs have exact lengths
(`ignore_eos`), and throughput counts the tokens actually produced.
"""

import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qkiln.runtime.engine import LLMEngine
from qkiln.runtime.loader import ServingModel, load_for_serving
from qkiln.runtime.sampling_params import SamplingParams

from .report import (fmt, log, make_report, peak_rss_bytes, plot_throughput_vs_concurrency, print_table,
                     reset_peak_rss)
from .report import summarize_runs, write_report
from .workload import BenchConfigError, Workload, check_at_least, make_workload


@dataclass
class RequestTiming:
    num_prompt_tokens: int
    num_output_tokens: int = 0
    ttft_s: float | None = None  # from the start of the pass (all requests arrive then)
    e2e_s: float | None = None


@dataclass
class RunTrace:
    elapsed_s: float
    num_steps: int
    requests: list[RequestTiming]
    step_end_s: list[float] = field(default_factory=list)  # since the start, one per engine step


def set_threads(num_threads: int | None) -> int:
    """Intra-op threads for the measurement (default: the cores this process may use)."""
    if num_threads is not None and num_threads < 1:
        raise BenchConfigError(f"--threads must be >= 1 (leave it out for every core), got {num_threads}")
    n = num_threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(n)
    return n


def parse_int_list(spec: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in str(spec).replace(" ", "").split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise BenchConfigError(f"{what} must be positive integers separated by commas (e.g. 1,8,64), got {spec!r}")
    return values


def load_model(model: str, dtype: str = "auto", int8_activations: bool = False) -> ServingModel:
    """`model` may be an artifact archive, as every other command takes it: unpacked and verified
    into a folder that is gone once the model is in memory."""
    from qkiln.compile.artifact_cli import unpacked

    with unpacked(model) as path:
        return load_for_serving(path, dtype=dtype, int8_activations=int8_activations)


def make_engine(loaded: ServingModel, **engine_kwargs) -> LLMEngine:
    """An engine over an already loaded model (what `LLM.__init__` does, without reloading)."""
    return loaded.engine(**engine_kwargs)


def check_fits(engine: LLMEngine, workload: Workload) -> None:
    """Every request's prompt and output fit what the engine lets a request reach: else it would be
    stopped at the context and the table would name lengths that did not run."""
    too_long = [(len(p), n) for p, n in zip(workload.prompts, workload.output_lens) if len(p) + n > engine.max_request_len]
    if too_long:
        raise BenchConfigError(f"a request of {too_long[0][0]} prompt + {too_long[0][1]} output tokens does not fit "
                               f"the {engine.max_request_len} tokens a request can reach here (the model's context, "
                               "or the KV pool); lower the input / output lengths")


def drive(engine: LLMEngine, workload: Workload, sampling: dict | None = None) -> RunTrace:
    """Submit every request, step until all finish; time each request's first token and end.
    sampling: SamplingParams options besides the lengths (greedy when None)."""
    check_fits(engine, workload)
    timings = {}
    start = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True,
                                                        **({"temperature": 0.0} | (sampling or {}))))
        timings[rid] = RequestTiming(len(prompt))
    step_end = []
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - start
        step_end.append(now)
        for out in outputs:
            t = timings[out.request_id]
            t.ttft_s = now if t.ttft_s is None else t.ttft_s
            if out.finished:
                t.e2e_s, t.num_output_tokens = now, len(out.token_ids)
    elapsed = time.perf_counter() - start
    return RunTrace(elapsed, len(step_end), list(timings.values()), step_end)


def trace_figures(trace: RunTrace) -> dict:
    num_in = sum(r.num_prompt_tokens for r in trace.requests)
    num_out = sum(r.num_output_tokens for r in trace.requests)
    t = trace.elapsed_s
    ttfts = [r.ttft_s for r in trace.requests if r.ttft_s is not None]
    return {"elapsed_s": t, "num_steps": trace.num_steps, "requests_per_s": len(trace.requests) / t,
            "input_tokens_per_s": num_in / t, "output_tokens_per_s": num_out / t,
            "total_tokens_per_s": (num_in + num_out) / t, "num_output_tokens": num_out,
            "mean_ttft_s": sum(ttfts) / max(1, len(ttfts))}


_FIGURES = ("elapsed_s", "num_steps", "requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
            "total_tokens_per_s", "num_output_tokens", "mean_ttft_s", "prefix_cache_hit_rate")


def run_throughput(engine: LLMEngine, workload: Workload, num_repeats: int = 3, sampling: dict | None = None,
                   warmup: bool = True, label: str = "qkiln") -> dict:
    """`num_repeats` timed passes of `workload` -> summaries of every figure, plus peak memory."""
    check_fits(engine, workload)  # the workload's lengths named, not the warm-up's shorter outputs
    reset_peak_rss()  # this row's peak, not the process's so far
    if warmup:
        head = Workload(workload.prompts[:2], [min(4, n) for n in workload.output_lens[:2]])
        drive(engine, head, sampling)
    runs = []
    for i in range(num_repeats):
        kv = engine.kv_manager
        kv.reset_prefix_cache()
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        trace = drive(engine, workload, sampling)
        figures = trace_figures(trace)
        dq = kv.prefix_cache_queries - queries
        figures["prefix_cache_hit_rate"] = (kv.prefix_cache_hits - hits) / dq if dq else 0.0
        runs.append(figures)
        log(f"{label}: repeat {i + 1}/{num_repeats}: {figures['output_tokens_per_s']:.1f} output tok/s, "
            f"{figures['elapsed_s']:.2f} s")
    result = summarize_runs(runs, _FIGURES)
    result["peak_rss_bytes"] = peak_rss_bytes()
    if torch.cuda.is_available():
        result["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return result


def main(model: str, *,
         num_requests: int = 64, input_len: str = "128", output_len: str = "128", prompts_jsonl: Path | None = None,
         shared_prefix_len: int = 0, max_num_seqs: str = "64", max_num_batched_tokens: int = 1024,
         num_kv_blocks: int | None = None, kv_dtype: str | None = None, prefix_caching: bool = True,
         dtype: str = "auto", int8_activations: bool = False, repeats: int = 3, temperature: float = 0.0,
         top_p: float = 1.0, top_k: int = -1, threads: int | None = None, seed: int = 0,
         json_out: Path | None = None, plot: Path | None = None):
    """Offline throughput: N requests at once through the engine; requests/s and tokens/s."""
    check_at_least(1, repeats=repeats, max_num_batched_tokens=max_num_batched_tokens)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    SamplingParams(**sampling)  # a bad value is refused before the model loads
    if num_kv_blocks is not None:
        check_at_least(1, num_kv_blocks=num_kv_blocks)
    num_threads = set_threads(threads)
    seq_limits = parse_int_list(max_num_seqs, "--max-num-seqs")
    log(f"loading {model}")
    loaded = load_model(model, dtype, int8_activations)
    workload = make_workload(loaded.tokenizer, num_requests, input_len, output_len, prompts_jsonl=prompts_jsonl,
                             shared_prefix_len=shared_prefix_len, seed=seed,
                             model_vocab_size=loaded.model.config.vocab_size)
    runs = []
    for limit in seq_limits:
        engine = make_engine(loaded, max_num_seqs=limit, max_num_batched_tokens=max_num_batched_tokens,
                             num_kv_blocks=num_kv_blocks, kv_dtype=kv_dtype, enable_prefix_caching=prefix_caching)
        result = run_throughput(engine, workload, repeats, sampling, label=f"max_num_seqs={limit}")
        runs.append({"max_num_seqs": limit, "kv_dtype": engine.kv_dtype, **result})  # kv_dtype: what ran
        del engine
        gc.collect()
    config = {"model": model, "dtype": dtype, "int8_activations": int8_activations, "threads": num_threads,
              "repeats": repeats, "sampling": sampling,
              "workload": workload.description, "max_num_batched_tokens": max_num_batched_tokens,
              "num_kv_blocks": num_kv_blocks, "kv_dtype": kv_dtype, "enable_prefix_caching": prefix_caching}
    report = make_report("throughput", config, {"runs": runs})
    write_report(json_out, report)
    rows = [[r["max_num_seqs"], fmt(r["requests_per_s"], 2), fmt(r["output_tokens_per_s"]),
             fmt(r["total_tokens_per_s"]), fmt(r["elapsed_s"], 2), fmt(r["prefix_cache_hit_rate"], 2)] for r in runs]
    print_table(f"offline throughput: {model}, {num_requests} requests, {workload.lengths_label}",
                ["max_num_seqs", "req/s", "output tok/s", "total tok/s", "elapsed s", "prefix hit"], rows)
    if plot:
        series = {"qkiln output tok/s": [(r["max_num_seqs"], r["output_tokens_per_s"]) for r in runs]}
        plot_throughput_vs_concurrency(plot / "throughput_vs_concurrency.png", series, "output tokens/s",
                                       "max_num_seqs (sequences the engine runs at once)")
    return report

