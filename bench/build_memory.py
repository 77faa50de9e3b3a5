"""`qkiln bench build-memory`: how much memory `qkiln build` holds, step by step.

The build runs in a child process (this module run as a script: `build()` with the layer cache off
and its steps announced on stderr). Its peak is the kernel's high-water mark, VmHWM, which the child
reports as it ends (a sampler can miss a peak between samples; wait4's ru_maxrss counts the parent's
size when the child was spawned); a step's peak comes from sampling the child's VmRSS every 20 ms
between the announcements. Bytes per parameter are above an idle process that imported what the
build imports (its VmHWM too), per parameter of the source (the manifest's count).

RssAnon is sampled beside VmRSS: the build holds a safetensors source as views of the files' memory
maps (runtime/source.py), pages the kernel drops under pressure and reads again, so the memory a
host must have for the build is its anonymous peak, which VmRSS (file pages counted) overstates.
"""

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from qkiln.errors import QkilnError, exit_on_error

from .report import _pyplot, _save, log, make_report, peak_rss_bytes, print_table, status_bytes, write_report

SAMPLE_SECONDS = 0.02
STEP_MARK = "qkiln-build-step: "
PEAK_MARK = "qkiln-build-peak: "
_IMPORTS = "import torch, qkiln.compile.build, qkiln.compile.export_onnx"


class BuildFailed(QkilnError):
    exit_code = 1


