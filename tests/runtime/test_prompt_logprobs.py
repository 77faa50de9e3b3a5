"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token after the first scored by
the model given the ones before it, equal to one teacher-forced forward pass of the whole
prompt, however the prompt was chunked, batched, preempted or found in the prefix cache."""

import random

import pytest
import torch

from qkiln.errors import RequestError
from qkiln.runtime import engine as engine_module
from qkiln.runtime.engine import EngineConfig, LLMEngine
from qkiln.runtime.loader import load_for_serving
from qkiln.runtime.sampling_params import SamplingParams
from qkiln.runtime.tokenizer import Tokenizer
from tiny_models import write_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_for_serving(str(write_tiny_hf_model(tmp_path_factory.mktemp("m"), "llama")), dtype="fp32")


def teacher_forced(model, prompt: list[int], full: bool = False) -> torch.Tensor:
    """[len(prompt) - 1] logprob of prompt[i + 1] given prompt[: i + 1], one dense forward
    (full: every token's, [len(prompt) - 1, vocab])."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]))[0].float()
    logprobs = torch.log_softmax(logits[:-1], -1)
    return logprobs if full else logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


def run(engine: LLMEngine, prompts, params, arrivals=None) -> dict[int, list]:
    """prompt index -> the prompt_logprobs of its first output; steps until every request ends."""
    arrivals = arrivals or [0] * len(prompts)
    ids, firsts, done, step = {}, {}, set(), 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrivals):
            if at == step:
                ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            i = ids[out.request_id]
            if i not in firsts:
                firsts[i] = out.prompt_logprobs
            else:
                assert out.prompt_logprobs is None  # only the first output carries them
            if out.finished:
                done.add(i)
        engine.check_integrity()
        step += 1
        assert step < 5000
    return firsts


def check(entries, prompt, expected, num_top):
    assert len(entries) == len(prompt) and entries[0] is None
    got = torch.tensor([e["logprob"] for e in entries[1:]])
    assert [e["token_id"] for e in entries[1:]] == prompt[1:]
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    for e in entries[1:]:
        assert len(e["top"]) == num_top
        if num_top:
            best = max(e["top"].values())
            assert e["logprob"] <= best + 1e-6
            # the argmax token's own value equals the top-1 exactly (loglikelihood "is greedy")
            assert (e["token_id"] == max(e["top"], key=e["top"].get)) == (e["logprob"] == best)


def test_prompt_logprobs_equal_a_teacher_forced_forward(tiny, monkeypatch):
    seed = random.randrange(1 << 30)
    print(f"prompts seed {seed}")  # shown with a failure, to replay it
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(37)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 50))] for _ in range(4)]
    prompts += [[rng.randrange(256)], [rng.randrange(256) for _ in range(70)]]
    expected = [teacher_forced(tiny.model, p) for p in prompts]
    num_tops = [0, 1, 3, 5, 2, 4]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=n) for n in num_tops]
    variants = {
        "one step each": dict(num_kv_blocks=128),
        "chunked prefill (budget 7)": dict(num_kv_blocks=128, max_num_batched_tokens=7),
        "preemption (8 blocks)": dict(num_kv_blocks=8, max_num_batched_tokens=24),
        "logits made 5 rows at a time": dict(num_kv_blocks=128),
    }
    for label, kw in variants.items():
        if "5 rows" in label:
            monkeypatch.setattr(engine_module, "PROMPT_SCORE_ROWS", 5)
        engine = LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(kv_dtype="fp32", **kw))
        firsts = run(engine, prompts, params, arrivals=[0, 2, 2, 5, 6, 6])
        for i, prompt in enumerate(prompts):
            check(firsts[i], prompt, expected[i], num_tops[i])
        if "preemption" in label:
            assert engine.scheduler.num_preemptions > 0, label


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(tiny):
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(50)]
    engine = LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(kv_dtype="fp32", num_kv_blocks=64))
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    assert run(engine, [prompt], [plain]) == {0: None}  # fills the prefix cache
    hits = engine.kv_manager.prefix_cache_hits
    scored = run(engine, [prompt], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)])
    check(scored[0], prompt, teacher_forced(tiny.model, prompt), 1)
    assert engine.kv_manager.prefix_cache_hits == hits
    run(engine, [prompt], [plain])  # and the plain request still hits the cache
    assert engine.kv_manager.prefix_cache_hits > hits


