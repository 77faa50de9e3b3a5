"""Registers the `qkiln::` custom ops with torch.library and gives them typed front doors.

Each op has a fake (meta) implementation, so torch.compile and torch.export trace through it,
and one kernel per device: CPU tensors run cpu_attention / cpu_linear, CUDA tensors run the
Triton kernels (imported on first CUDA call, so importing this module never needs triton or a
GPU), any other device runs the reference. Schemas (flat tensors; KVCache.op_tensors() order):

    qkiln::cache_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache,
        Tensor? k_scale, Tensor? v_scale, Tensor(c!)? k_group_scale, Tensor(d!)? k_group_min,
        Tensor(e!)? v_group_scale, Tensor(f!)? v_group_min, Tensor? k_channel_scale,
        Tensor slot_mapping) -> ()
    qkiln::paged_attention(Tensor query, <the same nine cache tensors, none mutated>,
        Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor
    qkiln::w4a16_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int group_size,
        int in_features, int out_features, Tensor? bias, Tensor? dequantized,
        Tensor? amx_tables=None) -> Tensor
    qkiln::w8a16_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, Tensor? dequantized,
        bool amx_codes=False) -> Tensor
    qkiln::fp8_w8a8_linear(Tensor x, Tensor weight, Tensor? weight_scale, Tensor? bias) -> Tensor
    qkiln::w4a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor zero_scales, int group_size,
        int out_features, Tensor? bias) -> Tensor      (CPU only: opt-in int8 activations)
    qkiln::w4a8_gemv(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size,
        int out_features, Tensor? bias) -> Tensor      (CPU only: the same rounding, int4 weights
                                                        packed for it, any rows)
    qkiln::w8a8_gemv(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor
                                                       (CPU only: the same rounding, native int8
                                                        weights, few rows)
    qkiln::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor
    qkiln::fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()
    qkiln::silu_and_mul(Tensor gate_up) -> Tensor
    qkiln::rotary_embedding(Tensor(a!) qkv, Tensor cos, Tensor signed_sin, int num_heads) -> ()

The small fused ops (the last four) follow Hugging Face's eager rounding (reference_small_ops.py);
on CPU they run csrc/cpu_small_ops.cpp when it built, on CUDA triton_small_ops.py, on every other
device the reference.

On target cpu the linears' bf16 weights are pre-packed for oneDNN (packed_weights.onednn_pack):
MkldnnCPU tensors, served by the same CPU kernels. Fake tensors cannot stand for those opaque
tensors, so tracing (torch.compile/export, opcheck) takes the plain weights (`.to_dense()`).

The front doors (`cache_write(key, value, cache, slot_mapping)`, `paged_attention(query, cache,
...)`, `w4a16_linear(x, weight, bias)`, ...) unpack a KVCache or a prepared weight into them.
"""

import torch
from torch import Tensor

from qkiln.plugins import cpu_attention, cpu_linear, cpu_native, reference
from qkiln.plugins import reference_small_ops as small
from qkiln.plugins.kv_cache import KVCache, offset_key
from qkiln.plugins.packed_weights import FP8Weight, W4A8Weight, W4A16Weight, W8A16Weight
from qkiln.plugins.reference import fake_quantize_fp8_activations, quantize_fp8_static

# Registered through the low-level `torch.library.Library` rather than `@custom_op`: a decode
# step makes ~300 op calls, and custom_op's Python wrapper measured ~17 us per call against
# ~2 us here (SmolLM2 decode on 2 CPU threads). Kernels per dispatch key: CPU, CUDA, and the
# reference under CompositeExplicitAutograd for any other device; fakes for torch.compile/export.
_LIB = torch.library.Library("qkiln", "DEF")
_LIB.define("cache_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "Tensor? k_scale, Tensor? v_scale, Tensor(c!)? k_group_scale, Tensor(d!)? k_group_min, "
            "Tensor(e!)? v_group_scale, Tensor(f!)? v_group_min, Tensor? k_channel_scale, "
            "Tensor slot_mapping) -> ()")
