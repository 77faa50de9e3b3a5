"""AsyncLLMEngine on a real tiny model: streaming, abort, admission errors, step failures, idle
sleep, shutdown; and the lean runtime's promise that loading + generating never imports
transformers (source model and built artifact, in a fresh interpreter)."""

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from qkiln.errors import QkilnError, RequestError
from qkiln.runtime.async_engine import AsyncLLMEngine, EngineError
from qkiln.runtime.llm import LLM
from qkiln.runtime.sampling_params import SamplingParams
from tiny_models import write_tiny_hf_model

ENGINE_KW = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=8)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", name="tiny", **ENGINE_KW)
    yield eng
    eng.shutdown()


def wait_idle(engine: AsyncLLMEngine, timeout: float = 30.0) -> None:
    """Until the engine holds no request and no KV block; then its accounting must be intact."""
    deadline = time.monotonic() + timeout
    while engine.call(lambda e: e.has_unfinished() or e.kv_manager.usage > 0).result(timeout):
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)
    engine.call(lambda e: e.check_integrity()).result(timeout)
    kv = engine.call(lambda e: (e.kv_manager.num_free_blocks, e.kv_manager.num_blocks)).result(timeout)
    assert kv[0] == kv[1], f"{kv[1] - kv[0]} KV blocks still held after every request ended"
    assert engine.num_open_requests == 0  # every stream ended, however (a server's capacity check counts them)


async def collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_stream_matches_offline_llm(engine, model_dir):
    prompts = ["the quick brown fox", "lorem ipsum dolor sit amet", "0123456789"]
    params = SamplingParams(max_tokens=12, **GREEDY)
    reference = LLM(str(model_dir), dtype="fp32", **ENGINE_KW).generate(prompts, params)

    async def main():
        return await asyncio.gather(*(collect(engine, p, params) for p in prompts))

    for outs, ref in zip(asyncio.run(main()), reference):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].token_ids == ref.token_ids and outs[-1].finish_reason == "length"
        assert "".join(o.new_text for o in outs) == outs[-1].text == ref.text
        assert outs[-1].metrics["num_output_tokens"] == 12 and outs[-1].metrics["ttft"] > 0
    wait_idle(engine)


def test_an_aborted_request_stops_counting_at_once(engine):
    """A server's capacity counts open requests; one whose client hung up counted until the engine
    ended it after the step in progress, so a retry at once could get a 429."""
    import threading

    gate = threading.Event()

    async def main():
        stream = await engine.add_request("a prompt", SamplingParams(max_tokens=200, **GREEDY))
        await stream.__anext__()  # running
        busy = engine.call(lambda e: gate.wait(30))  # the engine thread in a long step, say
        engine.abort(stream.request_id)
        counted = engine.num_open_requests
        gate.set()
        busy.result(30)
        last = [out async for out in stream][-1]
        return counted, last.finish_reason

    assert asyncio.run(main()) == (0, "abort")
    wait_idle(engine)


def test_leaving_the_loop_aborts_and_frees_blocks(engine):
    async def main():
        seen = 0
        async for out in engine.generate("a prompt that will be cut short", SamplingParams(max_tokens=100, **GREEDY)):
            seen += 1
            if seen == 3:
                break
        return seen

    before = engine.snapshot.num_generated_tokens
    assert asyncio.run(main()) == 3
    wait_idle(engine)
    assert engine.snapshot.num_generated_tokens - before < 100  # it stopped early: aborted, not finished


async def aborted_after(engine, num_outputs: int, prompt, params, request_id):
    """The request's outputs when another caller aborts it once `num_outputs` have arrived."""
    stream = await engine.add_request(prompt, params, request_id)
    outs = []
    async for out in stream:
        outs.append(out)
        if len(outs) == num_outputs:
            engine.abort(request_id)
    return outs


def test_abort_from_elsewhere_ends_the_stream_with_abort(engine):
    outs = asyncio.run(aborted_after(engine, 2, "abort me", SamplingParams(max_tokens=100, **GREEDY), "to-abort"))
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert 2 <= len(outs[-1].token_ids) < 100
    wait_idle(engine)


