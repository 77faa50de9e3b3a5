"""qkiln's own CPU kernels (csrc/cpu_gemv.cpp): lazy JIT build, native weight packing, wrappers.

Owns: building the C++ extension once per process (torch.utils.cpp_extension.load, cached in the
torch extensions dir, so later processes only load the .so), converting canonical quantized
weights (packed_weights.py) into the layouts the kernels read, and thin calls into them.

Invariants: nothing is compiled at import time; `native_extension()` returns None, after one line
on stderr saying why, when the build fails or QKILN_NATIVE_CPU=0, and callers then keep torch's
kernels. The packed bytes depend only on the canonical weights (not on the CPU), but they are
still a runtime layout: never stored in an artifact. Layouts and math: the header of cpu_gemv.cpp.
"""

import os
import sys
from pathlib import Path

import torch

_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_gemv.cpp"
TILE_ROWS = 4  # output rows per tile (kRows in cpu_gemv.cpp)
CHUNK = 64  # weights per row per chunk (kChunk)
_MISSING = object()
_extension = _MISSING


def _build(extra_cflags: list[str]):
    from torch.utils.cpp_extension import load

    # -fopenmp: at::parallel_for is a header template whose `omp parallel` needs it (the .so then
    # binds to the libgomp.so.1 torch already loaded, so there is one thread pool).
    flags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
    # -march=native code must not be reused on another CPU: the extensions dir is per machine
    # (~/.cache/torch_extensions), and a source or flag change rebuilds.
    name = "qkiln_cpu_gemv" + "".join("_" + f.strip("-").replace("=", "_").replace("-", "_")
                                      for f in extra_cflags)
    return load(name=name, sources=[str(_SOURCE)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], verbose=False)


def native_extension():
    """The compiled extension module, or None (reason logged once) when it cannot be used."""
    global _extension
    if _extension is _MISSING:
        if os.environ.get("QKILN_NATIVE_CPU", "1") == "0":
            print("qkiln: native CPU kernels disabled (QKILN_NATIVE_CPU=0); using torch's",
                  file=sys.stderr)
            _extension = None
        else:
            try:
                _extension = _build([])
            except Exception as e:  # compiler missing, headers missing, ninja missing, ...
                print(f"qkiln: native CPU kernels unavailable ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); "
                      "using torch's kernels", file=sys.stderr)
                _extension = None
    return _extension


def build_portable_extension():
    """A second build without AVX-512 (AVX2 only), to test the portable int4 path on any CPU."""
    return _build(["-mno-avx512f"])


def pack_w4a16(q: torch.Tensor, scales: torch.Tensor, zero_point: torch.Tensor | None,
               group_size: int):
    """Unsigned int4 q [out, in] (0..15), scales [out, G], zero points [out, G] (None: 8) ->
    (packed uint8 [out_p / 4, in_p / 64, 4, 32], scales fp32 [out_p / 4, G, 4],
     c fp32 [out_p, G]) for cpu_gemv.cpp's int4 kernel, with c = s * (16 + z).
    """
    out_features, in_features = q.shape
    num_groups = scales.shape[1]
    out_padded = -(-out_features // TILE_ROWS) * TILE_ROWS
    in_padded = -(-in_features // CHUNK) * CHUNK
    q = torch.nn.functional.pad(q.int(), (0, in_padded - in_features, 0, out_padded - out_features))
    q = q.reshape(out_padded, in_padded // CHUNK, 4, 16)  # [o, chunk, nibble set, word]
    words = q[:, :, 0] | (q[:, :, 1] << 4) | (q[:, :, 2] << 8) | (q[:, :, 3] << 12)  # [o, c, 16]
    chunk_bytes = torch.stack([words & 255, words >> 8], dim=-1).to(torch.uint8)  # [o, c, 16, 2]
    packed = chunk_bytes.reshape(out_padded // TILE_ROWS, TILE_ROWS, in_padded // CHUNK, 32)
    packed = packed.permute(0, 2, 1, 3).contiguous()  # [tile, chunk, row, 32]
    zero = torch.full_like(scales, 8.0, dtype=torch.float32) if zero_point is None \
        else zero_point.float()
    row_pad = (0, 0, 0, out_padded - out_features)
    s = torch.nn.functional.pad(scales.float(), row_pad)  # [out_p, G]; padded rows scale 0
    c = torch.nn.functional.pad(scales.float() * (16.0 + zero), row_pad).contiguous()
    tiled_scales = s.reshape(-1, TILE_ROWS, num_groups).transpose(1, 2).contiguous()
    return packed, tiled_scales, c


def is_native_w4a16(scales: torch.Tensor) -> bool:
    """The native int4 layout is marked by fp32 scales [out_p / 4, G, 4] (tinygemm's are bf16)."""
    return scales.dtype == torch.float32 and scales.dim() == 3


def w4a16_gemm(x2d, packed, scales, c, bias, group_size: int, out_features: int):
    """x [M, in] -> [M, out] in x's dtype, through the native int4 kernel."""
    return native_extension().w4a16_gemm(x2d.contiguous(), packed, scales, c, bias, group_size,
                                         out_features)


def w8a16_gemm(x2d, weight, scales, bias):
    """x [M, in] @ (int8 weight [out, in] * fp32 scales [out])^T (+ bias) in x's dtype."""
    return native_extension().w8a16_gemm(x2d.contiguous(), weight, scales, bias)
