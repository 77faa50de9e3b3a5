"""Quantized linear weights: canonical form in, target-specific packed layout out (`prepare_*`).

Canonical form (what quant/ produces and the artifact stores):

    qweight [out, in]  uint8 0..15 (asymmetric int4, with zeros) or int8 -8..7 (symmetric int4)
                       int8 -128..127 (w8a16) / float8_e4m3fn (fp8_w8a8)
    scales  [out, num_groups] (int4), [out] (int8, fp8)     zeros [out, num_groups] or None
    W[o, i] = (qweight[o, i] - zeros[o, i // group_size]) * scales[o, i // group_size]
    num_groups = ceil(in / group_size): the last group may be shorter (in=576, group 128).

Target "cuda" (Triton W4A16 kernel, triton_w4a16.py; pure torch here, so a CPU machine can pack):

    packed [ceil(in/2), out] uint8     byte (j, o) = q[o, 2j] | q[o, 2j + 1] << 4
    scales [num_groups, out], zeros [num_groups, out] or None (symmetric: q stored as q + 8)
    w8a16: weight int8 [in, out], scales [1, out]  (the same kernel with 8-bit, one group)
    fp8:   weight float8_e4m3fn [out, in], weight_scale fp32 [out]  (torch._scaled_mm)

Target "cpu", native (plugins/cpu_native.py + csrc/cpu_gemv_int4.cpp; used whenever that extension
builds, `in` and group_size are multiples of 32):

    packed uint8 [out_p / 4, in_p / 64, 4, 32]: tiles of 4 output rows, 64 nibbles per row per
           chunk (layout diagram in cpu_gemv_int4.cpp), out_p / in_p pad to multiples of 4 / 64.
    scales fp32 [out_p / 4, num_groups, 4]  (fp32 and 3-D: this marks the native layout)
    zeros  fp32 [out_p / 4, num_groups, 4] = scales * (16 + z)  (z = 8 when symmetric): the
           kernel's zero term, not the canonical zero point. (With int8 activations both
           differ: below.)
    group_size is the canonical one (any multiple of 32; the shorter last group is exact).
    Exact W4A16: activations are rounded to bf16 and every product is exact in fp32.
    w8a16: weight int8 [out, in] (canonical), scales fp32 [out] (fp32 marks the native kernel).
           No repacking: the kernel's 4-row tiles are already contiguous blocks of the row-major
           weight, and it converts int8 -> bf16/fp32 in registers (exact, see cpu_gemv_int8.cpp).

Target "cpu", torch's tinygemm (`_weight_int4pack_mm_for_cpu`; the fallback without the native
extension, e.g. QKILN_NATIVE_CPU=0 or no compiler):

    packed = _convert_weight_to_int4pack_for_cpu(q + offset) [out_p, in_p / 2] uint8, an opaque
             layout that depends on the CPU's vector ISA (AVX-512 / AVX2): prepare it on the
             machine that serves, never store these bytes in an artifact.
    scales = scale_and_zero [in_p / g, out_p, 2] bf16 with W = (q - 8) * scale + zero,
             so zero = (8 - z) * scale; zeros = None.
    g (the group size passed to the kernel) must be 32/64/128/256 and divide in_p: a shorter
    last group is handled *exactly* by re-expressing the groups with g = gcd-like divisor
    (group 128 over in=576 becomes group 64 with each scale repeated twice); in_p pads `in` to a
    multiple of 32 only when even that is impossible (the op pads x with zero columns to match),
    and out_p pads `out` to a multiple of 16 with zero rows (q = 8, scale = 0, zero = 0).
    w8a16: weight int8 [out, in], scales bf16 [out] (`_weight_int8pack_mm`).

Target "cpu", int8 activations (opt-in, `int8_activations=True`; not exact):
    int8_act = W4A8Weight for csrc/cpu_gemm_w4a8.cpp (many rows): unsigned codes (int4 0..15,
    symmetric as q + 8; int8 weights as w + 128, one group) in uint8 [out_p / 48, in / 4, 48, 4],
    scales and scale * zero point fp32 [num_groups, out_p], out_p a multiple of 48. Replaces
    `dequantized` (1 byte per weight instead of 2). Built only where that GEMM has its
    AVX512-VNNI kernel (int8_act_panels_fast).
    int4 weights round at every step (int8_activations): rows the panels do not serve go through
    csrc/cpu_gemv_int4_a8.cpp. `packed` and `zeros` are then in that kernel's form
    (cpu_native.pack_w4a16(..., int8_activations=True): the native tiles with another nibble order,
    zero term scales * z), which the exact kernel can't read; on a CPU without VNNI they are the
    only copy. int8 weights round their few rows (<= SMALL_M) through csrc/cpu_gemv_int8_a8.cpp on
    their native weight, their many rows only where they have panels.
    Needs `in` and group_size multiples of 32 and the native extension; otherwise the weight is
    prepared as without the option.

Native int4 on a CPU with AMX-BF16 (in and group_size multiples of 32), opted in (QKILN_AMX_CODES=1):
    amx_tables bf16 [out rounded up to 32, num_groups, 16] (cpu_native.w4_amx_tables): the 16
    weight values of each (channel, group), for csrc/cpu_gemm_codes_amx.cpp, which serves many rows
    from the packed codes with the same bits as the dense copy below, which it replaces (2 bytes
    per weight less memory; codes and tables are ~0.4 of the bytes a 64-row step reads).
Native int8 on a CPU with AMX-BF16 (in a multiple of 32), opted in: amx_codes = True, the same
    kernel reads the int8 codes for many rows instead of their dense bf16 copy (half the bytes).

Both cpu layouts:
    dequantized (optional) bf16 [out, in]: used instead of the int4 kernel above
    cpu_linear.int4_gemv_rows rows, where a GEMM is faster (DESIGN.md); costs 2 bytes per weight
    of memory (4 where it is held widened to fp32: CPUs without a fast bf16 GEMM, see pack_dense).
    fp8:   weight bf16 [out, in] already multiplied by its scale, weight_scale None: CPU fp8 GEMMs
           are 40-50x slower than bf16, so fp8 is only a storage format there.
    `dequantized` is held in qkiln's bf16 panels (`pack_dense`: int32 [ceil(out / 48), in / 2,
    48], csrc/cpu_gemm_bf16.cpp) where that kernel built with AVX512-BF16, else like the fp8
    weight pre-packed for oneDNN (`onednn_pack`: an opaque MkldnnCPU tensor in the blocked layout
    oneDNN's bf16 GEMM reads) where torch has oneDNN with bf16 support: aten's mm re-orders a
    plain weight into that layout on every call, which measured 1.2-1.35x slower at 64 rows and
    ~1.03x at 1024 (SmolLM2 shapes, 30 layers' weights, 2 threads).
"""

