"""Soak: 200 concurrent streaming requests against the real server on loopback, ~30% of them
cut off by the client after a random number of chunks, with a KV pool small enough to force
preemption and prompts that share prefixes. Afterwards every KV block must be back in the pool
and the engine's accounting must hold."""

import asyncio
import json
import random
import time

import httpx
import pytest

from loopback import serving_model
from tiny_models import write_tiny_hf_model

NUM_REQUESTS = 200
CANCEL_FRACTION = 0.3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    # 120 blocks of 16 slots cannot hold 48 running requests of up to ~90 tokens: preemption happens.
    with serving_model(model_dir, num_kv_blocks=120, max_num_seqs=48, max_num_batched_tokens=512,
                       max_model_len=256) as engine_and_server:
        yield engine_and_server


def _request(rng: random.Random, i: int, shared: str) -> tuple[str, dict]:
    prompt = (shared if rng.random() < 0.5 else "") + "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(4, 40)))
    body = {"model": "tiny", "max_tokens": rng.randrange(8, 25), "temperature": rng.choice([0.0, 0.8]),
            "seed": i, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        return "/v1/completions", body | {"prompt": prompt}
    return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}


async def _one(client: httpx.AsyncClient, path: str, body: dict, cancel_after: int | None) -> dict:
    """Stream one request; stop reading (closing the connection) after `cancel_after` chunks."""
    chunks, finish, usage, done = 0, None, None, False
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            if event["choices"]:
                finish = event["choices"][0]["finish_reason"] or finish
            usage = event.get("usage") or usage
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after and finish is None:
                return {"cancelled": True}
    return {"cancelled": False, "finish": finish, "usage": usage, "done": done, "max_tokens": body["max_tokens"]}


def test_soak_streaming_with_cancellations(served):
    engine, server = served
    rng = random.Random(1234)
    shared = "You are a helpful assistant. Answer in one short line, please. "  # 4 full blocks: prefix hits
    requests = [_request(rng, i, shared) for i in range(NUM_REQUESTS)]
    cancel = [rng.randrange(1, 7) if rng.random() < CANCEL_FRACTION else None for _ in requests]
    finished_before = engine.call(lambda e: e.stats["num_finished"]).result(30)

    async def main():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=NUM_REQUESTS + 10)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_one(client, p, b, c) for (p, b), c in zip(requests, cancel)))

    start = time.monotonic()
    results = asyncio.run(main())
    completed = [r for r in results if not r["cancelled"]]
    num_cancelled = len(results) - len(completed)
    assert 0.15 * NUM_REQUESTS < num_cancelled < 0.45 * NUM_REQUESTS
    for r in completed:  # a stream that ran to the end is whole: finish reason, usage, [DONE]
        assert r["done"] and r["finish"] == "length" and r["usage"]["completion_tokens"] == r["max_tokens"], r

    # Every request ends in the engine: finished or aborted; nothing is left holding blocks.
    deadline = time.monotonic() + 60
    while engine.call(lambda e: e.has_unfinished()).result(30):
        assert time.monotonic() < deadline, "requests of disconnected clients were never aborted"
        time.sleep(0.05)
    state = engine.call(_final_state).result(30)
    assert state["num_free_blocks"] == state["num_blocks"], state
    assert state["num_waiting"] == state["num_running"] == state["num_requests"] == 0, state
    num_finished = state["num_finished"] - finished_before
    assert len(completed) <= num_finished < NUM_REQUESTS, "no cancelled request was aborted early"
    print(f"\nsoak: {NUM_REQUESTS} streams, {num_cancelled} cancelled ({NUM_REQUESTS - num_finished} aborted "
          f"mid-generation), {state['num_preemptions']} preemptions, prefix hit rate "
          f"{state['prefix_cache_hit_rate']:.2f}, {time.monotonic() - start:.1f} s")


def _final_state(engine) -> dict:
    engine.check_integrity()  # free + evictable + used == total, ref counts, hash map, queues
    kv = engine.kv_manager
    return {"num_free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks,
            "num_waiting": engine.scheduler.num_waiting, "num_running": engine.scheduler.num_running,
            "num_requests": len(engine.requests), "num_finished": engine.stats["num_finished"],
            "num_preemptions": engine.scheduler.num_preemptions, "prefix_cache_hit_rate": kv.prefix_cache_hit_rate}
