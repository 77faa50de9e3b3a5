"""Unquantized bf16 linears of a model served on CPU, with weights pre-packed for oneDNN.

Serving only (loader.py): aten's bf16 GEMM re-orders a plain weight into oneDNN's blocked layout
on every call, which packing once at load avoids (plugins/packed_weights.onednn_pack; 1.2-1.35x at
64 rows on SmolLM2's shapes, 2 threads). Results are the bits of nn.Linear's. A tied lm_head gets
a packed copy of the embedding matrix: its bytes once more (56 MB for SmolLM2), for the largest
GEMM of a decode step.
"""

import torch
from torch import nn

from qkiln.plugins.cpu_linear import dense_linear
from qkiln.plugins.packed_weights import onednn_bf16_available, onednn_pack

from .model import CausalLM


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = onednn_pack(weight.detach())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = dense_linear(x.reshape(-1, self.in_features), self.packed, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"onednn-packed bf16, in={self.in_features}, out={self.out_features}"


def pack_dense_linears(model: CausalLM) -> int:
    """Replace the bf16 CPU nn.Linear modules of `model` (and a tied head) by PackedLinear, in
    place; returns how many. Nothing changes where oneDNN has no bf16 GEMM."""
    embed = model.model.embed_tokens.weight
    if embed.device.type != "cpu" or not onednn_bf16_available():
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    if model.lm_head is None and embed.dtype == torch.bfloat16:
        model.lm_head = PackedLinear(embed, None)
        return len(targets) + 1
    return len(targets)
