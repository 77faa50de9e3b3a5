"""Baselines measured in the same run as qkiln, on the same token ids and lengths.

Owns two comparators, each returning the figures latency.py / throughput.py report (ONNX Runtime
GenAI, the third, is ort_genai.py):
- Hugging Face `generate` (static batching, greedy, eager; what users run without a server).
  The model loads with transformers' own loaders: a HF directory, or a GGUF file through
  `from_pretrained(dir, gguf_file=name)` fully dequantized (`GgufConfig(dequantize=True)`) so the
  baseline is a plain dense bf16 model whatever optional kernels are installed.
  Batch-1 latency: T1 = generate 1 token (prefill + first sample), TN = generate N tokens;
  decode tokens/s = batch * (N - 1) / (TN - T1). Throughput: the requests in consecutive static
  batches of `batch_size`; each batch is left-padded and runs until its longest output
  (`min_new_tokens = max_new_tokens`, so EOS cannot end it early); only requested tokens count.
- llama.cpp through llama-cpp-python on the same GGUF (batch-1 decode; yields are timed), in a
  child process: built with -march=native on an AMX Xeon host, its AMX backend died with SIGSEGV
  in ggml_backend_amx_mul_mat on every generation (a general protection fault: GCC 12 drops the
  stores of a stack-held tile configuration), which took the whole comparison run with it. It
  returns {"skipped": reason} when not installed, when it fails or when its process dies twice,
  and never raises.
transformers and llama_cpp are imported inside functions only.
"""

import importlib.util
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

from qkiln.runtime.source import resolve_source

from .report import log, summarize_runs
from .workload import Workload


def load_hf_model(model: str, dtype: torch.dtype = torch.bfloat16):
    """A transformers CausalLM for an alias, HF directory or .gguf file, in eval mode."""
    from transformers import AutoModelForCausalLM

    path = resolve_source(model)
    kwargs = {"dtype": dtype}
    if path.is_file() and path.suffix == ".gguf":
        from transformers.utils.quantization_config import GgufConfig

        kwargs.update(gguf_file=path.name, quantization_config=GgufConfig(dequantize=True))
        path = path.parent
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


def _pad_id(hf_model) -> int:
    gc = hf_model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    return 0 if pad is None else int(pad)


def _left_padded(prompts: list[list[int]], pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def hf_generate(hf_model, prompts: list[list[int]], num_new_tokens: int) -> torch.Tensor:
    ids, mask = _left_padded(prompts, _pad_id(hf_model))
    with torch.inference_mode():
        return hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=num_new_tokens,
                                 min_new_tokens=num_new_tokens, do_sample=False, pad_token_id=_pad_id(hf_model))


def hf_latency(hf_model, workload: Workload, num_repeats: int = 3, label: str = "hf") -> dict:
    """Prefill and decode figures for one static batch (all of `workload`)."""
    n = max(workload.output_lens)
    hf_generate(hf_model, workload.prompts, 2)  # warmup, untimed
    runs = []
    for i in range(num_repeats):
        t0 = time.perf_counter()
        hf_generate(hf_model, workload.prompts, 1)
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf_generate(hf_model, workload.prompts, n)
        tn = time.perf_counter() - t0
        num_new = out.shape[1] - max(len(p) for p in workload.prompts)
        assert num_new == n, (num_new, n)  # min_new_tokens keeps EOS from ending it early
        b = workload.num_requests
        runs.append({"prefill_s": t1, "prefill_tokens_per_s": workload.num_input_tokens / t1,
                     "decode_tokens_per_s": b * (n - 1) / (tn - t1) if tn > t1 else 0.0, "e2e_s": tn})
        log(f"{label}: repeat {i + 1}/{num_repeats}: prefill {1000 * t1:.1f} ms, "
            f"decode {runs[-1]['decode_tokens_per_s']:.1f} tok/s")
    return summarize_runs(runs, ("prefill_s", "prefill_tokens_per_s", "decode_tokens_per_s", "e2e_s"))