def test_an_aborted_stream_adds_up_to_its_text_and_keeps_its_cache_hit(engine):
    """The abort's output carries what a stop string's hold-back had kept from the stream (its
    pieces had added up to less than its `text`) and the prompt's prefix-cache hit (it said 0)."""
    prompt = "a prompt long enough to fill two blocks of the prefix cache, at least"
    params = SamplingParams(max_tokens=100, stop=["\x00never\x00"], **GREEDY)  # holds back 6 characters

    async def main():
        await collect(engine, prompt, SamplingParams(max_tokens=1, **GREEDY))  # caches the prompt's blocks
        return await aborted_after(engine, 8, prompt, params, "aborted-with-stop")

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and len(outs[-1].text) >= 8
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert outs[0].num_cached_tokens >= 32 and {o.num_cached_tokens for o in outs} == {outs[0].num_cached_tokens}
    wait_idle(engine)


def test_changing_params_after_submitting_changes_nothing_submitted(engine):
    """The engine holds a copy: one params object reused in a loop gave every request the last
    value set (max_tokens 2, 5, 9 came back 9, 9, 9)."""
    async def main():
        params, streams = SamplingParams(max_tokens=2, **GREEDY), []
        for max_tokens in (2, 5, 9):
            params.max_tokens = max_tokens
            streams.append(engine.submit("reused params", params))
        return [[out async for out in stream] for stream in streams]

    assert [len(outs[-1].token_ids) for outs in asyncio.run(main())] == [2, 5, 9]
    wait_idle(engine)


def test_refused_requests_raise_and_the_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(RequestError, match="context"):
            await engine.add_request("x" * 200, SamplingParams(max_tokens=4))
        with pytest.raises(RequestError, match="max_tokens"):
            await engine.add_request("x", SamplingParams(max_tokens=0))
        with pytest.raises(RequestError, match="empty"):
            await engine.add_request("", SamplingParams(max_tokens=4))
        with pytest.raises(RequestError, match="seed"):  # once queued before seeding failed: every step broke
            await engine.add_request("x", SamplingParams(max_tokens=4, seed=2**64))
        first = await engine.add_request("same id", SamplingParams(max_tokens=30, **GREEDY), "dup")
        with pytest.raises(RequestError, match="already in use"):
            await engine.add_request("same id", SamplingParams(max_tokens=4), "dup")
        outs = [o async for o in first]
        return outs, await collect(engine, "still serving", SamplingParams(max_tokens=5, **GREEDY))

    dup, good = asyncio.run(main())
    assert dup[-1].finish_reason == "length" and len(dup[-1].token_ids) == 30
    assert good[-1].finish_reason == "length" and len(good[-1].token_ids) == 5
    wait_idle(engine)


def test_a_failing_step_errors_its_requests_not_the_engine(engine, caplog):
    async def main():
        stream = await engine.add_request("doomed", SamplingParams(max_tokens=50, **GREEDY), "doomed")
        await stream.__anext__()
        # Fault injection through the engine thread: the engine loses its record of the request,
        # so its next step raises (KeyError) while the scheduler still runs the sequence.
        await engine.call_async(lambda e: e.requests.pop("doomed"))
        with pytest.raises(EngineError, match="failed"):
            async for _ in stream:
                pass
        return await collect(engine, "after the failure", SamplingParams(max_tokens=6, **GREEDY))

    with caplog.at_level("ERROR", logger="qkiln.engine"):
        after = asyncio.run(main())
    assert after[-1].finish_reason == "length" and len(after[-1].token_ids) == 6
    assert engine.snapshot.num_step_errors == 1
    # which requests failed, for the operator (the log had a bare traceback)
    [line] = [r for r in caplog.records if r.name == "qkiln.engine"]
    assert "aborted requests: doomed" in line.getMessage() and line.exc_info is not None
    wait_idle(engine)


def test_a_failing_step_spares_the_requests_it_did_not_run(model_dir):
    """A waiting request was failed with the step that broke, though that step never touched it:
    on a busy server one bad prefill (an out-of-memory) turned into a 500 for every client queued."""
    eng = AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **(ENGINE_KW | dict(max_num_seqs=1)))

    async def main():
        doomed = await eng.add_request("doomed", SamplingParams(max_tokens=50, **GREEDY), "doomed")
        await doomed.__anext__()
        waiting = eng.submit("queued behind it", SamplingParams(max_tokens=6, **GREEDY))  # max_num_seqs=1
        await eng.call_async(lambda e: e.requests.pop("doomed"))  # its next step raises, as in the test above
        with pytest.raises(EngineError, match="failed"):
            async for _ in doomed:
                pass
        return [out async for out in waiting]

    try:
        outs = asyncio.run(main())
        assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 6
        assert eng.snapshot.num_step_errors == 1
        wait_idle(eng)
    finally:
        eng.shutdown()


