"""The OpenAI-compatible server, for real: uvicorn on a loopback port serving a tiny random model,
driven with httpx (sync and async). Greedy results are checked against the offline `LLM`."""

import asyncio
import importlib.metadata
import json
import re
import threading
import time

import httpx
import pytest

from qkiln.runtime.async_engine import AsyncLLMEngine
from qkiln.runtime.llm import LLM
from qkiln.runtime.sampling_params import SamplingParams
from loopback import serving_app, serving_client, serving_model
from qkiln.runtime.server import BackgroundServer, create_app
from tiny_models import write_tiny_hf_model

ENGINE_KW = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=8)
KEY = "sk-test-123"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "qwen2")


@pytest.fixture(scope="module")
def served(model_dir):
    with serving_model(model_dir, dtype="fp32", **ENGINE_KW) as engine_and_server:
        yield engine_and_server


@pytest.fixture(scope="module")
def engine(served):
    return served[0]


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(str(model_dir), dtype="fp32", **ENGINE_KW)
    return lambda prompt, n: llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]


def completion(client, **kw):
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True} | kw
    return client.post("/v1/completions", json=body)


def chat_body(content="hello there", **kw):
    return {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": content}],
            "temperature": 0, "ignore_eos": True} | kw


def sse_events(raw: str) -> list:
    """Strict SSE parse: every event is exactly `data: <payload>` and a blank line."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while engine.call(lambda e: e.has_unfinished() or e.kv_manager.usage > 0).result(timeout):
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)
    engine.call(lambda e: e.check_integrity()).result(timeout)
    kv = engine.call(lambda e: (e.kv_manager.num_free_blocks, e.kv_manager.num_blocks)).result(timeout)
    assert kv[0] == kv[1], f"{kv[1] - kv[0]} KV blocks still held after every request ended"


def metric(text: str, name: str, default: float | None = None) -> float:
    """A sample's value: `name` alone matches any labels, or name with its labels matches them exactly."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match or default is not None, f"{name} missing from /metrics"
    return float(match.group(1)) if match else default


