"""Benchmark reports: summaries with spread, the run's environment, JSON, a stdout table, PNGs.

Owns the report format every `qkiln bench` command writes:

    {"benchmark": name, "created": ISO time, "command": argv, "config": {...},
     "environment": {"git": {revision, is_dirty}, "versions": {...}, "machine": {...}},
     "results": {...}}

Invariants: every figure measured over repeats is a `summarize()` dict (median, min, max, q1, q3,
mean, n, values), so the spread always travels with the median; per-request latency
distributions use `distribution()` (mean, median, p90, p99 in ms, vLLM's benchmark_serving
set). Progress goes to stderr (`log`), tables to stdout. matplotlib is imported only by the
plot functions.
"""

import datetime
import importlib.metadata
import json
import math
import os
import platform
import resource
import sys
from pathlib import Path

import torch

from qkiln.compile.artifact import code_revision
from qkiln.errors import ArtifactError

_PACKAGES = ("qkiln", "torch", "numpy", "transformers", "tokenizers", "triton", "llama_cpp_python",
             "onnxruntime-genai", "httpx", "matplotlib")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values) -> dict:
    """Median over repeats with its spread: min/max and the interquartile range."""
    vals = sorted(float(v) for v in values)
    if not vals:  # null in JSON (NaN is not JSON), "-" in tables
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "mean": None, "n": 0, "values": []}
    return {"median": _quantile(vals, 0.5), "min": vals[0], "max": vals[-1], "q1": _quantile(vals, 0.25),
            "q3": _quantile(vals, 0.75), "mean": sum(vals) / len(vals), "n": len(vals),
            "values": [float(v) for v in values]}


def distribution(values_s) -> dict:
    """Per-request latencies in seconds -> mean/median/p90/p99 in milliseconds (0 when empty)."""
    vals = sorted(1000.0 * float(v) for v in values_s)
    if not vals:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "n": 0}
    return {"mean_ms": sum(vals) / len(vals), "median_ms": _quantile(vals, 0.5), "p90_ms": _quantile(vals, 0.9),
            "p99_ms": _quantile(vals, 0.99), "n": len(vals)}


def summarize_runs(runs: list[dict], keys) -> dict:
    """[{key: number}] over repeats -> {key: summarize(...)}."""
    return {k: summarize([r[k] for r in runs]) for k in keys}


def reset_peak_rss() -> None:
    """Start a new peak, so that a row's peak is its own: ru_maxrss never goes down, and a row that ran
    after the HF model was loaded reported HF's footprint as qkiln's (Linux: writing 5 to
    /proc/self/clear_refs resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A memory field of /proc/PID/status (VmRSS, VmHWM) in bytes; None without one (no /proc, or
    the process exited: a zombie has no memory fields)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_bytes() -> int:
    """Peak resident memory since the last reset_peak_rss (VmHWM), or of the process so far where
    /proc has none (ru_maxrss, in KiB on Linux)."""
    peak = status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_info() -> dict:
    import psutil

    info = {"platform": platform.platform(), "cpu": _cpu_model(), "num_cpus": os.cpu_count(),
            "num_cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_num_threads": torch.get_num_threads(), "memory_bytes": psutil.virtual_memory().total,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def kernel_info() -> dict:
    """Which CPU kernels ran (qkiln's native ones, or torch's where they did not build or were switched
    off) and every QKILN_* switch set: the same figures from another kernel path are another result."""
    from qkiln.plugins import cpu_native

    return {"native_extension": cpu_native.native_extension() is not None,
            "native_ops": cpu_native.native_ops() is not None,
            "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("QKILN_")}}


def environment() -> dict:
    return {"git": code_revision(), "versions": _versions(), "machine": machine_info(), "kernels": kernel_info()}


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def make_report(benchmark: str, config: dict, results: dict) -> dict:
    report = {"benchmark": benchmark, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": sys.argv, "config": config, "environment": environment(), "results": results}
    return _jsonable(report)


def write_report(path: str | Path | None, report: dict) -> None:
    if path is None:
        return
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    except OSError as e:  # checked before the run (bench/cli.py): something changed since
        raise ArtifactError(f"--json {path}: cannot write the report ({e.strerror or e}); the table above has "
                            "its numbers") from None
    log(f"wrote {path}")


def fmt(stat: dict | float | None, digits: int = 1, scale: float = 1.0) -> str:
    """`median [min-max]` for a summary (times `scale`, e.g. 1000 for s -> ms), the number for a value."""
    if stat is None:
        return "-"
    if isinstance(stat, dict):
        if not stat.get("n"):
            return "-"
        med, lo, hi = (scale * stat[k] for k in ("median", "min", "max"))
        return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"
    return f"{scale * stat:.{digits}f}"


def print_table(title: str, header: list[str], rows: list[list[str]],
                note: str = "values are the median [min-max] over repeats") -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    print(title)
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print(note if rows else "(no rows)")
    sys.stdout.flush()


# ---- plots -----------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput_vs_concurrency(path: Path, series: dict[str, list[tuple[float, dict]]], ylabel: str,
                                   xlabel: str = "concurrency (requests in flight)") -> Path:
    """series: name -> [(concurrency, summary)]; error bars span min..max over repeats."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in series.items():
        xs = [x for x, _ in points]
        med = [s["median"] for _, s in points]
        err = [[m - s["min"] for m, (_, s) in zip(med, points)], [s["max"] - m for m, (_, s) in zip(med, points)]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for points in series.values() for x, _ in points})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_latency_cdfs(path: Path, samples_ms: dict[str, list[float]], xlabel: str = "latency (ms)") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, vals in samples_ms.items():
        vals = sorted(vals)
        if vals:
            ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_bars(path: Path, bars: dict[str, dict], ylabel: str, title: str = "") -> Path:
    """bars: name -> summary; error bars span min..max over repeats."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(bars)), 4))
    names = list(bars)
    med = [bars[n]["median"] for n in names]
    err = [[m - bars[n]["min"] for m, n in zip(med, names)], [bars[n]["max"] - m for m, n in zip(med, names)]]
    ax.bar(names, med, yerr=err, capsize=4, color=["C0" if n.startswith("qkiln") else "C7" for n in names])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=20)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    log(f"wrote {path}")
    return path
