"""/v1/completions with a batch of prompts and with `echo`: what loglikelihood evaluations
(lm-evaluation-harness's `local-completions`) send. A real server on loopback, a tiny random model;
prompt logprobs are checked against one teacher-forced forward pass of the same weights."""

import json
import random
from contextlib import contextmanager

import httpx
import pytest
import torch

from qkiln.runtime.loader import load_for_serving
from loopback import serving_model
from tiny_models import write_tiny_hf_model

ENGINE_KW = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


@contextmanager
def serving(model_dir, **engine_kw):
    """The tiny model behind a real server on loopback: (engine, HTTP client); both stop on exit."""
    with serving_model(model_dir, dtype="fp32", **engine_kw) as (engine, server):
        with httpx.Client(base_url=server.url, timeout=120) as client:
            yield engine, client


@pytest.fixture(scope="module")
def served(model_dir):
    with serving(model_dir, **ENGINE_KW) as engine_and_client:
        yield engine_and_client


@pytest.fixture(scope="module")
def engine(served):
    return served[0]


@pytest.fixture(scope="module")
def client(served):
    return served[1]


@pytest.fixture(scope="module")
def model(model_dir):
    return load_for_serving(str(model_dir), dtype="fp32").model


def teacher_forced(model, ids: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def post(client, **kw):
    r = client.post("/v1/completions", json={"model": "tiny", "temperature": 0} | kw)
    return r


def random_prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, 70))] for _ in range(count)]