from dataclasses import dataclass

import torch

from qkiln.errors import RecipeError
from qkiln.plugins import cpu_native
from qkiln.plugins.reference import INT8_BLOCK

TARGETS = ("cpu", "cuda")
CPU_GROUP_SIZES = (256, 128, 64, 32)


@dataclass
class W4A8Weight:
    """Packed for the int8-activation GEMM (cpu_native.pack_w4a8); int4 or int8 codes alike."""
    packed: torch.Tensor
    scales: torch.Tensor
    zero_scales: torch.Tensor
    group_size: int
    out_features: int


@dataclass
class W4A16Weight:
    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    in_features: int
    out_features: int
    target: str
    dequantized: torch.Tensor | None = None
    int8_act: W4A8Weight | None = None  # cpu, many rows, opt-in (where int8_act_panels_fast)
    amx_tables: torch.Tensor | None = None  # cpu native, many rows on AMX (replaces dequantized)
    # cpu native, opt-in: every step rounds activations to int8 (rows above SMALL_M through
    # int8_act where it exists, all others through csrc/cpu_gemv_int4_a8.cpp on `packed`)
    int8_activations: bool = False

    @property
    def many_rows_form(self) -> bool:
        """Whether steps above INT4_GEMV_ROWS rows have a GEMM form (dense copy or AMX tables)."""
        return self.dequantized is not None or self.amx_tables is not None


