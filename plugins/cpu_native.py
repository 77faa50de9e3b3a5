"""qkiln's own CPU kernels (csrc/): a lazy JIT build, native weight packing, wrappers.

Owns: building the C++ extension once per process (torch.utils.cpp_extension.load, cached in the
torch extensions dir, so later processes only load the .so), converting canonical quantized
weights (packed_weights.py) into the layouts the kernels read, and thin calls into them.
One extension from several sources (csrc/: int4 and int8 GEMVs, the bf16 and int8-activation
GEMMs, paged attention and cache write, fused norm / SiLU / RoPE, the decode stack, module.cpp
binding them); `native_extension()` serves the quantized linears, `native_ops()` the attention and
the small ops (the same module, switchable on its own).

Invariants: nothing is compiled at import time; each accessor returns None, after one line on
stderr saying why, when the build fails or QKILN_NATIVE_CPU=0 (QKILN_NATIVE_CPU_OPS=0 turns off
only the ops and the decode stack), and callers then keep torch's code. `use_native_ops(False)`
switches the ops off at run time (same-process A/B measurements and tests). The packed bytes
depend only on the canonical weights (not on the CPU), but they are still a runtime layout: never
stored in an artifact. Layouts and math: the headers of the .cpp files.
"""

import contextlib
import fcntl
import hashlib
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from qkiln.plugins import reference_small_ops
from qkiln.plugins.env_switches import check_kernel_switches, env_switch

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("cpu_gemv_int4.cpp", "cpu_gemv_int4_a8.cpp", "cpu_gemv_fixed16.cpp",
            "cpu_gemv_int8.cpp", "cpu_gemv_int8_a8.cpp", "cpu_gemm_w4a8.cpp", "cpu_gemm_bf16.cpp", "cpu_gemm_bf16_amx.cpp",
            "cpu_gemm_codes_amx.cpp", "cpu_attention.cpp", "cpu_attention_decode_avx2.cpp",
            "cpu_attention_decode_bf16.cpp", "cpu_attention_int4.cpp",
            "cpu_attention_prefill.cpp", "cpu_attention_prefill_amx.cpp", "cpu_kv_write.cpp",
            "cpu_small_ops.cpp",
            "decode_stack.cpp", "decode_stack_rows.cpp", "module.cpp")
