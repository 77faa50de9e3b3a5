"""The server's ASGI middlewares: the API key, `x-request-id` (and the last-resort answer to a
bug), and the body size limit. Plain ASGI rather than FastAPI dependencies, so each acts before
a body is read and on every response, refusals included."""

import logging
import secrets
import time
import uuid

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from .openai_protocol import error_body

log = logging.getLogger("qkiln.server")

REQUEST_ID_HEADER = "x-request-id"


_TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class ApiKeyMiddleware:
    """`/v1/*` and the tokenizer endpoints need `Authorization: Bearer KEY` (vLLM leaves the latter
    open; they run the tokenizer on a caller's text). A plain ASGI middleware, so a request without the
    key is answered 401 before its body is read (a route dependency ran after body parsing, so a
    malformed body got a 400 that told a caller without the key about the API)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        guarded = scope["type"] == "http" and (path.startswith("/v1/") or path in _TOKENIZER_PATHS)
        if guarded and not self._authorized(scope):
            body = error_body("missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
            return await JSONResponse(body, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode("latin-1"), self.key)


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the caller's own (a gateway's trace id, as vLLM and
    OpenAI's clients send it) when it is printable ASCII up to 256 characters, else a fresh one.
    Completion ids are built from it (`cmpl-<id>`), so a response and a client's trace name the
    same request. A bug that escapes every handler is answered here too, as OpenAI's JSON error
    naming the id, and logged with its traceback under that id: Starlette's own last-resort answer
    is plain text, outside this layer, so it carried neither, and uvicorn then closed the
    connection, which a client's next request on it met as a reset."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"")
        request_id = given.decode() if 0 < len(given) <= 256 and all(0x21 <= c <= 0x7e for c in given) \
            else uuid.uuid4().hex
        # arrival: when the headers came in, from which the engine counts the request's latencies:
        # the body's upload, tokenization and the wait for the step in progress included (vLLM's
        # arrival is stamped after tokenization; the wait is in its latencies too)
        scope.setdefault("state", {}).update(request_id=request_id, arrival=time.time())

        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if started:  # a response already begun cannot be replaced: uvicorn logs it and drops the connection
                raise
            log.exception("request %s failed (a bug)", request_id)
            body = error_body(f"the server failed on this request (a bug, logged with request id {request_id}); "
                              "retrying may not help, report it", type="server_error")
            await JSONResponse(body, status_code=500)(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """A body past `max_bytes` is refused with a 413: by its Content-Length before it is read, or,
    sent without one, once that much has arrived (a 100 MB body was parsed whole, +0.9 GB)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes
        self.message = (f"the body is larger than {max_bytes >> 20} MiB, more than any request this server "
                        "takes needs; send less")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = error_body(self.message, code="request_too_large")
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # FastAPI passes an HTTPException from reading the body on
                raise HTTPException(413, self.message)
            return message

        await self.app(scope, counted, send)
