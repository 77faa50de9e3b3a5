"""Quantization quality on SmolLM2-135M: one row per recipe, same pinned protocol for all.

    python -m qkiln.bench.quant_quality --json quality.json [--plot quality.png]
    (also `qkiln bench quality`)

Each row is quantized in its own subprocess (so its calibration time and peak RSS are its own)
and written as an artifact; then every artifact is scored in ONE pass over the evaluation
windows, so the unquantized reference runs once per window for all rows (KL, top-1).
Protocol: wiki.test.raw as stored, first 16384 tokens, windows of 512, no special tokens.
Held-out check of the W4 rows (does the calibration generalize beyond wikitext?): the first 4096
tokens of Jane Austen's Persuasion (no calibration source here uses it), same windows.
Calibration: `--calib` (default: the recipe default), 128 samples x 512 tokens, seed 0
(`--awq-num-samples` for the AWQ rows: its scale search costs ~4x GPTQ's per sample).
`--reuse` keeps the rows already built in `--workdir` (a run cut short resumes there).
The texts live under `--data-dir` (default: $QKILN_SHARED_DIR, else the `shared` folder beside the
checkout); every file a run reads is checked before the first build, as building all the rows takes
hours and the texts are first read after them.
`--llmcompressor-python PATH` (an interpreter with llm-compressor, in its own venv: see
bench/llmc_reference.py) adds llm-compressor's GPTQ / AWQ / FP8 rows on the same protocol, scored
in the same pass, and a table of ours vs theirs (relative perplexity, calibration time).
"""

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qkiln.bench.report import environment
from qkiln.bench.workload import BenchConfigError
from qkiln.compile.artifact import is_artifact_dir

# Unnormalized on purpose: the calibration specs built from it are part of each row's identity,
# which --reuse compares with the rows built by earlier runs.
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1] / "../shared"
HELD_OUT_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class DataFiles:
    """The texts of the protocol, all under one data folder."""

    root: Path
    wiki_test: Path
    wiki_valid: Path
    novels: Path
    held_out: Path

    @classmethod
    def under(cls, root: Path) -> "DataFiles":
        return cls(root, root / "data/wikitext-2-raw/wiki.test.raw", root / "data/wikitext-2/valid.txt",
                   root / "data/janeausten/emma.txt", root / "data/janeausten/persuasion.txt")


def data_dir(option: Path | None) -> Path:
    """--data-dir, else $QKILN_SHARED_DIR, else the `shared` folder beside the checkout."""
    return option or Path(os.environ.get("QKILN_SHARED_DIR") or DEFAULT_DATA_DIR)


def _calibration_files(spec: str) -> list[Path]:
    """The file:PATH parts of a calibration source, a mix:A+B one included."""
    return [Path(part.removeprefix("file:")) for part in spec.removeprefix("mix:").split("+")
            if part.startswith("file:")]


def check_data_files(data: DataFiles, calib_specs: list[str]) -> None:
    """Refuse a run whose texts are missing before it builds anything (the builds take hours)."""
    needed = [data.wiki_test, data.held_out] + [p for spec in calib_specs for p in _calibration_files(spec)]
    missing = [str(p) for p in dict.fromkeys(needed) if not p.is_file()]
    if missing:
        raise BenchConfigError(
            f"missing data file(s): {', '.join(missing)}; point --data-dir (or QKILN_SHARED_DIR) at the folder "
            f"that holds data/wikitext-2-raw/wiki.test.raw (now {data.root}), or fix --calib's file: path")


def calibration_sources(data: DataFiles) -> dict[str, str]:
    from qkiln.compile.recipe import DEFAULT_CALIBRATION_SOURCE

    valid, novels = data.wiki_valid, data.novels
    return {"default": DEFAULT_CALIBRATION_SOURCE, "self": "self:128", "wiki-valid": f"file:{valid}",
            "novels": f"file:{novels}", "mix": f"mix:self:128+file:{valid}+file:{novels}"}


def rows(calib: str, data: DataFiles) -> list[dict]:
    """name, preset, weight-scheme overrides, calibration source."""
    out = []
    for group in (128, 64):
        for algo in ("rtn", "gptq", "awq"):
            out.append(dict(name=f"{algo.upper()} W4 g{group}", preset=f"w4a16-{algo}", group_size=group, calib=calib))
    out += [dict(name="RTN W8 per-channel", preset="w8a16", calib=calib),
            dict(name="FP8 W8A8 dynamic", preset="fp8-w8a8", calib=calib),
            dict(name="FP8 W8A8 dynamic RTN", preset="fp8-w8a8-rtn", calib=calib),
            dict(name="FP8 W8A8 static", preset="fp8-w8a8-static", calib=calib),
            dict(name="KV INT4", preset="kv-int4", calib=calib),
            dict(name="KV FP8", preset="kv-fp8", calib=calib),
            dict(name="GPTQ W4 g128 + KV INT4", preset="w4a16-gptq+kv-int4", calib=calib)]
    seen = {calib}
    for label, spec in calibration_sources(data).items():
        if spec not in seen:  # which calibration text generalizes: GPTQ is the most data-sensitive
            seen.add(spec)
            out.append(dict(name=f"GPTQ W4 g128 calib={label}", preset="w4a16-gptq", calib=spec))
    return out


