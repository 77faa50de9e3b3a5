"""`qkiln bench build-memory`: how much memory `qkiln build` holds, step by step.

The build runs in a child process (this module run as a script: `build()` with the layer cache off
and its steps announced on stderr). Its peak is the kernel's (`ru_maxrss` from wait4: a sampler
can miss a peak between samples); a step's peak comes from sampling the child's VmRSS every 20 ms
between the announcements. Bytes per parameter are above an idle process that imported what the
build imports, per parameter of the source (the manifest's count).
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from qkiln.errors import QkilnError, exit_on_error

from .report import log, make_report, print_table, write_report

SAMPLE_SECONDS = 0.02
STEP_MARK = "qkiln-build-step: "
_IMPORTS = "import torch, qkiln.compile.build, qkiln.compile.export_onnx"


class BuildFailed(QkilnError):
    exit_code = 1


def _wait(proc: subprocess.Popen) -> tuple[int, int]:
    """-> (exit status, peak RSS in bytes) of a finished-or-running child."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024  # KiB on Linux


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # the child has exited
        return None
    return None


def idle_bytes() -> int:
    proc = subprocess.Popen([sys.executable, "-c", _IMPORTS])
    status, peak = _wait(proc)
    if status:
        raise BuildFailed(f"`python -c '{_IMPORTS}'` failed (exit {status})")
    return peak


def _read_steps(stream, steps: list[tuple[float, str]], tail: deque, echo: bool) -> None:
    """The child's step announcements, each with the time it arrived; the rest is echoed, and its
    last lines kept for an error."""
    for raw in stream:
        line = raw.decode(errors="replace")
        if line.startswith(STEP_MARK):
            steps.append((time.perf_counter(), line[len(STEP_MARK):].strip()))
            line = f"step: {steps[-1][1]}\n"
        elif line.strip():
            tail.append(line.strip())
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
        marks: list[tuple[float, str]] = []
        tail: deque = deque(maxlen=3)
        reader = threading.Thread(target=_read_steps, args=(proc.stderr, marks, tail, echo), daemon=True)
        reader.start()
        samples = []
        while _alive(proc.pid):  # not proc.poll(): it would reap the child, and its rusage with it
            rss = _rss(proc.pid)
            if rss is not None:
                samples.append((time.perf_counter(), rss))
            time.sleep(SAMPLE_SECONDS)
        status, peak = _wait(proc)
        seconds = time.perf_counter() - start
        reader.join()
        if status:
            raise BuildFailed(f"the build failed (exit {status}): {' / '.join(tail) or 'no output'}")
        manifest = json.loads((out / "manifest.json").read_text())
    return {"peak_bytes": peak, "seconds": seconds, "steps": _steps(samples, [(start, "start python")] + marks),
            "num_parameters": manifest["num_parameters"], "source_bytes_bf16": manifest["source_bytes_bf16"]}


def _alive(pid: int) -> bool:
    """Not exited (a zombie, exited but not waited for, has no VmRSS)."""
    return _rss(pid) is not None


def _steps(samples, marks) -> list[dict]:
    """A step runs from its mark to the next one's (the last to the child's exit)."""
    end = samples[-1][0] if samples else marks[-1][0]
    steps = []
    for (t0, name), (t1, _) in zip(marks, marks[1:] + [(end, "")]):
        inside = [rss for t, rss in samples if t0 <= t <= t1]
        steps.append({"step": name, "seconds": t1 - t0, "peak_bytes": max(inside) if inside else None})
    return steps


def main(source: str, recipe: str, num_samples: int | None, eval_data: str | None, engine: str | None,
         json_out: Path | None, quiet: bool) -> dict:
    options = {"source": source, "recipe": recipe, "num_samples": num_samples, "eval_data": eval_data,
               "engine": engine}
    idle = idle_bytes()
    log(f"an idle process that imported the build: {idle / 2**20:.0f} MiB")
    result = run_build(options, echo=not quiet)
    result["idle_bytes"] = idle
    result["bytes_per_parameter"] = (result["peak_bytes"] - idle) / result["num_parameters"]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    rows = [[s["step"], f"{s['seconds']:.1f}", mib(s["peak_bytes"])] for s in result["steps"]]
    print_table(f"qkiln build {source} --recipe {recipe}: resident memory by step", ["step", "seconds", "peak MiB"],
                rows, note="one run, sampled every 20 ms")
    print(f"peak {mib(result['peak_bytes'])} MiB (an idle process: {mib(idle)} MiB), "
          f"{result['num_parameters'] / 1e6:.0f}M parameters: {result['bytes_per_parameter']:.2f} bytes a parameter "
          f"above idle; {result['seconds']:.0f} s")
    report = make_report("build-memory", options, result)
    write_report(json_out, report)
    return report


def _child(options: dict) -> None:
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    recipe = load_recipe(options["recipe"])
    if options["num_samples"] is not None:
        recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration,
                                                                             num_samples=options["num_samples"]))
    if options["eval_data"] is not None:
        recipe = dataclasses.replace(recipe, evaluation=dataclasses.replace(recipe.evaluation, data=options["eval_data"]))

    def announce(name: str) -> None:
        print(STEP_MARK + name, file=sys.stderr, flush=True)

    build(options["source"], recipe, Path(options["out"]), use_cache=False, progress=False, log=print,
          engines=(options["engine"],) if options["engine"] else (), on_step=announce)


if __name__ == "__main__":
    with exit_on_error():
        _child(json.loads(sys.argv[1]))