def idle_bytes() -> tuple[int, int]:
    """(VmHWM, RssAnon) of a process that imported what the build imports."""
    code = (f"{_IMPORTS}; from qkiln.bench.report import peak_rss_bytes, status_bytes; "
            "print(peak_rss_bytes(), status_bytes('RssAnon'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise BuildFailed(f"`python -c '{_IMPORTS}'` failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    peak, anon = done.stdout.split()
    return int(peak), int(anon)


@dataclass
class _ChildOutput:
    steps: list[tuple[float, str]] = field(default_factory=list)  # (arrival time, name)
    tail: deque = field(default_factory=lambda: deque(maxlen=3))  # its last other lines, for an error
    peak: int | None = None  # its VmHWM, said last


def _read(stream, out: _ChildOutput, echo: bool) -> None:
    """The child's stderr: step announcements (timed), its peak, the rest echoed."""
    for raw in stream:
        line = raw.decode(errors="replace")
        if line.startswith(STEP_MARK):
            out.steps.append((time.perf_counter(), line[len(STEP_MARK):].strip()))
            line = f"step: {out.steps[-1][1]}\n"
        elif line.startswith(PEAK_MARK):
            out.peak = int(line[len(PEAK_MARK):])
            continue
        elif line.strip():
            out.tail.append(line.strip())
        if echo:
            sys.stderr.write(line)
            sys.stderr.flush()


def run_build(options: dict, echo: bool = True) -> dict:
    """Build once in a child; -> peak bytes, seconds, per-step peaks and the source's size."""
    with tempfile.TemporaryDirectory(prefix="qkiln-build-memory-") as tmp:
        out = Path(tmp) / "artifact"
        command = [sys.executable, "-m", "qkiln.bench.build_memory", json.dumps(options | {"out": str(out)})]
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        child = _ChildOutput()
        reader = threading.Thread(target=_read, args=(proc.stderr, child, echo), daemon=True)
        reader.start()
        samples = []
        while proc.poll() is None:
            rss, anon = status_bytes("VmRSS", proc.pid), status_bytes("RssAnon", proc.pid)
            if rss is not None and anon is not None:
                samples.append((time.perf_counter(), rss, anon))
            time.sleep(SAMPLE_SECONDS)
        seconds = time.perf_counter() - start
        reader.join()
        if proc.returncode or child.peak is None:
            raise BuildFailed(f"the build failed (exit {proc.returncode}): {' / '.join(child.tail) or 'no output'}")
        manifest = json.loads((out / "manifest.json").read_text())
    # its exit (after it said its peak) may allocate a little more, which a sample may see
    peak = max([child.peak] + [rss for _, rss, _ in samples])
    return {"peak_bytes": peak, "peak_anon_bytes": max((anon for *_, anon in samples), default=None),
            "seconds": seconds,
            "steps": _steps(samples, [(start, "start python")] + child.steps),
            "timeline": _timeline(samples, start),
            "num_parameters": manifest["num_parameters"], "source_bytes_bf16": manifest["source_bytes_bf16"]}


def _timeline(samples, start: float, points: int = 2000) -> list[tuple[float, int, int]]:
    """(seconds since the start, VmRSS bytes, RssAnon bytes), each of at most `points` spans of the
    run taken at its largest VmRSS sample, so a short spike survives the thinning (a 10-minute build
    samples 30,000 times)."""
    if not samples:
        return []
    span = max((samples[-1][0] - start) / points, SAMPLE_SECONDS)
    kept: dict[int, tuple[float, int, int]] = {}
    for t, rss, anon in samples:
        slot = int((t - start) / span)
        if slot not in kept or rss > kept[slot][1]:
            kept[slot] = (round(t - start, 3), rss, anon)
    return list(kept.values())


def _steps(samples, marks) -> list[dict]:
    """A step runs from its mark to the next one's (the last to the child's exit)."""
    end = samples[-1][0] if samples else marks[-1][0]
    steps = []
    for (t0, name), (t1, _) in zip(marks, marks[1:] + [(end, "")]):
        inside = [(rss, anon) for t, rss, anon in samples if t0 <= t <= t1]
        steps.append({"step": name, "seconds": t1 - t0, "peak_bytes": max(r for r, _ in inside) if inside else None,
                      "peak_anon_bytes": max(a for _, a in inside) if inside else None})
    return steps


def plot_timeline(path: Path, result: dict, title: str) -> Path:
    """Resident memory over the build, each step's span shaded and named, the idle process's size and
    the peak marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    seconds = [t for t, *_ in result["timeline"]]
    ax.plot(seconds, [b / 2**20 for _, b, _ in result["timeline"]], color="C0", lw=1.2, label="VmRSS")
    ax.plot(seconds, [b / 2**20 for *_, b in result["timeline"]], color="C2", lw=1.2,
            label="RssAnon (what must fit: file pages are reclaimable)")
    t = 0.0
    for i, step in enumerate(result["steps"]):
        if i % 2:
            ax.axvspan(t, t + step["seconds"], color="0.92", lw=0)
        if step["seconds"] > 0.03 * result["seconds"]:  # name the steps wide enough to hold it
            ax.text(t + step["seconds"] / 2, 0.02, step["step"], rotation=90, ha="center", va="bottom",
                    fontsize=7, transform=ax.get_xaxis_transform())
        t += step["seconds"]
    ax.axhline(result["peak_bytes"] / 2**20, color="C3", ls="--", lw=1,
               label=f"peak {result['peak_bytes'] / 2**20:.0f} MiB (VmHWM)")
    ax.axhline(result["idle_bytes"] / 2**20, color="0.5", ls=":", lw=1,
               label=f"idle process {result['idle_bytes'] / 2**20:.0f} MiB")
    ax.set_xlabel("seconds")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def main(source: str, recipe: str, num_samples: int | None, eval_data: str | None, engine: str | None,
         json_out: Path | None, quiet: bool, plot: Path | None = None) -> dict:
    options = {"source": source, "recipe": recipe, "num_samples": num_samples, "eval_data": eval_data,
               "engine": engine}
    idle, idle_anon = idle_bytes()
    log(f"an idle process that imported the build: {idle / 2**20:.0f} MiB ({idle_anon / 2**20:.0f} anonymous)")
    result = run_build(options, echo=not quiet)
    result["idle_bytes"] = idle
    result["bytes_per_parameter"] = (result["peak_bytes"] - idle) / result["num_parameters"]
    result["idle_anon_bytes"] = idle_anon
    result["anon_bytes_per_parameter"] = (result["peak_anon_bytes"] - idle_anon) / result["num_parameters"]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    rows = [[s["step"], f"{s['seconds']:.1f}", mib(s["peak_bytes"]), mib(s["peak_anon_bytes"])]
            for s in result["steps"]]
    print_table(f"qkiln build {source} --recipe {recipe}: resident memory by step",
                ["step", "seconds", "peak MiB", "anon MiB"], rows, note="one run, sampled every 20 ms")
    print(f"peak {mib(result['peak_bytes'])} MiB (an idle process: {mib(idle)} MiB), "
          f"{result['num_parameters']:,} parameters: {result['bytes_per_parameter']:.2f} bytes a parameter "
          f"above idle; anonymous peak {mib(result['peak_anon_bytes'])} MiB (idle {mib(idle_anon)}): "
          f"{result['anon_bytes_per_parameter']:.2f} bytes a parameter; {result['seconds']:.0f} s")
    report = make_report("build-memory", options, result)
    write_report(json_out, report)
    if plot:
        plot_timeline(plot / "build_memory.png", result,
                      f"qkiln build {source} --recipe {recipe}: {result['num_parameters'] / 1e6:.0f}M parameters, "
                      f"{result['bytes_per_parameter']:.2f} bytes a parameter above idle "
                      f"({result['anon_bytes_per_parameter']:.2f} anonymous)")
    return report


def _child(options: dict) -> None:
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    recipe = load_recipe(options["recipe"]).with_overrides(
        calibration={"num_samples": options["num_samples"]} if options["num_samples"] is not None else None,
        evaluation={"data": options["eval_data"]} if options["eval_data"] is not None else None)

    def say(line: str) -> None:  # the parent reads stderr: steps are timed, the rest echoed
        print(line, file=sys.stderr, flush=True)

    build(options["source"], recipe, Path(options["out"]), use_cache=False, progress=False, log=say,
          engines=(options["engine"],) if options["engine"] else (), on_step=lambda name: say(STEP_MARK + name))
    print(PEAK_MARK + str(peak_rss_bytes()), file=sys.stderr, flush=True)


if __name__ == "__main__":
    with exit_on_error():
        _child(json.loads(sys.argv[1]))