def test_loglikelihood_request_as_lm_eval_sends_it(client, engine, model):
    """Token-id prompts in one request, echo, logprobs 1, max_tokens 1: every prompt token after
    the first is scored, then the one generated token (which lm-eval cuts with [ctxlen:-1])."""
    seed = random.randrange(1 << 30)
    print(f"prompts seed {seed}")  # shown with a failure, to replay it
    prompts = random_prompts(seed, 5)
    r = post(client, prompt=prompts, echo=True, logprobs=1, max_tokens=1, seed=1234)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(5))
    for prompt, choice in zip(prompts, body["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["tokens"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:-1]), torch.tensor(teacher_forced(model, prompt)),
                                   atol=2e-4, rtol=1e-4)
        for token, token_lp, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            # the best token and the token itself (vLLM's form): what lm-eval's is_greedy compares
            assert len(top) == (1 if token_lp == max(top.values()) else 2) and top[token] == token_lp
        assert lp["text_offset"][0] == 0 and choice["text"].startswith(engine.tokenizer.decode(prompt, skip_special_tokens=False))
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 5


def test_prompt_logprobs_as_vllm_s_server_writes_them(client, engine, model):
    """vLLM's prompt_logprobs (an evaluation job's way to score a prompt through vLLM's server):
    per prompt token {"<id>": {logprob, rank, decoded_token}}, the token first, then the top n; in
    every choice of a completion, beside the choices of a chat. It was refused."""
    prompts = random_prompts(7, 2)
    r = post(client, prompt=prompts, prompt_logprobs=2, max_tokens=2, n=2, echo=True, logprobs=1)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for k, choice in enumerate(choices):
        prompt = prompts[k // 2]
        scored = choice["prompt_logprobs"]
        assert scored == choices[k - k % 2]["prompt_logprobs"]  # a prompt's choices share its scores
        assert len(scored) == len(prompt) and scored[0] is None
        logprobs = [entry[str(token)]["logprob"] for token, entry in zip(prompt[1:], scored[1:])]
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(teacher_forced(model, prompt)),
                                   atol=2e-4, rtol=1e-4)
        for token, entry in zip(prompt[1:], scored[1:]):
            assert next(iter(entry)) == str(token) and 2 <= len(entry) <= 3
            by_rank = sorted(entry.values(), key=lambda v: v["rank"])
            assert {1, 2} <= {v["rank"] for v in by_rank} and \
                [v["logprob"] for v in by_rank] == sorted((v["logprob"] for v in by_rank), reverse=True)
            assert entry[str(token)]["decoded_token"] == engine.tokenizer.token_bytes(token).decode("utf-8", "replace")
        # the echo's logprobs keep their own top 1 though the engine scored the top 2
        assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
        assert choice["logprobs"]["token_logprobs"][1:len(prompt)] == pytest.approx(logprobs)
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi there"}],
                                                     "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    scored = chat.json()["prompt_logprobs"]
    assert scored[0] is None and all(len(entry) == 1 for entry in scored[1:])
    assert "prompt_logprobs" not in post(client, prompt="plain", max_tokens=1).json()["choices"][0]


def test_a_request_aborted_before_its_prompt_was_scored_still_builds_its_response(engine):
    """A client that left before the prefill: the abort output has no prompt logprobs, and building
    the (unread) response had raised a TypeError, a traceback in the server's log."""
    from qkiln.runtime.engine import RequestOutput
    from qkiln.runtime.openai_responses import ChatResponse, CompletionResponse

    ids = engine.tokenizer.encode("nobody waits")
    aborted = RequestOutput("r", ids, [], "", [], "", True, "abort")
    completion = CompletionResponse("cmpl-r", "tiny", engine.tokenizer, echo=("nobody waits", ids), logprobs=1,
                                    prompt_logprobs=2).response([aborted])
    assert completion["choices"][0]["prompt_logprobs"] is None and completion["choices"][0]["finish_reason"] == "abort"
    assert ChatResponse("chatcmpl-r", "tiny", engine.tokenizer, prompt_logprobs=0).response([aborted])["prompt_logprobs"] \
        is None


def test_max_tokens_0_with_echo_scores_the_prompt_only(client, engine, model):
    prompts = ["the quick brown fox", "jumps over the lazy dog and runs"]
    r = post(client, prompt=prompts, echo=True, logprobs=2, max_tokens=0)
    assert r.status_code == 200, r.text
    body = r.json()
    for text, choice in zip(prompts, body["choices"]):
        ids = engine.tokenizer.encode(text)
        assert choice["text"] == text and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids)
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), torch.tensor(teacher_forced(model, ids)),
                                   atol=2e-4, rtol=1e-4)
        assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    total = sum(len(engine.tokenizer.encode(t)) for t in prompts)
    assert body["usage"] == {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def token_bytes(name: str) -> bytes:
    """A logprobs token name back to its bytes: text, or OpenAI's `bytes:\\xNN...`."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
    return name.encode("utf-8")


def test_tokens_that_split_a_character_are_named_by_their_bytes(client):
    """The tiny model's tokens are single bytes, so every non-ASCII character spans tokens. Each
    token is named by its own bytes (was: all of them "\ufffd", merging their top_logprobs keys),
    and text_offset counts characters of the text (was: one per U+FFFD, drifting)."""
    text = "a\u00e9\U0001F600b"  # bytes: 61 | c3 a9 | f0 9f 98 80 | 62
    lp = post(client, prompt=text, echo=True, logprobs=5, max_tokens=0).json()["choices"][0]["logprobs"]
    assert [token_bytes(t) for t in lp["tokens"]] == [bytes([b]) for b in text.encode()]
    assert lp["tokens"][:3] == ["a", "bytes:\\xc3", "bytes:\\xa9"]
    assert lp["text_offset"] == [0, 1, 1, 2, 2, 2, 2, 3]
    # five distinct tokens and the token itself when it is not among them
    assert all(5 <= len(top) <= 6 for top in lp["top_logprobs"][1:])


def test_text_offset_counts_the_special_tokens_the_text_keeps(client):
    """With skip_special_tokens false the text spells EOS, and text_offset must count it (was: 0
    characters each, so every later offset pointed too early), streamed or not."""
    eos = "<|eos|>"  # the tiny tokenizer's, id 257
    for skip, text, offsets in ((False, eos * 3, [0, 7, 14]), (True, "", [0, 0, 0])):
        body = dict(prompt="hi", max_tokens=3, ignore_eos=True, logprobs=0, skip_special_tokens=skip,
                    logit_bias={"257": 100})
        lp = post(client, **body).json()["choices"][0]
        assert lp["text"] == text and lp["logprobs"]["text_offset"] == offsets, skip
        with client.stream("POST", "/v1/completions", json=dict(body, model="tiny", stream=True)) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed = [o for c in chunks for ch in c["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
        assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == text and streamed == offsets, skip


def test_chat_logprob_bytes_spell_the_message(client):
    body = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "caf\u00e9?"}], "max_tokens": 24,
        "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}).json()
    (choice,) = body["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 24 and all(len(c["top_logprobs"]) == 3 for c in content)
    raw = b"".join(bytes(c["bytes"]) for c in content)
    assert raw.decode("utf-8", "replace") == choice["message"]["content"]
    assert [token_bytes(c["token"]) for c in content] == [bytes(c["bytes"]) for c in content]


def test_a_batch_answers_as_its_prompts_sent_alone(client):
    prompts = ["abc", "hello world", [5, 6, 7, 8, 9, 10], "x"]
    alone = [post(client, prompt=p, max_tokens=8, ignore_eos=True).json()["choices"][0]["text"] for p in prompts]
    batch = post(client, prompt=[p for p in prompts if isinstance(p, str)], max_tokens=8, ignore_eos=True).json()
    assert [c["text"] for c in batch["choices"]] == [t for p, t in zip(prompts, alone) if isinstance(p, str)]
    echoed = post(client, prompt="hello world", max_tokens=8, ignore_eos=True, echo=True).json()["choices"][0]
    assert echoed["text"] == "hello world" + alone[1] and echoed["logprobs"] is None


def test_streamed_batch_with_echo(client):
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]
    plain = post(client, prompt=prompts, max_tokens=6, ignore_eos=True, echo=True, logprobs=0).json()
    with client.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    events = [json.loads(e[len("data: "):]) for e in raw.strip().split("\n\n")[:-1]]
    texts, logprobs, reasons = ["", ""], [[], []], [None, None]
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["logprobs"]:
            logprobs[choice["index"]] += choice["logprobs"]["token_logprobs"]
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == [c["text"] for c in plain["choices"]] and reasons == ["length", "length"]
    for got, choice in zip(logprobs, plain["choices"]):
        assert got[0] is None and len(got) == len(choice["logprobs"]["token_logprobs"])
        torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(choice["logprobs"]["token_logprobs"][1:]),
                                   atol=2e-4, rtol=1e-4)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ["fine", "x" * 300], "max_tokens": 2}, "prompt.1"),  # beyond the context
    ({"prompt": [[1, 2], [3, 99999]], "max_tokens": 2}, "prompt.1"),  # beyond the vocabulary
    ({"prompt": ["a", 5]}, "prompt"),
])
def test_a_bad_prompt_in_a_batch_refuses_the_whole_request(client, engine, body, param):
    r = post(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
    assert post(client, prompt=["still", "alive"], max_tokens=2).status_code == 200
    # nothing of the refused batch stays queued or holds KV blocks
    assert engine.call(lambda e: (e.has_unfinished(), e.kv_manager.num_free_blocks)).result(30) == (False, 64)


def test_a_kv_pool_smaller_than_the_context_bounds_null_max_tokens(model_dir):
    """max_tokens null means the rest of what the request can reach: the context, or the KV pool
    when it is smaller (was: every such request refused, default chat requests included)."""
    with serving(model_dir, num_kv_blocks=4, max_model_len=128) as (eng, c):
        assert eng.max_request_len == 4 * 16
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == eng.max_request_len
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "KV cache" in r.json()["error"]["message"]
        # the longest prompt /v1/models reports is scored in full (lm-eval reads its windows there)
        window = c.get("/v1/models").json()["data"][0]["max_model_len"]
        r = c.post("/v1/completions", json={"prompt": list(range(3, 3 + window)), "max_tokens": 0, "echo": True,
                                            "logprobs": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == window, r.text
        r = c.post("/v1/completions", json={"prompt": list(range(3, 4 + window)), "max_tokens": 0, "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "KV cache holds 64" in r.json()["error"]["message"]


def test_echo_only_scores_a_prompt_that_fills_the_context(client, engine, model):
    """lm-eval's rolling loglikelihood sends windows of exactly max_length tokens with echo and
    max_tokens 0: a prompt of max_model_len tokens is scored (it was refused), one more is not."""
    ids = [random.randrange(256) for _ in range(ENGINE_KW["max_model_len"])]
    r = post(client, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert r.status_code == 200, r.text
    scored = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    torch.testing.assert_close(torch.tensor(scored[1:]), torch.tensor(teacher_forced(model, ids)), atol=2e-4, rtol=1e-4)
    r = post(client, prompt=ids + [7], max_tokens=0, echo=True, logprobs=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = post(client, prompt=ids, max_tokens=1)  # generating needs room after the prompt: the field asked for it
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "max_tokens: 0 with echo scores it alone" in r.json()["error"]["message"]
    r = post(client, prompt=ids, echo=True, logprobs=0)  # max_tokens left out: the rest of the context is none
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "max_tokens: 0 with echo scores it alone" in r.json()["error"]["message"]
    assert engine.call(lambda e: (e.has_unfinished(), e.kv_manager.num_free_blocks)).result(30) == (False, 64)