def test_models_and_health(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == engine.max_model_len == 128
    assert client.get("/v1/models/tiny").json() == models["data"][0]  # the openai client's models.retrieve
    assert client.get("/v1/models/gpt-4").status_code == 404
    assert client.get("/health").json() == {"status": "ok"}
    # vLLM's other probe names, so a deploy file written for it works
    assert client.get("/ping").json() == client.post("/ping").json() == {"status": "ok"}
    assert client.get("/version").json()["version"] == importlib.metadata.version("qkiln")
    r = client.delete("/v1/models")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


@pytest.mark.parametrize("as_ids", [False, True])
def test_completion_equals_offline_generate(client, reference, engine, as_ids):
    prompt = "The capital of France is"
    ids = engine.tokenizer.encode(prompt)
    r = completion(client, prompt=ids if as_ids else prompt, max_tokens=10, seed=1)
    assert r.status_code == 200, r.text
    body, ref = r.json(), reference(prompt, 10)
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == ref.text and body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (len(ids), 10, len(ids) + 10)


def test_model_may_be_left_out(client, reference):
    """As vLLM allows: a request without "model" goes to the served model (an unknown one is a 400)."""
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny" and r.json()["choices"][0]["text"] == reference(body["prompt"], 6).text
    chat = chat_body(max_tokens=4)
    del chat["model"]
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text


def test_completion_logprobs_and_stop(client):
    r = completion(client, prompt="abc", max_tokens=6, logprobs=3).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert all(len(top) <= 3 and max(top.values()) >= chosen - 1e-4
               for top, chosen in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    only_chosen = completion(client, prompt="abc", max_tokens=3, logprobs=0)  # once a 500 for every request in flight
    assert only_chosen.status_code == 200, only_chosen.text
    chosen = only_chosen.json()["choices"][0]["logprobs"]
    assert chosen["top_logprobs"] == [{t: lp} for t, lp in zip(chosen["tokens"], chosen["token_logprobs"])]
    assert len(only_chosen.json()["choices"][0]["logprobs"]["token_logprobs"]) == 3
    chat = client.post("/v1/chat/completions", json=chat_body(max_tokens=3, logprobs=True))
    assert chat.status_code == 200 and len(chat.json()["choices"][0]["logprobs"]["content"]) == 3, chat.text
    text = r["choices"][0]["text"]
    stop = text[2:4]  # a stop string the greedy continuation is known to contain
    cut = completion(client, prompt="abc", max_tokens=6, stop=stop).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.index(stop)]
    assert cut["stop_reason"] == stop and r["choices"][0]["stop_reason"] is None  # vLLM's: what stopped it
    # a stop string completed by the last allowed token is still a stop, as in OpenAI's API
    tokens = lp["tokens"]
    k = next(k for k in range(1, 6) if tokens[k] and text.find(tokens[k]) == len("".join(tokens[:k])))
    last = completion(client, prompt="abc", max_tokens=k + 1, stop=tokens[k]).json()["choices"][0]
    assert last["finish_reason"] == "stop" and last["text"] == "".join(tokens[:k])


def test_stop_token_ids_stop_the_completion(client, reference):
    ids = reference("abc", 6).token_ids
    r = completion(client, prompt="abc", max_tokens=6, stop_token_ids=[ids[2]]).json()["choices"][0]
    # vLLM's: the stop token ends the text and is not in it (it is in the token ids and usage)
    assert r["finish_reason"] == "stop" and r["text"] == reference("abc", 2).text and r["stop_reason"] == ids[2]
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 6,
                                                        "temperature": 0, "stop_token_ids": [ids[2]], "stream": True}) as s:
        last = sse_events(s.read().decode())[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == ids[2]


def test_null_max_tokens_means_the_rest_of_the_context(client, engine):
    """As in chat (and vLLM): completions with max_tokens null generate up to the context's end."""
    r = completion(client, prompt="abc", max_tokens=None, ignore_eos=True)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == engine.max_model_len


def test_chat_uses_the_template_and_equals_offline_generate(client, reference, engine):
    body = client.post("/v1/chat/completions", json=chat_body(max_tokens=8)).json()
    rendered = "<system>be brief\n<user>hello there\n<assistant>"  # tiny_models' template
    ref = reference(engine.tokenizer.encode(rendered, add_special_tokens=False), 8)
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert choice["message"] == {"role": "assistant", "content": ref.text} and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(rendered) and body["usage"]["completion_tokens"] == 8


def chat_prompt(client, **kw) -> str:
    """The text the server rendered for a chat request: its prompt tokens, one byte each here."""
    body = client.post("/v1/chat/completions", json=chat_body(max_tokens=1) | kw).json()
    return body["usage"]["prompt_tokens"]


def test_chat_roles_parts_and_prefill_render_as_vllm_renders_them(client, reference, engine):
    developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    # "developer" is OpenAI's newer "system"; this template knows only system
    assert chat_prompt(client, messages=developer) == chat_prompt(client, messages=system) == len(
        "<system>be brief\n<user>hi\n<assistant>")
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    assert chat_prompt(client, messages=parts) == len("<user>ab\ncd\n<assistant>")
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    body = client.post("/v1/chat/completions", json=chat_body(
        messages=prefill, max_tokens=6, add_generation_prompt=False, continue_final_message=True)).json()
    continued = "<user>hi\n<assistant>The answer is"  # the turn left open, not closed and a new one begun
    assert body["usage"]["prompt_tokens"] == len(continued)
    assert body["choices"][0]["message"]["content"] == reference(continued, 6).text


def test_null_means_the_default_as_openai_clients_send_it(client):
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None, frequency_penalty=None,
                 logprobs=None, top_k=None, ignore_eos=None, min_tokens=None, repetition_penalty=None, min_p=None,
                 logit_bias=None)
    plain = client.post("/v1/chat/completions", json=chat_body(max_tokens=5, temperature=1.0, seed=7)).json()
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=5, seed=7) | nulls)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    r = completion(client, prompt="abc", max_tokens=3, echo=None, temperature=None)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_fields_the_server_does_not_read_are_logged_once(client, caplog):
    """Ignored, as OpenAI and vLLM ignore them, but named in the log (a misspelt `temprature` had
    left no trace): once per set of names, not once per request."""
    with caplog.at_level("WARNING", logger="qkiln.server"):
        for _ in range(3):
            r = completion(client, prompt="abc", max_tokens=2, temprature=0.2, user="u-1")
            assert r.status_code == 200, r.text
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=2, x_unread_chat=1)).status_code == 200
        forged = {"prompt": "abc", "max_tokens": 2, "x\nINFO: forged\u001b[2J" + "y" * 10_000: 1}
        assert client.post("/v1/completions", json=forged).status_code == 200
    said = [r.getMessage() for r in caplog.records if r.name == "qkiln.server"]
    assert said[:2] == ["ignored request fields qkiln does not read: temprature, user (logged once for this set)",
                        "ignored request fields qkiln does not read: x_unread_chat (logged once for this set)"]
    # a caller's field name is escaped and cut short: it can neither forge a log line nor fill the log
    assert "\n" not in said[2] and "\x1b" not in said[2] and len(said[2]) < 200 and "\\nINFO" in said[2]