def hf_throughput(hf_model, workload: Workload, batch_size: int, num_repeats: int = 3, label: str = "hf") -> dict:
    """Static batching: consecutive batches of `batch_size` requests, each to its longest output."""
    batches = static_batches(workload, batch_size)
    hf_generate(hf_model, workload.prompts[:batch_size], 2)  # warmup at this batch shape
    runs = []
    for rep in range(num_repeats):
        t0 = time.perf_counter()
        for rows in batches:
            hf_generate(hf_model, [workload.prompts[r] for r in rows], max(workload.output_lens[r] for r in rows))
        runs.append(throughput_figures(workload, time.perf_counter() - t0))
        log(f"{label} batch {batch_size}: repeat {rep + 1}/{num_repeats}: "
            f"{runs[-1]['output_tokens_per_s']:.1f} output tok/s, {runs[-1]['elapsed_s']:.1f} s")
    return summarize_runs(runs, THROUGHPUT_KEYS)


def static_batches(workload: Workload, batch_size: int) -> list[range]:
    """The request indices of consecutive static batches of `batch_size` (the last may be short)."""
    return [range(i, min(i + batch_size, workload.num_requests))
            for i in range(0, workload.num_requests, batch_size)]


THROUGHPUT_KEYS = ("elapsed_s", "requests_per_s", "input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s")


def throughput_figures(workload: Workload, elapsed_s: float) -> dict:
    num_in, num_out = workload.num_input_tokens, workload.num_output_tokens
    return {"elapsed_s": elapsed_s, "requests_per_s": workload.num_requests / elapsed_s,
            "input_tokens_per_s": num_in / elapsed_s, "output_tokens_per_s": num_out / elapsed_s,
            "total_tokens_per_s": (num_in + num_out) / elapsed_s}


def decode_figures(t_start: float, token_times: list[float], num_input: int) -> dict:
    prefill = token_times[0] - t_start
    decode = (len(token_times) - 1) / (token_times[-1] - token_times[0]) if len(token_times) > 1 else 0.0
    return {"prefill_s": prefill, "prefill_tokens_per_s": num_input / prefill, "decode_tokens_per_s": decode,
            "e2e_s": token_times[-1] - t_start}


LATENCY_KEYS = ("prefill_s", "prefill_tokens_per_s", "decode_tokens_per_s", "e2e_s")


def llama_cpp_latency(gguf: str | Path | None, workload: Workload, num_threads: int, num_repeats: int = 3) -> dict:
    """Batch-1 greedy decode of the first prompt with llama.cpp on `gguf` (same file as the source),
    in a child process (a crash there costs this row, not the run; one retry)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    if gguf is None or not str(gguf).endswith(".gguf"):
        return {"skipped": "the source model is not a .gguf file"}
    return run_in_child("llama.cpp", _llama_cpp_latency, gguf, workload, num_threads, num_repeats)


def run_in_child(name: str, fn, *args, attempts: int = 2):
    """fn(*args) in a fresh (spawned) process; {"skipped": reason} when that process dies each of
    `attempts` times (fn and args must pickle)."""
    for attempt in range(attempts):
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            log(f"{name}: its process died (attempt {attempt + 1} of {attempts})")
    return {"skipped": f"{name}'s process died {attempts} times (a crash inside it)"}


def _llama_cpp_latency(gguf, workload: Workload, num_threads: int, num_repeats: int) -> dict:
    from llama_cpp import Llama

    prompt, n = workload.prompts[0], workload.output_lens[0]
    try:
        llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + n + 8, n_threads=num_threads,
                    n_threads_batch=num_threads, n_batch=max(512, len(prompt)), verbose=False)
        runs = []
        for _ in range(num_repeats + 1):  # the first pass is the warmup
            llm.reset()  # forget the previous pass so the prompt is evaluated again
            t0, times = time.perf_counter(), []
            for _token in llm.generate(prompt, temp=0.0, reset=True):
                times.append(time.perf_counter())
                if len(times) == n:
                    break
            runs.append(decode_figures(t0, times, len(prompt)))
    except Exception as e:  # a comparator must not end the run: record why it failed
        return {"skipped": f"llama-cpp-python failed: {type(e).__name__}: {e}"}
    return summarize_runs(runs[1:], LATENCY_KEYS)
