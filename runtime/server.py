"""The OpenAI-compatible HTTP server: `create_app(async_engine, model_name, api_key, allowed_origins)` and `serve()`.

Owns routes, the HTTP error mapping, the server-sent-event framing and uvicorn's lifecycle. Request
shapes live in openai_protocol.py, response shapes in openai_responses.py, prompts as token ids in
request_prompts.py, the API key, request ids and body limit in http_middleware.py, the read
deadline in http_guard.py, the engine thread in async_engine.py, Prometheus in metrics.py. Must not
touch the `LLMEngine` directly.

Invariants:
- A bad request never reaches the engine's step loop and never takes the server down: every
  refusal is a 400 (401 for auth, 413 for a body past MAX_BODY_BYTES) with OpenAI's body
  `{"error": {message, type, param, code}}`.
  Validation errors (including malformed JSON) are 400, not FastAPI's default 422.
- Bounded: at most `max_concurrent_requests` engine requests open at once (past it a 429 with
  Retry-After, before anything is queued), and a deadline on reading each request (http_guard.py).
- A request whose client goes away is aborted: a streaming response is cancelled by Starlette
  when the client disconnects and the stream's `finally` aborts; a non-streaming one watches
  the connection while it waits.
- `/v1/*` and the tokenizer endpoints (`/tokenize`, `/detokenize`, `/tokenizer_info`) need
  `Authorization: Bearer KEY` when a key is set; `/health` (and vLLM's `/ping`), `/version` and
  `/metrics` are open (probes and scrapers), as in vLLM.
- Browsers may call it cross-origin only from `allowed_origins` (none by default, unlike vLLM's
  `*`: a page the user visits must not reach a server on their loopback). The CORS layer is
  outside the key check, so a preflight, which carries no key, is answered.
"""

import asyncio
import copy
import importlib.metadata
import json
import logging
import re
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from qkiln.errors import QkilnError, RequestError

from .async_engine import AsyncLLMEngine, EngineError, RequestStream
from .engine import RequestOutput, check_sampling_token_ids, last_tokens
from .http_guard import REQUEST_READ_TIMEOUT_S, GuardedH11Protocol
from .http_middleware import REQUEST_ID_HEADER, ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from .metrics import ServerMetrics
from .openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, InvalidRequestError,
                              SamplingFields, TokenizeChatRequest, TokenizeCompletionRequest, error_body)
from .openai_responses import ChatResponse, CompletionResponse, ResponseBuilder, batch_response, usage_chunk
from .request_prompts import chat_prompt_ids, check_token_ids, encode_text, kept_prompt_tokens, request_limit
from .sampling_params import SamplingParams

log = logging.getLogger("qkiln.server")

# Larger than any body a request needs: a 128k-token prompt as ids is ~1 MB, an evaluation batch a few.
MAX_BODY_BYTES = 64 << 20
# Above clients' pool expiry (httpx and openai: 5 s, aiohttp: 15 s): at uvicorn's 5 s the server
# closed idle connections just as clients reused them, ~1 request in 500 failing with a ReadError.
KEEP_ALIVE_S = 30
# Requests running or queued at once (a choice of n is one): the engine runs max_num_seqs of them;
# the rest wait, holding their prompts. A full completion batch (MAX_CHOICES_PER_REQUEST) fits.
MAX_CONCURRENT_REQUESTS = 4096
# distinct sets of ignored request fields the log names (once each): bounded, as clients choose them
MAX_IGNORED_SETS = 256
# after a forced exit (a second Ctrl-C), how long the requests still open get to answer their 503
FORCED_EXIT_ANSWER_S = 2.0