@dataclass
class W8A16Weight:
    weight: torch.Tensor
    scales: torch.Tensor
    target: str
    dequantized: torch.Tensor | None = None  # cpu: the codes as bf16 [out, in] (exact), many rows
    int8_act: W4A8Weight | None = None  # cpu, many rows, opt-in
    amx_codes: bool = False  # cpu native: many rows on AMX read `weight` (replaces dequantized)
    # cpu native, opt-in: few rows round activations to int8 (csrc/cpu_gemv_int8_a8.cpp on `weight`)
    int8_activations: bool = False

    @property
    def many_rows_form(self) -> bool:
        """Whether steps above SMALL_M rows have a GEMM form (dense copy or the AMX codes GEMM)."""
        return self.dequantized is not None or self.amx_codes


@dataclass
class FP8Weight:
    weight: torch.Tensor
    weight_scale: torch.Tensor | None
    target: str
    input_scale: torch.Tensor | None = None  # fp32 [] static activation scale; None: per token


def onednn_bf16_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [out, in] -> the same weight pre-packed for oneDNN's GEMM (cpu_linear.dense_linear
    reads either form; results are bit-identical), or unchanged where oneDNN lacks bf16."""
    if not onednn_bf16_available():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] copy for the many-row CPU GEMM (cpu_linear.dense_linear): qkiln's own
    panels (int32, cpu_native.pack_bf16_panels; csrc/cpu_gemm_bf16*.cpp, 1.36x oneDNN at 64 rows
    without AMX) where cpu_native.bf16_panels_available says, else oneDNN's packing (onednn_pack)
    where oneDNN has a bf16 GEMM, else the values in fp32 (4 bytes a weight): on a CPU without
    AVX512-BF16 / AMX (an AVX2 EPYC, 2 threads, 3072 x 576) aten's bf16 GEMM ran at 10-12 GMAC/s
    from 16 to 512 rows against 32-53 for its fp32 one. `weight` bf16, or fp32 where the exact
    values are known (a dequantized int4 weight): rounded to bf16 for the bf16 forms, kept as they
    are for the fp32 one."""
    if cpu_native.bf16_panels_available(weight.shape[1]):
        return cpu_native.pack_bf16_panels(weight.to(torch.bfloat16).contiguous())
    if onednn_bf16_available():
        return onednn_pack(weight.to(torch.bfloat16))
    return weight.float().contiguous()


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise RecipeError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")


def _unsigned_int4(qweight: torch.Tensor, zeros: torch.Tensor | None):
    """Canonical q -> (q in 0..15 as int32, zero point per group): symmetric q is offset by 8."""
    if zeros is None:
        if qweight.dtype != torch.int8:
            raise RecipeError("symmetric int4 weights must be int8 in -8..7 (zeros=None)")
        return qweight.int() + 8, None
    if qweight.dtype != torch.uint8:
        raise RecipeError("asymmetric int4 weights must be uint8 in 0..15 with zeros")
    return qweight.int(), zeros.float()


def int8_activations_fit(in_features: int, group_size: int) -> bool:
    """Whether the int8-activation GEMM takes these shapes: `in` and the weight group size must be
    multiples of its 32-channel activation blocks (other weights stay exact)."""
    return in_features % INT8_BLOCK == 0 and group_size % INT8_BLOCK == 0


def int8_act_panels_fast() -> bool:
    """Whether the many-row int8-activation GEMM (csrc/cpu_gemm_w4a8.cpp) has its AVX512-VNNI
    kernel here. Its plain C++ form is for tests only (3072 x 576 at 64 rows: ~150 ms against ~2.4
    exact on an AVX2 host), so elsewhere weights get no panels: int4 ones round their activations
    through the GEMV kernel at every row count, int8 ones stay exact."""
    ext = cpu_native.native_extension()
    return ext is not None and ext.w4a8_kernel_isa() != "portable"


