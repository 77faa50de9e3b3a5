"""`n` choices per prompt and the logit adjustments (penalties, min_p, logit_bias) over real HTTP:
each choice is the request it stands for sent alone, OpenAI's order and usage hold, streaming too."""

import json

import pytest

from qkiln.runtime.llm import LLM
from qkiln.runtime.sampling_params import SamplingParams
from loopback import serving_client
from tiny_models import write_tiny_hf_model

ENGINE_KW = dict(num_kv_blocks=96, max_model_len=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def client(model_dir):
    with serving_client(model_dir, dtype="fp32", **ENGINE_KW) as c:
        yield c


def post(client, path, **body):
    r = client.post(path, json={"model": "tiny", "ignore_eos": True} | body)
    assert r.status_code == 200, r.text
    return r.json()


def test_n_choices_are_the_seeded_requests_sent_alone(client):
    """Choice j of a seeded request samples with seed + j (vLLM's rule): it equals that request alone."""
    sampled = dict(prompt="once upon a time", max_tokens=10, temperature=1.0)
    body = post(client, "/v1/completions", n=3, seed=40, **sampled)
    alone = [post(client, "/v1/completions", seed=40 + j, **sampled)["choices"][0]["text"] for j in range(3)]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == alone and len(set(alone)) > 1
    single = post(client, "/v1/completions", seed=40, **sampled)["usage"]
    # the prompt is billed once however many choices it has, as OpenAI does
    assert body["usage"] == {"prompt_tokens": single["prompt_tokens"], "completion_tokens": 30,
                             "total_tokens": single["prompt_tokens"] + 30, "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_batch_with_n_orders_choices_prompt_by_prompt(client):
    prompts = ["the first prompt", "a second, longer prompt here"]
    body = post(client, "/v1/completions", prompt=prompts, n=2, max_tokens=6, temperature=0.9, seed=7)
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):  # choice i * n + j is prompt i's choice j
        alone = post(client, "/v1/completions", prompt=prompt, n=2, max_tokens=6, temperature=0.9, seed=7)
        assert texts[2 * i:2 * i + 2] == [c["text"] for c in alone["choices"]]
    lengths = [post(client, "/v1/completions", prompt=p, max_tokens=1)["usage"]["prompt_tokens"] for p in prompts]
    assert body["usage"]["prompt_tokens"] == sum(lengths) and body["usage"]["completion_tokens"] == 24


def test_streamed_chat_choices_each_open_with_the_role_and_reassemble(client):
    chat = dict(messages=[{"role": "user", "content": "tell me a story"}], max_tokens=8, temperature=1.0,
                seed=3, n=2)
    whole = post(client, "/v1/chat/completions", **chat)
    with client.stream("POST", "/v1/chat/completions", json={"model": "tiny", "ignore_eos": True, "stream": True,
                                                            "stream_options": {"include_usage": True}} | chat) as r:
        events = [line[6:] for line in r.read().decode().split("\n\n") if line]
    assert events.pop() == "[DONE]"
    *chunks, usage = [json.loads(e) for e in events]
    assert [c["choices"][0] for c in chunks[:2]] == [
        {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for j in range(2)]
    for j, choice in enumerate(whole["choices"]):
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == j)
        assert streamed == choice["message"]["content"]
    # the same prompt again: its full blocks come from the prefix cache, which usage reports
    cached = whole["usage"]["prompt_tokens"] // 16 * 16
    assert usage["usage"] == whole["usage"] | {"prompt_tokens_details": {"cached_tokens": cached}} and cached > 0


@pytest.mark.parametrize("adjustment", [dict(frequency_penalty=1.5, presence_penalty=0.5),
                                        dict(repetition_penalty=5.0), dict(min_p=0.2, temperature=1.0, seed=1)])
def test_penalties_and_min_p_answer_as_the_offline_engine_does(client, model_dir, adjustment):
    prompt, params = "the cat sat on the mat and the cat", {"temperature": 0} | adjustment
    adjusted = post(client, "/v1/completions", prompt=prompt, max_tokens=12, **params)["choices"][0]["text"]
    offline = LLM(str(model_dir), dtype="fp32", **ENGINE_KW).generate(
        prompt, SamplingParams(max_tokens=12, ignore_eos=True, **params))[0].text
    assert adjusted == offline
    if "min_p" not in adjustment:  # the tiny model repeats one token greedily: penalties break the run
        plain = post(client, "/v1/completions", prompt=prompt, max_tokens=12, temperature=0)["choices"][0]["text"]
        assert adjusted != plain
    chat = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": prompt}], max_tokens=4, **params)
    assert chat["choices"][0]["finish_reason"] == "length"


def test_logit_bias_with_json_string_keys(client):
    body = post(client, "/v1/completions", prompt="hello", max_tokens=4, temperature=0, logit_bias={"70": 100},
                logprobs=1)
    forced = body["choices"][0]
    token = post(client, "/v1/completions", prompt=[70], max_tokens=1, echo=True, logprobs=0)["choices"][0]
    assert forced["logprobs"]["tokens"] == [token["logprobs"]["tokens"][0]] * 4  # the name of token 70
    plain = post(client, "/v1/completions", prompt="hello", max_tokens=4, temperature=0)["choices"][0]["text"]
    assert forced["text"] == token["logprobs"]["tokens"][0] * 4 != plain


def test_choice_seeds_count_on_across_minus_one():
    """seed -2 with n 3 gives -2, -1, 0: made anew, the -1 became "no seed" (vLLM's meaning for a
    request's own seed), and that choice differed every time."""
    from qkiln.runtime.openai_protocol import CompletionRequest

    params = CompletionRequest(prompt="x", n=3, seed=-2).sampling_params(4, None)
    assert [p.seed for p in params] == [-2, -1, 0]
    assert [p.seed for p in CompletionRequest(prompt="x", n=2, seed=-1).sampling_params(4, None)] == [None, None]



def test_a_batch_of_too_many_choices_is_refused_and_the_server_goes_on(client):
    """prompts x n is bounded per request (MAX_CHOICES_PER_REQUEST): 20 prompts x 128 were queued."""
    r = client.post("/v1/completions", json={"prompt": ["a"] * 20, "n": 128, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "20 prompts x n 128 is 2560 choices" in r.json()["error"]["message"]
    assert post(client, "/v1/completions", prompt=["a"] * 16, n=128, max_tokens=1)["usage"]["completion_tokens"] == 2048
