"""`qkiln bench serve`: drive the OpenAI-compatible HTTP server over loopback and measure what a
client sees, with the metric definitions of vLLM's benchmarks/benchmark_serving.py:

    TTFT    time from sending the request to the first streamed chunk with a choice
    TPOT    (e2e latency - TTFT) / (output_tokens - 1)       per request; 0 for 1-token outputs
    ITL     gaps between consecutive streamed chunks           (all requests pooled)
    E2EL    time from sending the request to its last streamed chunk
    goodput requests/s whose TTFT, TPOT and E2EL all meet the SLOs given (--goodput ttft:MS,...)

Load: a fixed concurrency (at most C requests in flight) and/or Poisson arrivals at
`--request-rate` requests/s (exponential gaps from a seeded RNG; `inf` sends all at once).
Requests go to POST /v1/completions with `stream: true`, greedy, `ignore_eos: true` and
`stream_options.include_usage`, so output lengths are exact and the server's usage counts the
tokens (chunk count is the fallback). Prompts are token ids by default (exact lengths);
`--prompt-format text` sends their decoded text instead. Without `--base-url` it starts
`python -m qkiln serve` on a free port, waits for it and stops it at the end (serve_client.py
owns the HTTP side). Owns the metric computation and the command. Figures are medians over
repeats with spread; per-request samples are kept for the latency CDF plots.

Timing is per chunk, as the client sees it: the server sends no chunk for a token whose text is
still incomplete (part of a UTF-8 character), so that token arrives with the next one; a request
streamed as a single chunk then has TPOT 0 (vLLM's client measures the same way).
"""

import asyncio
import math
import shlex
from pathlib import Path

from .report import distribution, fmt, log, make_report, plot_latency_cdfs, plot_throughput_vs_concurrency
from .report import print_table, summarize, write_report
from .serve_client import RequestResult, ServerProcess, run_load, served_model_name, warmup_server
from .workload import BenchConfigError, check_at_least, load_tokenizer, make_workload

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(spec: str | None) -> dict[str, float]:
    """`ttft:500,tpot:50 e2el:2000` -> {"ttft": 0.5, ...} in seconds."""
    slos = {}
    for item in (spec or "").replace(",", " ").split():
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in SLO_KEYS or ms <= 0:
            raise BenchConfigError(f"--goodput takes KEY:MS items with KEY in {SLO_KEYS}, e.g. ttft:500,tpot:50; "
                                   f"got {item!r}")
        slos[key] = ms / 1000.0
    return slos


def parse_concurrency(spec: str) -> list[int | None]:
    """`1,4,16` -> [1, 4, 16]; 0 means no cap (None)."""
    try:
        values = [int(c) for c in str(spec).replace(" ", "").split(",") if c]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise BenchConfigError(f"--concurrency takes integers >= 0 separated by commas (0 = no cap), got {spec!r}")
    return [v or None for v in values]