def build_row(row: dict, out: Path, num_samples: int) -> dict:
    """Quantize one row into an artifact (no evaluation); runs in a subprocess."""
    num_samples = row.get("num_samples", num_samples)
    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset

    r = preset(row["preset"])
    if row.get("group_size") and r.scheme.weights is not None:
        w = dataclasses.replace(r.scheme.weights, group_size=row["group_size"])
        r = dataclasses.replace(r, scheme=dataclasses.replace(r.scheme, weights=w))
    r = r.with_overrides(calibration={"source": row["calib"], "num_samples": num_samples}, evaluation={"data": None})
    start = time.perf_counter()
    result = build("smollm2-135m", r, out, overwrite=True, use_cache=False, progress=True,
                   log=lambda m: print(m, file=sys.stderr))
    return {"seconds": time.perf_counter() - start, "calibration_seconds": result.calibration_seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "fallbacks": result.manifest.recipe.get("fallbacks", {}), "num_samples": num_samples}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("quant_quality.json"))
    p.add_argument("--plot", type=Path)
    p.add_argument("--calib", help="calibration source of the main rows (default: the recipe default)")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--awq-num-samples", type=int, help="calibration samples for the AWQ rows (default: --num-samples)")
    p.add_argument("--reuse", action="store_true", help="keep rows already built in --workdir")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--only", help="comma-separated row names to run (exact)")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--data-dir", type=Path, help="the folder holding data/wikitext-2-raw, data/wikitext-2 and "
                   "data/janeausten (default: $QKILN_SHARED_DIR, else ../shared beside the checkout)")
    p.add_argument("--threads", type=int, help="torch threads for builds and evaluation (default: all cores)")
    p.add_argument("--llmcompressor-python", help="an interpreter with llmcompressor installed (its own venv: "
                   "see bench/llmc_reference.py): adds its GPTQ/AWQ/FP8 rows, side by side with ours")
    p.add_argument("--llmc-workdir", type=Path, help="where the llm-compressor rows are built (default: WORKDIR/llmc)")
    p.add_argument("--build-row", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.build_row:
        print(json.dumps(build_row(json.loads(args.build_row), args.out, args.num_samples)))
        return {}
    if args.calib is None:
        from qkiln.compile.recipe import DEFAULT_CALIBRATION_SOURCE

        args.calib = DEFAULT_CALIBRATION_SOURCE
    from qkiln.bench import llmc_reference  # reference rows: built in llm-compressor's own interpreter

    data = DataFiles.under(data_dir(args.data_dir))
    if args.only:  # a misspelt name silently measured nothing but the unquantized row
        known = [r["name"] for r in rows(args.calib, data)] + list(llmc_reference.ROWS)
        unknown = [n for n in args.only.split(",") if n not in known]
        if unknown:
            raise BenchConfigError(f"--only: no row named {', '.join(map(repr, unknown))}; rows: {', '.join(known)}")
    selected = [r for r in rows(args.calib, data) if not args.only or r["name"] in args.only.split(",")]
    check_data_files(data, [args.calib] + [r["calib"] for r in selected])  # the llmc rows calibrate on args.calib
    for row in selected:
        if row["name"].startswith("AWQ") and args.awq_num_samples:
            row["num_samples"] = args.awq_num_samples
    workdir = args.workdir or _fresh_workdir()
    results = {row["name"]: _build_in_subprocess(row, workdir, args, f"[{i + 1}/{len(selected)}]")
               for i, row in enumerate(selected)}
    results |= llmc_reference.llmc_rows(
        args.llmcompressor_python, args.llmc_workdir or workdir / "llmc", calib=args.calib,
        num_samples=args.num_samples, awq_num_samples=args.awq_num_samples, threads=args.threads, reuse=args.reuse,
        only=args.only and args.only.split(","))
    report = evaluate_rows(results, data, args.max_tokens, args.threads)
    report["environment"] = environment()  # results move with thread count and float reductions
    report["llmc_comparison"] = llmc_reference.compare(report)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    llmc_reference.print_comparison(report["llmc_comparison"])
    if args.plot:
        plot(report, args.plot)
    return report


def _fresh_workdir() -> Path:
    """A temp folder for the rows' artifacts, announced: the only way back to hours of builds."""
    workdir = Path(tempfile.mkdtemp(prefix="qkiln-quality-"))
    print(f"work dir {workdir} (a rerun with --workdir {workdir} --reuse keeps its rows)", file=sys.stderr)
    return workdir


def _build_in_subprocess(row: dict, workdir: Path, args, label: str) -> dict:
    """One row's artifact and build facts; with --reuse a row built before (same spec) is kept."""
    slug = "".join(c if c.isalnum() else "-" for c in row["name"]).lower()
    out, facts = workdir / slug, workdir / f"{slug}.json"
    if args.reuse and facts.is_file() and is_artifact_dir(out):
        kept = json.loads(facts.read_text())
        if {k: kept.get(k) for k in row} == row:
            print(f"{label} reusing {row['name']}", file=sys.stderr)
            return kept
    print(f"{label} quantizing {row['name']}", file=sys.stderr)
    cmd = [sys.executable, "-m", "qkiln.bench.quant_quality", "--build-row", json.dumps(row), "--out", str(out),
           "--num-samples", str(args.num_samples)] + (["--threads", str(args.threads)] if args.threads else [])
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=os.environ)
    if done.returncode != 0:
        return {"error": f"build failed with exit code {done.returncode}"}
    result = json.loads(done.stdout.strip().splitlines()[-1]) | {"artifact": str(out), **row}
    facts.write_text(json.dumps(result, indent=2) + "\n")
    return result


