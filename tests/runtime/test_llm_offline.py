"""The offline `LLM`: a call that fails part-way (a refused prompt, an interrupt) leaves nothing
behind, so the next call works; mismatched prompt / params lists are refused, not truncated."""

import pytest

from qkiln.errors import RequestError
from qkiln.runtime.llm import LLM
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(write_tiny_hf_model(tmp_path_factory.mktemp("m"), "llama")), dtype="fp32",
               num_kv_blocks=32, max_model_len=128)


def test_a_refused_prompt_in_a_batch_leaves_the_llm_usable(llm):
    expected = llm.generate(["abc"], GREEDY)[0].token_ids
    with pytest.raises(RequestError, match="context"):
        llm.generate(["abc", "x" * 500], GREEDY)  # the second is longer than the context
    assert not llm.engine.has_unfinished() and llm.engine.kv_manager.usage == 0.0
    assert llm.generate(["abc"], GREEDY)[0].token_ids == expected


def test_an_interrupt_leaves_the_llm_usable(llm, monkeypatch):
    expected = llm.generate(["hello"], GREEDY)[0].token_ids
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["hello", "world"], GREEDY)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished() and llm.engine.kv_manager.usage == 0.0
    assert llm.generate(["hello"], GREEDY)[0].token_ids == expected


def test_params_list_must_match_the_prompts(llm):
    with pytest.raises(RequestError, match="3 prompts but 1 SamplingParams"):
        llm.generate(["a", "b", "c"], [GREEDY])
    assert len(llm.generate(["a", "b"], [GREEDY, GREEDY])) == 2


def test_a_kv_fp8_artifact_serves_with_another_kv_dtype(tmp_path, monkeypatch):
    """--kv-dtype / kv_dtype overrides the artifact's cache: its fp8 scales have no place in a bf16
    or int4 cache (they crashed the engine's start)."""
    import dataclasses

    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset
    from tiny_models import write_tiny_model_and_text

    monkeypatch.setenv("QKILN_CACHE_DIR", str(tmp_path / "cache"))
    model, text = write_tiny_model_and_text(tmp_path)
    recipe = preset("w4a16-rtn+kv-fp8")
    recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, source=str(text),
                                                                         num_samples=2, seq_len=32))
    artifact = build(str(model), recipe, tmp_path / "a", progress=False, log=lambda m: None).path
    outputs = {kv: LLM(str(artifact), dtype="fp32", kv_dtype=kv, num_kv_blocks=16).generate(["abc"], GREEDY)[0]
               for kv in ("fp8", "bf16", "int4")}
    assert all(len(out.token_ids) == 5 for out in outputs.values())


def test_a_sliding_window_caps_the_context():
    """qkiln has no sliding-window attention: a model with a window shorter than its context is
    served up to the window, where full and sliding attention agree (it attended past it silently)."""
    import warnings

    from qkiln.runtime.config import ModelConfig

    hf = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 260, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024, "sliding_window": 64}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ModelConfig.from_hf(hf).max_position_embeddings == 64
    assert any("sliding window of 64" in str(w.message) for w in caught)
    assert ModelConfig.from_hf(hf | {"sliding_window": None}).max_position_embeddings == 1024


@pytest.mark.parametrize("bad, message", [
    (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1"),
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(max_model_len=1), "max_model_len must be >= 2"),
    (dict(max_model_len=4096), "max_model_len 4096 exceeds the model's context of 1024"),  # was capped silently
])
def test_engine_settings_out_of_range_are_refused(tmp_path, bad, message):
    from qkiln.errors import QkilnError

    model = write_tiny_hf_model(tmp_path, "llama")
    with pytest.raises(QkilnError, match=message):
        LLM(str(model), dtype="fp32", **({"num_kv_blocks": 8} | bad))
