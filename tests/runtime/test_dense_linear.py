"""bf16 models served on CPU read oneDNN-packed weights (runtime/dense_linear.py): the logits keep
nn.Linear's bits, and every linear (and a tied head) is packed once."""

import pytest
import torch

from qkiln.plugins.packed_weights import onednn_bf16_available
from qkiln.runtime.dense_linear import PackedLinear, pack_dense_linears
from qkiln.runtime.fusion import fuse_tensors, projection_out_sizes
from qkiln.runtime.loader import load_for_serving
from qkiln.runtime.source import build_model, load_source
from tiny_models import write_tiny_hf_model

pytestmark = pytest.mark.skipif(not onednn_bf16_available(), reason="oneDNN without bf16 GEMMs")


def _unpacked(path: str):
    """What load_for_serving builds before packing: fused projections, nn.Linear modules."""
    src = load_source(path)
    weights = dict(src.state_dict)
    fused = fuse_tensors(weights, {}, src.config.num_hidden_layers, projection_out_sizes(src.config))
    return build_model(src.config, weights, torch.bfloat16, fused=fused)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_packed_model_gives_nn_linears_bits(tmp_path, arch):
    path = str(write_tiny_hf_model(tmp_path / arch, arch))
    served = load_for_serving(path, dtype="bf16").model
    plain = _unpacked(path)
    num_layers = plain.config.num_hidden_layers
    assert sum(isinstance(m, PackedLinear) for m in served.modules()) == 4 * num_layers + 1  # + tied head
    assert not any(type(m) is torch.nn.Linear for m in served.modules())
    assert pack_dense_linears(served) == 0  # nothing left to pack
    ids = torch.randint(0, plain.config.vocab_size, (2, 19))
    with torch.inference_mode():
        assert torch.equal(served(ids), plain(ids))