def poisoned_model(directory, token_id: int):
    """A tiny model (untied head) with token `token_id`'s embedding NaN: any request holding that
    token gets NaN logits (as an fp16 overflow would give), the others are untouched."""
    from safetensors.torch import load_file, save_file

    write_tiny_hf_model(directory, "llama3")
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.embed_tokens.weight"][token_id] = float("nan")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_nan_logits_fail_that_request_only(tmp_path):
    """NaN logits gave a token anyway (argmax's first NaN: token 0, again and again) and a 200."""
    eng = AsyncLLMEngine.from_model(str(poisoned_model(tmp_path, 7)), dtype="fp32", **ENGINE_KW)
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def main():
        alone = await collect(eng, [5, 6, 9], params)
        poisoned = eng.submit([5, 7, 9], params, "poisoned")
        healthy = eng.submit([5, 6, 9], params)
        with pytest.raises(EngineError, match=r"logits are not finite .* request 'poisoned' at output token 1"):
            async for _ in poisoned:
                pass
        return alone, [out async for out in healthy]

    try:
        alone, healthy = asyncio.run(main())
        assert healthy[-1].token_ids == alone[-1].token_ids and len(alone[-1].token_ids) == 6
        assert eng.snapshot.num_step_errors == 1
        wait_idle(eng)
    finally:
        eng.shutdown()


def test_requests_failed_together_are_each_told_only_their_own_id(tmp_path):
    """Two overflowing requests in one step: each client was told 'request <the other's id> ... and
    1 more', and a server's ids carry its clients' x-request-id (a gateway's trace id)."""
    eng = AsyncLLMEngine.from_model(str(poisoned_model(tmp_path, 7)), dtype="fp32", **ENGINE_KW)
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def failure(stream):
        try:
            async for _ in stream:
                pass
        except EngineError as e:
            return str(e)

    async def main():
        streams = [eng.submit([5, 7, 9], params, name) for name in ("alice-1", "bob-1")]
        return await asyncio.gather(*(failure(s) for s in streams))

    try:
        told = asyncio.run(main())
        wait_idle(eng)
        eng.call(lambda e: None).result(30)  # the loop published a snapshot after wait_idle's call
        assert eng.snapshot.num_step_errors == 1  # one step failed them both
        for mine, theirs, message in (("alice-1", "bob-1", told[0]), ("bob-1", "alice-1", told[1])):
            assert f"request '{mine}' at output token 1:" in message and theirs not in message
    finally:
        eng.shutdown()


def test_idle_engine_thread_sleeps(engine):
    asyncio.run(collect(engine, "warm", SamplingParams(max_tokens=2)))
    wait_idle(engine)
    thread = next(t for t in psutil.Process().threads() if t.id == engine._thread.native_id)
    time.sleep(1.0)
    later = next(t for t in psutil.Process().threads() if t.id == engine._thread.native_id)
    busy = (later.user_time + later.system_time) - (thread.user_time + thread.system_time)
    assert busy < 0.1, f"the idle engine thread used {busy:.2f} s of CPU in 1 s: it is polling"


def test_an_engine_dropped_without_shutdown_is_freed(model_dir):
    """The thread held the engine (model, KV pool) for the life of the process: +930 MiB per engine
    a notebook or a reloading app made and dropped (probe s50)."""
    import gc
    import weakref

    eng = AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **ENGINE_KW)
    assert len(asyncio.run(collect(eng, "once", SamplingParams(max_tokens=3, **GREEDY)))) == 3
    ref, thread = weakref.ref(eng.engine), eng._thread
    del eng
    gc.collect()
    thread.join(10)
    assert ref() is None and not thread.is_alive()
    # a call queued on an engine dropped at once is answered (it ran, or it failed), never left hanging
    future = AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **ENGINE_KW).call(lambda e: "ran")
    try:
        assert future.result(timeout=10) == "ran"
    except EngineError as e:
        assert "garbage-collected" in str(e)