def test_without_chunked_prefill_scores_repeat_bit_for_bit_under_any_load(tmp_path):
    """An evaluation job's loglikelihoods changed between identical runs (0.7 nats on a SmolLM2
    W4A16 artifact): the budget cut a prompt where the requests before it left off, and a few rows
    of an int4 linear take another kernel than many. With chunked prefill off the cuts are fixed
    and a prompt's scores are the same bits alone and under load (on SmolLM2 W4A16 with chunked
    prefill on, 0.14 nats apart; this tiny model happens to agree either way, so the scheduler's
    test_fixed_chunks_* show the cuts themselves)."""
    from qkiln.compile.build import build
    from qkiln.compile.recipe import preset

    source = write_tiny_hf_model(tmp_path / "m", "llama")
    artifact = build(str(source), preset("w4a16-rtn"), tmp_path / "a", use_cache=False, progress=False,
                     log=lambda m: None).path
    model = load_for_serving(str(artifact))
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(45)]
    others = [[rng.randrange(256) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    scored = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)
    decodes = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def scores(arrivals):
        engine = LLMEngine(model.model, model.tokenizer, EngineConfig(
            max_num_batched_tokens=16, enable_chunked_prefill=False, enable_prefix_caching=False, num_kv_blocks=64))
        firsts = run(engine, [prompt, *others][:len(arrivals)], [scored, *[decodes] * 3], arrivals)
        return [e["logprob"] for e in firsts[0][1:]]

    alone = scores([0])
    for arrivals in ([1, 0, 0, 0], [3, 0, 1, 2], [0, 0, 2, 2]):
        assert scores(arrivals) == alone, arrivals


def test_prompt_logprobs_out_of_range_is_refused_naming_the_field(tiny):
    engine = LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(kv_dtype="fp32", num_kv_blocks=16))
    for bad in (-1, 10_000, 1.5, True):
        with pytest.raises(RequestError, match="prompt_logprobs") as e:
            engine.add_request([1, 2, 3], SamplingParams(prompt_logprobs=bad))
        assert e.value.param == "prompt_logprobs"


def test_offline_llm_returns_prompt_and_token_logprobs(tmp_path):
    from qkiln.runtime.llm import LLM, Logprob

    llm = LLM(str(write_tiny_hf_model(tmp_path, "llama")), dtype="fp32", num_kv_blocks=32)
    prompt = [5, 17, 99, 3, 250, 42]
    scored, plain = llm.generate([prompt, prompt], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                                   logprobs=2, prompt_logprobs=0),
                                                    SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    # vLLM's shapes: per token a dict token id -> Logprob(logprob, rank, decoded_token), the scored
    # token first, then the top ones
    full = teacher_forced(llm.engine.model, prompt, full=True)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt)
    for row, token, entry in zip(full, prompt[1:], scored.prompt_logprobs[1:]):
        assert list(entry) == [token]  # prompt_logprobs=0: the prompt token alone
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=2e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    for entry, token in zip(scored.logprobs, scored.token_ids):
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy: the top token
        assert len(entry) == 2 and all(isinstance(v, Logprob) for v in entry.values())
        runner_up = list(entry)[1]
        assert entry[runner_up].rank == 2 and entry[runner_up].logprob <= entry[token].logprob
    assert scored.outputs[0].cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in
                                                                     zip(scored.logprobs, scored.token_ids)))
    assert plain.logprobs is None and plain.prompt_logprobs is None and plain.token_ids == scored.token_ids
    assert plain.cumulative_logprob is None


def test_offline_logprobs_of_a_sampled_token_outside_the_top(tmp_path):
    """A sampled token that is not among the top ones is first in its dict, with its own rank,
    and the dict holds it and the top `logprobs` (k + 1 entries), as vLLM's does."""
    from qkiln.runtime import LLM

    llm = LLM(str(write_tiny_hf_model(tmp_path, "llama")), dtype="fp32", num_kv_blocks=32)
    out = llm.generate([[5, 17, 99]], SamplingParams(max_tokens=48, temperature=5.0, seed=3, ignore_eos=True,
                                                     logprobs=1))[0]
    outside = [(e, t) for e, t in zip(out.logprobs, out.token_ids) if e[t].rank > 1]
    assert outside, "a temperature of 5 on a random model never sampled past the top token"
    for entry, token in outside:
        assert list(entry)[0] == token and len(entry) == 2
        top = list(entry)[1]
        assert entry[top].rank == 1 and entry[top].logprob > entry[token].logprob


def test_tied_tokens_rank_as_vllm_ranks_them(tmp_path):
    """vLLM counts the tokens at least as likely (ties share the worse rank); a top token's rank is
    its place in the top, also when it is the scored token."""
    from qkiln.runtime.logprob_dicts import LogprobConverter
    from qkiln.runtime.sampler import score_tokens

    logits = torch.tensor([[2.0, 5.0, 5.0, 1.0]])
    scores = score_tokens(logits, torch.tensor([1]), 2)
    assert scores.ranks.tolist() == [2] and score_tokens(logits, torch.tensor([3]), 0).ranks.tolist() == [4]
    tokenizer = Tokenizer.from_dir(write_tiny_hf_model(tmp_path, "llama"))
    top = dict(zip(scores.top_token_ids[0].tolist(), scores.top_logprobs[0].tolist()))
    entry = {"token_id": 1, "logprob": float(scores.logprobs[0]), "rank": 2, "top": top}
    out = LogprobConverter(tokenizer).one(entry)
    assert list(out) == [1, 2] and [v.rank for v in out.values()] == [1, 2]
    below = LogprobConverter(tokenizer).one(entry | {"token_id": 3, "logprob": -5.0, "rank": 4})
    assert list(below) == [3, 1, 2] and below[3].rank == 4
