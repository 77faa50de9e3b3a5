"""llm-compressor reference rows for bench/quant_quality.py: its GPTQ, AWQ and FP8 on our protocol.

Owns `llmc_rows` (quantize each reference row with llm-compressor and import the checkpoint as
a qkiln artifact, so the bench's `evaluate_rows` scores it in the same pass as ours),
`compare` / `print_comparison` (ours vs llm-compressor per matching recipe) and the worker that
runs inside llm-compressor's interpreter (`python llmc_reference.py --worker SPEC`).

llm-compressor pins a transformers version other than the repo's, so it lives in its own venv
and is reached only through `--llmcompressor-python PATH`; without one (or when it cannot import
llmcompressor) the rows are skipped with the reason printed. Install (versions that worked):
    python3.11 -m venv .notes/llmc-venv && echo torch==2.13.0 > c.txt
    .notes/llmc-venv/bin/pip install torch==2.13.0
    .notes/llmc-venv/bin/pip install -c c.txt llmcompressor==0.14.0.1
    (-> transformers 5.17.0, compressed-tensors 0.19.0, accelerate 1.15.0)

Invariants: both sides see the same model and the same tokens. The dense model is the source
qkiln loads (GGUF dequantized to fp32, HF names) written as an fp32 safetensors directory, so
llm-compressor calibrates exactly the weights we do; the calibration samples are
`sample_token_set` of the same source spec, count, length and seed (their sha256 is recorded
and equals our build's `calibration.token_sha256`). `seconds` covers model load + calibration
+ save, as our rows' `seconds` covers the whole build; `calibration_seconds` is `oneshot` alone.
This file imports nothing from qkiln at module level: the worker runs without qkiln installed.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

# name -> (algorithm, group size, our row it is compared with, bypass_divisibility_checks, weight args).
# llm-compressor refuses group 128 on SmolLM2 (576 input columns); the "partial" rows try its opt-in
# `bypass_divisibility_checks` (a last, shorter group, as ours). In 0.14.0.1 its weight observer then
# fails (`unflatten` by group_size), so both g128 rows record an error: the reference has no g128 here.
# Rows use llm-compressor's defaults (min-max observer); "mse" uses its MSE observer, as our GPTQ preset.
ROWS = {"llmc GPTQ W4 g128": ("gptq", 128, "GPTQ W4 g128", False, {}),
        "llmc GPTQ W4 g128 partial": ("gptq", 128, "GPTQ W4 g128", True, {}),
        "llmc GPTQ W4 g64": ("gptq", 64, "GPTQ W4 g64", False, {}),
        "llmc GPTQ W4 g64 mse": ("gptq", 64, "GPTQ W4 g64", False, {"observer": "mse"}),
        "llmc AWQ W4 g128": ("awq", 128, "AWQ W4 g128", False, {}),
        "llmc AWQ W4 g128 partial": ("awq", 128, "AWQ W4 g128", True, {}),
        "llmc AWQ W4 g64": ("awq", 64, "AWQ W4 g64", False, {}),
        # its FP8_DYNAMIC is data-free round-to-nearest: the same recipe as our fp8-w8a8-rtn preset
        "llmc FP8 W8A8 dynamic": ("fp8", None, "FP8 W8A8 dynamic RTN", False, {}),
        # GPTQ on the fp8 grid with the last decoder layer's MLP kept, as our fp8-w8a8 preset
        "llmc GPTQ FP8 W8A8 dynamic": ("gptq-fp8", None, "FP8 W8A8 dynamic", False, {})}


def check_interpreter(python) -> tuple[str | None, str | None]:
    """(llmcompressor version, None) when `python` imports it, else (None, why the rows are skipped)."""
    if not python:
        return None, "no --llmcompressor-python given (an interpreter with llmcompressor installed)"
    try:
        done = subprocess.run([str(python), "-c", "import llmcompressor; print(llmcompressor.__version__)"],
                              capture_output=True, text=True, timeout=300, env=_worker_env(1))
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} cannot be run ({e})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} cannot import llmcompressor ({last}); see bench/llmc_reference.py for the install"
    return done.stdout.strip().splitlines()[-1], None


def export_dense_model(source_name: str, out: Path) -> Path:
    """The source model as an fp32 HF directory (config.json, model.safetensors, tokenizer); cached by sha256."""
    from safetensors.torch import save_file

    from qkiln.compile.export_compressed_tensors import hf_config_dict
    from qkiln.runtime.source import load_source

    source = load_source(source_name)
    marker = out / "qkiln_source.json"
    if marker.is_file() and json.loads(marker.read_text()).get("sha256") == source.sha256:
        return out
    out.mkdir(parents=True, exist_ok=True)
    # fp32: the GGUF's dequantized values are not all bf16-representable; both sides start from these
    tensors = {k: v.float().contiguous() for k, v in source.state_dict.items()
               if not (source.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(source.config) | {"torch_dtype": "float32"}, indent=2))
    source.tokenizer.save(out)
    marker.write_text(json.dumps({"source": source_name, "sha256": source.sha256}))
    return out


def export_calibration(source_name: str, calib: str, num_samples: int, out: Path, seq_len: int = 512,
                       seed: int = 0) -> dict:
    """Our calibration tokens ([num_samples, seq_len] int64) as safetensors `input_ids`; -> provenance."""
    import torch
    from safetensors.torch import save_file

    from qkiln.calib_data import load_text_source, sample_token_set
    from qkiln.compile.self_generate import make_self_generator
    from qkiln.runtime.source import load_source

    source = load_source(source_name)
    text = load_text_source(calib, make_self_generator(source, seq_len, False), seed)
    tokens = sample_token_set(text, source.tokenizer, num_samples, seq_len, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": torch.tensor(tokens.input_ids, dtype=torch.int64)}, str(out))
    return tokens.provenance


def llmc_rows(python, workdir: Path, *, calib: str, num_samples: int = 128, awq_num_samples: int | None = None,
              threads: int | None = None, reuse: bool = False, only=None, source: str = "smollm2-135m",
              log=lambda m: print(m, file=sys.stderr)) -> dict:
    """name -> row facts (artifact path, seconds, peak RSS, ...) or {"error": ...}; {} when skipped.

    `threads` defaults to all cores, as our rows' builds do: the two sides' seconds must compare."""
    selected = [name for name in ROWS if not only or name in only]
    if not selected:
        return {}
    version, why = check_interpreter(python)
    if why:
        print(f"llm-compressor rows skipped: {why}")
        return {}
    workdir, threads = Path(workdir).absolute(), threads or os.cpu_count() or 1
    dense = export_dense_model(source, workdir / "dense")
    results = {}
    for name in selected:
        algo, group, _, bypass, weight_args = ROWS[name]
        n = awq_num_samples if algo == "awq" and awq_num_samples else num_samples
        samples = workdir / f"calib-{n}.safetensors"
        provenance = export_calibration(source, calib, n, samples)  # cheap: tokenization only
        spec = dict(name=name, algorithm=algo, group_size=group, calib=calib, num_samples=n, threads=threads,
                    token_sha256=provenance["token_sha256"], llmcompressor=version)
        if bypass:  # only when set: facts of rows built without these keys stay reusable
            spec["bypass_divisibility_checks"] = True
        if weight_args:
            spec["weight_args"] = weight_args
        results[name] = _run_row(python, spec, dense, samples, workdir, reuse, log)
    return results


def _run_row(python, spec: dict, dense: Path, samples: Path, workdir: Path, reuse: bool, log) -> dict:
    from qkiln.compile.import_checkpoint import import_checkpoint

    slug = "".join(c if c.isalnum() else "-" for c in spec["name"]).lower()
    ckpt, artifact, facts = workdir / f"{slug}-ct", workdir / slug, workdir / f"{slug}.json"
    if reuse and facts.is_file():
        kept = json.loads(facts.read_text())
        if {k: kept.get(k) for k in spec} == spec and ("error" in kept or (artifact / "manifest.json").is_file()):
            log(f"reusing {spec['name']}")
            return kept
    log(f"llm-compressor: {spec['name']} ({spec['num_samples']} samples, {spec['threads']} thread(s))")
    result_file = workdir / f"{slug}.worker.json"
    result_file.unlink(missing_ok=True)
    job = spec | {"dense": str(dense), "samples": str(samples), "out": str(ckpt), "result": str(result_file)}
    done = subprocess.run([str(python), str(Path(__file__).resolve()), "--worker", json.dumps(job)],
                          env=_worker_env(spec["threads"]))
    result = spec | (json.loads(result_file.read_text()) if result_file.is_file()
                     else {"error": f"llm-compressor worker exited with code {done.returncode} and no result"})
    if "error" not in result:
        import_checkpoint(ckpt, artifact, overwrite=True)  # scored by the bench like any artifact
        result["artifact"] = str(artifact)
    facts.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _worker_env(threads: int) -> dict:
    # the repo venv's paths must not leak into the other interpreter (its transformers differs)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return env | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def compare(report: dict) -> list[dict]:
    """Per llm-compressor row with a scored counterpart of ours: relative perplexity and time ratio."""
    rows, out = report["rows"], []
    for name, (_, _, ours_name, _, _) in ROWS.items():
        theirs, ours = rows.get(name, {}), rows.get(ours_name, {})
        entry = {"recipe": ours_name, "ours": ours_name, "llmc": name}
        if "error" in theirs:
            entry["llmc_error"] = theirs["error"]
        if "perplexity" in theirs and "perplexity" in ours:
            entry["perplexity_ours_vs_llmc"] = ours["perplexity"] / theirs["perplexity"] - 1
            entry["within_1pct"] = entry["perplexity_ours_vs_llmc"] <= 0.01
        if ours.get("seconds") and theirs.get("seconds"):
            entry["seconds_ratio_ours_over_llmc"] = ours["seconds"] / theirs["seconds"]
            entry["not_slower"] = entry["seconds_ratio_ours_over_llmc"] <= 1.0
        if ours.get("calibration_seconds") and theirs.get("calibration_seconds"):  # without load and save
            ratio = ours["calibration_seconds"] / theirs["calibration_seconds"]
            entry["calibration_seconds_ratio_ours_over_llmc"] = ratio
        rtn = rows.get("RTN " + ours_name.split(" ", 1)[1], {})  # same group size and symmetry
        base = rows.get("unquantized", {}).get("perplexity")
        if "perplexity" in theirs and rtn.get("perplexity", 0) > (base or float("inf")):
            # the measure for ours (bench: rtn_gap_closed), computed the same way for llm-compressor
            entry["llmc_rtn_gap_closed"] = (rtn["perplexity"] - theirs["perplexity"]) / (rtn["perplexity"] - base)
        if len(entry) > 3:
            out.append(entry)
    return out


def print_comparison(comparison: list[dict]) -> None:
    if not comparison:
        return
    print(f"\n{'ours vs llm-compressor row':28s} {'ppl ours/llmc-1':>16s} {'<=1%':>5s} {'time ours/llmc':>15s} "
          f"{'<=1x':>5s} {'calib-only':>10s} {'llmc gap closed':>16s}")
    for c in comparison:
        ppl, ratio, calib, gap = (c.get(k) for k in ("perplexity_ours_vs_llmc", "seconds_ratio_ours_over_llmc",
                                                     "calibration_seconds_ratio_ours_over_llmc", "llmc_rtn_gap_closed"))
        print(f"{c['llmc'].removeprefix('llmc '):28s} {'-' if ppl is None else format(ppl, '+.2%'):>16s} "
              f"{'-' if ppl is None else ('yes' if c['within_1pct'] else 'NO'):>5s} "
              f"{'-' if ratio is None else format(ratio, '.2f'):>15s} "
              f"{'-' if ratio is None else ('yes' if c['not_slower'] else 'NO'):>5s} "
              f"{'-' if calib is None else format(calib, '.2f'):>10s} "
              f"{'-' if gap is None else format(gap, '.0%'):>16s}"
              + (f"  llmc: {c['llmc_error'][:90]}" if "llmc_error" in c else ""))


# --- worker: runs inside llm-compressor's interpreter (torch, transformers, llmcompressor; no qkiln) ---

def _recipe(algo: str, group_size: int | None, num_layers: int, bypass: bool = False,
            weight_args: dict | None = None):
    """llm-compressor's own recipe for the row, with its defaults (GPTQ: static act-order, damp 0.01,
    block 128, min-max observer; AWQ: duo scaling, 20-point grid, no clipping search)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if algo == "fp8":  # per-channel e4m3 weights, dynamic per-token activations; lm_head kept, as ours
        return [QuantizationModifier(targets=["Linear"], scheme="FP8_DYNAMIC", ignore=["lm_head"])]
    if algo == "gptq-fp8":  # our fp8-w8a8 preset also keeps the last layer's MLP in high precision
        last_mlp = rf"re:.*layers\.{num_layers - 1}\.mlp\..*"
        return [GPTQModifier(targets=["Linear"], scheme="FP8_DYNAMIC", ignore=["lm_head", last_mlp])]
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size,
                               **(weight_args or {}))
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if algo == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"], bypass_divisibility_checks=bypass)]
    from llmcompressor.modifiers.transform.awq import AWQModifier

    quantize = QuantizationModifier(config_groups=groups, ignore=["lm_head"], bypass_divisibility_checks=bypass)
    return [AWQModifier(), quantize]


