"""`AsyncLLMEngine`: one `LLMEngine` driven by one background thread, streamed to asyncio callers.

Owns the engine thread, the hand-off of requests and aborts from any thread to it, and the
per-request output streams. Must not schedule, sample or format responses (engine.py and
server.py do).

Invariants:
- Only the engine thread touches the `LLMEngine`. Other threads enqueue commands (add, abort,
  call) on `_commands` and set `_wake`; the engine thread applies them between steps, in order.
  So an abort sent after an add always finds the request, and KV blocks are only ever freed by
  the thread that allocates them.
- Idle means asleep: with no unfinished request the thread blocks on `_wake` (no busy-wait).
- The thread holds the engine only through a weak reference while it sleeps, so an engine dropped
  without `shutdown()` (or a `with` block) is collected, model and KV pool with it, and its thread
  ends; while a request's stream is alive, that stream keeps the engine alive.
- Every stream ends exactly once: with a finished `RequestOutput` (stop, length, or abort) or
  with an exception (`RequestError` at admission, `EngineError` when a step fails or the engine
  shuts down). A failing step aborts the requests it had in it (every open one if it failed
  while scheduling), frees their blocks, and the engine keeps serving the rest. `shutdown` ends
  the open streams itself, at once, rather than after the step in progress (which may take
  seconds); what that step then puts is dropped.
- `snapshot` is an immutable `EngineSnapshot` replaced after every loop turn and once a step is
  scheduled, so metrics and health checks read it from any thread without locking.

    event loop thread                         engine thread
    add_request ─┐                            ┌─ drain commands (add / abort / call)
    abort       ─┼─> _commands + _wake.set ──>┤  step() -> outputs
    call        ─┘                            └─ loop.call_soon_threadsafe(stream.put, out)
"""

import asyncio
import collections
import concurrent.futures
import logging
import queue
import sys
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from qkiln.errors import QkilnError, RequestError

from .engine import LLMEngine, NonFiniteLogitsError, RequestOutput
from .memory_limits import release_freed_memory
from .sampling_params import SamplingParams

log = logging.getLogger("qkiln.engine")
# --enable-log-requests' lines: asked for, so shown whatever the server's log level (server.py)
request_log = logging.getLogger("qkiln.requests")


