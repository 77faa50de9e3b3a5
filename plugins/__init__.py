"""qkiln.plugins: custom ops (paged attention, KV cache write, quantized linears) for CPU and CUDA.

Importing this package registers the `qkiln::` ops with torch.library (ops.py) and never imports
triton: the Triton kernels load on the first call with CUDA tensors.
"""

from qkiln.plugins.kv_cache import KV_DTYPES, KVCache, allocate_kv_cache, kv_bytes_per_block
from qkiln.plugins.ops import (cache_write, fp8_w8a8_linear, paged_attention, w4a16_linear,
                               w8a16_linear)
from qkiln.plugins.packed_weights import (FP8Weight, W4A16Weight, W8A16Weight, prepare_fp8_w8a8,
                                          prepare_w4a16, prepare_w8a16)

__all__ = [
    "KV_DTYPES", "KVCache", "allocate_kv_cache", "kv_bytes_per_block", "cache_write",
    "paged_attention", "w4a16_linear", "w8a16_linear", "fp8_w8a8_linear", "W4A16Weight",
    "W8A16Weight", "FP8Weight", "prepare_w4a16", "prepare_w8a16", "prepare_fp8_w8a8",
]
