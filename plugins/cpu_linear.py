"""CPU quantized linears over the "cpu" layouts of packed_weights.py.

Few rows (decode, <= SMALL_M; <= int4_gemv_rows for int4 with a dense copy): qkiln's own kernels
(cpu_native.py, csrc/cpu_gemv_int*.cpp) when the weight was packed for them, which the dtype of
`scales` says (fp32: native; bf16: torch's). The native int4 kernel is exact W4A16 (bf16
activations, fp32 products and sums) and streams the nibbles once for up to 4 rows; the native int8
kernel is exact too, without rounding activations at all (bf16 ones through vdpbf16ps, others
widened to fp32). Otherwise torch's packed kernels, fast only with bf16 activations
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`), so activations are cast to bf16 and the
result cast back.
Many rows (prefill, offline decode): a bf16 GEMM on dequantized weights, where the packed kernels
lose to it
(DESIGN.md: int4 ~2x slower than bf16 at 64 rows). For int4 that needs the optional cached
`dequantized` copy: without it the packed kernel stays in use, because dequantizing the packed
weight on every call measured slower than tinygemm itself at 16-128 rows (SmolLM2 shapes).
Opted in (QKILN_AMX_CODES=1) on a CPU with AMX-BF16, native int4 / int8 weights keep no copy:
csrc/cpu_gemm_codes_amx.cpp reads their codes (exact, the copy's bits;
cpu_native.codes_amx_available says why it is not the default).
fp8 is a storage format on CPU: the weight arrives already dequantized to bf16 and activations
are fake-quantized per token (quantize to fp8 and back), or with a static recipe's calibrated
scale, so results match the GPU path.
Opt-in int8 activations (W4A8Weight, many rows): csrc/cpu_gemm_w4a8.cpp, activations rounded to
int8 per 32 channels, int4 or int8 weights; 1.5x the bf16 GEMM at 64 rows, 1.14-1.3x at 1024;
not exact (packed_weights.py). An int4 weight's other rows (few rows; all rows on a CPU without
AVX512-VNNI, where it has no panels) round the same way through csrc/cpu_gemv_int4_a8.cpp; an int8
weight's few rows through csrc/cpu_gemv_int8_a8.cpp (2.1x the exact int8 GEMV at one row on AVX2,
whose int8 -> fp32 widening kept it below the DRAM rate), its many rows through the panels where
they exist, else exact.
Every bf16 GEMM goes through `dense_linear`, which reads the weight in qkiln's bf16 panels
(packed_weights.pack_dense, csrc/cpu_gemm_bf16.cpp), plain, or pre-packed for oneDNN
(packed_weights.onednn_pack); the last two give the same bits. On a CPU without a fast bf16 GEMM
(AVX2 only) the copy is held in fp32 and the GEMM runs in fp32 (pack_dense).
"""

import torch

from qkiln.plugins import cpu_native
from qkiln.plugins.reference import fake_quantize_fp8_activations

SMALL_M = 16
# An int4 weight with a dequantized copy switches to the bf16 GEMM above this many rows, not above
# SMALL_M: the GEMV's cost grows with the rows (4 at a time) while the GEMM's stays that of
# streaming the bf16 copy. 30 layers of SmolLM2's linears from memory, 2 threads: int4 GEMV / bf16
# GEMM 5.7 / 6.3 ms at 8 rows, 6.9 / 6.1 at 10, 9.9 / 6.5 at 12, 10.7 / 5.9 at 16.
INT4_GEMV_ROWS = 8


def int4_gemv_rows(dequantized: torch.Tensor | None, amx_tables: torch.Tensor | None = None) -> int:
    """The most rows the int4 GEMV serves before the weight's many-row form does: INT4_GEMV_ROWS for
    the AMX tables or a bf16 copy, SMALL_M for a copy held in fp32 (packed_weights.pack_dense, no
    fast bf16 GEMM): on the AVX2 host measured, the GEMV beat aten's fp32 GEMM at 8 and 16 rows
    (gate_up 3072 x 576: 500 vs 901 us at 8, 967 vs 1463 at 16; 2 threads)."""
    fp32_copy = amx_tables is None and dequantized is not None and dequantized.dtype == torch.float32
    return SMALL_M if fp32_copy else INT4_GEMV_ROWS


def dense_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_features: int | None = None, fp32_out: bool = False) -> torch.Tensor:
    """bf16 rows [M, in] @ weight^T (+ bias) -> bf16 [M, out]; weight bf16 [out, in], plain or
    oneDNN-packed (F.linear's bits either way), int32 bf16 panels (pack_dense; out_features
    needed, as the panels pad it; the bias is added to the rounded product), or a bf16 weight
    widened to fp32 (pack_dense without a fast bf16 GEMM: the products are exact either way, the
    fp32 sum is rounded once, or with fp32_out not at all: the other forms ignore it)."""
    if weight.dtype == torch.float32:
        out = torch.nn.functional.linear(rows.float(), weight, None if bias is None else bias.float())
        return out if fp32_out else out.to(torch.bfloat16)
    if weight.dtype == torch.int32:
        if out_features is None:
            raise ValueError("bf16 panels pad the output channels to 48: pass out_features")
        out = cpu_native.bf16_gemm(rows, weight, out_features)
        return out if bias is None else out + bias
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return torch.nn.functional.linear(rows, weight, bias)


