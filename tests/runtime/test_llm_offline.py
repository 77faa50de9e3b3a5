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