_LIB.define("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor? k_scale, "
            "Tensor? v_scale, Tensor? k_group_scale, Tensor? k_group_min, Tensor? v_group_scale, "
            "Tensor? v_group_min, Tensor? k_channel_scale, Tensor block_tables, Tensor seq_lens, "
            "Tensor query_start_loc, float scale) -> Tensor")
_LIB.define("w4a16_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int group_size, "
            "int in_features, int out_features, Tensor? bias, Tensor? dequantized, "
            "Tensor? amx_tables=None) -> Tensor")
_LIB.define("w8a16_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, Tensor? dequantized, "
            "bool amx_codes=False) -> Tensor")
_LIB.define("fp8_w8a8_linear(Tensor x, Tensor weight, Tensor? weight_scale, Tensor? bias, "
            "Tensor? input_scale=None) -> Tensor")
_LIB.define("w4a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor zero_scales, int group_size, "
            "int out_features, Tensor? bias) -> Tensor")
_LIB.define("w4a8_gemv(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size, "
            "int out_features, Tensor? bias) -> Tensor")
_LIB.define("w8a8_gemv(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIB.define("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()")
_LIB.define("silu_and_mul(Tensor gate_up) -> Tensor")
_LIB.define("rotary_embedding(Tensor(a!) qkv, Tensor cos, Tensor signed_sin, int num_heads) -> ()")


def _register(name: str, cpu, cuda, other, onednn_weights: bool = False) -> None:
    _LIB.impl(name, cpu, "CPU")
    _LIB.impl(name, cuda, "CUDA")
    _LIB.impl(name, other, "CompositeExplicitAutograd")
    if onednn_weights:  # a weight pre-packed for oneDNN is an MkldnnCPU tensor: same CPU kernel
        _LIB.impl(name, cpu, "MkldnnCPU")


def _triton_cache_write(*args) -> None:
    from qkiln.plugins.triton_kv import triton_cache_write

    triton_cache_write(*args)


def _triton_paged_attention(*args) -> Tensor:
    from qkiln.plugins.triton_attention import triton_paged_attention

    return triton_paged_attention(*args)


def _no_kernel(op: str):
    def fail(x, *args):
        raise NotImplementedError(f"{op} has no kernel for device {x.device.type}")
    return fail


_register("cache_write", cpu_attention.cpu_cache_write, _triton_cache_write, reference.reference_cache_write)
_register("paged_attention", cpu_attention.cpu_paged_attention, _triton_paged_attention,
          reference.reference_paged_attention)


@torch.library.register_fake("qkiln::cache_write")
def _(*args) -> None:
    return None


@torch.library.register_fake("qkiln::paged_attention")
def _(query, *args) -> Tensor:
    return torch.empty_like(query)


def _cuda_w4a16_linear(x, packed, scales, zeros, group_size, in_features, out_features, bias, dequantized,
                       amx_tables=None):
    from qkiln.plugins.triton_w4a16 import triton_wna16_linear

    return triton_wna16_linear(x, packed, scales, zeros, group_size, 4, in_features,
                               out_features, bias)


_register("w4a16_linear", cpu_linear.cpu_w4a16_linear, _cuda_w4a16_linear, _no_kernel("w4a16_linear"),
          onednn_weights=True)


@torch.library.register_fake("qkiln::w4a16_linear")
def _(x, packed, scales, zeros, group_size, in_features, out_features, bias, dequantized,
      amx_tables=None):
    return x.new_empty(*x.shape[:-1], out_features)


def _cuda_w8a16_linear(x, weight, scales, bias, dequantized, amx_codes=False):
    from qkiln.plugins.triton_w4a16 import triton_wna16_linear

    in_features, out_features = weight.shape
    # One group spanning all of K, rounded to whole K tiles so every tile is group-aligned.
    return triton_wna16_linear(x, weight, scales, None, -(-in_features // 128) * 128, 8,
                               in_features, out_features, bias)


_register("w8a16_linear", cpu_linear.cpu_w8a16_linear, _cuda_w8a16_linear, _no_kernel("w8a16_linear"),
          onednn_weights=True)


@torch.library.register_fake("qkiln::w8a16_linear")
def _(x, weight, scales, bias, dequantized, amx_codes=False):
    return x.new_empty(*x.shape[:-1], scales.shape[-1])  # [out] on cpu, [1, out] on cuda


def _cuda_fp8_w8a8_linear(x, weight, weight_scale, bias, input_scale=None):
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if weight_scale is None:  # group-wise weight scales: the weight arrives dequantized (bf16)
        out = fake_quantize_fp8_activations(rows, input_scale).to(weight.dtype) @ weight.t()
        out = out if bias is None else out + bias
        return out.to(x.dtype).reshape(*x.shape[:-1], out_features)
    from qkiln.plugins import triton_fp8

    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if input_scale is not None:  # static: one calibrated scale for every token
        x_q = quantize_fp8_static(rows, input_scale)
        x_scale = input_scale.float().reshape(1, 1).expand(rows.shape[0], 1).contiguous()
    elif 0 < rows.shape[0] <= triton_fp8.GEMV_MAX_ROWS:  # decode: quantize + GEMV in one launch
        out = triton_fp8.triton_fp8_gemv(rows, weight, weight_scale, bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], out_features)
    else:
        x_q, x_scale = triton_fp8.triton_quantize_fp8_per_token(rows)  # [M, in] fp8, [M, 1] fp32
    if in_features % 16 or out_features % 16:  # _scaled_mm's alignment rule; rare shapes
        out = (x_q.float() * x_scale) @ (weight.float() * weight_scale[:, None]).t()
    else:  # row-wise scaled fp8 GEMM: scale_a per token, scale_b per output channel
        out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :],
                               out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


