"""Logit bias, repetition / frequency / presence penalties and min-p: against the formulas
written out token by token, on random logits and random histories (fresh each run)."""

import math
import random

import pytest
import torch

from qkiln.errors import RequestError
from qkiln.runtime.logits_processing import adjust_logits
from qkiln.runtime.sampler import Sampler
from qkiln.runtime.sampling_params import SamplingParams

V = 40


@pytest.fixture
def rng():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    return random.Random(seed)


def reference_adjust(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, one token at a time: bias, then CTRL's repetition rule over prompt and output, then
    OpenAI's frequency and presence terms over the output."""
    row = logits.tolist()
    for token, bias in (p.logit_bias or {}).items():
        row[token] += bias
    seen = set(prompt) | set(output)
    for token in range(len(row)):
        if token in seen:
            row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
        count = output.count(token)
        row[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return torch.tensor(row)


def test_penalties_and_bias_match_the_formulas_row_by_row(rng):
    rows = 6
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 3
    params, history = [], []
    for i in range(rows):
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.8]),
            presence_penalty=rng.uniform(-2, 2) if i % 3 else 0.0,
            frequency_penalty=rng.uniform(-2, 2) if i % 2 else 0.0,
            repetition_penalty=rng.uniform(0.5, 2.0) if i != 4 else 1.0,
            logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(i)} or None))
        history.append(([rng.randrange(V) for _ in range(rng.randrange(0, 12))],
                        [rng.randrange(V) for _ in range(rng.randrange(0, 20))]))
    adjusted = adjust_logits(logits, params, None, history)
    for i in range(rows):
        expected = reference_adjust(logits[i], params[i], *history[i])
        torch.testing.assert_close(adjusted[i], expected, rtol=1e-5, atol=1e-5)
    out = Sampler().sample(logits, params, token_history=history)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    assert out.token_ids[greedy].tolist() == adjusted[greedy].argmax(-1).tolist()


def test_rows_without_adjustments_keep_their_logits_and_logprobs_stay_raw():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0, logprobs=2),
              SamplingParams(temperature=0, frequency_penalty=1.5, logprobs=2),
              SamplingParams(temperature=0, logit_bias={7: -100.0, 3: 100.0}, logprobs=2)]
    history = [([1, 2], [5, 5]), ([1, 2], [int(logits[1].argmax())] * 3), ([], [])]
    adjusted = adjust_logits(logits, params, None, history)
    assert torch.equal(adjusted[0], logits[0]) and not torch.equal(adjusted[1], logits[1])
    out = Sampler().sample(logits, params, token_history=history)
    assert out.token_ids[2].item() == 3  # +100 forces it
    assert out.token_ids[1].item() != logits[1].argmax().item()  # 3 x 1.5 off the repeated argmax
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))


def test_adjustments_make_the_step_leave_the_plain_argmax_path():
    greedy = SamplingParams(temperature=0)
    assert Sampler.is_plain_argmax([greedy, SamplingParams(temperature=0, min_p=0.5)])  # min-p keeps the argmax
    for adjusted in (dict(presence_penalty=0.1), dict(frequency_penalty=-0.1), dict(repetition_penalty=1.1),
                     dict(logit_bias={0: 1.0})):
        assert not Sampler.is_plain_argmax([greedy, SamplingParams(temperature=0, **adjusted)])


@pytest.mark.parametrize("min_p, kept", [(0.25, 3), (0.5, 2), (0.9, 1), (0.05, 4)])
def test_min_p_keeps_tokens_within_min_p_of_the_top_and_renormalizes(min_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4).contiguous()
    torch.manual_seed(0)
    out = Sampler().sample(logits, [SamplingParams(temperature=1.0, min_p=min_p)] * 20000)
    freq = torch.bincount(out.token_ids, minlength=4).float() / 20000
    expected = torch.where(probs >= min_p * 0.5, probs, torch.zeros(4))
    expected /= expected.sum()
    assert (freq[kept:] == 0).all()
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_min_p_applies_after_temperature():
    """vLLM's order: at temperature 2 the distribution is flatter, so more tokens clear min_p."""
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    torch.manual_seed(0)
    out = Sampler().sample(logits, [SamplingParams(temperature=2.0, min_p=0.4)] * 4000)
    # tempered: p ~ sqrt(p) -> 0.775, 0.548, 0.316 (relative): 0.316 / 0.775 = 0.41 >= 0.4 stays
    assert set(out.token_ids.tolist()) == {0, 1, 2}
    out = Sampler().sample(logits, [SamplingParams(temperature=1.0, min_p=0.4)] * 4000)
    assert set(out.token_ids.tolist()) == {0, 1}  # 0.1 / 0.6 < 0.4


def test_logit_bias_keys_may_be_json_strings():
    params = SamplingParams(logit_bias={"12": -5, 3: 2.5})
    assert params.logit_bias == {12: -5, 3: 2.5}


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(repetition_penalty=0),
                                 dict(repetition_penalty=math.inf), dict(min_p=1.5), dict(min_p=-0.1),
                                 dict(presence_penalty=math.nan), dict(logit_bias={"x": 1}), dict(logit_bias={-1: 1}),
                                 dict(logit_bias={"²": 1}), dict(logit_bias={1: 101}), dict(logit_bias={1: True}),
                                 dict(logit_bias=[1, 2]), dict(logit_bias={i: 1 for i in range(1025)})])
def test_bad_adjustments_are_refused_naming_the_field(bad):
    with pytest.raises(RequestError) as refused:
        SamplingParams(**bad)
    assert refused.value.param == next(iter(bad))
