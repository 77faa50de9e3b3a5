"""Simulated (fake-quant) execution: the lean model computing exactly what the quantized one would.

Weights are replaced by their dequantized values, FP8 activations are quantize-dequantized on the
way into each linear (forward pre-hook), and K/V pass through the cache's quantizer before
attention. This lets `qkiln eval` score any scheme before a kernel exists, and is what
calibration propagates through so each layer is calibrated on its quantized predecessors.
"""

import torch
from torch import nn

from qkiln.plugins.packed_weights import int8_activations_fit
from qkiln.plugins.reference import fake_quantize_int8_blocks
from qkiln.quant import Fp8Weight, QuantizedWeight, fake_quant_kv, fake_quantize_activation
from qkiln.runtime.attention import DenseAttention
from qkiln.runtime.model import CausalLM
from qkiln.runtime.source import build_model

from .quantized_model import QuantizedModel
from .upcast import compute_in_float32

# What an artifact's accuracy report scores. Serving computes in bf16 by default, which moves a
# KV-int4 artifact's perplexity by about 1% (README, "Accuracy as served").
SIMULATION_SCORING = ("fp32 simulation: weights dequantized as stored, activations and KV cache fake-quantized "
                      "as the recipe says")


def simulated_kv_backend(qm: QuantizedModel) -> DenseAttention:
    scheme = qm.scheme.kv_cache
    if scheme is None:
        return DenseAttention()

    def transform(layer_id, k, v):
        k_cal, v_cal = qm.kv[layer_id]
        return fake_quant_kv(k, scheme, k_cal), fake_quant_kv(v, scheme, v_cal)

    return DenseAttention(kv_transform=transform)


def _act_hook(name: str, qm: QuantizedModel):
    scheme, scale = qm.scheme.activations, qm.act_scales.get(name)

    def hook(module, args):
        return (fake_quantize_activation(args[0], scheme, scale),)

    return hook


def install_layer_simulation(layer: nn.Module, layer_id: int, qm: QuantizedModel,
                             names: tuple[str, ...] | None = None) -> None:
    """Make decoder layer `layer_id`'s linears (or only `names`, e.g. "mlp.down_proj") compute as
    quantized (weights and activations). Install each linear once: a second call would quantize its
    activations twice."""
    prefix = f"model.layers.{layer_id}."
    for name, module in layer.named_modules():
        full = prefix + name
        if full in qm.weights and (names is None or name in names):
            _simulate_linear(module, full, qm)


def _simulate_linear(module: nn.Linear, name: str, qm: QuantizedModel) -> None:
    """The linear computes as qm's quantized `name`: its weight dequantized per call, and an fp8
    one's activations quantized as the scheme says (an integer head under an fp8 scheme is W8A16)."""
    weight = qm.weights[name]
    _dequantize_per_call(module, weight)
    if qm.scheme.activations is not None and isinstance(weight, Fp8Weight):
        module.register_forward_pre_hook(_act_hook(name, qm))


def _dequantize_per_call(module: nn.Linear, weight: QuantizedWeight | Fp8Weight) -> None:
    """The linear computes with `weight` dequantized, made for each call and let go after it: held
    whole, the simulation's fp32 weights were 4 bytes a parameter beside the source's own for the
    rest of the build (SmolLM2: 405 MiB). Dequantizing is the same arithmetic every call, and costs
    a pass over the weight where the GEMM costs one per token."""
    module.weight.data = torch.empty(0, dtype=module.weight.dtype)

    def materialize(module, args):  # in the activations' dtype: a float64 copy of the model computes in float64
        module.weight.data = weight.dequantize().to(args[0].dtype)

    def release(module, args, output):
        module.weight.data = torch.empty(0, dtype=module.weight.dtype)

    module.register_forward_pre_hook(materialize)
    module.register_forward_hook(release)


def simulate_lm_head(model: CausalLM, qm: QuantizedModel) -> None:
    """Compute logits with qm's quantized head (`_simulate_linear`); a tied model gets a head module
    of its own (its embedding lookups keep the exact weights)."""
    if model.lm_head is None:
        with torch.device("meta"):  # no [vocab, hidden] initialisation: the weight is made per call
            model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        model.lm_head.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    _simulate_linear(model.lm_head, "lm_head", qm)


def _int8_activations_hook(module, args):
    return (fake_quantize_int8_blocks(args[0]).to(args[0].dtype),)


def takes_int8_activations(weight) -> bool:
    """Whether the runtime's opt-in int8-activation GEMM serves this integer weight."""
    if not isinstance(weight, QuantizedWeight):
        return False
    in_features = weight.shape[1]
    return int8_activations_fit(in_features, weight.group_size or in_features)


def simulated_model(qm: QuantizedModel, int8_activations: bool = False) -> tuple[CausalLM, DenseAttention]:
    """A model that computes in fp32 as `qm` would; pass the backend to its forward. Its quantized
    linears (the head too) hold no dense weight: they dequantize for each call.

    int8_activations: also round the inputs of its integer linears to int8 per 32 channels, as a
    CPU runtime serving with int8 activations does for steps of more than 16 rows (every scored
    window here is such a step)."""
    # high-precision tensors as stored (bf16 but norms), computing in fp32 (compile/upcast.py);
    # each quantized linear a placeholder never written (so never resident), dequantized per call
    state = dict(qm.fp_tensors) | {name + ".weight": torch.empty(w.shape) for name, w in qm.weights.items()}
    model = compute_in_float32(build_model(qm.config, state, None))
    for name in qm.weights:
        if name == "lm_head":  # a module of its own where the model ties it to the embeddings
            simulate_lm_head(model, qm)
        else:
            _simulate_linear(model.get_submodule(name), name, qm)
    if int8_activations:
        for name, module in model.named_modules():
            if takes_int8_activations(qm.weights.get(name)):
                module.register_forward_pre_hook(_int8_activations_hook)
    return model, simulated_kv_backend(qm)