def test_a_with_block_shuts_the_engine_down(model_dir):
    async def main():
        async with AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **ENGINE_KW) as eng:
            assert len(await collect(eng, "hi", SamplingParams(max_tokens=2, **GREEDY))) == 2
        return eng

    assert not asyncio.run(main()).is_running
    with AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **ENGINE_KW) as eng:
        assert eng.is_running
    assert not eng.is_running


def test_options_and_params_are_checked_before_anything_runs(model_dir):
    """from_model loaded the model first and then failed with EngineConfig's TypeError; params given
    where the prompt goes (vLLM's argument order) failed with "'str' object has no attribute 'admitted'"."""
    with pytest.raises(TypeError, match="from_model\\(\\) has no option gpu_memory_utilization"):
        AsyncLLMEngine.from_model("no-such-model", gpu_memory_utilization=0.5)
    with pytest.raises(QkilnError, match="max_num_seqs must be an integer >= 1"):
        AsyncLLMEngine.from_model("no-such-model", max_num_seqs=0)

    async def main():
        with AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **ENGINE_KW) as eng:
            with pytest.raises(RequestError, match="params must be a SamplingParams, not str"):
                eng.submit("hello", "req-1")
            with pytest.raises(RequestError, match="not dict"):
                eng.engine.add_request("hello", {"max_tokens": 2})

    asyncio.run(main())


def test_shutdown_ends_open_streams(model_dir):
    eng = AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **ENGINE_KW)

    async def main():
        stream = await eng.add_request("long", SamplingParams(max_tokens=100, **GREEDY))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineError, match="not running"):
            await eng.add_request("late", SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert not eng.is_running
    assert eng.num_open_requests == 0


def test_shutdown_ends_open_streams_without_waiting_for_the_step(model_dir):
    """A server's forced exit gives its requests two seconds to answer: a stream that ended only
    after a long step (here the engine thread is held for 3 s, as a long prefill holds it) was
    cancelled first, a bare 500. What that step puts afterwards is dropped: each stream ends once."""
    eng = AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", **ENGINE_KW)

    async def main():
        streams = [await eng.add_request(f"long {i}", SamplingParams(max_tokens=100, **GREEDY)) for i in range(3)]
        for stream in streams:
            await stream.__anext__()
        busy = threading.Event()
        held = eng.call(lambda e: (busy.set(), time.sleep(3)))  # the engine thread busy, as in a long step
        assert await asyncio.get_running_loop().run_in_executor(None, busy.wait, 30)
        started = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, lambda: eng.shutdown(timeout=0))
        for stream in streams:
            with pytest.raises(EngineError, match="shut down"):
                async for _ in stream:
                    pass
        assert time.monotonic() - started < 1.5, "the streams waited for the step"
        await asyncio.wrap_future(held)
        await asyncio.sleep(0.1)  # what the step put has reached the loop: dropped
        assert not any(s.queue for s in streams)

    asyncio.run(main())
    eng.shutdown()
    assert eng.num_open_requests == 0


_NO_TRANSFORMERS = textwrap.dedent("""
    import asyncio, sys
    from qkiln.runtime.async_engine import AsyncLLMEngine
    from qkiln.runtime.llm import LLM
    from qkiln.runtime.sampling_params import SamplingParams
    import qkiln.runtime.server  # the HTTP layer too
    for path in sys.argv[1:]:
        out = LLM(path, max_num_seqs=2, num_kv_blocks=16).generate(["hi"], SamplingParams(max_tokens=3))
        assert len(out[0].token_ids) >= 1, out
        eng = AsyncLLMEngine.from_model(path, num_kv_blocks=16)
        async def main():
            return [o async for o in eng.generate("hi", SamplingParams(max_tokens=3))]
        assert asyncio.run(main())[-1].finished
        eng.shutdown()
    bad = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "accelerate"))
    assert not bad, bad
    print("ok")
""")


