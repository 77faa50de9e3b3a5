"""Serving an artifact with int8 activations (opt-in, CPU): what the loader builds and where the
engine's numbers move. Kernel accuracy itself: tests/plugins/test_plugins_w4a8.py."""

import pytest
import torch

from qkiln.errors import QkilnError
from qkiln.plugins import cpu_native
from qkiln.plugins.packed_weights import int8_act_panels_fast
from qkiln.runtime.engine import EngineConfig, LLMEngine
from qkiln.runtime.loader import load_for_serving
from qkiln.runtime.quantized_linear import QuantizedLinear
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model

pytestmark = pytest.mark.skipif(cpu_native.native_extension() is None, reason="native CPU kernels not built")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("a8")
    source = write_tiny_hf_model(tmp / "m", "llama")
    path = build(str(source), load_recipe("w4a16-rtn"), tmp / "w4", use_cache=False, progress=False,
                 log=lambda m: None).path
    return source, path


def _step_logits(path, int8_activations: bool, prompt: list[int]) -> list[torch.Tensor]:
    loaded = load_for_serving(str(path), dtype="bf16", int8_activations=int8_activations)
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(max_num_batched_tokens=256, num_kv_blocks=64))
    steps, run = [], engine.runner.run
    engine.runner.run = lambda plan, argmax=False: steps.append(run(plan, argmax)) or steps[-1]
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return [step.logits.float() for step in steps]


def test_loader_packs_every_int_linear_for_int8_activations(artifact):
    _, path = artifact
    model = load_for_serving(str(path), dtype="bf16", int8_activations=True).model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.kind for m in linears} == {"int4", "int8"}  # int8: the head of w4a16-rtn
    panels = int8_act_panels_fast()  # the many-row GEMM's AVX512-VNNI kernel
    for m in linears:
        assert (m.packed.int8_act is not None) == panels
        if m.kind == "int4":  # every step rounds: no dense copy
            assert m.packed.int8_activations and m.packed.dequantized is None
        else:  # int8: few rows round (the GEMV), many through the panels only; else exact
            assert m.packed.int8_activations == (m.packed.weight.shape[1] % 32 == 0)
            assert (m.packed.dequantized is None) == panels
    exact = load_for_serving(str(path), dtype="bf16").model
    assert all(m.packed.int8_act is None for m in exact.modules() if isinstance(m, QuantizedLinear))


def test_many_row_steps_move_the_logits_a_little(artifact):
    _, path = artifact
    prompt = [(7 * i + 3) % 250 for i in range(40)]  # a 40-row prefill: int8 activations apply
    exact, int8 = _step_logits(path, False, prompt), _step_logits(path, True, prompt)
    first = (int8[0] - exact[0]).abs().max() / exact[0].abs().max()
    assert 0 < first < 0.05
    # A decode row rounds too (the int4 and int8 GEMVs): about as far as the prefill's logits
    # moved.
    decode = (int8[1] - exact[1]).abs().max() / exact[1].abs().max()
    assert 0 < decode < 0.1


def test_refused_where_there_is_nothing_to_apply_it_to(artifact):
    source, _ = artifact
    with pytest.raises(QkilnError, match="int8 activations"):
        load_for_serving(str(source), int8_activations=True)


def test_eval_simulates_what_serving_with_int8_activations_computes(artifact):
    from qkiln.compile.model_ref import open_model
    from qkiln.plugins.reference import fake_quantize_int8_blocks

    source, path = artifact
    exact, int8 = open_model(str(path)), open_model(str(path), int8_activations=True)
    ids = torch.tensor([[(5 * i + 1) % 250 for i in range(48)]])
    moved = (int8(ids) - exact(ids)).abs().max() / exact(ids).abs().max()
    assert 0 < moved < 0.05 and int8.description["int8_activations"]
    # Each integer linear's input is rounded exactly as the kernel's reference rounds it.
    seen = []
    head = int8.model.lm_head
    head.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    int8(ids)
    assert torch.equal(seen[0], fake_quantize_int8_blocks(seen[0]))  # already on the int8 grid
    with pytest.raises(QkilnError, match="int8 activations"):
        open_model(str(source), int8_activations=True)
