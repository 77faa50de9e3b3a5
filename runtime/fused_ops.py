"""Whether a forward takes the fused-op path: bf16/fp16 activations, no gradients, and a kernel
for the device: qkiln's native ops on CPU (plugins/cpu_native.py), the Triton small ops on CUDA
(plugins/triton_small_ops.py; QKILN_GPU_FUSED_OPS=0 keeps the torch code there). Everything else
(fp32 evaluation and parity, a failed build, no triton) keeps the model's plain torch code.

The fused path runs the `qkiln::` small ops (plugins/ops.py: fused_add_rms_norm, rms_norm,
silu_and_mul, rotary_embedding), which round like Hugging Face's eager bf16 code op by op, so
it changes the cost of a layer (~20 eager ops fewer), not its numbers: only the fp32 summation
order inside RMSNorm differs.
"""

import functools
import importlib.util

import torch

from qkiln.plugins import cpu_native
from qkiln.plugins.env_switches import env_switch

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _gpu_fused_ops() -> bool:
    return env_switch("QKILN_GPU_FUSED_OPS", True) and importlib.util.find_spec("triton") is not None


def use_fused_ops(x: torch.Tensor) -> bool:
    """True when the layers should run the fused ops for activations like x (the ops mutate
    their inputs and have no autograd, so only without gradients)."""
    if x.dtype not in _FUSED_DTYPES or torch.is_grad_enabled():
        return False
    if x.device.type == "cpu":
        return cpu_native.native_ops() is not None
    return x.device.type == "cuda" and _gpu_fused_ops()