def create_app(engine: AsyncLLMEngine, model_name: str | None = None, api_key: str | None = None,
               allowed_origins: list[str] | None = None,
               max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS) -> FastAPI:
    """allowed_origins: origins browsers may call from (`*` for any); none by default.
    max_concurrent_requests: engine requests (a choice is one) open at once, running or waiting;
    past it requests get a 429 with Retry-After."""
    if max_concurrent_requests < 1:
        raise ValueError(f"max_concurrent_requests must be at least 1, not {max_concurrent_requests}")
    check_allowed_origins(allowed_origins)
    model_name = model_name or engine.name
    metrics = ServerMetrics(engine, model_name)
    app = FastAPI(title="qkiln", summary="OpenAI-compatible server for a qkiln model")
    app.state.engine, app.state.metrics, app.state.model_name = engine, metrics, model_name
    app.state.max_concurrent_requests = max_concurrent_requests
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)  # outside the key and size checks: their refusals carry it too
    if allowed_origins:  # added last: the outermost layer
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER])
    v1 = APIRouter(prefix="/v1")
    started = int(time.time())
    defaults = engine.sampling_defaults  # the model's recommended sampling values, for fields a request leaves out
    logged_ignored: set[tuple[str, ...]] = set()

    def check_model_name(model: str | None) -> None:
        if model is not None and model != model_name:
            raise InvalidRequestError(f"model {model!r} is not served here; use {model_name!r} "
                                      "(see GET /v1/models)", param="model", code="model_not_found")

    def check_model(body: SamplingFields) -> None:
        check_model_name(body.model)
        body.check_supported()
        # once per set of names (a client sends the same each time), and at most MAX_IGNORED_SETS sets
        ignored = body.ignored_fields
        if ignored and ignored not in logged_ignored and len(logged_ignored) < MAX_IGNORED_SETS:
            logged_ignored.add(ignored)
            log.warning("ignored request fields qkiln does not read: %s (logged once for this set)", ", ".join(ignored))

    # max_model_len: what one request (prompt and output) can reach, which a KV pool smaller than
    # the context bounds (clients size requests from it)
    card = {"id": model_name, "object": "model", "created": started, "owned_by": "qkiln",
            "max_model_len": engine.max_request_len}
    if engine.artifact:  # which build answers: a deploy checks its rollout by the manifest's digest
        card["artifact"] = engine.artifact

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [card]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise _HTTPError(404, f"model {model_id!r} is not served here; {model_name!r} is (see GET /v1/models)",
                             code="model_not_found", param="model")
        return card

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        choices = await _completion_choices(engine, body, f"cmpl-{request.state.request_id}", model_name, defaults)
        return await _respond(engine, metrics, request, choices, body.stream)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        choices = await _chat_choices(engine, body, f"chatcmpl-{request.state.request_id}", model_name, defaults)
        return await _respond(engine, metrics, request, choices, body.stream)

    app.include_router(v1)

    # vLLM's tokenizer endpoints: token counts for clients without the model's tokenizer; a text
    # longer than the context is counted too (the response's max_model_len is the limit)
    @app.post("/tokenize")
    async def tokenize(payload: dict[str, Any]):
        body = _parse(TokenizeChatRequest if "messages" in payload else TokenizeCompletionRequest, payload)
        check_model_name(body.model)
        if isinstance(body, TokenizeChatRequest):
            body.check_chat_prompt()
            ids = await chat_prompt_ids(engine, body, body.add_special_tokens, check_length=False)
        else:
            ids = await encode_text(engine, body.prompt, "prompt", body.add_special_tokens, check_length=False)

        def reply() -> bytes:  # off the event loop: a 1 MB text's reply held every other client for seconds
            strs = [engine.tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None
            return json.dumps({"count": len(ids), "max_model_len": engine.max_request_len, "tokens": ids,
                               "token_strs": strs}, ensure_ascii=False, separators=(",", ":")).encode()

        return Response(await asyncio.to_thread(reply), media_type="application/json")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return engine.tokenizer.info() | {"model_max_length": engine.max_request_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model_name(body.model)
        check_token_ids(engine, body.tokens, "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse(error_body("the engine is not running", type="server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/ping")  # vLLM's names for the same probe (SageMaker's is POST), so its deploy files work
    @app.post("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("qkiln")}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


async def _completion_choices(engine: AsyncLLMEngine, body: CompletionRequest, request_id: str, model_name: str,
                              defaults: dict) -> list["_Choice"]:
    """A completion request's engine requests: prompt i's choice j is choice i * n + j, as OpenAI
    orders them."""
    batch, choices = body.prompts(), []
    keep = kept_prompt_tokens(engine, body.truncate_prompt_tokens)
    for i, prompt in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt.{i}"
        if isinstance(prompt, list):
            check_token_ids(engine, prompt, where)  # before echo decodes them (-1 had been a 500)
            ids = last_tokens(prompt, keep)
        else:
            ids = await encode_text(engine, prompt, where, body.add_special_tokens, keep_last=keep)
        # max_tokens 0 (echo only): the engine samples one token, which is not returned and
        # needs no room, so the prompt may fill the context (lm-eval's rolling windows do)
        max_tokens = _completion_budget(*body.requested_max_tokens(defaults), len(ids), engine, where) \
            if body.generates else 1
        # with echo, logprobs covers the prompt's tokens too
        params = body.sampling_params(max_tokens, body.logprobs, body.logprobs if body.echo else None, defaults)
        echo = None
        if body.echo:  # the prompt's text as sent, or its ids' text (also when truncation may have cut it)
            text = prompt if isinstance(prompt, str) and (keep is None or len(ids) < keep) else \
                engine.tokenizer.decode(ids, skip_special_tokens=False)
            echo = (text, ids)
        for j, sp in enumerate(params):
            builder = CompletionResponse(request_id, model_name, engine.tokenizer, body.include_usage,
                                         index=i * body.n + j, counts_prompt=j == 0, echo=echo,
                                         logprobs=body.logprobs, generates=body.generates,
                                         prompt_logprobs=body.prompt_logprobs,
                                         skip_special_tokens=sp.skip_special_tokens)
            choices.append(_Choice(ids, sp, builder, i if len(batch) > 1 else None))
    return choices


async def _chat_choices(engine: AsyncLLMEngine, body: ChatCompletionRequest, request_id: str, model_name: str,
                        defaults: dict) -> list["_Choice"]:
    """A chat request's n engine requests over its one templated prompt."""
    keep = kept_prompt_tokens(engine, body.truncate_prompt_tokens)
    prompt_ids = await chat_prompt_ids(engine, body, body.add_special_tokens, keep_last=keep)
    max_tokens = _completion_budget(*body.requested_max_tokens(defaults), len(prompt_ids), engine, "messages")
    choices = []
    for j, sp in enumerate(body.sampling_params(max_tokens, body.num_logprobs, defaults=defaults)):
        builder = ChatResponse(request_id, model_name, engine.tokenizer, body.include_usage, index=j,
                               counts_prompt=j == 0,  # one prompt_logprobs beside the choices: the first's
                               prompt_logprobs=body.prompt_logprobs if j == 0 else None)
        choices.append(_Choice(prompt_ids, sp, builder))
    return choices


def _parse(model: type[BaseModel], payload: dict):
    """`payload` as `model`, or the 400 FastAPI gives a body that does not fit its declared model."""
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def _completion_budget(requested: int | None, field: str | None, prompt_len: int, engine: AsyncLLMEngine,
                       what: str) -> int:
    """The tokens a completion may generate: what was asked, or (null) the rest of the context, or
    of what the KV cache holds when that is less. A max_tokens the request set that cannot fit is
    refused, as OpenAI's and vLLM's servers do, rather than cut short; a default one is cut to fit."""
    limit, holder = engine.max_request_len, request_limit(engine)
    room, takes = limit - prompt_len, "takes" if what.startswith("prompt") else "take"
    score_alone = "; max_tokens: 0 with echo scores it alone" if what.startswith("prompt") else ""
    if room == 0 and prompt_len and requested is not None and field is not None:  # the field asked for room
        raise InvalidRequestError(f"{field} {requested} does not fit: the {what} {takes} all {prompt_len} tokens of "
                                  f"the {holder}; shorten the {what} (truncate_prompt_tokens below {limit} keeps its "
                                  f"last tokens){score_alone}", param=field)
    if room < 1 and prompt_len:
        raise InvalidRequestError(f"the {what} {takes} {prompt_len} tokens but the {holder} cannot hold more; "
                                  f"shorten it (truncate_prompt_tokens below {limit} keeps its last tokens)"
                                  f"{score_alone}", param=what)
    if requested is None or (field is None and requested > room):
        return max(room, 1)  # an empty prompt is refused by the engine, with its own message
    if requested > room:
        raise InvalidRequestError(f"{field} {requested} does not fit: the {what} {takes} {prompt_len} of the "
                                  f"{holder}, leaving {room}; lower {field}", param=field)
    return requested


@dataclass
class _Choice:
    """One choice of an HTTP request: an engine request (its prompt ids, SamplingParams), the
    builder that writes it, and the index of its prompt in a completion batch (None: not a batch)."""
    prompt_ids: list[int]
    params: SamplingParams
    builder: ResponseBuilder
    prompt_index: int | None = None


async def _respond(engine: AsyncLLMEngine, metrics: ServerMetrics, request: Request, choices: list[_Choice],
                   is_stream: bool):
    """Run one request's choices (a completion batch's prompts, n per prompt) and answer with them all."""
    # Admission first, so a prompt the engine refuses is a 400 before any byte of a stream is sent;
    # and what no server state can change before capacity, so it is not a 429 to retry.
    for c in choices:
        check_sampling_token_ids(c.params, engine.vocab_size)
    _check_capacity(engine, metrics, len(choices), request.app.state.max_concurrent_requests)
    streams = await _admit(engine, choices, request.state.arrival)
    builders = [c.builder for c in choices]
    if is_stream:
        return StreamingResponse(_sse(engine, metrics, streams, builders), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_abort_on_disconnect(engine, request, streams))
    try:
        results = await asyncio.gather(*(_collect(stream, metrics) for stream in streams))
    finally:
        watcher.cancel()
        _abort_unfinished(engine, streams)
    _share_prompt_logprobs(choices, results)
    return batch_response([b.response(outputs) for b, outputs in zip(builders, results)])


def _share_prompt_logprobs(choices: list[_Choice], results: list[list[RequestOutput]]) -> None:
    """A prompt's later choices take its prompt logprobs from its first, the one choice that
    computed them (SamplingParams.choices)."""
    first = None
    for choice, outputs in zip(choices, results):
        if choice.builder.counts_prompt:
            first = outputs[0]
        elif first.prompt_logprobs is not None and outputs[0].prompt_logprobs is None:
            outputs[0] = replace(outputs[0], prompt_logprobs=first.prompt_logprobs)


def _check_capacity(engine: AsyncLLMEngine, metrics: ServerMetrics, num_choices: int, capacity: int) -> None:
    """At most `capacity` engine requests are open at once (a choice is one). Past it a request is
    a 429 the client may retry (OpenAI's clients do, after Retry-After), refused before anything
    is queued, so a burst cannot grow the queue, and the memory it holds, without bound."""
    if num_choices > capacity:
        raise InvalidRequestError(f"this request makes {num_choices} completions (prompts x n), more than the "
                                  f"{capacity} this server runs at once (serve --max-concurrent-requests); split it",
                                  param="n")
    if engine.num_open_requests + num_choices > capacity:
        metrics.refused_busy.inc()
        raise _HTTPError(429, f"the server is at its limit of {capacity} requests in flight; retry shortly",
                         code="server_busy", type="server_busy", headers={"Retry-After": "1"})


async def _admit(engine: AsyncLLMEngine, choices: list[_Choice], arrival_time: float) -> list[RequestStream]:
    """Every choice admitted (at once: one engine round trip, not one per choice), or none: a
    refused one aborts the others and is a 400 naming its prompt's place in the batch.
    Everything up to the first await is synchronous, so a capacity check just before holds."""

    unique = uuid.uuid4().hex[:12]  # a caller's x-request-id names the response, and two may share one

    def engine_id(i):
        return f"{choices[i].builder.request_id}-{i}-{unique}"

    streams: list[RequestStream] = []
    try:
        for i, c in enumerate(choices):
            streams.append(engine.submit(c.prompt_ids, c.params, engine_id(i), arrival_time))
        admitted = await asyncio.gather(*(s.accepted for s in streams), return_exceptions=True)
    except BaseException:  # a bad parameter, the engine stopped, or the client went away
        _abort_unfinished(engine, streams)
        raise
    for choice, result in zip(choices, admitted):
        if isinstance(result, BaseException):
            _abort_unfinished(engine, streams)
            k = choice.prompt_index
            if isinstance(result, RequestError) and k is not None:
                param = getattr(result, "param", None)
                param = f"prompt.{k}" if param in (None, "prompt") else param
                raise InvalidRequestError(f"prompt {k}: {result}", param)
            raise result
    return streams


async def _collect(stream: RequestStream, metrics: ServerMetrics) -> list[RequestOutput]:
    """The stream's first output (its prompt logprobs) and its last (the whole text), which carries
    the logprob entries of every output after the first. Each output holds the token ids and text
    so far: keeping them all took memory quadratic in the length (16 requests of 4000 tokens:
    +820 MiB that stayed)."""
    first = last = None
    later_logprobs = []
    async for out in stream:
        metrics.observe(out)  # as they come: a choice's first token counts though its client leaves
        if first is None:
            first = out
        else:
            later_logprobs += out.logprobs
            last = out
    return [first] if last is None else [first, replace(last, logprobs=later_logprobs)]


def _abort_unfinished(engine: AsyncLLMEngine, streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.finished:
            engine.abort(stream.request_id)


async def _merged(streams: list[RequestStream]):
    """(index, output) from all streams as they come; an engine error ends it by raising."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream):
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except QkilnError as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _sse(engine: AsyncLLMEngine, metrics: ServerMetrics, streams: list[RequestStream],
               builders: list[ResponseBuilder]):
    """`data: {json}\\n\\n` per chunk, then `data: [DONE]`. Cancelled on disconnect: then abort."""
    try:
        for builder in builders:  # a chat choice opens with its role
            for chunk in builder.start_chunks():
                yield _event(chunk)
        finals = [None] * len(streams)
        async for index, out in _merged(streams):
            # before the write, which a client leaving cancels: its first token and gaps count still
            metrics.observe(out)
            chunk = builders[index].chunk(out)
            if chunk is not None:
                yield _event(chunk)
            finals[index] = out
        if builders[0].include_usage:
            yield _event(usage_chunk(builders, finals))
    except QkilnError as e:  # the engine failed mid-stream: headers are sent, so report it in-band
        yield _event(error_body(str(e), type="server_error"))
    finally:
        _abort_unfinished(engine, streams)
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _abort_on_disconnect(engine: AsyncLLMEngine, request: Request, streams: list[RequestStream]) -> None:
    """For non-streaming requests: the body is read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    _abort_unfinished(engine, streams)


def check_allowed_origins(origins: list[str] | None) -> None:
    """Each as a browser's Origin header spells it (scheme://host[:port]) or '*': "app.example" or
    "https://app.example/" matches no request, and the browser's preflight got a 400."""
    for origin in origins or ():
        if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
            raise QkilnError(f"allowed origin {origin!r} is not an origin as browsers send it: give "
                             "scheme://host[:port] (e.g. https://app.example, no path or trailing '/'), or '*'")


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.param, self.type, self.headers = status, code, param, type, headers or {}


def _install_error_handlers(app: FastAPI) -> None:
    def reply(status: int, message: str, param=None, code=None, type="invalid_request_error"):
        if status == 400:
            app.state.metrics.refused_invalid.inc()
        return JSONResponse(error_body(message, param, code, type), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
        if errors[0].get("type") == "json_invalid":
            detail = errors[0].get("ctx", {}).get("error", errors[0]["msg"])
            return reply(400, f"the body is not valid JSON ({detail}); send a JSON object", code="invalid_json")
        content_type = request.headers.get("content-type", "")
        if tuple(errors[0].get("loc", ())) == ("body",) and "json" not in content_type:
            return reply(400, f"the body was sent as {content_type or 'no content type'}; send JSON with "
                              "'content-type: application/json'", code="invalid_json")
        param = _param(errors[0].get("loc", ()))
        # A union field (prompt: str | list[int]) fails once per alternative: name them all.
        messages = dict.fromkeys(e["msg"] for e in errors if _param(e.get("loc", ())) == param)
        return reply(400, f"{param or 'body'}: {' or '.join(messages)}", param=param)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError):
        return reply(400, str(exc), getattr(exc, "param", None), getattr(exc, "code", None))

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError):
        return reply(503 if not request.app.state.engine.is_running else 500, str(exc), type="server_error")

    @app.exception_handler(_HTTPError)
    async def http_error(request: Request, exc: _HTTPError):
        response = reply(exc.status, str(exc), exc.param, exc.code, exc.type)
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, exc: StarletteHTTPException):
        detail, code = str(exc.detail), None
        if isinstance(exc.__cause__, ClientDisconnect):  # the client left mid-upload: nothing was refused, and
            return Response(status_code=400)  # nobody reads this (FastAPI's 400 had counted as invalid)
        if exc.status_code == 404:  # no such route (/v1/responses, /v1/embeddings, ...): say which there are
            detail = f"{request.url.path} is not served here; qkiln serves {', '.join(_ROUTES)}"
        elif exc.status_code == 400 and isinstance(exc.__cause__, Exception):  # FastAPI's "error parsing the body"
            detail, code = _unparsable_body(exc.__cause__), "invalid_json"
        response = reply(exc.status_code, detail, code=code)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response


def _unparsable_body(cause: Exception) -> str:
    """Why a body that is not a JSON decoding error could not be read as JSON, and what to send."""
    if isinstance(cause, UnicodeDecodeError):
        why = f"is not UTF-8 (byte {cause.start}); send JSON encoded as UTF-8"
    elif isinstance(cause, RecursionError):
        why = "nests too deeply; send a flatter JSON object"
    elif isinstance(cause, ValueError) and "digits" in str(cause):
        why = f"holds an integer too long to read ({cause}); send shorter numbers"
    else:
        why = f"cannot be read as JSON ({type(cause).__name__}: {cause}); send a JSON object"
    return f"the body {why}"


_UNION_TAGS = {"str", "int", "float", "bool", "none"}
_ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /tokenize",
           "POST /detokenize", "GET /tokenizer_info", "GET /health", "GET /ping", "GET /version", "GET /metrics")


def _param(loc) -> str | None:
    """`('body', 'prompt', 'list[int]', 0)` -> `prompt.0`: drop the body prefix and pydantic's union tags."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or (p.isidentifier() and p not in _UNION_TAGS)]
    return ".".join(parts) or None


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
EXIT_PORT_TAKEN = 2  # the README's exit statuses: a usage problem
EXIT_ENGINE_DIED = 1  # a bug, with its traceback


def serve(engine: AsyncLLMEngine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, log_level: str = "info", shutdown_timeout: float = 5.0,
          allowed_origins: list[str] | None = None, max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS,
          on_listening: Callable[[int], None] | None = None, access_log: bool = True) -> None:
    """Run the server in this thread until interrupted; loopback unless `host` says otherwise.
    `on_listening(port)` is called once it accepts connections, with the port it bound (port 0:
    the one the system picked). log_level: uvicorn's and qkiln's loggers (LOG_LEVELS); access_log
    False drops uvicorn's line per HTTP request (a kubelet's probes alone write thousands a day).

    SIGTERM (docker stop, systemd) ends it like Ctrl-C: uvicorn stops accepting, requests in flight
    get `shutdown_timeout` seconds to finish, then the engine stops and the rest end with a 503 (a
    stream: an in-band error event), then uvicorn re-raises the signal it caught, which here
    becomes SystemExit(0), so the caller's cleanup runs (an archive's unpacked folder is deleted)
    instead of the process dying on the default handler. Without the bound, a generation thousands
    of tokens long held the exit past docker's 10 s, and SIGKILL skipped the cleanup. SIGHUP (the
    shell that started it closed, systemctl reload) does the same, as does a second SIGTERM without
    the wait. If the engine dies, every request would get a 503 from then on: the server exits with
    status 1, so that systemd or the kubelet restarts it, as vLLM's does. A port another process
    took while the model loaded exits with status 2 and a line saying so."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    # uvicorn's own bound is a backstop: by then every handler has had its EngineError
    app = create_app(engine, model_name, api_key, allowed_origins, max_concurrent_requests)
    config = _uvicorn_config(app, host, port, log_level, timeout_graceful_shutdown=shutdown_timeout + 5,
                             access_log=access_log)
    server = _DrainingServer(config, engine, shutdown_timeout, on_listening)
    previous = {}
    if on_main_thread:
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _exit_cleanly)
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda sig, frame: server.handle_exit(signal.SIGTERM,
                                                                                                     frame))
    try:
        try:
            server.run()
        except SystemExit:  # uvicorn's own exit when it cannot bind (status 3: a source model's here)
            if server.started:
                raise
        if server.engine_died:
            raise SystemExit(EXIT_ENGINE_DIED)
        if not server.started:  # uvicorn has logged why
            print(f"error: cannot listen on {host}:{port} (uvicorn's line above says why; another process may have "
                  "taken the port while the model loaded); free it or pick another --port", file=sys.stderr)
            raise SystemExit(EXIT_PORT_TAKEN)
    finally:
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str, timeout_graceful_shutdown: float,
                    read_timeout: float = REQUEST_READ_TIMEOUT_S, access_log: bool = True) -> uvicorn.Config:
    """h11 with a deadline on reading each request (http_guard.py), whatever else is installed; every
    log line on stderr (uvicorn's access log went to stdout, alone), qkiln's through uvicorn's
    formatter ("WARNING:  ..."; they had no handler, so Python printed them bare)."""
    if log_level not in LOG_LEVELS:
        raise QkilnError(f"log level {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    log_config["loggers"]["qkiln"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    # request lines exist only with --enable-log-requests: a quieter --log-level (vLLM's quiet-uvicorn
    # deploys) had dropped the audit trail asked for
    log_config["loggers"]["qkiln.requests"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=GuardedH11Protocol.with_timeout(read_timeout), timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=timeout_graceful_shutdown,
                          log_config=log_config, access_log=access_log)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


class _DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown stops the engine `grace` seconds in, so requests still in flight end
    with the engine's EngineError, which their handlers answer (503, or an error event in a
    stream), rather than being cancelled by uvicorn into bare 500s with tracebacks."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace: float,
                 on_listening: Callable[[int], None] | None = None):
        super().__init__(config)
        self.engine, self.grace, self.on_listening = engine, grace, on_listening
        self._stopping_engine = False
        self.engine_died = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGTERM:  # uvicorn forces only on a second Ctrl-C
            self.force_exit = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if not self.engine.is_running and not self._stopping_engine and not self.should_exit:
            log.critical("the engine is not running (its traceback is above): the server exits so that it is "
                         "restarted")
            self.engine_died = True
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            self.on_listening(self.servers[0].sockets[0].getsockname()[1])

    async def shutdown(self, sockets=None) -> None:
        stop = asyncio.get_running_loop().call_later(self.grace, self._stop_engine)
        try:
            await super().shutdown(sockets)
        finally:
            stop.cancel()
        if self.server_state.tasks:
            # A second Ctrl-C (uvicorn's force exit) cut the wait short, and the requests still open
            # would be cancelled as the loop closes: bare 500s, streams cut without an error event,
            # a traceback each. The engine stops now instead, so their handlers answer as above.
            self._stop_engine()
            await asyncio.wait(list(self.server_state.tasks), timeout=FORCED_EXIT_ANSWER_S)
        if self.force_exit:  # uvicorn skips the app's shutdown then, and its task died with a traceback
            await self.lifespan.shutdown()

    def _stop_engine(self) -> None:
        # engine.shutdown joins the engine thread: off the event loop, which must keep serving
        if not self._stopping_engine:
            self._stopping_engine = True
            threading.Thread(target=self.engine.shutdown, name="qkiln-stop", daemon=True).start()


class BackgroundServer:
    """uvicorn in a daemon thread on a free loopback port (tests, benchmarks): `.url`, `.stop()`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 read_timeout: float = REQUEST_READ_TIMEOUT_S):
        self.server = uvicorn.Server(_uvicorn_config(app, host, port, log_level, 5, read_timeout))
        self.thread = threading.Thread(target=self.server.run, name="qkiln-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
            time.sleep(0.01)
        self.host = host
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
