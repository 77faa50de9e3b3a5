"""qkiln's plugin nodes in ONNX graphs: the `qkiln` domain's CacheWrite and PagedAttention.

An exported engine (compile/onnx_export.py) reaches the paged KV cache only through these two
nodes, one pair per decoder layer. They are the registered ops (ops.py) as graph nodes, with the
same flat inputs in the same order, so every cache dtype (bf16 / fp16 / fp32 / fp8 / int4) and
key smoothing export the same way; an absent optional input is "" (ONNX's convention):

    CacheWrite(key [N, Hkv, D] f32, value, k_cache, v_cache, k_scale, v_scale, k_group_scale,
               k_group_min, v_group_scale, v_group_min, k_channel_scale, slot_mapping [N] i64)
        -> k_cache', v_cache' (+ k_group_scale', k_group_min', v_group_scale', v_group_min' for int4)
    PagedAttention(query [N, Hq, D] f32, k_cache', v_cache', k_scale, ..., k_channel_scale,
                   block_tables [S, B] i32, seq_lens [S] i32, query_start_loc [S + 1] i32)
        -> out [N, Hq, D] f32

ONNX has no in-place update, so CacheWrite returns the caches it wrote (ONNX Runtime's
com.microsoft.PagedAttention does the same): a runtime binds each output to its input's buffer
and the write happens in place; the graph's outputs are the updated caches.

Who runs them: TensorRT's ONNX parser resolves a node it does not know to the plugin registered
under its op_type with the `plugin_namespace` / `plugin_version` attributes written here, and ONNX
Runtime takes a custom-op library for the domain; qkiln provides neither kernel yet (TensorRT
cannot be installed here). What runs them today is `onnx.reference.ReferenceEvaluator` through
`reference_ops()`, which call plugins/reference.py (the spec every kernel is tested against).
"""

import numpy as np
import torch

from qkiln.plugins.kv_cache import FP8_DTYPE
from qkiln.plugins.reference import reference_cache_write, reference_paged_attention

DOMAIN = "qkiln"
DOMAIN_VERSION = 1
PLUGIN_VERSION = "1"
# the op_tensors() fields after k / v, in the ops' schema order
CACHE_PARAMS = ("k_scale", "v_scale", "k_group_scale", "k_group_min", "v_group_scale", "v_group_min",
                "k_channel_scale")
INT4_WRITTEN = ("k_group_scale", "k_group_min", "v_group_scale", "v_group_min")


def plugin_attributes() -> dict:
    return {"plugin_namespace": DOMAIN, "plugin_version": PLUGIN_VERSION}


def written_fields(kv_dtype: str) -> tuple[str, ...]:
    """The cache tensors a CacheWrite node writes (and returns), in output order."""
    return ("k", "v") + (INT4_WRITTEN if kv_dtype == "int4" else ())


def to_torch(a: np.ndarray | None) -> torch.Tensor | None:
    """numpy (ml_dtypes bfloat16 / float8_e4m3fn included) -> a torch tensor of the same dtype."""
    if a is None:
        return None
    name = a.dtype.name
    if name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    if name == "float8_e4m3fn":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(FP8_DTYPE)
    return torch.from_numpy(np.array(a))  # a writable copy: the reference writes caches in place


def to_numpy(t: torch.Tensor) -> np.ndarray:
    import ml_dtypes

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == FP8_DTYPE:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def reference_ops() -> list[type]:
    """OpRun classes for onnx.reference.ReferenceEvaluator(model, new_ops=reference_ops())."""
    from onnx.reference.op_run import OpRun

    class CacheWrite(OpRun):
        op_domain = DOMAIN

        def _run(self, key, value, k_cache, v_cache, *params_and_slots, kv_dtype=None, group_size=None,
                 plugin_namespace=None, plugin_version=None):
            *params, slot_mapping = params_and_slots
            cache = {"k": to_torch(k_cache), "v": to_torch(v_cache)}
            cache |= {name: to_torch(p) for name, p in zip(CACHE_PARAMS, params)}
            reference_cache_write(to_torch(key), to_torch(value), *(cache[f] for f in ("k", "v") + CACHE_PARAMS),
                                  to_torch(slot_mapping))
            return tuple(to_numpy(cache[f]) for f in written_fields(kv_dtype))

    class PagedAttention(OpRun):
        op_domain = DOMAIN

        def _run(self, query, k_cache, v_cache, *rest, scale=None, kv_dtype=None, plugin_namespace=None,
                 plugin_version=None):
            *params, block_tables, seq_lens, query_start_loc = rest
            out = reference_paged_attention(to_torch(query), to_torch(k_cache), to_torch(v_cache),
                                            *(to_torch(p) for p in params), to_torch(block_tables),
                                            to_torch(seq_lens), to_torch(query_start_loc), scale)
            return (to_numpy(out),)

    return [CacheWrite, PagedAttention]
