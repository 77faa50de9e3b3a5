"""compile/upcast.py: a model held in bf16 computes exactly as its fp32 copy, and leaves its weights
as stored, also when a call is cut short."""

import pytest
import torch
from torch import nn

from qkiln.compile.upcast import compute_in_float32


class _Stop(Exception):
    pass


def test_a_bf16_linear_and_embedding_compute_in_float32_and_stay_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 6)).to(torch.bfloat16)
    exact = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 6))
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    compute_in_float32(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        got, want = model(ids), exact(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert model[1].weight.dtype == torch.bfloat16 and model[0].weight.dtype == torch.bfloat16
    assert model[1].bias.dtype == torch.float32  # 1-D tensors are fp32 copies
    model.double()  # as the ONNX check's exact copy: a weight in the input's dtype is used as it is
    with torch.no_grad():
        assert model(ids).dtype == torch.float64 and torch.allclose(model(ids), want.double(), atol=1e-6)


def test_a_call_cut_short_puts_the_weight_back_unless_it_was_replaced():
    stored = nn.Linear(4, 4).to(torch.bfloat16)
    linear = compute_in_float32(stored)
    bf16 = linear.weight.data
    x = torch.randn(1, 4)

    def stop(module, args):  # after the upcast's hook, as calibration's capture hooks are
        raise _Stop

    def cut_short():
        handle = linear.register_forward_pre_hook(stop)
        with pytest.raises(_Stop):
            linear(x)
        handle.remove()

    cut_short()
    assert linear.weight.dtype == torch.float32  # the call's copy, until the next call
    with torch.no_grad():
        assert torch.equal(linear(x), nn.functional.linear(x, bf16.float(), linear.bias))
    assert linear.weight.data_ptr() == bf16.data_ptr()  # put back
    cut_short()
    replaced = torch.randn(4, 4)  # e.g. AWQ's scaled weight, or a quantized simulation's placeholder
    linear.weight.data = replaced
    with torch.no_grad():
        assert torch.equal(linear(x), nn.functional.linear(x, replaced, linear.bias))
    assert linear.weight.data_ptr() == replaced.data_ptr()  # not overwritten by the stale bf16 weight
