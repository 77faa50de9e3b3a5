"""True-sequential GPTQ: each group of a layer's linears is calibrated on what the quantized groups
before it compute (q/k/v, then o, then gate/up, then down)."""

import pytest
import torch

from qkiln.compile.calibrate import quantize_model
from qkiln.quant import gptq
from qkiln.quant.scheme import GPTQOptions, QuantScheme, WeightScheme
from qkiln.runtime.attention import DenseAttention
from qkiln.runtime.config import ModelConfig
from qkiln.runtime.model import CausalLM

CONFIG = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def _model(seed=0):
    torch.manual_seed(seed)
    return CausalLM(CONFIG).eval()


def _quantize(true_sequential: bool):
    torch.manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 32))
    scheme = QuantScheme(weights=WeightScheme(4, symmetric=False, group_size=32), algorithm="gptq",
                         gptq=GPTQOptions(true_sequential=true_sequential))
    model = _model()
    return model, quantize_model(model, scheme, ids, batch_size=2, progress=False), ids


@pytest.fixture(scope="module")
def both():
    return _quantize(True), _quantize(False)


def test_first_group_matches_one_pass_gptq_and_o_proj_differs(both):
    (_, seq, _), (_, par, _) = both
    for name in ("q_proj", "k_proj", "v_proj"):  # both see the same inputs: the same weights
        a, b = seq.weights[f"model.layers.0.self_attn.{name}"], par.weights[f"model.layers.0.self_attn.{name}"]
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    # o_proj reads the quantized q/k/v's attention output only with true_sequential
    a, b = seq.weights["model.layers.0.self_attn.o_proj"], par.weights["model.layers.0.self_attn.o_proj"]
    assert not torch.equal(a.dequantize(), b.dequantize())


def test_down_proj_hessian_comes_from_the_quantized_mlp_input(both):
    """Recompute down_proj's GPTQ by hand from layer 0 with every earlier linear quantized: the
    same weights as the calibration's."""
    (_, seq, ids), _ = both
    ref = _model()
    layer = ref.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        layer.self_attn.get_submodule(name).weight.data = seq.weights[f"model.layers.0.self_attn.{name}"].dequantize()
    for name in ("gate_proj", "up_proj"):
        layer.mlp.get_submodule(name).weight.data = seq.weights[f"model.layers.0.mlp.{name}"].dequantize()
    captured = []
    layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    with torch.no_grad():
        hidden = ref.model.embed_tokens(ids)
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        for s in range(0, ids.shape[0], 2):
            layer(hidden[s : s + 2], ref.rope.cos_sin(positions[s : s + 2], hidden.dtype), DenseAttention())
    H, n = gptq.make_empty_hessian(CONFIG.intermediate_size), 0
    for x in captured:
        H, n = gptq.accumulate_hessian(H, x, n)
    W = _model().model.layers[0].mlp.down_proj.weight.data
    expected, _ = gptq.quantize_weight(W, H, seq.scheme.weights, seq.scheme.gptq)
    got = seq.weights["model.layers.0.mlp.down_proj"]
    assert torch.equal(got.qweight, expected.qweight) and torch.equal(got.scales, expected.scales)


def test_calibrated_model_computes_with_every_dequantized_weight(both):
    """The calibrated (simulated) model computes with the dequantized weights of every linear, which
    it makes for each call and does not keep (they were 4 bytes a parameter for the whole build)."""
    (model, seq, _), _ = both
    for name, w in seq.weights.items():
        if name.startswith("model.layers."):
            linear = model.get_submodule(name)
            x = torch.randn(3, linear.in_features)
            with torch.no_grad():
                assert torch.equal(linear(x), torch.nn.functional.linear(x, w.dequantize(), linear.bias))
            assert linear.weight.numel() == 0