def _finish(out, x, bias, out_features: int):
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def cpu_w4a16_linear(x, packed, scales, zeros, group_size: int, in_features: int,
                     out_features: int, bias=None, dequantized=None, amx_tables=None):
    """x [..., in] -> [..., out]; native layout (fp32 scales, `zeros` = zero term) or tinygemm's
    (`scales` = scale_and_zero, `zeros` unused); see packed_weights.py."""
    rows = x.reshape(-1, in_features)
    gemv_rows = int4_gemv_rows(dequantized, amx_tables)
    if amx_tables is not None and rows.shape[0] > gemv_rows:
        out = cpu_native.w4a16_amx_gemm(rows.to(torch.bfloat16), packed, amx_tables, group_size,
                                        out_features)
        return _finish(out, x, bias, out_features)
    if dequantized is not None and rows.shape[0] > gemv_rows:
        # fp32 activations keep fp32 where the copy is fp32 (no fast bf16 GEMM: the AVX2 GEMV, which
        # neither rounds them nor its sums), else bf16 rows as the AVX-512 GEMV rounds them
        fp32 = x.dtype == torch.float32 and dequantized.dtype == torch.float32
        out = dense_linear(rows if fp32 else rows.to(torch.bfloat16), dequantized,
                           out_features=out_features, fp32_out=x.dtype == torch.float32)
        return _finish(out, x, bias, out_features)
    if cpu_native.is_native_w4a16(scales):
        out = cpu_native.w4a16_gemm(rows, packed, scales, zeros, bias, group_size, out_features)
        return out.reshape(*x.shape[:-1], out_features)
    rows = rows.to(torch.bfloat16)
    in_padded = scales.shape[0] * group_size
    if in_padded > in_features:
        rows = torch.nn.functional.pad(rows, (0, in_padded - in_features))
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), packed, group_size, scales)
    return _finish(out[:, :out_features], x, bias, out_features)


def cpu_w8a16_linear(x, weight, scales, bias=None, dequantized=None, amx_codes=False):
    """x [..., in] @ (int8 weight [out, in] * scales [out])^T; `dequantized`: the codes as bf16;
    amx_codes: many rows read `weight` through the AMX codes GEMM instead (same bits)."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    # fp32 activations are not rounded at any row count: the bf16 forms below round them and the
    # product, and an fp32 model's int8 lm_head scored prompts with logits up to 0.27 off its decode
    # logits (SmolLM2 W4A16). Many rows take the fp32 GEMM where the copy is fp32 (2.2-2.3x the
    # native kernel at 64 and 256 rows of SmolLM2's head, AVX2, 2 threads), else the native kernel.
    fp32_rows = x.dtype == torch.float32 and rows.shape[0] > SMALL_M
    if fp32_rows and dequantized is not None and dequantized.dtype == torch.float32:
        return _finish(dense_linear(rows, dequantized, fp32_out=True) * scales, x, bias, out_features)
    if scales.dtype == torch.float32 and (rows.shape[0] <= SMALL_M or fp32_rows):  # native layout
        return cpu_native.w8a16_gemm(rows, weight, scales, bias).reshape(*x.shape[:-1],
                                                                          out_features)
    rows = rows.to(torch.bfloat16)
    # torch's int8 kernel reads whole vectors along in_features: another width read past each
    # weight row (NaN, 1e32, or a SIGSEGV at 2+ rows); the GEMM below takes any width
    if rows.shape[0] <= SMALL_M and in_features % 32 == 0:
        out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), weight, scales)
    else:  # per-output-channel scale commutes with the GEMM: scale the result, not the weight
        if amx_codes:
            out = cpu_native.int8_codes_amx_gemm(rows, weight)
        else:
            codes = dequantized if dequantized is not None else weight.to(torch.bfloat16)
            out = dense_linear(rows, codes, out_features=out_features)
        # In place when nothing follows: the product is taken in fp32 and rounded once into bf16,
        # as the out-of-place product would be by _finish (a bias is added before that rounding).
        out = cpu_native.scale_columns_(out, scales) if bias is None else out * scales
    return _finish(out, x, bias, out_features)


def cpu_w4a8_linear(x, packed, scales, zero_scales, group_size: int, out_features: int, bias=None):
    """x [..., in] -> [..., out] in x's dtype through the int8-activation GEMM (W4A8Weight)."""
    rows = x.reshape(-1, x.shape[-1])
    out = cpu_native.w4a8_gemm(rows, packed, scales, zero_scales, bias, group_size, out_features)
    return out.reshape(*x.shape[:-1], out_features)


def cpu_w4a8_gemv(x, packed, scales, zeros, group_size: int, out_features: int, bias=None):
    """x [..., in] -> [..., out] in x's dtype: the native int4 GEMV layout with activations rounded
    to int8 per 32 channels (an int4 weight's rows that its many-row panels do not serve)."""
    rows = x.reshape(-1, x.shape[-1])
    out = cpu_native.w4a8_gemv(rows, packed, scales, zeros, bias, group_size, out_features)
    return out.reshape(*x.shape[:-1], out_features)


def cpu_w8a8_gemv(x, weight, scales, bias=None):
    """x [..., in] -> [..., out] in x's dtype: the native int8 weight with activations rounded to
    int8 per 32 channels (an int8 weight's few rows, when it rounds them)."""
    rows = x.reshape(-1, x.shape[-1])
    out = cpu_native.w8a8_gemv(rows, weight, scales, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def cpu_fp8_w8a8_linear(x, weight, weight_scale, bias=None, input_scale=None):
    """weight: bf16 [out, in] already scaled (weight_scale None) or fp8 with weight_scale [out].
    input_scale: the calibrated per-tensor activation scale (static); None quantizes per token."""
    out_features, in_features = weight.shape
    if weight_scale is not None:  # canonical fp8 passed directly: dequantize on the fly
        weight = (weight.float() * weight_scale[:, None]).to(torch.bfloat16)
    rows = fake_quantize_fp8_activations(x.reshape(-1, in_features), input_scale).to(torch.bfloat16)
    return _finish(dense_linear(rows, weight), x, bias, out_features)