def evaluate_rows(results: dict, data: DataFiles, max_tokens: int, threads: int | None = None) -> dict:
    import torch

    from qkiln.compile.evaluate import evaluate_many
    from qkiln.compile.model_ref import open_model

    torch.set_num_threads(threads or os.cpu_count() or 1)
    reference = open_model("smollm2-135m")
    models = {"unquantized": reference}
    models |= {name: open_model(r["artifact"]) for name, r in results.items() if "artifact" in r}
    scores = evaluate_many(models, reference.tokenizer, str(data.wiki_test), 512, max_tokens, reference=reference)
    held_out_models = {n: m for n, m in models.items() if n == "unquantized" or " W4 " in n}
    held_out = evaluate_many(held_out_models, reference.tokenizer, str(data.held_out), 512, HELD_OUT_TOKENS)
    for name, s in held_out.items():
        scores[name]["held_out_perplexity"] = s["perplexity"]
    base = scores["unquantized"]["perplexity"]
    table = {"unquantized": {"perplexity": base, "kl_divergence": 0.0, "top1_agreement": 1.0,
                             "held_out_perplexity": scores["unquantized"]["held_out_perplexity"]}}
    for name, r in results.items():
        s = scores.get(name, {})
        table[name] = r | {k: s[k] for k in ("perplexity", "kl_divergence", "top1_agreement", "bits_per_byte",
                                             "held_out_perplexity") if k in s}
        if "perplexity" in s:
            table[name]["perplexity_change"] = s["perplexity"] / base - 1
    _gap_closed(table)
    return {"protocol": scores["unquantized"]["protocol"], "held_out_protocol": held_out["unquantized"]["protocol"],
            "rows": table, "machine": os.uname().nodename, "num_threads": torch.get_num_threads()}


def _gap_closed(table: dict) -> None:
    """Fraction of RTN's perplexity gap that GPTQ / AWQ close (same group size, same symmetry).
    Not for combined rows ("... + KV INT4"): RTN's row has no KV quantization to compare with."""
    for key, out in (("perplexity", "rtn_gap_closed"), ("held_out_perplexity", "held_out_rtn_gap_closed")):
        base = table["unquantized"].get(key)
        for name, row in table.items():
            for algo in ("GPTQ", "AWQ"):
                if name.startswith(f"{algo} W4 g") and "+" not in name and key in row and base is not None:
                    rtn = table.get("RTN W4 g" + name.split(" g", 1)[1].split(" ")[0], {})
                    if key in rtn and rtn[key] > base:
                        row[out] = (rtn[key] - row[key]) / (rtn[key] - base)


def print_table(report: dict) -> None:
    print(f"{'recipe':40s} {'ppl':>8s} {'change':>8s} {'KL':>8s} {'top-1':>7s} {'gap closed':>10s} "
          f"{'held-out':>9s} {'closed':>7s} {'build s':>8s} {'RSS MiB':>8s}")
    for name, r in report["rows"].items():
        def f(key, fmt):  # "-" padded to the column's width
            return format(r[key], fmt) if key in r else "-".rjust(int(fmt.lstrip("+").split(".")[0]))
        print(f"{name:40s} {f('perplexity', '8.3f')} {f('perplexity_change', '+8.2%')} {f('kl_divergence', '8.4f')} "
              f"{f('top1_agreement', '7.3f')} {f('rtn_gap_closed', '10.0%')} {f('held_out_perplexity', '9.3f')} "
              f"{f('held_out_rtn_gap_closed', '7.0%')} {f('seconds', '8.1f')} {f('peak_rss_mib', '8.0f')}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in report["rows"].items() if "perplexity" in r]
    values = [report["rows"][n]["perplexity"] for n in names]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(names) + 1))
    ax.barh(names, values, color="tab:blue")
    ax.axvline(report["rows"]["unquantized"]["perplexity"], color="k", linestyle="--", label="unquantized")
    ax.set_xlabel("perplexity (wiki.test.raw, 512-token windows)")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