def test_a_tiny_temperature_is_raised_to_the_smallest_one_that_works(client):
    """Below float32's range, logits / temperature overflowed: NaN, then token 0 ("!") every step."""
    tiny = completion(client, prompt="abc", max_tokens=8, temperature=1e-38, seed=1).json()["choices"][0]
    assert tiny["text"] == completion(client, prompt="abc", max_tokens=8, temperature=0.01, seed=1).json()[
        "choices"][0]["text"] != "!" * 8


def test_a_body_sent_as_another_content_type_is_told_to_send_json(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "content-type: application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, says", [(b'{"prompt": "caf\xe9"}', "is not UTF-8 (byte 15)"),
                                        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
                                        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "integer too long")])
def test_a_body_json_cannot_read_is_named_as_such(client, body, says):
    """These got FastAPI's "There was an error parsing the body", which says neither why nor what to send."""
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "invalid_json"


def test_completion_stream_sse(client):
    whole = completion(client, prompt="streaming!", max_tokens=9).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "streaming!", "max_tokens": 9,
                                                        "temperature": 0, "ignore_eos": True, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(r.read().decode())
    *text_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in text_chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])


def test_chat_stream_sse(client):
    whole = client.post("/v1/chat/completions", json=chat_body(max_tokens=7)).json()["choices"][0]["message"]
    with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=7, stream=True)) as r:
        chunks = sse_events(r.read().decode())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_async_clients_get_their_own_answers(server, client):
    prompts = [f"request number {i}: " for i in range(6)]
    expected = [completion(client, prompt=p, max_tokens=8).json()["choices"][0]["text"] for p in prompts]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            rs = await asyncio.gather(*(ac.post("/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                for p in prompts))
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(main()) == expected


def test_a_bug_is_answered_as_json_with_the_request_id(engine):
    """An exception no handler takes (a bug) had reached Starlette's last resort: a plain-text
    "Internal Server Error" without x-request-id, so neither the client's JSON parsing nor its
    trace could name it. The route that fails is added here: qkiln's own routes have no such bug."""
    app = create_app(engine, "tiny")

    @app.get("/fails")
    async def fails():
        raise RuntimeError("a bug")

    server = BackgroundServer(app)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            failed = c.get("/fails", headers={"X-Request-Id": "trace-500"})
            assert failed.status_code == 500 and failed.headers["x-request-id"] == "trace-500"
            error = failed.json()["error"]
            assert error["type"] == "server_error" and "trace-500" in error["message"]
            assert c.get("/health").status_code == 200  # and it goes on serving
    finally:
        server.stop()


def test_every_response_carries_a_request_id_the_caller_may_choose(server, client, engine):
    """A gateway traces a request by the x-request-id it sends (vLLM's clients send one); the
    response had none. Two callers sharing one still get their own answers."""
    given = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42" and given.json()["id"] == "cmpl-trace-42"
    chat = client.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers={"X-Request-Id": "trace-43"})
    assert chat.headers["x-request-id"] == "trace-43" and chat.json()["id"] == "chatcmpl-trace-43"
    fresh = [completion(client, prompt="hi", max_tokens=2).headers["x-request-id"] for _ in range(2)]
    assert fresh[0] != fresh[1] and all(len(f) == 32 for f in fresh)
    refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}, headers={"X-Request-Id": "bad-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    assert client.get("/nowhere").headers["x-request-id"]  # a 404 too
    unprintable = client.get("/health", headers={"X-Request-Id": "a b"}).headers["x-request-id"]
    assert unprintable != "a b" and len(unprintable) == 32  # not echoed: a fresh one

    prompts = [f"shared id {i}: " for i in range(4)]
    expected = [completion(client, prompt=p, max_tokens=6).json()["choices"][0]["text"] for p in prompts]

    async def main():  # at once, under one id: the engine had refused the second as "already in use"
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            rs = await asyncio.gather(*(ac.post("/v1/completions", headers={"X-Request-Id": "same"}, json={
                "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}) for p in prompts))
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(main()) == expected


def test_metrics_change_after_requests(client):
    before = client.get("/metrics")
    assert before.headers["content-type"].startswith("text/plain")
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "qkiln_generation_tokens_per_second"):
        metric(before.text, name)
    prompt = "count me, count me again, count me thrice"  # byte-level: one token per character
    completion(client, prompt=prompt, max_tokens=5)
    completion(client, prompt=prompt, max_tokens=5)  # a prefix-cache hit
    after = client.get("/metrics").text

    def grew(name, text=after, base=before.text):
        return metric(text, name) - metric(base, name, default=0)

    assert grew("vllm:generation_tokens_total") == 10 and grew("vllm:prompt_tokens_total") == 2 * len(prompt)
    assert grew("vllm:prefix_cache_queries_total") == 2 * len(prompt)
    assert 0 < grew("vllm:prefix_cache_hits_total") < len(prompt)  # the second's full blocks
    assert grew('vllm:request_success_total{finished_reason="length",model_name="tiny"}') == 2
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):
        assert grew(hist + "_count") == 2, hist
    assert grew("vllm:request_prompt_tokens_sum") == 2 * len(prompt)
    # one gap before each token after a request's first, which together are its decode time
    assert grew("vllm:inter_token_latency_seconds_count") == 2 * 4
    assert grew("vllm:inter_token_latency_seconds_sum") == pytest.approx(grew("vllm:request_decode_time_seconds_sum"))
    assert grew("vllm:request_generation_tokens_sum") == 10
    rates = [metric(client.get("/metrics").text, "qkiln_generation_tokens_per_second") for _ in range(3)]
    assert metric(after, "qkiln_generation_tokens_per_second") > 0 and min(rates) > 0  # a scrape does not reset it
    assert completion(client, prompt="x", max_tokens=-1).status_code == 400
    assert client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    last = client.get("/metrics").text
    assert grew("qkiln_request_refused_invalid_total", last, after) == 2
    assert metric(last, "vllm:num_preemptions_total") == 0 and metric(last, "qkiln_request_aborted_total") >= 0


def test_latencies_count_from_arrival_at_the_server(client, engine):
    """TTFT and e2e started when the engine thread took the request in, between steps: a request
    that arrived during a 5.6 s prefill step recorded 0.043 s (probe s50)."""
    before = client.get("/metrics").text
    gate = threading.Event()
    blocked = engine.call(lambda e: gate.wait(30))  # the engine thread busy, as in a long step
    timer = threading.Timer(0.6, gate.set)
    timer.start()
    assert completion(client, prompt="late", max_tokens=2).status_code == 200
    blocked.result(30)
    after = client.get("/metrics").text
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert metric(after, name + "_count") - metric(before, name + "_count") == 1
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert metric(after, name + "_sum") - metric(before, name + "_sum") >= 0.5, name
    # vLLM's queue time runs from the engine's receipt, between steps: the busy thread is not in it
    queued = "vllm:request_queue_time_seconds_sum"
    assert metric(after, queued) - metric(before, queued) < 0.5


def test_a_first_token_counts_though_its_client_leaves(server, client, engine):
    """TTFT was recorded when a request finished: a stream its client stopped (a chat UI's stop
    button) never counted, and a long one's counted minutes late; vLLM records it at the first token."""
    before = client.get("/metrics").text
    body = {"model": "tiny", "prompt": "go on", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first token; leaving closes the connection
    wait_idle(engine)
    after = client.get("/metrics").text
    ttft = "vllm:time_to_first_token_seconds_count"
    assert metric(after, ttft) - metric(before, ttft) == 1
    assert metric(after, "qkiln_request_aborted_total") - metric(before, "qkiln_request_aborted_total") == 1


def test_gauges_show_a_step_while_it_runs(engine):
    """The snapshot was published before a step scheduled and after it ran, so during a prefill
    step its request read as waiting with no KV in use ("waiting 1, running 0": a stuck-scheduler alert)."""
    seen = []
    runner = engine.engine.runner
    run = runner.run

    def run_and_look(*args, **kwargs):
        snap = engine.snapshot
        seen.append((snap.num_waiting, snap.num_running, snap.kv_usage))
        return run(*args, **kwargs)

    runner.run = run_and_look
    try:
        async def go():
            async for _ in engine.generate("a prompt of some length", SamplingParams(max_tokens=2, temperature=0)):
                pass

        asyncio.run(go())
    finally:
        del runner.run
    waiting, running, kv_usage = seen[0]
    assert (waiting, running) == (0, 1) and kv_usage > 0


def test_api_key(engine):
    with serving_app(engine, api_key=KEY) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        # refused before the body is read: a malformed one tells a caller without the key nothing
        r = c.post("/v1/completions", content=b'{"prompt": ', headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 401  # it runs the tokenizer


def test_an_unknown_route_names_the_ones_there_are(client):
    r = client.post("/v1/responses", json={"model": "tiny", "input": "hi"})  # the Agents SDK's default
    assert r.status_code == 404 and "/v1/responses is not served here" in r.json()["error"]["message"]
    assert "POST /v1/chat/completions" in r.json()["error"]["message"]
    ok = client.post("/v1/chat/completions", json=chat_body(modalities=["text"], max_tokens=1))  # OpenAI's default
    assert ok.status_code == 200, ok.text


def test_a_whole_number_sent_as_a_float_is_that_integer(client):
    """What a client computing max_tokens by division sends: OpenAI's and vLLM's servers take it."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4.0, "n": 2.0, "seed": 3.0, "logprobs": 1.0,
            "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4
    for field, value in (("max_tokens", 4.5), ("max_tokens", "4"), ("n", True)):
        r = client.post("/v1/completions", json=body | {field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_tokenize_and_detokenize_as_vllm_serves_them(client, engine):
    """The ids a completion or a chat completion would run, and their text back."""
    tok = engine.tokenizer
    r = client.post("/tokenize", json={"model": "tiny", "prompt": "hello there", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.max_request_len
    assert body["token_strs"] == [tok.backend.id_to_token(i) for i in body["tokens"]]
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    completion = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == completion["usage"]["prompt_tokens"] and chat["token_strs"] is None
    assert chat["tokens"] == tok.chat_prompt_ids([{"role": "user", "content": "hi"}], True)
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "hello there"}
    # what lm-evaluation-harness's remote tokenizer reads: the special tokens' text and the template
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|eos|>" and info["chat_template"] == tok.chat_template
    assert client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"] \
        == [tok.eos_token_id]
    long = client.post("/tokenize", json={"prompt": "ab " * 4000}).json()  # counted, though past the context
    assert long["count"] == len(tok.encode("ab " * 4000)) > long["max_model_len"]
    # counted whole, but not without bound: an 8 MB text had taken the server 1.3 GB to count
    from qkiln.runtime.request_prompts import MAX_UNBOUNDED_CHARS

    huge = client.post("/tokenize", json={"prompt": "a" * (MAX_UNBOUNDED_CHARS + 1)})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt", huge.text
    cut = client.post("/v1/completions", json={"prompt": "a" * (MAX_UNBOUNDED_CHARS + 1), "max_tokens": 1,
                                               "truncate_prompt_tokens": 8})
    assert cut.status_code == 400 and "at most" in cut.json()["error"]["message"]
    r = client.post("/tokenize", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text  # not "messages", no class name
    assert "Tokenize" not in r.json()["error"]["message"]
    for path, payload, param in [("/detokenize", {"tokens": [1, -3]}, "tokens"),
                                 ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                                 ("/tokenize", {"messages": messages, "continue_final_message": True}, None)]:
        r = client.post(path, json=payload)
        assert r.status_code == 400 and (param is None or r.json()["error"]["param"] == param), r.text
    message = client.post("/detokenize", json={"tokens": [1, -3]}).json()["error"]["message"]
    assert message.startswith("token id -3 is outside the vocabulary")  # they are no prompt's



def test_cross_origin_calls_only_from_allowed_origins(engine, client):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    plain = client.post("/v1/completions", json=body, headers={"Origin": "https://app.example"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers  # none by default
    with serving_app(engine, api_key=KEY, allowed_origins=["https://app.example"]) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        ok = c.options("/v1/completions", headers=preflight)  # answered though it carries no key
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        r = c.post("/v1/completions", json=body,
                   headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert c.post("/v1/completions", json=body, headers={"Origin": "https://app.example"}).status_code == 401
        other = c.options("/v1/completions", headers=preflight | {"Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers



def test_a_body_past_the_limit_is_refused_413_however_it_is_sent(engine, monkeypatch):
    from qkiln.runtime import server

    monkeypatch.setattr(server, "MAX_BODY_BYTES", 2000)
    body = json.dumps({"model": "tiny", "prompt": "x" * 3000, "max_tokens": 1}).encode()
    with serving_app(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        declared = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        chunked = c.post("/v1/completions", content=iter([body[:1500], body[1500:]]),  # no Content-Length
                         headers={"Content-Type": "application/json"})
        for r in (declared, chunked):
            assert r.status_code == 413 and "larger than" in r.json()["error"]["message"], r.text
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200


BAD_REQUESTS = {  # label: (path, raw body, param named in the error or None)
    "unknown model": ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model"),
    "malformed json": ("/v1/completions", b'{"model": "tiny", "prompt": ', None),
    "body not an object": ("/v1/completions", b"[1, 2]", None),
    "prompt wrong type": ("/v1/completions", {"model": "tiny", "prompt": 5}, "prompt"),
    "max_tokens as string": ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    "negative max_tokens": ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -3}, "max_tokens"),
    "zero max_tokens": ("/v1/chat/completions", chat_body(max_tokens=0), "max_tokens"),
    "temperature negative": ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
    "missing prompt": ("/v1/completions", {"model": "tiny"}, "prompt"),
    "prompt longer than context": ("/v1/completions", {"model": "tiny", "prompt": "x" * 300}, "prompt"),
    # refused before tokenizing: no token spells that many characters
    "prompt longer than any context": ("/v1/completions", {"model": "tiny", "prompt": "x" * 200_000}, "prompt"),
    "chat role unknown": ("/v1/chat/completions", chat_body() | {"messages": [{"role": "wizard", "content": "x"}]},
                          "messages.0.role"),
    "prompt ids out of vocab": ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, "prompt"),
    "prompt mixing text and ids": ("/v1/completions", {"model": "tiny", "prompt": ["a", [1, 2]]}, "prompt"),
    "streamed prompt too long": ("/v1/completions", {"model": "tiny", "prompt": "x" * 300, "stream": True}, None),
    "chat messages too long": ("/v1/chat/completions", chat_body(content="y" * 300), "messages"),
    "n above OpenAI's 128": ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 129}, "n"),
    "chat n 0": ("/v1/chat/completions", chat_body(n=0), "n"),
    "seed + n past 64 bits": ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2, "seed": 2**64 - 1}, "seed"),
    "chat messages missing role": ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "x"}]},
                                   "messages.0.role"),
    "stop wrong type": ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": 3}, "stop"),
    "empty stop string": ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [""]}, "stop"),  # engine-side
    "min_tokens above max_tokens": ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                        "min_tokens": 5}, "min_tokens"),
    "max_tokens beyond the context": ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**6},
                                      "max_tokens"),
    "chat max_tokens beyond the context": ("/v1/chat/completions", chat_body(max_tokens=10**6), "max_tokens"),
    # a seed torch cannot take once broke every later step (the request was queued before seeding)
    "seed beyond 64 bits": ("/v1/completions", {"model": "tiny", "prompt": "x", "seed": 2**64}, "seed"),
    "temperature infinite": ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": 1e400}',
                             "temperature"),
    "presence_penalty past 2": ("/v1/chat/completions", chat_body(presence_penalty=2.5), "presence_penalty"),
    "frequency_penalty a string": ("/v1/completions", {"model": "tiny", "prompt": "x", "frequency_penalty": "1"},
                                   "frequency_penalty"),
    "logit_bias key not a token id": ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"a": 1}},
                                      "logit_bias"),
    "logit_bias past 100": ("/v1/chat/completions", chat_body(logit_bias={"5": 150}), "logit_bias"),
    # accepted once, it failed the step of every request in flight
    "logit_bias null value": ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": None}},
                              "logit_bias"),
    "logit_bias outside the vocabulary": ("/v1/completions", {"model": "tiny", "prompt": "x",
                                                              "logit_bias": {"999999": 1}}, "logit_bias"),
    "tools": ("/v1/chat/completions", chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    "best_of": ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 3}, "best_of"),
    "repetition_penalty 0": ("/v1/completions", {"model": "tiny", "prompt": "x", "repetition_penalty": 0},
                             "repetition_penalty"),
    "min_p past 1": ("/v1/chat/completions", chat_body(min_p=1.5), "min_p"),
    # vLLM extensions lm-eval forwards from a task's generation_kwargs: never silently ignored
    "use_beam_search": ("/v1/completions", {"model": "tiny", "prompt": "x", "use_beam_search": True}, "use_beam_search"),
    # vLLM >= 0.12's names (structured_outputs replaced guided_*), and fields that change what the
    # answer holds: they had been accepted and ignored
    **{f"vLLM's {name}": ("/v1/chat/completions", chat_body(**{name: value}), name) for name, value in (
        ("structured_outputs", {"choice": ["yes", "no"]}), ("structural_tag", "{}"),
        ("return_tokens_as_token_ids", True), ("logits_processors", ["x"]), ("priority", 1), ("cache_salt", "a"),
        ("modalities", ["text", "audio"]))},
    "prompt_logprobs streamed": ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True,
                                                     "prompt_logprobs": 1}, "prompt_logprobs"),
    "prompt_logprobs -1 (the whole vocabulary)": ("/v1/chat/completions", chat_body(prompt_logprobs=-1),
                                                  "prompt_logprobs"),
    "continuous usage stats": ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True,
                                                   "stream_options": {"continuous_usage_stats": True}},
                               "stream_options.continuous_usage_stats"),
    "max_completion_tokens past the context": ("/v1/chat/completions", chat_body(max_completion_tokens=10**6),
                                               "max_completion_tokens"),
    "a tool message": ("/v1/chat/completions", chat_body() | {"messages": [{"role": "tool", "content": "42"}]},
                       "messages.0.role"),
    "suffix": ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
    "stream_options without stream": ("/v1/completions", {"model": "tiny", "prompt": "x",
                                                          "stream_options": {"include_usage": True}}, "stream_options"),
    "json mode": ("/v1/chat/completions", chat_body(response_format={"type": "json_object"}), "response_format"),
    "legacy functions": ("/v1/chat/completions", chat_body(functions=[{"name": "f"}]), "functions"),
    "tool_choice required": ("/v1/chat/completions", chat_body(tool_choice="required"), "tool_choice"),
    "top_logprobs without logprobs": ("/v1/chat/completions", chat_body(top_logprobs=3), "top_logprobs"),
    "an image part": ("/v1/chat/completions", chat_body(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
                      "messages.1.content"),
    "continue a user message": ("/v1/chat/completions", chat_body(continue_final_message=True,
                                                                  add_generation_prompt=False),
                                "continue_final_message"),
    "continue and open a turn": ("/v1/chat/completions", chat_body(continue_final_message=True),
                                 "continue_final_message"),
    "top_p NaN": ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": NaN}', "top_p"),
    # banned while min_tokens holds, it indexed the logits: the whole step failed, every request in it
    "stop token outside the vocabulary": ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5,
                                                              "min_tokens": 2, "stop_token_ids": [10**6]},
                                          "stop_token_ids"),
    # echo decoded them before the engine's check: a 500 (lm-eval retries, then aborts the run)
    "a negative token id with echo": ("/v1/completions", {"model": "tiny", "prompt": [[1, -1]], "echo": True,
                                                          "max_tokens": 1, "logprobs": 1}, "prompt"),
    "a huge token id with echo": ("/v1/completions", {"model": "tiny", "prompt": [1, 10**20], "echo": True,
                                                      "stream": True}, "prompt"),
    "too many stop strings": ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [f"s{i}" for i in range(33)]},
                              "stop"),
    "a lone surrogate": ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    "a lone surrogate in chat": ("/v1/chat/completions",
                                 b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
                                 "messages"),
    "too many messages": ("/v1/chat/completions", chat_body() | {"messages": [{"role": "user", "content": ""}] * 4097},
                          "messages"),
}


@pytest.mark.parametrize("label", list(BAD_REQUESTS))
def test_bad_request_is_400_and_the_server_keeps_serving(client, engine, label):
    path, body, param = BAD_REQUESTS[label]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and (param is None or error["param"] == param), error
    good = completion(client, prompt="still alive", max_tokens=3)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    wait_idle(engine)


def test_client_disconnect_mid_stream_aborts(server, engine):
    before, aborted = engine.snapshot.num_generated_tokens, engine.snapshot.num_aborted
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "go on forever", "max_tokens": 110,
                                                       "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            data = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data.append(line)
                if len(data) == 3:
                    break  # leaving the block closes the connection mid-stream
    wait_idle(engine)
    assert engine.snapshot.num_generated_tokens - before < 100, "the request ran to completion: not aborted"
    assert engine.snapshot.num_aborted - aborted == 1  # /metrics: qkiln_request_aborted_total


def test_a_choice_that_finished_counts_though_the_stream_is_left_early(server, client, engine):
    """A streamed batch counted its choices only once all had ended: one that finished was lost
    from request_success and the histograms when the client left before the others (probe s50)."""
    before = client.get("/metrics").text
    # max_tokens null: each prompt runs to the end of the context, the long one first
    body = {"model": "tiny", "prompt": ["x" * 100, "short"], "max_tokens": None, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"]:
                    break  # the first choice to finish; leaving closes the connection
    wait_idle(engine)
    after = client.get("/metrics").text
    assert metric(after, "vllm:e2e_request_latency_seconds_count") - \
        metric(before, "vllm:e2e_request_latency_seconds_count") == 1
    assert metric(after, "qkiln_request_aborted_total") - metric(before, "qkiln_request_aborted_total") == 1


def test_client_disconnect_while_waiting_for_a_plain_response_aborts(server, engine):
    gate = threading.Event()
    blocked = engine.call(lambda e: gate.wait(30))  # hold the engine thread so the request is still queued
    before = engine.snapshot.num_generated_tokens
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.5)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"model": "tiny", "prompt": "nobody waits for me", "max_tokens": 100,
                                            "temperature": 0, "ignore_eos": True})
    gate.set()
    blocked.result(30)
    wait_idle(engine)
    assert engine.snapshot.num_generated_tokens - before < 100, "the request ran to completion: not aborted"


@pytest.mark.smollm2
@pytest.mark.slow
def test_real_model_chat_through_the_server(smollm2):
    import torch

    from qkiln.runtime.engine import EngineConfig, LLMEngine

    model = smollm2.build_model(torch.bfloat16)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    ref = LLMEngine(model, smollm2.tokenizer, EngineConfig(num_kv_blocks=32))
    ref.add_request(ids, SamplingParams(max_tokens=24, temperature=0))
    expected = [out for _ in range(100) for out in ref.step() if out.finished]
    eng = AsyncLLMEngine(LLMEngine(model, smollm2.tokenizer, EngineConfig(num_kv_blocks=32)), "smollm2")
    try:
        with serving_app(eng, None) as srv:
            body = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
                "model": "smollm2", "messages": messages, "max_tokens": 24, "temperature": 0}).json()
    finally:
        eng.shutdown()
    choice = body["choices"][0]
    assert choice["message"]["content"] == expected[0].text and choice["finish_reason"] == expected[0].finish_reason
    assert "Paris" in choice["message"]["content"]  # the real model, templated correctly, answers


@pytest.mark.filterwarnings("ignore:.*add_bos_token true")  # the copy's tokenizer.json does not add it itself
def test_add_special_tokens_is_honoured_as_vllm_does(model_dir, tmp_path):
    """A client that renders the chat template itself (its text starts with BOS) sends it to
    /v1/completions with add_special_tokens false: the field was ignored, so the prompt ran with two
    BOS tokens while /tokenize, given the same field, counted one."""
    import shutil

    bos_dir = tmp_path / "bos"
    shutil.copytree(model_dir, bos_dir)
    config = json.loads((bos_dir / "tokenizer_config.json").read_text()) | {"add_bos_token": True}
    (bos_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with serving_client(bos_dir, num_kv_blocks=32) as c:
        def prompt_tokens(path, **body):
            r = c.post(path, json={"max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        plain = c.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["count"]
        assert prompt_tokens("/v1/completions", prompt="hi", add_special_tokens=False) == plain
        assert prompt_tokens("/v1/completions", prompt="hi") == plain + 1  # vLLM's default: the tokenizer's BOS
        messages = [{"role": "user", "content": "hi"}]
        chat = c.post("/tokenize", json={"messages": messages}).json()["count"]
        assert prompt_tokens("/v1/chat/completions", messages=messages) == chat  # the template's BOS only
        assert prompt_tokens("/v1/chat/completions", messages=messages, add_special_tokens=True) == chat + 1