_register("fp8_w8a8_linear", cpu_linear.cpu_fp8_w8a8_linear, _cuda_fp8_w8a8_linear, _no_kernel("fp8_w8a8_linear"),
          onednn_weights=True)


@torch.library.register_fake("qkiln::fp8_w8a8_linear")
def _(x, weight, weight_scale, bias, input_scale=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_register("w4a8_linear", cpu_linear.cpu_w4a8_linear, _no_kernel("w4a8_linear"), _no_kernel("w4a8_linear"))


@torch.library.register_fake("qkiln::w4a8_linear")
def _(x, packed, scales, zero_scales, group_size, out_features, bias):
    return x.new_empty(*x.shape[:-1], out_features)


_register("w4a8_gemv", cpu_linear.cpu_w4a8_gemv, _no_kernel("w4a8_gemv"), _no_kernel("w4a8_gemv"))


@torch.library.register_fake("qkiln::w4a8_gemv")
def _(x, packed, scales, zeros, group_size, out_features, bias):
    return x.new_empty(*x.shape[:-1], out_features)


_register("w8a8_gemv", cpu_linear.cpu_w8a8_gemv, _no_kernel("w8a8_gemv"), _no_kernel("w8a8_gemv"))


@torch.library.register_fake("qkiln::w8a8_gemv")
def _(x, weight, scales, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _triton_small_op(name: str):
    def run(*args):
        from qkiln.plugins import triton_small_ops

        return getattr(triton_small_ops, "triton_" + name)(*args)
    return run


_register("rms_norm", cpu_native.cpu_rms_norm, _triton_small_op("rms_norm"), small.reference_rms_norm)
_register("fused_add_rms_norm", cpu_native.cpu_fused_add_rms_norm, _triton_small_op("fused_add_rms_norm"),
          small.reference_fused_add_rms_norm)
_register("silu_and_mul", cpu_native.cpu_silu_and_mul, _triton_small_op("silu_and_mul"),
          small.reference_silu_and_mul)
_register("rotary_embedding", cpu_native.cpu_rotary_embedding, _triton_small_op("rotary_embedding"),
          small.reference_rotary_embedding)


@torch.library.register_fake("qkiln::rms_norm")
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.register_fake("qkiln::fused_add_rms_norm")
def _(x, residual, weight, eps) -> None:
    return None


@torch.library.register_fake("qkiln::silu_and_mul")
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.register_fake("qkiln::rotary_embedding")
def _(qkv, cos, signed_sin, num_heads) -> None:
    return None


def cache_write(key: Tensor, value: Tensor, cache: KVCache, slot_mapping: Tensor) -> None:
    """Quantize key/value [N, Hkv, D] into `cache` at slot_mapping [N] int64 (-1 = skip)."""
    torch.ops.qkiln.cache_write(offset_key(key, cache), value, *cache.op_tensors(), slot_mapping)


def paged_attention(query: Tensor, cache: KVCache, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, scale: float) -> Tensor:
    """Causal GQA attention of query [N, Hq, D] over the paged cache -> [N, Hq, D].

    block_tables [S, max_blocks] int32; seq_lens [S] int32 context length including this step;
    query_start_loc [S + 1] int32: sequence s owns rows [qsl[s], qsl[s+1]), its last positions.
    """
    return torch.ops.qkiln.paged_attention(query, *cache.op_tensors(), block_tables, seq_lens,
                                           query_start_loc, scale)


def argmax(logits: Tensor) -> Tensor:
    """[M, V] -> int64 [M]: torch.argmax(dim=-1)'s result (first maximum, NaN the largest), through
    a native kernel for CPU logits in fp32, bf16 or fp16 (torch's reads ~0.6 G floats/s there)."""
    return cpu_native.argmax_rows(logits) if logits.device.type == "cpu" else logits.argmax(dim=-1)


def _int8_act(x: Tensor, weight: W4A16Weight | W8A16Weight) -> W4A8Weight | None:
    """The weight's int8-activation form when it has one and x has many rows (opt-in CPU path)."""
    a8 = weight.int8_act
    return a8 if a8 is not None and x.numel() > cpu_linear.SMALL_M * x.shape[-1] else None


def w4a8_linear(x: Tensor, weight: W4A8Weight, bias: Tensor | None = None) -> Tensor:
    return torch.ops.qkiln.w4a8_linear(x, weight.packed, weight.scales, weight.zero_scales,
                                       weight.group_size, weight.out_features, bias)


def w4a16_linear(x: Tensor, weight: W4A16Weight, bias: Tensor | None = None) -> Tensor:
    if (a8 := _int8_act(x, weight)) is not None:
        return w4a8_linear(x, a8, bias)
    if weight.int8_activations:  # the rows the panels do not serve: the GEMV layout, same rounding
        return torch.ops.qkiln.w4a8_gemv(x, weight.packed, weight.scales, weight.zeros,
                                         weight.group_size, weight.out_features, bias)
    return torch.ops.qkiln.w4a16_linear(x, weight.packed, weight.scales, weight.zeros,
                                        weight.group_size, weight.in_features,
                                        weight.out_features, bias, weight.dequantized,
                                        weight.amx_tables)


def w8a16_linear(x: Tensor, weight: W8A16Weight, bias: Tensor | None = None) -> Tensor:
    if (a8 := _int8_act(x, weight)) is not None:
        return w4a8_linear(x, a8, bias)
    if weight.int8_activations and x.numel() <= cpu_linear.SMALL_M * x.shape[-1]:  # the GEMV rows
        return torch.ops.qkiln.w8a8_gemv(x, weight.weight, weight.scales, bias)
    return torch.ops.qkiln.w8a16_linear(x, weight.weight, weight.scales, bias, weight.dequantized,
                                        weight.amx_codes)


def fp8_w8a8_linear(x: Tensor, weight: FP8Weight, bias: Tensor | None = None) -> Tensor:
    return torch.ops.qkiln.fp8_w8a8_linear(x, weight.weight, weight.weight_scale, bias, weight.input_scale)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H] -> RMSNorm(x) * weight [..., H], Hugging Face's rounding."""
    return torch.ops.qkiln.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: residual = x + residual (rounded); x = RMSNorm(residual) * weight."""
    torch.ops.qkiln.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2I] (gate first) -> silu(gate) * up [..., I]."""
    return torch.ops.qkiln.silu_and_mul(gate_up)


def rotary_embedding(qkv: Tensor, cos: Tensor, signed_sin: Tensor, num_heads: int) -> None:
    """Rotate heads [0, num_heads) of qkv [..., H, D] in place (rope.py's cos / signed sin)."""
    torch.ops.qkiln.rotary_embedding(qkv, cos, signed_sin, num_heads)