class EngineError(QkilnError):
    """The engine failed while running a request (a bug or an out-of-memory), or it has shut down."""


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine looked like after its latest loop turn (read from any thread)."""

    num_waiting: int = 0  # in the scheduler's queue, or received and not yet handed to the engine
    num_running: int = 0
    num_unfinished: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_step_errors: int = 0
    num_aborted: int = 0  # requests ended before they finished (a client gone, a refused sibling)
    num_preemptions: int = 0  # running requests sent back to wait for KV blocks (their KV recomputed)
    time: float = 0.0


_ACCEPTED = object()  # engine thread -> stream: "admitted"; resolves `accepted`, never queued


# Outputs a stream holds before it merges the newest ones (a consumer that stopped reading, e.g. an
# HTTP client that reads slowly): each output carries the text and token ids so far, so an unread
# backlog grew quadratically (one stalled 4000-token stream: 70.7 MiB); vLLM's output collector merges too.
MERGE_BACKLOG = 16


class RequestStream:
    """Outputs of one request, in order; iterate with `async for`. Ends after the finished output.
    A consumer more than MERGE_BACKLOG outputs behind gets the newest merged into one
    (`RequestOutput.merged`): its new tokens, text and logprobs concatenated."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 on_end: Callable[["RequestStream"], None] | None = None):
        self.request_id = request_id
        self.loop = loop
        self.queue: collections.deque = collections.deque()  # the event loop's thread only
        self._arrived = asyncio.Event()
        self.accepted: asyncio.Future = loop.create_future()  # None once admitted, or the admission error
        self.finished = False
        self._on_end = on_end  # called once, by the thread that puts the last item, whoever listens
        self._ended = False  # the last item was put: anything later is dropped
        self._end_lock = threading.Lock()  # the engine thread and `shutdown` may both end a stream

    # ---- producer side (any thread: everything goes through the loop) -----------------------
    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand an output or an error to the consumer; False if its event loop is gone. Items after
        the last one (a finished output or an error) are dropped."""
        last = isinstance(item, BaseException) or (item is not _ACCEPTED and item.finished)
        with self._end_lock:
            if self._ended:
                return True
            self._ended = last
        if last and self._on_end is not None:
            self._on_end(self)
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
            return True
        except RuntimeError:  # the loop was closed: nobody is listening any more
            return False

    def _deliver(self, item) -> None:
        if not self.accepted.done():
            if isinstance(item, BaseException):  # refused at admission: nothing else will come
                self.accepted.set_exception(item)
                self._push(item)  # and an `async for` that did not await `accepted` ends (it had hung)
                return
            self.accepted.set_result(None)
        if item is not _ACCEPTED:
            self._push(item)

    def _push(self, item) -> None:
        behind = self.queue[-1] if len(self.queue) >= MERGE_BACKLOG else None
        if isinstance(behind, RequestOutput) and isinstance(item, RequestOutput):
            self.queue[-1] = behind.merged(item)
        else:
            self.queue.append(item)
        self._arrived.set()

    # ---- consumer side -----------------------------------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self.queue:
            self._arrived.clear()
            await self._arrived.wait()
        item = self.queue.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            if self.accepted.done() and not self.accepted.cancelled():
                self.accepted.exception()  # a refusal raised here is retrieved: asyncio need not warn of it
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, name: str = "model", artifact: dict | None = None,
                 log_requests: bool = False):
        """artifact: what identifies the artifact served ({"name", "digest", "serving_digest"}),
        which the server reports so a deploy can tell which build answers. log_requests: a line on
        logger qkiln.engine (INFO) when a request is received, finishes or is aborted, with its id
        (a client's x-request-id), token counts and latencies; failures are logged either way."""
        self.engine = engine
        self.name = name
        self.artifact = artifact
        self.log_requests = log_requests
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_request_len = engine.max_request_len
        self.sampling_defaults = engine.sampling_defaults
        self.vocab_size = engine.model.config.vocab_size
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stopping = False
        self._closed = False  # set once by the engine thread on exit; guarded by `_send_lock`
        self._send_lock = threading.Lock()
        self.snapshot = EngineSnapshot()
        self._num_step_errors = 0
        # submitted, not yet ended, by request id (an abort finds its streams without a scan: a mass
        # disconnect of 4000 streams had blocked the event loop 0.73 s); guarded by `_open_lock`
        self._open: dict[str, set[RequestStream]] = {}
        self._num_open = 0
        self._aborted: set[RequestStream] = set()  # of those, the ones abort() asked to end
        self._num_queued_adds = 0  # submitted, not yet drained by the engine thread; guarded by `_open_lock`
        self._open_lock = threading.Lock()
        self._thread = threading.Thread(target=_engine_thread, args=(weakref.ref(self), self._wake, self._commands),
                                        name="qkiln-engine", daemon=True)
        weakref.finalize(self, self._wake.set)  # collected while the thread sleeps: wake it to end
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, dtype: str = "auto", name: str | None = None,
                   int8_activations: bool = False, log_requests: bool = False, device: str = "cpu",
                   dense_prefill: bool = True, **engine_kwargs) -> "AsyncLLMEngine":
        """Load an artifact directory or a source model (alias, HF dir, .gguf) on `device` and start
        serving it (int8_activations, dense_prefill: loader.load_for_serving; engine_kwargs:
        EngineConfig's fields, checked before the model loads)."""
        from qkiln.compile.artifact import serving_digest

        from .loader import check_engine_options, load_for_serving

        check_engine_options(engine_kwargs, device, "AsyncLLMEngine.from_model()",
                             "model, dtype, name, int8_activations, log_requests, device, dense_prefill")
        loaded = load_for_serving(model, dtype=dtype, device=device, int8_activations=int8_activations,
                                  dense_prefill=dense_prefill)
        manifest = loaded.manifest
        # a format-1.0 manifest records no digest: "" in the metrics' info labels, which take strings
        # only (prometheus_client raised on None, and `qkiln serve` exited on every such artifact)
        artifact = None if manifest is None else {"name": manifest.name, "digest": manifest.digest or "",
                                                  "serving_digest": serving_digest(manifest)}
        return cls(loaded.engine(device=device, **engine_kwargs), name or loaded.name, artifact, log_requests)

    # `with` / `async with` end in shutdown(): the thread, the model and the KV pool go with the block
    def __enter__(self) -> "AsyncLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLMEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)  # it joins the thread: not on the event loop

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def num_open_requests(self) -> int:
        """Requests submitted and not yet ended (waiting, running, or on their way to the engine),
        less those aborted and about to end: exact at any moment, unlike the snapshot's counts, so a
        server can bound them (a client that hung up and retried at once had got a 429 while the
        engine was still finishing a step with its first request)."""
        with self._open_lock:
            return self._num_open - len(self._aborted)

    # ---- public API (any thread / the event loop) -------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, arrival_time: float | None = None) -> RequestStream:
        """Queue a request without waiting (call it on the event loop its stream belongs to):
        `await stream.accepted` raises the engine's refusal. Raises `RequestError` for bad
        parameters and `EngineError` when the engine is not running. arrival_time: when the request
        arrived (a time.time(), as vLLM's; None: now), from which its latencies count."""
        arrival_time = time.time() if arrival_time is None else arrival_time
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, not {type(params).__name__} (the order is prompt, "
                               "params, request_id)", "sampling_params")
        # None: the model's recommended values (generation_config.json), as LLM.generate and the server use
        params = (params or self.engine.default_sampling_params()).admitted()  # now: the caller may change it next
        stream = RequestStream(request_id if request_id is not None else f"req-{uuid.uuid4().hex}",
                               asyncio.get_running_loop(), on_end=self._request_ended)
        with self._open_lock:
            self._open.setdefault(stream.request_id, set()).add(stream)
            self._num_open += 1
            self._num_queued_adds += 1
        try:
            self._send(_Add(stream, prompt, params, arrival_time))
        except EngineError:
            self._request_ended(stream)
            with self._open_lock:
                self._num_queued_adds -= 1
            raise
        return stream

    def _request_ended(self, stream: RequestStream) -> None:
        with self._open_lock:
            same_id = self._open.get(stream.request_id, set())
            if stream in same_id:
                same_id.remove(stream)
                self._num_open -= 1
                if not same_id:
                    del self._open[stream.request_id]
            self._aborted.discard(stream)

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine has admitted it.

        Raises `RequestError` if the engine refuses it (bad parameters, prompt too long), so a
        server can answer 400 before it starts streaming.
        """
        stream = self.submit(prompt, params, request_id)
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(stream.request_id)  # the caller went away while we were queued
            raise
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs; leaving the loop early (or being cancelled) aborts it. One
        request is one choice: for n > 1, submit each of `params.choices()` (the server does)."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its stream ends with finish_reason "abort". Unknown ids are ignored."""
        with self._open_lock:
            self._aborted.update(self._open.get(request_id, ()))
        try:
            self._send(("abort", request_id))
        except EngineError:
            pass  # a stopped engine has already ended every stream; cleanup paths must not raise

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps (integrity checks, inspection)."""
        future = concurrent.futures.Future()
        self._send(("call", fn, future))
        return future

    async def call_async(self, fn: Callable[[LLMEngine], object]):
        return await asyncio.wrap_future(self.call(fn))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; open streams end with `EngineError` now, not after the step in
        progress: a server's forced exit gives its requests two seconds to answer, and a long
        prefill had outlasted them, cancelling them into bare 500s."""
        self._stopping = True
        self._wake.set()
        with self._open_lock:
            still_open = [s for same_id in self._open.values() for s in same_id]
        for stream in still_open:
            stream.put(EngineError("the engine has shut down; retry against a running server"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _send(self, command) -> None:
        # Under the lock, a command either lands before the exiting thread's final drain or is refused:
        # none can be left in the queue unanswered.
        with self._send_lock:
            if self._closed or self._stopping:
                raise EngineError("the engine is not running (it was shut down or crashed); restart the server")
            self._commands.put(command)
        self._wake.set()

    # ---- engine thread (_engine_thread below runs these) ---------------------------------------
    def _turn(self) -> bool:
        """One loop turn: commands, then a step; False when idle (nothing to step)."""
        self._drain_commands()
        self._publish()
        if not self.engine.has_unfinished():
            return False
        self._step()
        return True

    def _close(self) -> None:
        """Refuse new commands, then fail every open stream and everything still queued."""
        with self._send_lock:
            self._closed = True
        error = EngineError("the engine has shut down; retry against a running server")
        for request_id in list(self._streams):
            self._streams.pop(request_id).put(error)
        _fail_queued(self._commands, error)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._apply_add(command)
            elif command[0] == "abort":
                self._apply_abort(command[1])
            else:
                _, fn, future = command
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except BaseException as e:
                        future.set_exception(e)

    def _apply_add(self, add: _Add) -> None:
        with self._open_lock:
            self._num_queued_adds -= 1
        request_id = add.stream.request_id
        try:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use; use a unique id")
            self.engine.add_request(add.prompt, add.params, request_id, add.arrival_time)
        except QkilnError as e:
            add.stream.put(e)
            return
        except Exception as e:  # e.g. a tokenizer failure: this request's problem, not the engine's
            add.stream.put(EngineError(f"could not add request {request_id!r}: {e!r}"))
            return
        self._streams[request_id] = add.stream
        if self.log_requests:
            seq = self.engine.requests[request_id].seq
            request_log.info("request %s received: %d prompt tokens, max_tokens %s", request_id,
                             len(seq.prompt_token_ids), add.params.max_tokens)
        if not add.stream.put(_ACCEPTED):
            self._apply_abort(request_id)

    def _apply_abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        req = self.engine.requests.get(request_id)
        self.engine.abort_request(request_id)
        if stream is not None and req is not None:
            # new_text: what a stop-string hold-back kept from the stream, so its pieces add up to `text`
            seq = req.seq
            if self.log_requests:
                request_log.info("request %s aborted (its client went away, or the server is stopping) after %d "
                                 "generated tokens", request_id, len(seq.output_token_ids))
            stream.put(RequestOutput(request_id, seq.prompt_token_ids, [], req.detok.get_next_output_text(True),
                                     seq.output_token_ids, req.detok.output_text, True, "abort",
                                     num_cached_tokens=seq.num_cached_tokens))

    def _step(self) -> None:
        try:
            outputs = self.engine.step(on_scheduled=self._publish)
        except Exception as e:
            # Mostly we cannot tell which of the step's requests broke it: fail them all, keep the
            # engine and the requests the step did not touch (those waiting for their turn).
            self._num_step_errors += 1
            nonfinite = isinstance(e, NonFiniteLogitsError)  # those requests only; the rest run the step again
            if nonfinite:
                print(f"warning: {e}", file=sys.stderr)
                message, in_step = e.for_request, e.request_ids
            else:
                failure = f"the engine failed while running this request ({e!r}); it was aborted"
                message, in_step = (lambda _: failure), self.engine.last_step_request_ids
            failed = list(self._streams) if in_step is None else list(in_step)
            if not nonfinite:
                log.error("an engine step failed; aborted requests: %s", ", ".join(map(str, failed)) or "none",
                          exc_info=True)
            for request_id in failed:
                self.engine.abort_request(request_id)
                self.engine.scheduler.abort(request_id)  # also when the engine lost its own record of it
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(EngineError(message(request_id)))
            # a sequence nobody waits for would fail every later step the same way: drop it too
            scheduler = self.engine.scheduler
            for seq in [*scheduler.waiting, *scheduler.running]:
                if seq.seq_id not in self.engine.requests:
                    scheduler.abort(seq.seq_id)
            return
        self._publish()  # before delivery: a client that saw its output also sees it in the metrics
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                if self.log_requests:
                    _log_finished(out)
            if not stream.put(out) and not out.finished:
                self._apply_abort(out.request_id)

    def _publish(self) -> None:
        """A new snapshot: after each loop turn's commands, once a step is scheduled, after it ran."""
        e, kv = self.engine, self.engine.kv_manager
        with self._open_lock:
            queued = self._num_queued_adds
        self.snapshot = EngineSnapshot(
            num_waiting=e.scheduler.num_waiting + queued, num_running=e.scheduler.num_running,
            num_unfinished=len(e.requests), kv_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_prompt_tokens=e.stats["num_prompt_tokens"], num_generated_tokens=e.stats["num_generated_tokens"],
            num_steps=e.stats["num_steps"], num_step_errors=self._num_step_errors, num_aborted=e.stats["num_aborted"],
            num_preemptions=e.scheduler.num_preemptions, time=time.monotonic())

def _fail_queued(commands: queue.SimpleQueue, error: BaseException) -> None:
    """Requests and calls that were queued but never applied."""
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            return
        if isinstance(command, _Add):
            command.stream.put(error)
        elif command[0] == "call" and command[2].set_running_or_notify_cancel():  # its caller may have left
            command[2].set_exception(error)


def _engine_thread(ref: "weakref.ref[AsyncLLMEngine]", wake: threading.Event, commands: queue.SimpleQueue) -> None:
    """The engine thread's loop. Asleep it holds no reference to the engine, so a dropped engine is
    collected (its finalizer sets `wake`) and the loop ends, failing a call queued just before."""
    engine = ref()
    busy = False
    try:
        while engine is not None and not engine._stopping:
            if engine._turn():
                busy = True
            else:
                if busy:  # gone idle: the steps' freed heap back to the OS. A server of SmolLM2 W4A16 under
                    # random 16-768-token prompts, 16 at a time: idle RSS 1.28-1.56 GB after 160 requests
                    # (the most on a busy host), 1.22 with this; the same wall time
                    release_freed_memory()
                    busy = False
                engine = None
                # Commands queued between the drain and here left `wake` set: no lost wake-up.
                wake.wait()
                wake.clear()
                engine = ref()
    except BaseException:  # a bug in the loop itself: fail every stream rather than hang them
        # not re-raised: the thread's excepthook printed the traceback a second time; a server
        # sees is_running go false and exits so that it is restarted
        log.critical("the engine loop failed; every request in flight is failed and the engine stops",
                     exc_info=True)
        if engine is not None:
            engine._stopping = True
    finally:
        if engine is not None:
            engine._close()
        else:  # a queued request holds its engine (its stream does); a queued call does not
            _fail_queued(commands, EngineError("the engine was garbage-collected before it ran this call; keep a "
                                               "reference to it until its calls are answered"))


def _log_finished(out: RequestOutput) -> None:
    m = out.metrics
    timing = f", queued {m['queue']:.3f} s, first token {m['ttft']:.3f} s, total {m['e2e']:.3f} s" if m else ""
    request_log.info("request %s finished (%s): %d prompt tokens (%d from the prefix cache), %d generated%s",
                     out.request_id, out.finish_reason, len(out.prompt_token_ids), out.num_cached_tokens,
                     len(out.token_ids), timing)