TILE_ROWS = 4  # output rows per tile (kRows in gemv_common.h)
CHUNK = 64  # weights per row per chunk (kChunk)
# A load (not a first build) slower than this is a rebuild or a wait on another process: said on stderr.
SLOW_LOAD_S = 10.0
_MISSING = object()
_extension = _MISSING
_ops_enabled = True


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja qkiln depends on sits beside the venv's Python, which
    is not on PATH when `.venv/bin/qkiln` runs without the venv activated (the kernels then fell
    back to torch's, with "pip install ninja" as the reason)."""
    try:
        import ninja
    except ImportError:  # a system ninja, if any, is what torch finds
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(p for p in (path, ninja.BIN_DIR) if p)  # last: a system one first


def _build(extra_cflags: list[str]):
    from torch.utils.cpp_extension import _get_build_directory, load

    _ninja_on_path()

    # -fopenmp: at::parallel_for is a header template whose `omp parallel` needs it (the .so then
    # binds to the libgomp.so.1 torch already loaded, so there is one thread pool).
    # -ffp-contract=off: a product HF rounds to bf16 must not fuse into an FMA (small ops); the
    # GEMVs' inner loops are explicit FMA / dot-product intrinsics, which the flag leaves alone.
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", *extra_cflags]
    name = extension_name(extra_cflags)
    # A compile takes minutes with nothing on the screen: say so, or it looks hung. A first one is
    # known in advance (once no other process is building it), a wait on another process by the
    # lock, a rebuild after a source change only by how long the load takes.
    folder = Path(_get_build_directory(name, verbose=False))
    start = time.perf_counter()
    with _build_lock(folder):
        first = not (folder / f"{name}.so").exists()
        if first:
            print(f"qkiln: compiling its CPU kernels for this machine, once (about 5 minutes on 2 cores; kept in "
                  f"{folder})", file=sys.stderr)
        slow = threading.Timer(SLOW_LOAD_S, lambda: print(
            f"qkiln: loading its CPU kernels is taking a while: recompiling after a change (about 5 minutes on "
            f"2 cores) in {folder}", file=sys.stderr))
        slow.daemon = True
        if not first:
            slow.start()
        try:
            module = load(name=name, sources=[str(_CSRC / s) for s in _SOURCES], extra_cflags=flags,
                          extra_ldflags=["-fopenmp"], extra_include_paths=[str(_CSRC)], verbose=False)
        finally:
            slow.cancel()
    if first or time.perf_counter() - start > SLOW_LOAD_S:
        print(f"qkiln: CPU kernels ready in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return module


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One build of `folder` at a time, by an flock the kernel drops when its holder dies. torch's
    own lock is a file its builder deletes when done: a build killed mid-compile (Ctrl-C, a
    timeout) left it, and every later load waited on it forever. Under the flock nobody else is
    building, so a torch lock found then is such a leftover: removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "qkiln-build.lock", "a") as holder:
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"qkiln: waiting for another process compiling its CPU kernels in {folder}", file=sys.stderr)
            fcntl.flock(holder, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        yield


def extension_name(extra_cflags: list[str]) -> str:
    """The build folder's name: what the compiled code depends on."""
    from torch.utils.cpp_extension import include_paths

    # -march=native code must not be reused on another CPU: the CPU's instruction sets are in the
    # name, as a home folder (~/.cache/torch_extensions) shared over NFS would otherwise hand a
    # node without AVX-512 the build of one with it (SIGILL, no error). A source or flag change
    # rebuilds. The checkout's path and torch's headers are in the name too: two checkouts, or two
    # Python environments, on one machine would otherwise share one build folder and rebuild every
    # object each time the other one loaded (minutes each switch, with nothing on the screen).
    key = "\n".join([str(_CSRC.resolve()), torch.__version__, *include_paths(), _cpu_features()])
    return f"qkiln_cpu_{hashlib.sha256(key.encode()).hexdigest()[:8]}" + "".join(
        "_" + f.strip("-").replace("=", "_").replace("-", "_") for f in extra_cflags)


def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's feature flags (Linux), else its platform names."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _load_or_none(what: str, switches: tuple[str, ...], build, fallback: str):
    """build() once, or None after one stderr line saying why (switched off, or the build failed)."""
    off = [s for s in switches if not env_switch(s, True)]
    if off:
        print(f"qkiln: {what} disabled ({off[0]}=0); using torch's", file=sys.stderr)
        return None
    try:
        return build()
    except Exception as e:  # compiler missing, headers missing, ninja missing, ...
        last_line = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        print(f"qkiln: {what} unavailable ({type(e).__name__}: {last_line}); using {fallback}",
              file=sys.stderr)
        return None


def native_extension():
    """The compiled extension module, or None (reason logged once) when it cannot be used."""
    global _extension
    if _extension is _MISSING:
        check_kernel_switches()  # a misspelt one refused before minutes of compiling
        _extension = _load_or_none("native CPU kernels", ("QKILN_NATIVE_CPU",), lambda: _build([]),
                                   "torch's kernels")
    return _extension


_ops_switch_logged = False


def native_ops():
    """The extension for the attention and small ops, or None (built but switched off, or absent)."""
    global _ops_switch_logged
    if not _ops_enabled:
        return None
    if not env_switch("QKILN_NATIVE_CPU_OPS", True):
        if not _ops_switch_logged:
            print("qkiln: native CPU ops disabled (QKILN_NATIVE_CPU_OPS=0); using torch's code",
                  file=sys.stderr)
            _ops_switch_logged = True
        return None
    return native_extension()


def use_native_ops(enabled: bool) -> bool:
    """Turn the native ops on or off for this process; returns the previous setting."""
    global _ops_enabled
    previous, _ops_enabled = _ops_enabled, enabled
    return previous


def build_portable_extension():
    """A second build without AVX-512, to test on any CPU the kernels a CPU without it runs: the
    AVX2 paths (int4 GEMV, vec.h's two-half vectors) where the compiler targets AVX2, plain C++
    for the rest (and for everything on a CPU without AVX2)."""
    return _build(["-mno-avx512f"])


def pack_w4a16(q: torch.Tensor, scales: torch.Tensor, zero_point: torch.Tensor | None,
               group_size: int, int8_activations: bool = False):
    """Unsigned int4 q [out, in] (0..15), scales [out, G], zero points [out, G] (None: 8) ->
    (packed uint8 [out_p / 4, in_p / 64, 4, 32], scales fp32 [out_p / 4, G, 4],
     c fp32 [out_p / 4, G, 4]) for cpu_gemv_int4.cpp's kernel, with c = s * (16 + z).
    int8_activations: for the int8-activation GEMV (cpu_gemv_int4_a8.cpp) instead, which the
    exact kernel can't read: byte i of a row's 64-weight chunk at k0 is q[k0 + i] | q[k0 + 32 + i]
    << 4, and c = s * z.
    """
    out_features, in_features = q.shape
    num_groups = scales.shape[1]
    out_padded = -(-out_features // TILE_ROWS) * TILE_ROWS
    in_padded = -(-in_features // CHUNK) * CHUNK
    # uint8 throughout: a load repacks every int4 linear, and int32 temporaries took ~4x the time
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, in_padded - in_features, 0, out_padded - out_features))
    if int8_activations:
        q = q.reshape(out_padded, in_padded // CHUNK, 2, 32)  # [o, chunk, nibble, byte]
        chunk_bytes = q[:, :, 0] | (q[:, :, 1] << 4)  # [o, c, 32]
    else:
        # 16-bit word w of a chunk holds codes w, 16 + w, 32 + w, 48 + w from its low nibble up,
        # stored little-endian: byte 0 = codes w | 16 + w, byte 1 = codes 32 + w | 48 + w
        q = q.reshape(out_padded, in_padded // CHUNK, 2, 2, 16)  # [o, chunk, byte, nibble, word]
        chunk_bytes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).transpose(2, 3)  # [o, c, 16, 2]
    packed = chunk_bytes.reshape(out_padded // TILE_ROWS, TILE_ROWS, in_padded // CHUNK, 32)
    packed = packed.permute(0, 2, 1, 3).contiguous()  # [tile, chunk, row, 32]
    zero = torch.full_like(scales, 8.0, dtype=torch.float32) if zero_point is None \
        else zero_point.float()
    row_pad = (0, 0, 0, out_padded - out_features)
    s = torch.nn.functional.pad(scales.float(), row_pad)  # [out_p, G]; padded rows scale 0
    # The exact kernel's bf16 codes are 16 + q (cpu_gemv_int4.cpp), the int8-activation ones q.
    offset = 0.0 if int8_activations else 16.0
    c = torch.nn.functional.pad(scales.float() * (offset + zero), row_pad)  # [out_p, G]
    tiled_scales, tiled_c = (t.reshape(-1, TILE_ROWS, num_groups).transpose(1, 2).contiguous()
                             for t in (s, c))
    return packed, tiled_scales, tiled_c


def is_native_w4a16(scales: torch.Tensor) -> bool:
    """The native int4 layout is marked by fp32 scales [out_p / 4, G, 4] (tinygemm's are bf16)."""
    return scales.dtype == torch.float32 and scales.dim() == 3


def w4a16_gemm(x2d, packed, scales, c, bias, group_size: int, out_features: int):
    """x [M, in] -> [M, out] in x's dtype, through the native int4 kernel."""
    return native_extension().w4a16_gemm(x2d.contiguous(), packed, scales, c, bias, group_size,
                                         out_features)


def w8a8_gemv(x2d, weight, scales, bias):
    """x [M, in] -> [M, out] in x's dtype: the native int8 weight (int8 [out, in], fp32 scales) with
    activations rounded to int8 per 32 channels (csrc/cpu_gemv_int8_a8.cpp; opt-in, not exact)."""
    return native_extension().w8a8_gemv(x2d.contiguous(), weight, scales, bias)


def w4a8_gemv(x2d, packed, scales, c, bias, group_size: int, out_features: int):
    """x [M, in] -> [M, out] in x's dtype: weights packed for int8 activations
    (pack_w4a16(..., int8_activations=True)), activations rounded to int8 per 32 channels
    (csrc/cpu_gemv_int4_a8.cpp; opt-in, not exact)."""
    return native_extension().w4a8_gemv(x2d.contiguous(), packed, scales, c, bias, group_size,
                                        out_features)


AMX_CODES_BLOCK = 32  # output channels per task of the AMX codes GEMMs (kBlock); tables pad to it


def codes_amx_available(in_features: int, group_size: int = 32) -> bool:
    """Whether the AMX codes GEMMs (csrc/cpu_gemm_codes_amx.cpp) serve many rows of a native int4 /
    int8 weight with these shapes here, instead of a dense bf16 copy: opted in (QKILN_AMX_CODES=1),
    AMX-BF16 and the tile state, K and G multiples of 32.
    Opt-in because, on the AMX host measured (session 18), the copies were faster for prefill: 30
    SmolLM2 layers' linears at 1024 rows 375 vs 427 ms (same process), equal at 64 rows (26.9 vs
    26.2); the codes save 2 bytes a weight of memory (offline 64 x 128/128 maxrss ~1.38 -> ~1.2 GB
    for SmolLM2-135M; an 8B model's copies would be ~16 GB)."""
    ext = native_extension()
    return ext is not None and in_features % 32 == 0 and group_size % 32 == 0 and \
        env_switch("QKILN_AMX_CODES", False) and ext.codes_amx_ready()


def w4_amx_tables(q: torch.Tensor, scales: torch.Tensor, zero_point: torch.Tensor | None,
                  group_size: int) -> torch.Tensor:
    """The AMX int4 GEMM's lookup tables: bf16 [out rounded up to 32, num_groups, 16], entry
    [o, g, c] = bf16((c - z[o, g]) * s[o, g]), the formula of the dense copy
    (packed_weights._prepare_w4a16_native), so both compute with the same bf16 weights."""
    out_features, num_groups = scales.shape
    codes = torch.arange(16, dtype=torch.float32)
    z = torch.full((out_features, num_groups), 8.0) if zero_point is None else zero_point.float()
    tables = ((codes - z[..., None]) * scales.float()[..., None]).to(torch.bfloat16)
    out_padded = -(-out_features // AMX_CODES_BLOCK) * AMX_CODES_BLOCK
    return torch.nn.functional.pad(tables, (0, 0, 0, 0, 0, out_padded - out_features)).contiguous()


def w4a16_amx_gemm(x2d: torch.Tensor, packed: torch.Tensor, tables: torch.Tensor, group_size: int,
                   out_features: int) -> torch.Tensor:
    """bf16 x [M, in] -> bf16 [M, out] through the AMX int4 GEMM (packed: pack_w4a16's codes)."""
    return native_extension().w4a16_amx_gemm(x2d.contiguous(), packed, tables, group_size,
                                             out_features)


def int8_codes_amx_gemm(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 x [M, in] @ int8 codes [out, in]^T -> bf16 [M, out], unscaled (the AMX int8 GEMM)."""
    return native_extension().int8_codes_amx_gemm(x2d.contiguous(), weight)


W4A8_PANEL = 48  # output channels the packed layout pads to (kPanel)


def pack_w4a8(codes: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor):
    """Unsigned codes u [out, in] (0..15 or 0..255), scales and zero points [out, G] ->
    (packed uint8 [out_p / 48, in / 4, 48, 4], scales fp32 [G, out_p], zero scales s * z fp32
    [G, out_p]) for cpu_gemm_w4a8.cpp, out_p padding `out` to a multiple of 48 with zeros."""
    out_features, in_features = codes.shape
    out_padded = -(-out_features // W4A8_PANEL) * W4A8_PANEL
    row_pad = (0, 0, 0, out_padded - out_features)
    u = torch.nn.functional.pad(codes.to(torch.uint8), row_pad)
    packed = u.reshape(out_padded // W4A8_PANEL, W4A8_PANEL, in_features // 4, 4).permute(0, 2, 1, 3)
    packed = packed.contiguous()
    s = torch.nn.functional.pad(scales.float(), row_pad)
    zs = torch.nn.functional.pad(scales.float() * zero_points.float(), row_pad)
    return packed, s.t().contiguous(), zs.t().contiguous()


def w4a8_gemm(x2d, packed, scales, zero_scales, bias, group_size: int, out_features: int):
    """x [M, in] -> [M, out] in x's dtype: activations rounded to int8 per 32 channels."""
    return native_extension().w4a8_gemm(x2d.contiguous(), packed, scales, zero_scales, bias,
                                        group_size, out_features)


BF16_PANEL = 48  # output channels per panel of the bf16 GEMM's layout (kPanel)


def bf16_panels_available(in_features: int) -> bool:
    """Whether qkiln's bf16 GEMM is the one to use for weights with `in_features` inputs: its AMX
    path (in a multiple of 32), or its AVX512-BF16 path on a CPU without AMX-BF16; where the CPU
    has AMX but our AMX path cannot run, oneDNN's GEMM (which uses AMX) measured 4-5x faster than
    the AVX512-BF16 panels. The portable build's loop is for tests: callers keep oneDNN then."""
    ext = native_extension()
    isa = None if ext is None or in_features % 2 else ext.bf16_gemm_isa()
    if isa == "amx-bf16":
        return in_features % 32 == 0
    return isa == "avx512-bf16" and not torch.cpu._is_amx_tile_supported()


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [out, in] (in even) -> int32 panels [ceil(out / 48), in / 2, 48] for
    cpu_gemm_bf16.cpp: each int32 a pair (w[n][2j], w[n][2j+1]), rows padded with zeros."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or in_features % 2:
        raise ValueError("bf16 panels need a bf16 weight with an even number of input features")
    out_padded = -(-out_features // BF16_PANEL) * BF16_PANEL
    w = torch.nn.functional.pad(weight, (0, 0, 0, out_padded - out_features)).contiguous()
    pairs = w.view(torch.int32)  # [out_p, in / 2]: little-endian, so w[n][2j] is the low half
    return pairs.reshape(-1, BF16_PANEL, in_features // 2).transpose(1, 2).contiguous()


def bf16_gemm(x2d: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """bf16 x [M, in] @ W^T -> bf16 [M, out], W as pack_bf16_panels wrote it."""
    return native_extension().bf16_gemm(x2d.contiguous(), panels, out_features)


def w8a16_gemm(x2d, weight, scales, bias):
    """x [M, in] @ (int8 weight [out, in] * fp32 scales [out])^T (+ bias) in x's dtype."""
    return native_extension().w8a16_gemm(x2d.contiguous(), weight, scales, bias)


# ---- CPU kernels of the small fused ops (ops.py registers them): native when the extension is
# up and the layout is one it reads, else the plain-torch reference (same results).

_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _rows_native(x: torch.Tensor, weight: torch.Tensor):
    ops = native_ops()
    ok = ops is not None and x.dtype in _NATIVE_DTYPES and x.dtype == weight.dtype and \
        x.is_contiguous() and weight.is_contiguous() and weight.dim() == 1
    return ops if ok else None


def cpu_rms_norm(x, weight, eps: float):
    ops = _rows_native(x, weight)
    return ops.rms_norm(x, weight, eps) if ops else reference_small_ops.reference_rms_norm(x, weight, eps)


def cpu_fused_add_rms_norm(x, residual, weight, eps: float) -> None:
    ops = _rows_native(x, weight)
    if ops and residual.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape:
        ops.fused_add_rms_norm(x, residual, weight, eps)
    else:
        reference_small_ops.reference_fused_add_rms_norm(x, residual, weight, eps)


def cpu_silu_and_mul(gate_up):
    ops = native_ops()
    if ops is not None and gate_up.dtype in _NATIVE_DTYPES and gate_up.is_contiguous():
        return ops.silu_and_mul(gate_up)
    return reference_small_ops.reference_silu_and_mul(gate_up)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[M, V] -> int64 [M], torch.argmax(dim=-1)'s result; native for contiguous CPU logits in
    fp32, bf16 or fp16 (no fp32 copy needed first)."""
    ops = native_ops()
    if ops is not None and logits.device.type == "cpu" and logits.dtype in _NATIVE_DTYPES and \
            logits.dim() == 2 and logits.is_contiguous() and logits.shape[1] > 0:
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def scale_columns_(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """In place x [M, N] *= scales [N] fp32 (fp32 products rounded once into x's dtype): the bits of
    torch's x.mul_(scales), natively where it can be (torch's promotes through a copy)."""
    ops = native_ops()
    if ops is not None and x.dtype in _NATIVE_DTYPES and x.dim() == 2 and x.is_contiguous() and \
            scales.dtype == torch.float32 and scales.is_contiguous():
        ops.scale_columns_(x, scales)
        return x
    return x.mul_(scales)


def cpu_rotary_embedding(qkv, cos, signed_sin, num_heads: int) -> None:
    ops = native_ops()
    rows = qkv if qkv.dim() == 3 else qkv.flatten(0, -3) if qkv.is_contiguous() else None
    if ops is not None and rows is not None and qkv.dtype in _NATIVE_DTYPES and \
            cos.dtype == signed_sin.dtype == qkv.dtype and cos.is_contiguous() and \
            signed_sin.is_contiguous() and rows.stride(-1) == 1 and rows.stride(-2) == rows.shape[-1]:
        ops.rotary_embedding(rows, cos, signed_sin, num_heads)
    else:
        reference_small_ops.reference_rotary_embedding(qkv, cos, signed_sin, num_heads)
