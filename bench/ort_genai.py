"""ONNX Runtime GenAI as a comparator: its int4 model folder built from the same weights, batch-1
decode and static-batch offline throughput on the same token ids as qkiln.

The folder comes from onnxruntime-genai's own model builder (`build_ort_model`, or
`qkiln bench ort-model`): the source is loaded with transformers (a GGUF fully dequantized, as
the HF baseline is), saved as a HF directory, and handed to
`python -m onnxruntime_genai.models.builder -p int4 -e cpu`, whose defaults for the CPU are
RTN int4 in blocks of 32 with int8 activations in the matmuls (accuracy level 4) and the lm_head
quantized too: the engine the plugins issue names as the best CPU one it found.

Each figure function returns {"skipped": reason} when onnxruntime-genai is not installed, no
folder was given, or it fails, and never raises: a comparator must not end a benchmark run.
onnxruntime_genai, numpy and transformers are imported inside functions only.
"""

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .baselines import (LATENCY_KEYS, THROUGHPUT_KEYS, decode_figures, load_hf_model, static_batches,
                        throughput_figures)
from .report import log, summarize_runs
from .workload import BenchConfigError, Workload


def _import_genai():
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None, {"skipped": "onnxruntime-genai is not installed (pip install onnxruntime-genai)"}
    return og, None


def _check_folder(model_dir) -> dict | None:
    if model_dir is None or not (Path(model_dir) / "genai_config.json").is_file():
        return {"skipped": "no ONNX Runtime GenAI model folder given (--ort-model DIR with "
                           "genai_config.json; `qkiln bench ort-model` builds one)"}
    return None


def _generate(og, model, prompts: list[list[int]], num_new: int) -> list[float]:
    """Greedy, `num_new` tokens for every row (EOS suppressed by min_length); the time of each step."""
    import numpy as np

    params = og.GeneratorParams(model)
    total = len(prompts[0]) + num_new
    params.set_search_options(max_length=total, min_length=total, do_sample=False,
                              batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompts, dtype=np.int32))  # [batch, prompt]: prefill
    times = []
    while not generator.is_done() and len(times) < num_new:
        generator.generate_next_token()
        times.append(time.perf_counter())
    del generator
    return times


def ort_genai_latency(model_dir, workload: Workload, num_repeats: int = 3) -> dict:
    """Batch-1 greedy decode of the first prompt (latency.py's definitions)."""
    og, skipped = _import_genai()
    skipped = skipped or _check_folder(model_dir)
    if skipped:
        return skipped
    prompt, n = workload.prompts[0], workload.output_lens[0]
    try:
        model = og.Model(str(model_dir))
        runs = []
        for _ in range(num_repeats + 1):  # the first pass is the warmup
            t0 = time.perf_counter()
            runs.append(decode_figures(t0, _generate(og, model, [prompt], n), len(prompt)))
    except Exception as e:  # noqa: BLE001 - recorded, see the module docstring
        return {"skipped": f"onnxruntime-genai failed: {type(e).__name__}: {e}"}
    return summarize_runs(runs[1:], LATENCY_KEYS)


def ort_genai_throughput(model_dir, workload: Workload, batch_size: int, num_repeats: int = 3) -> dict:
    """Static batching like the HF baseline: consecutive batches of `batch_size` requests, each run
    to its longest output; only requested tokens count. Prompts of one length only (no padding).
    Also the run's split: `prefill_s` (each batch's prompt to its first tokens, summed) and
    `decode_tokens_per_s` (the tokens after the first over the time after it)."""
    og, skipped = _import_genai()
    skipped = skipped or _check_folder(model_dir)
    if skipped:
        return skipped
    if len({len(p) for p in workload.prompts}) != 1:
        return {"skipped": "ORT GenAI batches here take prompts of one length (use a fixed --input-len)"}
    batches = static_batches(workload, batch_size)
    try:
        model = og.Model(str(model_dir))
        _generate(og, model, workload.prompts[:batch_size], 2)  # warmup at this batch shape
        runs = []
        for rep in range(num_repeats):
            t0 = time.perf_counter()
            prefill_s = decode_s = decode_tokens = 0.0
            for rows in batches:
                start = time.perf_counter()
                times = _generate(og, model, [workload.prompts[r] for r in rows],
                                  max(workload.output_lens[r] for r in rows))
                prefill_s += times[0] - start  # the prompt and the first token of each row
                decode_s += times[-1] - times[0]
                decode_tokens += len(rows) * (len(times) - 1)
            runs.append({**throughput_figures(workload, time.perf_counter() - t0),
                         "prefill_s": prefill_s, "decode_tokens_per_s": decode_tokens / decode_s})
            log(f"ort-genai batch {batch_size}: repeat {rep + 1}/{num_repeats}: "
                f"{runs[-1]['output_tokens_per_s']:.1f} output tok/s, {runs[-1]['elapsed_s']:.1f} s")
    except Exception as e:  # noqa: BLE001 - recorded, see the module docstring
        return {"skipped": f"onnxruntime-genai failed: {type(e).__name__}: {e}"}
    return summarize_runs(runs, (*THROUGHPUT_KEYS, "prefill_s", "decode_tokens_per_s"))


def build_ort_model(model: str, out_dir: Path) -> Path:
    """Build the int4 CPU folder for `model` (alias, HF dir or .gguf) into `out_dir` with
    onnxruntime-genai's builder (needs onnxruntime-genai, onnx and onnx-ir). It is written under
    `<out_dir>.partial` and renamed when the builder succeeds, so a failed build never leaves a
    folder that looks finished."""
    missing = [m for m in ("onnxruntime_genai", "onnx", "onnx_ir") if importlib.util.find_spec(m) is None]
    if missing:
        raise BenchConfigError(f"building an ORT GenAI folder needs {', '.join(missing)}: "
                               "pip install onnxruntime-genai onnx onnx-ir")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise BenchConfigError(f"{out_dir} already exists; remove it or choose another folder")
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    hf = load_hf_model(model, torch.float32)
    with tempfile.TemporaryDirectory(prefix="qkiln-ort-src-") as src:
        log(f"saving {model} as a Hugging Face folder for the ORT builder")
        hf.save_pretrained(src)
        _tokenizer(model).save_pretrained(src)
        del hf
        log(f"building the ONNX Runtime GenAI int4 folder in {out_dir}")
        done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", src,
                               "-o", str(partial), "-p", "int4", "-e", "cpu",
                               "-c", str(Path(src) / "cache")])
    if done.returncode != 0:
        raise BenchConfigError(f"onnxruntime-genai's builder failed (exit {done.returncode}, its "
                               f"output is above); the partial folder is {partial}")
    partial.rename(out_dir)
    return out_dir


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    from qkiln.runtime.source import resolve_source

    path = resolve_source(model)
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))