def test_loading_and_generating_never_imports_transformers(model_dir, tmp_path):
    from qkiln.compile.build import build
    from qkiln.compile.recipe import load_recipe

    artifact = build(str(model_dir), load_recipe("w4a16-rtn"), tmp_path / "artifact", use_cache=False).path
    result = subprocess.run([sys.executable, "-c", _NO_TRANSFORMERS, str(model_dir), str(artifact)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_a_non_streamed_response_keeps_two_outputs_not_one_per_token(engine):
    """Each output holds the text and token ids so far: the server kept every one until the
    response was built (quadratic memory: 16 requests of 4000 tokens held +820 MiB)."""
    from qkiln.runtime.metrics import ServerMetrics
    from qkiln.runtime.server import _collect

    params = SamplingParams(max_tokens=40, logprobs=2, **GREEDY)

    async def main():
        everything = await collect(engine, "the quick brown fox", params)
        stream = engine.submit("the quick brown fox", params)
        await stream.accepted
        return everything, await _collect(stream, ServerMetrics(engine, "tiny"))

    everything, kept = asyncio.run(main())
    assert len(everything) == 40 and len(kept) == 2
    assert (kept[-1].token_ids, kept[-1].text, kept[-1].finish_reason) == \
        (everything[-1].token_ids, everything[-1].text, everything[-1].finish_reason)
    kept_entries = [e for out in kept for e in out.logprobs]  # every token's, in order
    all_entries = [e for out in everything for e in out.logprobs]
    assert [(e["token_id"], e["rank"]) for e in kept_entries] == [(e["token_id"], e["rank"]) for e in all_entries]
    assert [e["logprob"] for e in kept_entries] == pytest.approx([e["logprob"] for e in all_entries], abs=1e-5)
    wait_idle(engine)


def test_abort_ends_its_request_and_no_other(engine):
    """abort() finds the request's stream by its id (a scan of every open stream per abort had
    blocked the event loop 0.73 s in a disconnect of 4000 streams)."""
    long, short = SamplingParams(max_tokens=100, **GREEDY), SamplingParams(max_tokens=4, **GREEDY)

    async def main():
        streams = [engine.submit(p, long if i == 1 else short, f"abort-one-{i}") for i, p in
                   enumerate(("one", "two", "three"))]
        engine.abort("abort-one-1")
        engine.abort("not-a-request")
        return [[out async for out in s][-1].finish_reason for s in streams]

    assert asyncio.run(main()) == ["length", "abort", "length"]
    assert engine.num_open_requests == 0
    wait_idle(engine)


def test_iterating_a_refused_stream_raises_its_refusal(engine):
    """Without `await stream.accepted` first, `async for` over a refused request had waited forever."""
    params = SamplingParams(max_tokens=4, **GREEDY)

    async def main():
        first, second = engine.submit("one", params, "twice"), engine.submit("two", params, "twice")
        with pytest.raises(RequestError, match="already in use"):
            await asyncio.wait_for(anext(aiter(second)), 30)
        return [out async for out in first][-1].finish_reason

    assert asyncio.run(main()) == "length"
    wait_idle(engine)


def test_a_stream_nobody_reads_holds_a_bounded_backlog_that_adds_up(engine):
    """Each output carries the text and token ids so far: a consumer that stopped reading (a slow
    HTTP client) made the backlog grow quadratically. Past MERGE_BACKLOG the newest outputs merge."""
    from qkiln.runtime.async_engine import MERGE_BACKLOG

    params = SamplingParams(max_tokens=100, logprobs=1, **GREEDY)

    async def main():
        stream = engine.submit("a reader that fell behind", params)
        await stream.accepted
        while not stream.queue or not stream.queue[-1].finished:
            await asyncio.sleep(0.01)
        held = len(stream.queue)
        return held, [out async for out in stream]

    held, outputs = asyncio.run(main())
    assert held == MERGE_BACKLOG
    final = outputs[-1]
    assert len(final.token_ids) == 100 and final.finish_reason == "length"
    assert [t for out in outputs for t in out.new_token_ids] == final.token_ids
    assert "".join(out.new_text for out in outputs) == final.text
    assert [e["token_id"] for out in outputs for e in out.logprobs] == final.token_ids
    assert "ttft" in outputs[0].metrics and "e2e" in final.metrics
    gaps = [gap for out in outputs for gap in out.inter_token_latencies]  # one before each token after the first
    assert len(gaps) == 99 and min(gaps) > 0 and sum(gaps) == pytest.approx(final.metrics["decode"])
    wait_idle(engine)
