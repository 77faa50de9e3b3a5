"""Whether a forward takes the fused-op path: bf16/fp16 activations on CPU with qkiln's native
ops built (plugins/cpu_native.py). Everything else (fp32 evaluation and parity, GPUs, a failed
build) keeps the model's plain torch code, unchanged.

The fused path runs the `qkiln::` small ops (plugins/ops.py: fused_add_rms_norm, rms_norm,
silu_and_mul, rotary_embedding), which round like Hugging Face's eager bf16 code op by op, so
it changes the cost of a layer (~20 eager ops fewer), not its numbers: only the fp32 summation
order inside RMSNorm differs.
"""

import torch

from qkiln.plugins import cpu_native

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def use_fused_ops(x: torch.Tensor) -> bool:
    """True when the layers should run the fused ops for activations like x (the ops mutate
    their inputs and have no autograd, so only without gradients)."""
    return x.device.type == "cpu" and x.dtype in _FUSED_DTYPES and not torch.is_grad_enabled() \
        and cpu_native.native_ops() is not None
