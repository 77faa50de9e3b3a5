"""Memory-bandwidth roofline for decode: how fast a step *could* be, and how close we get.

Decode is bound by memory bandwidth (Williams et al. 2009, "Roofline", applied per step): each
step must read every weight once and the live KV cache of every sequence in the batch, so

    bytes_per_step   = weight_bytes + kv_bytes_per_token * sum(context lengths in the batch)
    roofline tok/s   = batch_size * bandwidth / bytes_per_step
    % of roofline    = measured tok/s / roofline tok/s

Owns `measure_bandwidth` (a large tensor copy, timed in the same run as the benchmark it
normalises; bytes moved = read + write) and the byte counts. Weight bytes are what the kernels
must read in the *packed* form (int4 codes + scales/zeros, not the optional bf16 copy the CPU
keeps for prefill); the input embedding is a gather of `batch_size` rows and is not counted
unless it doubles as the tied LM head. Activations, logits and sampling are ignored (tiny next
to the weights for decode), so the roofline is an upper bound for data streamed from DRAM; a
model small enough to stay partly in the last-level cache (SmolLM2-135M in int4 is ~110 MB) can
exceed 100%, which says the copy bandwidth is the wrong ceiling for it, not that the figure is wrong.
"""

import dataclasses
import time

import torch
from torch import nn

from .report import summarize

# Past the last-level cache of any CPU we run on; GPUs get a larger copy (4.8 TB/s HBM3e).
DEFAULT_COPY_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}


def measure_bandwidth(device: str = "cpu", num_bytes: int | None = None, num_repeats: int = 5) -> dict:
    """Copy a `num_bytes` tensor `num_repeats` times -> bytes/s summary (read + write counted)."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    num_bytes = num_bytes or DEFAULT_COPY_BYTES[kind]
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # [num_bytes / 4]
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocation are not bandwidth
    rates = []
    for _ in range(num_repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        rates.append(2 * src.numel() * 4 / (time.perf_counter() - start))
    del src, dst
    return {"device": str(device), "copy_bytes": num_bytes, "bytes_per_s": summarize(rates)}


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


_MANY_ROW_FORMS = ("dequantized", "amx_tables")


def _packed_tensors(module: nn.Module, rows: int = 1):
    """Tensors a step of `rows` rows reads of a quantized linear's packed weight (a plugins
    dataclass): the packed codes and scales up to the rows its GEMV serves, past them the many-row
    form (the dense copy, or the AMX tables) where it has one (`int8_act`, a nested dataclass, is
    never counted); or a dense linear's oneDNN-packed weight (runtime/dense_linear.PackedLinear)."""
    from qkiln.plugins.cpu_linear import SMALL_M, int4_gemv_rows

    packed = getattr(module, "packed", None)
    if isinstance(packed, torch.Tensor):
        yield packed
    if packed is None or not dataclasses.is_dataclass(packed):
        return
    many_row = [getattr(packed, name, None) for name in _MANY_ROW_FORMS]
    many_row = [t for t in many_row if isinstance(t, torch.Tensor)]
    gemv_rows = int4_gemv_rows(*(getattr(packed, name, None) for name in _MANY_ROW_FORMS)) \
        if hasattr(packed, "amx_tables") else SMALL_M
    if many_row and rows > gemv_rows:
        yield from many_row
        return
    for f in dataclasses.fields(packed):
        value = getattr(packed, f.name)
        if isinstance(value, torch.Tensor) and f.name not in _MANY_ROW_FORMS:
            yield value


def weight_bytes(model: nn.Module, rows: int = 1) -> int:
    """Bytes one decode step of `rows` rows reads for weights (each storage counted once, tied
    weights too): a quantized linear's packed form, or past its GEMV's rows its many-row form."""
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors = list(module.parameters(recurse=False)) + list(_packed_tensors(module, rows))
        for t in tensors:  # oneDNN-packed weights have no data pointer: each is its own storage
            seen[id(t) if t.is_mkldnn else t.data_ptr()] = t.numel() * t.element_size()
    for emb in _gather_only_embeddings(model):
        seen.pop(emb.weight.data_ptr(), None)
    return sum(seen.values())


def _gather_only_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """Input embeddings that decode only gathers from (not shared with an output projection)."""
    if hasattr(model, "get_output_embeddings"):  # Hugging Face models
        out = model.get_output_embeddings()
        out_ptr = out.weight.data_ptr() if out is not None else None
        inp = model.get_input_embeddings()
        return [inp] if inp is not None and inp.weight.data_ptr() != out_ptr else []
    if getattr(model, "lm_head", None) is None:  # qkiln CausalLM with tied embeddings: the head reads it
        return []
    return [m for m in model.modules() if isinstance(m, nn.Embedding)]


def kv_bytes_per_token(engine) -> float:
    """Bytes of KV cache (all layers, K and V, with int4 scales) that one token occupies."""
    from qkiln.plugins import kv_bytes_per_block

    c, mc = engine.config, engine.model.config
    per_block = kv_bytes_per_block(mc.num_hidden_layers, c.block_size, mc.num_key_value_heads, mc.head_dim,
                                   engine.kv_dtype, c.kv_group_size)
    return per_block / c.block_size


def decode_roofline(bandwidth_bytes_per_s: float, weight_bytes_: int, kv_bytes_per_token_: float,
                    batch_size: int, mean_context_len: float) -> dict:
    """Upper bound on decode tokens/s for `batch_size` sequences of `mean_context_len` tokens."""
    bytes_per_step = weight_bytes_ + kv_bytes_per_token_ * batch_size * mean_context_len
    return {"bandwidth_bytes_per_s": bandwidth_bytes_per_s, "weight_bytes": weight_bytes_,
            "kv_bytes_per_token": kv_bytes_per_token_, "batch_size": batch_size,
            "mean_context_len": mean_context_len, "bytes_per_step": bytes_per_step,
            "roofline_tokens_per_s": batch_size * bandwidth_bytes_per_s / bytes_per_step}


def percent_of_roofline(measured_tokens_per_s: float, roofline: dict) -> float:
    return 100.0 * measured_tokens_per_s / roofline["roofline_tokens_per_s"]