def compute_metrics(results: list[RequestResult], duration_s: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    num_in = sum(r.prompt_len for r in ok)
    num_out = sum(r.output_tokens for r in ok)
    good = [r for r in ok if all(getattr(r, f"{k}_s") <= v for k, v in slos.items())]
    metrics = {"duration_s": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
               "request_throughput": len(ok) / duration_s, "output_throughput": num_out / duration_s,
               "total_token_throughput": (num_in + num_out) / duration_s,
               "goodput": len(good) / duration_s if slos else None,
               "ttft": distribution([r.ttft_s for r in ok]),
               "tpot": distribution([r.tpot_s for r in ok if r.output_tokens > 1]),
               "itl": distribution([g for r in ok for g in r.itl_s]),
               "e2el": distribution([r.e2el_s for r in ok])}
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        metrics["errors"] = errors[:5]
    return metrics


# ---- the benchmark ---------------------------------------------------------------------------
_SCALARS = ("duration_s", "completed", "failed", "request_throughput", "output_throughput", "total_token_throughput")
_DISTS = ("ttft", "tpot", "itl", "e2el")


LEVEL_SEED_STRIDE = 1_000_000  # level k's repeats use seeds seed + (k + 1) * stride + repeat


def run_serve_level(base_url: str, model_name: str, make, tokenizer, concurrency: int | None,
                    request_rate: float, num_repeats: int, slos: dict, prompt_format: str, seed: int) -> dict:
    """`num_repeats` loads at one concurrency -> summaries over repeats plus per-request samples."""
    runs, samples = [], {"ttft_ms": [], "tpot_ms": [], "e2el_ms": []}
    for rep in range(num_repeats):
        # fresh prompts per repeat and per level (`seed` is the level's): no prefix-cache hits across them
        workload = make(seed + rep)
        prompts = workload.prompts if prompt_format == "ids" else [tokenizer.decode(p) for p in workload.prompts]
        results, duration = asyncio.run(run_load(base_url, model_name, workload, concurrency, request_rate,
                                                 seed + rep, prompts))
        m = compute_metrics(results, duration, slos)
        if m["completed"] == 0:
            raise BenchConfigError(f"every request failed (first errors: {m.get('errors')}); check the server log")
        runs.append(m)
        ok = [r for r in results if r.success]
        samples["ttft_ms"] += [1000 * r.ttft_s for r in ok]
        samples["tpot_ms"] += [1000 * r.tpot_s for r in ok if r.output_tokens > 1]
        samples["e2el_ms"] += [1000 * r.e2el_s for r in ok]
        log(f"concurrency {concurrency or 'unbounded'}: repeat {rep + 1}/{num_repeats}: "
            f"{m['output_throughput']:.1f} output tok/s, median TTFT {m['ttft']['median_ms']:.1f} ms, "
            f"{m['failed']} failed")
    keys = _SCALARS + (("goodput",) if slos else ())
    out = {k: summarize([r[k] for r in runs]) for k in keys}
    for d in _DISTS:  # over the repeats that had samples (no TPOT with 1-token outputs: "-", not 0 ms)
        out[d] = {stat: summarize([r[d][stat] for r in runs if r[d]["n"]])
                  for stat in ("mean_ms", "median_ms", "p90_ms", "p99_ms")}
    out["errors"] = sorted({e for r in runs for e in r.get("errors", [])})[:5]
    out["samples"] = samples
    return out


def main(model: str, *,
         base_url: str | None = None, server_args: str = "", num_requests: int = 64, input_len: str = "128",
         output_len: str = "128", prompts_jsonl: Path | None = None, shared_prefix_len: int = 0,
         concurrency: str = "16", request_rate: float = math.inf, goodput: str | None = None,
         prompt_format: str = "ids", repeats: int = 3, seed: int = 0, json_out: Path | None = None,
         plot: Path | None = None):
    """Online serving: TTFT, TPOT, ITL, E2EL and goodput over HTTP (vLLM benchmark_serving definitions)."""
    check_at_least(1, repeats=repeats)
    if prompt_format not in ("ids", "text"):
        raise BenchConfigError(f"--prompt-format must be ids or text, got {prompt_format!r}")
    levels = parse_concurrency(concurrency)
    slos = parse_goodput(goodput)
    from qkiln.compile.artifact_cli import unpacked

    # an artifact archive is unpacked and verified once, for the tokenizer and the server both
    with unpacked(model) as path:
        tokenizer = load_tokenizer(path)
        make = lambda s: make_workload(tokenizer, num_requests, input_len, output_len,  # noqa: E731
                                       prompts_jsonl=prompts_jsonl, shared_prefix_len=shared_prefix_len, seed=s)
        server = None if base_url else ServerProcess(path, shlex.split(server_args))
        try:
            url = base_url or server.base_url
            name = served_model_name(url, model)
            warmup_server(url, name, make(seed + 10_000).prompts[0], prompt_format, tokenizer)
            # each level its own prompts: the same ones again were answered from the server's prefix
            # cache (a second level of the same concurrency measured TTFT 9x lower)
            level_seeds = [seed + LEVEL_SEED_STRIDE * (k + 1) for k in range(len(levels))]
            runs = [{"concurrency": c, "seed": s, **run_serve_level(url, name, make, tokenizer, c, request_rate,
                                                                     repeats, slos, prompt_format, s)}
                    for c, s in zip(levels, level_seeds)]
        finally:
            if server is not None:
                server.close()
    shape = make(seed)  # describes the workload (lengths, source) for the config and the table
    config = {"model": model, "base_url": base_url, "server_args": server_args, "request_rate": request_rate,
              "goodput_slos_s": slos, "prompt_format": prompt_format, "repeats": repeats,
              "workload": shape.description}
    report = make_report("serve", config, {"runs": runs})
    write_report(json_out, report)
    rows = [[r["concurrency"] or "all", fmt(r["request_throughput"], 2), fmt(r["output_throughput"]),
             fmt(r["ttft"]["median_ms"]), fmt(r["ttft"]["p99_ms"]), fmt(r["tpot"]["median_ms"]),
             fmt(r["itl"]["p99_ms"]), fmt(r["e2el"]["median_ms"]), fmt(r.get("goodput"), 2),
             fmt(r["failed"], 0)] for r in runs]
    print_table(f"serving: {model}, {num_requests} requests, {shape.lengths_label}, rate {request_rate}",
                ["conc", "req/s", "out tok/s", "TTFT med ms", "TTFT p99", "TPOT med ms", "ITL p99", "E2EL med ms",
                 "goodput", "failed"], rows)
    if plot:
        bounded = [r for r in runs if r["concurrency"]]
        if bounded:
            plot_throughput_vs_concurrency(plot / "serve_throughput_vs_concurrency.png",
                                           {"qkiln": [(r["concurrency"], r["output_throughput"]) for r in bounded]},
                                           "output tokens/s")
        names = [f"c={r['concurrency'] or 'all'}" for r in runs]
        names = [f"{n} (level {i + 1})" if names.count(n) > 1 else n for i, n in enumerate(names)]  # one curve each
        for metric in ("ttft", "tpot", "e2el"):
            plot_latency_cdfs(plot / f"serve_{metric}_cdf.png",
                              {n: r["samples"][f"{metric}_ms"] for n, r in zip(names, runs)}, f"{metric.upper()} (ms)")
    return report
