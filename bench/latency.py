"""`qkiln bench latency`: prefill time and decode tokens/s at a fixed batch (batch 1 by default).

Owns `run_latency` and `latency_figures`. One pass submits `batch_size` prompts of `input_len`
tokens at once and generates exactly `output_len` tokens each (`ignore_eos`), through the same
`drive` loop as the throughput benchmark:

    prefill_s            = time until every sequence of the batch has its first token (TTFT)
    decode_tokens_per_s  = batch_size * (output_len - 1) / (end - prefill_s)
    decode_step_ms       = median gap between engine steps after the prefill

With `--roofline`, the memory bandwidth is measured in the same run (roofline.py) and the decode
rate is reported as a percentage of weights-plus-live-KV bytes per step. Each figure is a median
over repeats with its spread; the prefix cache is reset between repeats.
"""

import bisect
import gc
from pathlib import Path

from .report import fmt, log, make_report, plot_throughput_vs_concurrency, print_table, summarize_runs
from .report import write_report
from .roofline import decode_roofline, kv_bytes_per_token, measure_bandwidth, percent_of_roofline, weight_bytes
from .throughput import RunTrace, check_fits, drive, load_model, make_engine, parse_int_list, set_threads
from .workload import BenchConfigError, Workload, check_at_least, make_workload

_FIGURES = ("prefill_s", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_ms", "e2e_s")


def latency_figures(trace: RunTrace) -> dict:
    reqs = trace.requests
    prefill_s = max(r.ttft_s for r in reqs)
    end_s = max(r.e2e_s for r in reqs)
    # Tokens made after the whole batch had its first token, one per step a request ran in: a batch
    # whose prompts take several steps decodes its first sequences during the others' prefill, and
    # counting those tokens over the time after it gave 10-33% too many tokens/s.
    after = bisect.bisect_right(trace.step_end_s, prefill_s)
    num_decoded = sum(bisect.bisect_right(trace.step_end_s, r.e2e_s) - after for r in reqs)
    decode_steps = [b - a for a, b in zip(trace.step_end_s, trace.step_end_s[1:]) if a >= prefill_s]
    decode_steps.sort()
    return {"prefill_s": prefill_s, "prefill_tokens_per_s": sum(r.num_prompt_tokens for r in reqs) / prefill_s,
            "decode_tokens_per_s": num_decoded / (end_s - prefill_s) if end_s > prefill_s else 0.0,
            "decode_step_ms": 1000.0 * decode_steps[len(decode_steps) // 2] if decode_steps else 0.0,
            "e2e_s": end_s}


def run_latency(engine, workload: Workload, num_repeats: int = 3, label: str = "qkiln") -> dict:
    """`num_repeats` timed passes of one batch -> summaries of the prefill and decode figures."""
    if min(workload.output_lens) < 2:
        raise BenchConfigError("latency needs output_len >= 2 (one prefill token, then decode)")
    check_fits(engine, workload)  # before the warmup, whose outputs are shorter
    drive(engine, Workload(workload.prompts, [2] * workload.num_requests))  # warmup, untimed
    runs = []
    for i in range(num_repeats):
        engine.kv_manager.reset_prefix_cache()
        figures = latency_figures(drive(engine, workload))
        runs.append(figures)
        log(f"{label}: repeat {i + 1}/{num_repeats}: prefill {1000 * figures['prefill_s']:.1f} ms, "
            f"decode {figures['decode_tokens_per_s']:.1f} tok/s")
    return summarize_runs(runs, _FIGURES)


def engine_roofline(engine, bandwidth_bytes_per_s: float, batch_size: int, input_len: int, output_len: int,
                    measured_tokens_per_s: float) -> dict:
    """Decode roofline for this engine's weights and KV dtype at the mean context of the decode."""
    roof = decode_roofline(bandwidth_bytes_per_s, weight_bytes(engine.model, batch_size), kv_bytes_per_token(engine),
                           batch_size, input_len + output_len / 2)
    roof["percent_of_roofline"] = percent_of_roofline(measured_tokens_per_s, roof)
    return roof


def main(model: str, *,
         input_len: int = 128, output_len: int = 128, batch_size: str = "1", dtype: str = "auto",
         kv_dtype: str | None = None, max_num_batched_tokens: int = 1024, roofline: bool = True, repeats: int = 3,
         threads: int | None = None, seed: int = 0, json_out: Path | None = None, plot: Path | None = None):
    """Prefill time and decode tokens/s for given lengths (batch 1 unless --batch-size)."""
    check_at_least(1, repeats=repeats, input_len=input_len, max_num_batched_tokens=max_num_batched_tokens)
    check_at_least(2, output_len=output_len)
    num_threads = set_threads(threads)
    sizes = parse_int_list(batch_size, "--batch-size")
    log(f"loading {model}")
    loaded = load_model(model, dtype)
    bandwidth = measure_bandwidth() if roofline else None
    runs = []
    for b in sizes:
        workload = make_workload(loaded.tokenizer, b, input_len, output_len, seed=seed,
                                 model_vocab_size=loaded.model.config.vocab_size)
        engine = make_engine(loaded, max_num_seqs=b, max_num_batched_tokens=max(max_num_batched_tokens, input_len),
                             kv_dtype=kv_dtype)
        result = {"batch_size": b, "kv_dtype": engine.kv_dtype,  # what ran: an artifact's KV scheme, say
                  "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                  **run_latency(engine, workload, repeats, label=f"batch {b}")}
        if bandwidth:
            result["roofline"] = engine_roofline(engine, bandwidth["bytes_per_s"]["median"], b, input_len,
                                                 output_len, result["decode_tokens_per_s"]["median"])
        runs.append(result)
        del engine
        gc.collect()
    config = {"model": model, "dtype": dtype, "kv_dtype": kv_dtype, "threads": num_threads, "repeats": repeats,
              "input_len": input_len, "output_len": output_len, "seed": seed, "batch_sizes": sizes,
              "max_num_batched_tokens": max_num_batched_tokens, "roofline": roofline}
    report = make_report("latency", config, {"bandwidth": bandwidth, "runs": runs})
    write_report(json_out, report)
    rows = [[r["batch_size"], fmt(r["prefill_s"], scale=1000.0),
             fmt(r["decode_tokens_per_s"]), fmt(r["decode_step_ms"], 2),
             f"{r['roofline']['percent_of_roofline']:.1f}%" if "roofline" in r else "-"] for r in runs]
    print_table(f"latency: {model}, in {input_len} / out {output_len}",
                ["batch", "prefill ms", "decode tok/s", "step ms", "% roofline"], rows)
    if plot:
        series = {"qkiln decode tok/s": [(r["batch_size"], r["decode_tokens_per_s"]) for r in runs]}
        plot_throughput_vs_concurrency(plot / "decode_vs_batch.png", series, "decode tokens/s", "batch size")
    return report