def _int8_act_weight(codes, scales, zero_point, group_size: int) -> W4A8Weight | None:
    """W4A8Weight of unsigned codes [out, in], or None where the int8-activation GEMM can't run
    or would be slow (int8_act_panels_fast)."""
    out_features, in_features = codes.shape
    if not int8_activations_fit(in_features, group_size) or not int8_act_panels_fast():
        return None
    packed, s, zs = cpu_native.pack_w4a8(codes, scales, zero_point)
    return W4A8Weight(packed, s, zs, group_size, out_features)


def prepare_w4a16(qweight, scales, zeros, group_size: int, target: str,
                  keep_dequantized: bool = False,
                  dtype: torch.dtype = torch.bfloat16, use_native: bool = True,
                  int8_activations: bool = False) -> W4A16Weight:
    """Canonical grouped int4 -> W4A16Weight for `target` (layouts in the module docstring).

    dtype: the activation dtype the cuda kernel will see (scales/zeros are stored in it).
    use_native: False keeps torch's tinygemm on target cpu (benchmarks and A/B checks).
    int8_activations (cpu, native layout, `in` and group_size multiples of 32): every step rounds
    activations to int8 (W4A16Weight.int8_activations), many rows through the int8-activation
    GEMM where it is fast (int8_act), else through the GEMV; no `dequantized` copy then.
    """
    _check_target(target)
    out_features, in_features = qweight.shape
    if scales.shape != (out_features, -(-in_features // group_size)):
        raise RecipeError(f"int4 scales have shape {tuple(scales.shape)}, expected "
                          f"[{out_features}, ceil({in_features} / {group_size})]")
    q, zero_point = _unsigned_int4(qweight, zeros)
    if target == "cuda":
        return _prepare_w4a16_cuda(q, scales, zero_point, group_size, dtype)
    rounds = int8_activations and use_native and int8_activations_fit(in_features, group_size) \
        and cpu_native.native_extension() is not None
    weight = _prepare_w4a16_cpu(q, scales, zero_point, group_size, keep_dequantized and not rounds,
                                use_native, rounds)
    if rounds and cpu_native.is_native_w4a16(weight.scales):
        zp = torch.full_like(scales, 8.0, dtype=torch.float32) if zero_point is None else zero_point
        weight.int8_act = _int8_act_weight(q, scales, zp, group_size)
        weight.int8_activations = True
    return weight


def _prepare_w4a16_cuda(q, scales, zero_point, group_size: int, dtype) -> W4A16Weight:
    out_features, in_features = q.shape
    if in_features % 2:
        q = torch.nn.functional.pad(q, (0, 1))  # the kernel masks column `in`, so 0 is harmless
    q = q.t().contiguous()  # [in, out]
    packed = (q[0::2] | (q[1::2] << 4)).to(torch.uint8)  # [ceil(in/2), out]
    zeros = None if zero_point is None else zero_point.t().contiguous().to(dtype)
    return W4A16Weight(packed, scales.t().contiguous().to(dtype), zeros, group_size,
                       in_features, out_features, "cuda")


def cpu_serves_int4_groups(group_size: int | None) -> bool:
    """Whether the CPU's int4 kernels serve this group size: whole 32-channel blocks, or one group a row."""
    return group_size is None or group_size % CPU_GROUP_SIZES[-1] == 0


def _cpu_group_size(group_size: int, in_features: int) -> tuple[int, int]:
    """(kernel group size, padded in_features) that express `group_size` groups exactly: tinygemm's
    groups are 32..256, and any multiple of 32 (96, 4096, what Recipe.validate lets through) is
    whole groups of one of them, each with its recipe group's scale."""
    if not cpu_serves_int4_groups(group_size):
        raise RecipeError(f"target cpu needs an int4 group_size that is a multiple of 32, got "
                          f"{group_size}; re-quantize with one (e.g. {', '.join(map(str, CPU_GROUP_SIZES))})")
    padded = -(-in_features // 32) * 32
    for size in CPU_GROUP_SIZES:
        if size <= group_size and group_size % size == 0 and padded % size == 0:
            return size, padded
    raise AssertionError("unreachable: 32 divides both group_size and the padded width")


def _prepare_w4a16_cpu(q, scales, zero_point, group_size: int, keep_dequantized: bool,
                       use_native: bool, int8_activations: bool = False):
    out_features, in_features = q.shape
    if use_native and in_features % 32 == 0 and group_size % 32 == 0 and \
            cpu_native.native_extension():
        return _prepare_w4a16_native(q, scales, zero_point, group_size, keep_dequantized,
                                     int8_activations)
    kernel_group, in_padded = _cpu_group_size(group_size, in_features)
    out_padded = -(-out_features // 16) * 16
    # Per-column scale and tinygemm zero, then one value per kernel group (first column of it).
    col_scale = scales.float().repeat_interleave(group_size, dim=1)[:, :in_features]
    col_zero = 8.0 if zero_point is None else \
        zero_point.repeat_interleave(group_size, dim=1)[:, :in_features]
    col_tiny_zero = (8.0 - col_zero) * col_scale  # W = (q - 8) * s + (8 - z) * s
    pad = (0, in_padded - in_features, 0, out_padded - out_features)
    q_padded = torch.nn.functional.pad(q, pad, value=8)  # [out_p, in_p]
    scale_g = torch.nn.functional.pad(col_scale, pad)[:, ::kernel_group]  # [out_p, in_p / g]
    zero_g = torch.nn.functional.pad(col_tiny_zero, pad)[:, ::kernel_group]
    scale_and_zero = torch.stack([scale_g.t(), zero_g.t()], dim=-1).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_padded.int().contiguous(), 1)
    weight = W4A16Weight(packed, scale_and_zero.contiguous(), None, kernel_group, in_features,
                         out_features, "cpu")
    if keep_dequantized:
        # From the bf16-rounded kernel parameters, so both paths compute the same weights.
        s = scale_and_zero[..., 0].t().float().repeat_interleave(kernel_group, dim=1)
        z = scale_and_zero[..., 1].t().float().repeat_interleave(kernel_group, dim=1)
        full = (q_padded.float() - 8.0) * s + z  # [out_p, in_p]
        weight.dequantized = pack_dense(full[:out_features, :in_features].to(torch.bfloat16))
    return weight


def _prepare_w4a16_native(q, scales, zero_point, group_size: int, keep_dequantized: bool,
                          int8_activations: bool = False):
    out_features, in_features = q.shape
    packed, tiled_scales, zero_term = cpu_native.pack_w4a16(q, scales, zero_point, group_size,
                                                            int8_activations)
    weight = W4A16Weight(packed, tiled_scales, zero_term, group_size, in_features, out_features,
                         "cpu")
    if keep_dequantized and cpu_native.codes_amx_available(in_features, group_size):
        weight.amx_tables = cpu_native.w4_amx_tables(q, scales, zero_point, group_size)
    elif keep_dequantized:
        z = 8.0 if zero_point is None else \
            zero_point.float().repeat_interleave(group_size, dim=1)[:, :in_features]
        s = scales.float().repeat_interleave(group_size, dim=1)[:, :in_features]
        # fp32: where the copy stays fp32 (no fast bf16 GEMM) it holds the weights the GEMV computes
        # with, not their bf16 rounding, so a prompt's rows give the logits its decode steps do to
        # fp32 rounding (SmolLM2 W4A16 on AVX2, bf16: 0.14 nats apart with the rounded copy)
        weight.dequantized = pack_dense((q.float() - z) * s)  # [out, in]
    return weight


def prepare_w8a16(qweight, scales, target: str, use_native: bool = True,
                  keep_dequantized: bool = False, int8_activations: bool = False) -> W8A16Weight:
    """Canonical int8 [out, in] with per-channel scales [out] -> W8A16Weight for `target`.

    use_native: False keeps torch's `_weight_int8pack_mm` on target cpu.
    keep_dequantized (cpu): also keep the codes as bf16 (exact; 2 bytes per weight) for the
    many-row GEMM, which otherwise converts the whole weight on every call (a 49152 x 576 head:
    ~35 ms per 64-row step, more than the GEMM itself).
    int8_activations (cpu, native, `in` a multiple of 32): few rows round activations to int8
    through the int8-activation GEMV (int8_activations), many rows through the int8-activation
    GEMM (codes w + 128, zero point 128, one group) instead of `dequantized` where that GEMM is
    fast (int8_act_panels_fast), else exactly.
    """
    _check_target(target)
    if qweight.dtype != torch.int8 or scales.shape != (qweight.shape[0],):
        raise RecipeError("w8a16 needs int8 weights [out, in] and per-channel scales [out]")
    if target == "cuda":
        return W8A16Weight(qweight.t().contiguous(), scales.float()[None].contiguous(), "cuda")
    in_features = qweight.shape[1]
    int8_act = None
    if int8_activations:
        codes = (qweight.to(torch.int16) + 128).to(torch.uint8)
        int8_act = _int8_act_weight(codes, scales[:, None], torch.full_like(scales[:, None], 128.0),
                                    in_features)
    native = use_native and cpu_native.native_extension() is not None
    amx_codes = native and keep_dequantized and int8_act is None and \
        cpu_native.codes_amx_available(in_features)
    dequantized = pack_dense(qweight.to(torch.bfloat16)) \
        if keep_dequantized and int8_act is None and not amx_codes else None
    if native:
        return W8A16Weight(qweight.contiguous(), scales.float().contiguous(), "cpu", dequantized,
                           int8_act, amx_codes,
                           int8_activations and int8_activations_fit(in_features, in_features))
    # torch's kernel loads the weight with 16-byte aligned loads above 4 rows (a SIGSEGV, not an
    # error, otherwise); an artifact's tensors come zero-copy from safetensors at any offset.
    weight = qweight.contiguous()
    if weight.data_ptr() % 64:
        weight = weight.clone()
    return W8A16Weight(weight, scales.to(torch.bfloat16), "cpu", dequantized, int8_act)


def prepare_fp8_w8a8(weight, weight_scale, target: str, input_scale=None, group_size: int | None = None) -> FP8Weight:
    """fp8 e4m3 weight [out, in] with per-channel scale [out] (or [out, 1]), or group-wise scales
    [out, ceil(in / group_size)] -> FP8Weight for `target`. Group-wise weights are kept dequantized
    (bf16) on either target: no fp8 GEMM here takes per-group weight scales (the CPU keeps every fp8
    weight that way). input_scale: a static recipe's calibrated activation scale (one value);
    None: per token."""
    _check_target(target)
    out_features, in_features = weight.shape
    if weight_scale.dim() == 2 and weight_scale.shape[1] == 1:
        weight_scale = weight_scale.reshape(-1)
    grouped = weight_scale.dim() == 2
    if weight.dtype != torch.float8_e4m3fn or weight_scale.shape[0] != out_features or (
            grouped and (not group_size or weight_scale.shape[1] != -(-in_features // group_size))):
        raise RecipeError("fp8_w8a8 needs float8_e4m3fn weights [out, in] and scales [out] or "
                          f"[out, ceil(in / group_size)]; got scales {tuple(weight_scale.shape)}, group_size {group_size}")
    if input_scale is not None:
        if input_scale.numel() != 1:
            raise RecipeError(f"a static fp8 activation scale is one value, got shape {tuple(input_scale.shape)}")
        input_scale = input_scale.float().reshape(()).to(weight.device)
    if target == "cuda" and not grouped:
        return FP8Weight(weight.contiguous(), weight_scale.float().contiguous(), "cuda", input_scale)
    scale = weight_scale.float().repeat_interleave(group_size, dim=1)[:, :in_features] if grouped \
        else weight_scale.float()[:, None]
    dequantized = (weight.float() * scale).to(torch.bfloat16)
    if target == "cuda":
        return FP8Weight(dequantized.contiguous(), None, "cuda", input_scale)
    return FP8Weight(onednn_pack(dequantized), None, "cpu", input_scale)
