"""Requests admitted in the same step share a prompt's KV blocks (the prefix cache hashes a block
when it is scheduled, and every layer writes the step's K/V before attending): the outputs are
those of each request alone, the blocks are computed once, and a step that fails leaves no hash
naming KV that was never written."""

import pytest

from qkiln.runtime.engine import EngineConfig, LLMEngine
from qkiln.runtime.loader import load_for_serving
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_for_serving(str(write_tiny_hf_model(tmp_path_factory.mktemp("m"), "llama")), dtype="fp32")


def make_engine(tiny, **kw) -> LLMEngine:
    return LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(kv_dtype="fp32", num_kv_blocks=64, block_size=16, **kw))


def finish(engine: LLMEngine) -> dict[str, list[int]]:
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        engine.check_integrity()
    return outputs


def alone(tiny, prompt) -> list[int]:
    engine = make_engine(tiny)
    engine.add_request(prompt, GREEDY, "r")
    return finish(engine)["r"]


def test_copies_admitted_together_compute_the_prompt_once(tiny):
    prompt = [(7 * i) % 250 + 3 for i in range(80)]  # 5 blocks
    expected = alone(tiny, prompt)
    engine = make_engine(tiny)
    ids = [engine.add_request(prompt if i < 3 else prompt[:50] + [9, 9], GREEDY) for i in range(4)]
    engine.step()  # all four prefilled in one step, from one copy of the shared blocks
    assert [engine.scheduler.get(i).num_cached_tokens for i in ids] == [0, 64, 64, 48]
    assert engine.kv_manager.usage * 64 == 5 + 2 + 1  # the first one's 5 blocks, one more per copy, 1 for the 4th
    outputs = finish(engine)
    assert [outputs[i] for i in ids[:3]] == [expected] * 3
    assert outputs[ids[3]] == alone(tiny, prompt[:50] + [9, 9])


@pytest.fixture(scope="module")
def w4_artifact(tmp_path_factory):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("w4")
    return build(str(write_tiny_hf_model(tmp / "m", "llama")), load_recipe("w4a16-rtn"), tmp / "a",
                 use_cache=False, progress=False, log=lambda m: None).path


def _b_after_a(loaded, join_at: int) -> tuple[int, list[int]]:
    """Request A decodes; request B, whose prompt is A's first 32 tokens and one more, is added
    when A has `join_at` tokens. Returns (B's cached prompt tokens, B's greedy tokens)."""
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_dtype=loaded.kv_dtype, num_kv_blocks=64,
                                                                    block_size=16))
    assert engine.runner.decode_stack is not None, "the native decode stack serves this artifact"
    engine.add_request([(5 * i) % 200 + 11 for i in range(20)],
                       SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), "a")
    seq_a = engine.scheduler.get("a")
    while seq_a.num_tokens < join_at:
        engine.step()
    engine.add_request(seq_a.token_ids[:32] + [42], GREEDY, "b")
    engine.step()
    cached = engine.scheduler.get("b").num_cached_tokens
    return cached, finish(engine)["b"]


def test_a_decode_that_fills_a_block_shares_it_in_the_same_step(w4_artifact):
    """A's decode step computes position 31, filling its second block, while B hits that block:
    two one-token rows, so on CPU the native decode stack writes the block and B reads it in
    one call. B's tokens are those it gets when the block was written a step earlier."""
    from qkiln.plugins import cpu_native

    if cpu_native.native_ops() is None:
        pytest.skip("the native CPU extension is not built")
    loaded = load_for_serving(str(w4_artifact), dtype="bf16")
    same_step = _b_after_a(loaded, join_at=32)  # A's token 32 is computed in the step B joins
    step_later = _b_after_a(loaded, join_at=33)
    assert same_step[0] == step_later[0] == 32
    assert same_step[1] == step_later[1]


def test_a_failed_step_drops_the_hashes_it_gave_and_recomputes(tiny, monkeypatch):
    prompt = [(3 * i) % 240 + 5 for i in range(70)]
    expected = alone(tiny, prompt)
    engine = make_engine(tiny)
    kv = engine.kv_manager
    for i in range(3):
        engine.add_request(prompt, GREEDY, f"r{i}")
    run = engine.runner.run

    def fails(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "run", fails)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    # no hash survives: the blocks it named were never written, and a later prompt hit them
    assert not kv._hash_to_block and kv.usage == 0.0
    assert engine.scheduler.num_waiting == 3 and engine.scheduler.num_running == 0
    assert engine.scheduler.num_preemptions == 0  # a rollback is not a preemption in the stats
    engine.check_integrity()
    monkeypatch.setattr(engine.runner, "run", run)
    assert finish(engine) == {f"r{i}": expected for i in range(3)}
