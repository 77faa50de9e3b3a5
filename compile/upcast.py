"""A model held in its stored precision that computes in float32.

The build calibrates, evaluates and checks in fp32 (CPU, deterministic). Holding an fp32 copy of
a bf16 checkpoint was 4 bytes a parameter for the whole build, beside the source's own: a weight
is upcast for each call instead and let go after it. Upcasting bf16 or fp16 to fp32 is exact, so
the numbers are those of the held copy; the cost is one pass over the weight per call, where the
GEMM makes one per token.
"""

import torch
from torch import nn

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_in_float32(model: nn.Module) -> nn.Module:
    """Make `model` (weights in any float dtype, shared with whoever else holds them: never written)
    compute in fp32: linears upcast their weight per call, embeddings their rows, and the small
    1-D tensors (norms, biases) become fp32 copies. Returns `model`."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            _upcast_per_call(module)
        elif isinstance(module, nn.Embedding):
            module.register_forward_hook(_rows_in_float32)
    for _, param in model.named_parameters():
        if param.dim() == 1 and param.is_floating_point():
            param.data = param.data.float()
    return model


def _upcast_per_call(module: nn.Linear) -> None:
    """The weight in the input's dtype for this call (a float64 input gets float64). A weight that
    already matches, or a placeholder another hook fills (compile/simulate.py), is left alone."""
    held = {}  # during a call: the weight as stored, and where the copy it computes with lives

    def put_back(module, *_):
        # a call cut short (calibration's capture hooks raise out of the forward) puts it back at the
        # next call, unless the weight was replaced since
        if held and module.weight.data_ptr() == held["copy"]:
            module.weight.data = held["stored"]
        held.clear()

    def upcast(module, args):
        put_back(module)
        weight = module.weight.data
        if weight.numel() and weight.dtype != args[0].dtype:
            module.weight.data = weight.to(args[0].dtype)
            held.update(stored=weight, copy=module.weight.data_ptr())

    module.register_forward_pre_hook(upcast)
    module.register_forward_hook(put_back)


def _rows_in_float32(module, args, output):
    return output.float() if output.dtype in _LOW_PRECISION else output
