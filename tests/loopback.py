"""A real qkiln server on a loopback port for tests: the engine's app under uvicorn in a thread."""

from contextlib import contextmanager

from qkiln.runtime.async_engine import AsyncLLMEngine
from qkiln.runtime.server import BackgroundServer, create_app


@contextmanager
def serving_app(engine: AsyncLLMEngine, name: str | None = "tiny", **app_kw):
    """`engine` behind a server (create_app's options, e.g. api_key); it stops on exit, the engine does not."""
    server = BackgroundServer(create_app(engine, name, **app_kw))
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def serving_model(model_dir, **engine_kw):
    """A model directory's engine (AsyncLLMEngine.from_model's options) behind a server, served as
    "tiny": (engine, server); both stop on exit."""
    engine = AsyncLLMEngine.from_model(str(model_dir), name="tiny", **engine_kw)
    try:
        with serving_app(engine) as server:
            yield engine, server
    finally:
        engine.shutdown()


@contextmanager
def serving_client(model_dir, **engine_kw):
    """An httpx client of a model directory served as "tiny" (serving_model's options)."""
    import httpx

    with serving_model(model_dir, **engine_kw) as (_, server), httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
