"""Quantized linear layers the runtime builds from an artifact's manifest (never from names).

`manifest.quantization["linears"][name]` says the format of each quantized linear; its tensors
are stored canonically (see compile/artifact_tensors.py) and packed here for the target's
kernels (plugins.prepare_*), so an artifact is portable across CPUs with different vector ISAs.
"""

import torch
from torch import nn

from qkiln.errors import ArtifactError
from qkiln.plugins import (fp8_w8a8_linear, prepare_fp8_w8a8, prepare_w4a16, prepare_w8a16, w4a16_linear,
                           w8a16_linear)
from qkiln.quant.pack import unpack_int4


class QuantizedLinear(nn.Module):
    def __init__(self, kind: str, weight, bias: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.kind, self.packed = kind, weight
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "int4":
            return w4a16_linear(x, self.packed, self.bias)
        if self.kind == "int8":
            return w8a16_linear(x, self.packed, self.bias)
        return fp8_w8a8_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}"


def make_quantized_linear(name: str, entry: dict, tensors: dict[str, torch.Tensor], target: str,
                          dtype: torch.dtype, bias: torch.Tensor | None,
                          int8_activations: bool = False, dense_prefill: bool = True) -> QuantizedLinear:
    """int8_activations (cpu): int4/int8 weights also packed for the int8-activation GEMM of many
    rows (plugins/packed_weights.py); fp8 linears are unaffected. dense_prefill (cpu): int4/int8
    weights also kept as a dense copy (bf16, or fp32 without fast bf16) for the GEMMs of many rows
    (prefill); False computes every row from the codes: less memory, slower prompts."""
    fmt = entry["format"]
    out_features, in_features = entry["out_features"], entry["in_features"]
    keep_dequantized = target == "cpu" and dense_prefill
    try:
        if fmt == "int4":
            codes = unpack_int4(tensors[name + ".qweight"])[:, :in_features]  # [out, in] 0..15
            zeros = tensors.get(name + ".zeros")
            qweight = codes if zeros is not None else (codes.to(torch.int16) - 8).to(torch.int8)
            gs = entry["group_size"] or in_features
            packed = prepare_w4a16(qweight, tensors[name + ".scales"].float(), zeros, gs, target,
                                   keep_dequantized=keep_dequantized, dtype=dtype,
                                   int8_activations=int8_activations)
        elif fmt == "int8":
            packed = prepare_w8a16(tensors[name + ".qweight"], tensors[name + ".scales"].float().reshape(-1), target,
                                   keep_dequantized=keep_dequantized, int8_activations=int8_activations)
        elif fmt == "fp8":
            static = entry.get("activations") == "static"  # served with the scale it was evaluated with
            packed = prepare_fp8_w8a8(tensors[name + ".weight"], tensors[name + ".weight_scale"].float(), target,
                                      tensors[name + ".input_scale"] if static else None, entry.get("group_size"))
        else:
            raise ArtifactError(f"linear {name} has unknown format {fmt!r}; rebuild with this qkiln version")
    except KeyError as e:
        raise ArtifactError(f"artifact lacks tensor {e} for linear {name}; rebuild the artifact") from None
    return QuantizedLinear(fmt, packed, bias, in_features, out_features)