def _cpu_workarounds() -> list[str]:
    """llm-compressor 0.14.0.1's AWQ pins its cached activations unconditionally, which raises
    "Cannot access accelerator device" on a machine without one. Pinning only speeds host-to-device
    copies, so without an accelerator it is skipped; the numbers are unchanged."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        return []
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    return ["IntermediatesCache.pin_memory skipped (no accelerator)"]


def _worker(job: dict) -> None:
    import torch

    torch.set_num_threads(job["threads"])  # one thread on both sides so the seconds compare
    result = Path(job["result"])
    try:
        result.write_text(json.dumps(_quantize(job)))
    except Exception as e:  # e.g. group 128 refused on 576 columns: a row with its error, not a crash
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        result.write_text(json.dumps({"error": msg[:400]}))  # the layer list runs to 180 names
        raise


def _quantize(job: dict) -> dict:
    import llmcompressor
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(job["dense"], dtype=torch.float32)
    ids = load_file(job["samples"])["input_ids"]  # [num_samples, seq_len] int64, ours exactly
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    workarounds = _cpu_workarounds()
    calib_start = time.perf_counter()
    recipe = _recipe(job["algorithm"], job["group_size"], model.config.num_hidden_layers,
                     job.get("bypass_divisibility_checks", False), job.get("weight_args"))
    oneshot(model=model, dataset=data if job["algorithm"] != "fp8" else None, recipe=recipe,  # fp8: data-free
            num_calibration_samples=ids.shape[0], max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
    calibration_seconds = time.perf_counter() - calib_start
    out = Path(job["out"])
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, save_compressed=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # import_checkpoint reads the tokenizer beside it
        shutil.copyfile(Path(job["dense"]) / f, out / f)
    return {"seconds": time.perf_counter() - start, "calibration_seconds": calibration_seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "num_threads": torch.get_num_threads(), "workarounds": workarounds,
            "versions": {"llmcompressor": llmcompressor.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__}}


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(json.loads(sys.argv[2]))
