"""fp8 artifacts are served as they were evaluated: a static-activation recipe's linears quantize
their inputs with the calibrated per-tensor scale the artifact stores, not per token; group-wise
weight scales are served, not refused at load; greedy tokens served equal the simulated
(evaluated) model's."""

import dataclasses

import pytest
import torch

from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from qkiln.plugins.reference import reference_fp8_w8a8_linear
from qkiln.runtime.llm import LLM
from qkiln.runtime.quantized_linear import QuantizedLinear
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import simulated_greedy, write_tiny_model_and_text


def _build(root, name: str, group_size: int | None = None):
    model, text = write_tiny_model_and_text(root)
    r = preset(name)
    r = dataclasses.replace(r, scheme=dataclasses.replace(
        r.scheme, weights=dataclasses.replace(r.scheme.weights, group_size=group_size)),
        calibration=dataclasses.replace(r.calibration, source=str(text), num_samples=4, seq_len=64),
        evaluation=dataclasses.replace(r.evaluation, data=None))
    return build(str(model), r, root / "a", use_cache=False, progress=False, log=lambda m: None).path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("fp8static"), "fp8-w8a8-static")


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("fp8grouped"), "fp8-w8a8-rtn", group_size=32)


def test_fp8_linears_carry_the_calibrated_scale(artifact):
    llm = LLM(str(artifact), dtype="fp32", num_kv_blocks=16)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedLinear) and m.kind == "fp8"]
    assert linears and all(m.packed.input_scale is not None and m.packed.input_scale.dim() == 0 for m in linears)
    layer = linears[0]
    x = torch.randn(5, layer.in_features) * 3  # beyond the calibrated range: static clips, per token would not
    weight = layer.packed.weight  # on the CPU: the dequantized weight, bf16 (possibly packed for oneDNN)
    weight = (weight.to_dense() if weight.is_mkldnn else weight).float()
    scale = layer.packed.input_scale
    static = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    expected = static @ weight.t()
    assert _rel_error(layer(x), expected) < 1e-2
    per_token = reference_fp8_w8a8_linear(x, weight.to(torch.float8_e4m3fn), torch.ones(weight.shape[0]))
    assert _rel_error(per_token, expected) > 5e-2  # what the runtime computed before


def _rel_error(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("which", ["artifact", "grouped"])
def test_served_greedy_tokens_equal_simulated(which, request):
    artifact = request.getfixturevalue(which)
    llm = LLM(str(artifact), dtype="fp32", num_kv_blocks=16)
    prompt = list(b"It was a bright")
    got = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    assert got == simulated_greedy(artifact, prompt, 12)
