"""One buffer for the CPU weights a decode step streams, so they sit on transparent huge pages.

torch madvises CPU allocations of 2 MB and more for huge pages (host_memory.py), but a small
model's quantized linears are smaller than that one by one (SmolLM2-135M's int4 linears 0.1-0.9
MB with their scales), so as loaded they sit on 4 KB pages: a batch-1 step reads ~60 MB of them
across ~15,000 pages, a TLB miss and a restart of the hardware prefetcher at every page. Copied
into one buffer in layer order, they sit on ~30 huge pages: batch-1 decode of the `w4a16-rtn`
SmolLM2 artifact 3.32 -> 3.17, 3.54 -> 3.35 and (through loader.py) 3.12 -> 2.95 ms a step
(same-process A/Bs of two loads of the artifact, 10, 20 and 20 alternating runs, 8/10, 16/20 and
15/20 pairs faster; session 14). Offline 64 x 128/128 runs decode through the dense copies and
did not change beyond the host's noise; gathering those too (269 MB) was not measurably better.

The weights keep their dtypes, shapes and contiguity; their tensors become views of the buffer
(64-byte aligned), which their storage keeps alive. Kernels read them through data_ptr, so nothing
else changes.
"""

import torch

from qkiln.plugins.packed_weights import W4A16Weight, W8A16Weight

_ALIGN = 64  # bytes: a cache line, and what the kernels' aligned loads could ask for

# The tensors the CPU GEMV kernels read (not the many-row copies: `dequantized`, `int8_act`).
# The AMX int4 GEMM's tables go along: it reads the same codes (packed_weights.py).
_GEMV_FIELDS = {W4A16Weight: ("packed", "scales", "zeros", "amx_tables"),
                W8A16Weight: ("weight", "scales")}


def gather_gemv_weights(weights: list) -> int:
    """Move the GEMV tensors of the CPU weights in `weights` (W4A16Weight / W8A16Weight; others
    are skipped) into one buffer, in the order given; returns its size in bytes (0: nothing)."""
    parts = []
    for w in weights:
        fields = _GEMV_FIELDS.get(type(w), ())
        if fields and w.target == "cpu":
            parts += [(w, f) for f in fields if getattr(w, f) is not None]
    if not parts:
        return 0
    sizes = [-(-getattr(w, f).nbytes // _ALIGN) * _ALIGN for w, f in parts]
    arena = torch.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for (w, field), size in zip(parts, sizes):
        tensor = getattr(w, field).contiguous()
        view = arena[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        setattr(w, field, view)
        offset += size
    return offset
