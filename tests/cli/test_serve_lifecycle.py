"""`qkiln serve` as an orchestrator runs it: SIGHUP and a second SIGTERM, a dead engine, a port
taken while the model loads, and the log an operator reads (levels, access lines, request lines)."""

import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from qkiln.runtime.async_engine import AsyncLLMEngine
from qkiln.runtime.server import serve
from serve_process import free_port, healthy, killed_on_exit, serve_process
from tiny_models import write_tiny_hf_model

LONG = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle")
    model = write_tiny_hf_model(root / "model", "llama")
    return build(str(model), preset("w4a16-rtn"), root / "tiny-w4", progress=False, log=lambda m: None,
                 use_cache=False).path


def _stream(url):
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG | {"stream": True}, timeout=60) as r:
        return [line for line in r.iter_lines() if line]


def test_sighup_drains_as_sigterm_does(artifact, tmp_path):
    """SIGHUP (the shell that started it closed, systemctl reload) killed the server at once: a
    stream cut without an error event, an archive's unpacked copy left in /tmp."""
    server, port = serve_process(artifact, tmp_path, "--shutdown-timeout", "0.5")
    with killed_on_exit(server):
        stream = ThreadPoolExecutor(1).submit(_stream, f"http://127.0.0.1:{port}")
        time.sleep(0.5)
        server.send_signal(signal.SIGHUP)
        assert server.wait(timeout=60) == 0
        lines = stream.result()
        assert lines[-1] == "data: [DONE]", lines[-3:]


def test_a_second_sigterm_cuts_the_drain_short(artifact, tmp_path):
    """Only a second Ctrl-C forced the exit: a second `kill` waited out the whole grace period."""
    server, port = serve_process(artifact, tmp_path, "--shutdown-timeout", "60")
    url = f"http://127.0.0.1:{port}"
    with killed_on_exit(server):
        pool = ThreadPoolExecutor(2)
        plain = [pool.submit(httpx.post, f"{url}/v1/completions", json=LONG | {"n": 8}, timeout=60) for _ in range(2)]
        time.sleep(1.0)
        server.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 10
        for r in plain:
            r = r.result()
            assert r.status_code == 503 and "shut down" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("quiet", [(), ("--uvicorn-log-level", "warning")])  # quiet: the request lines had gone too
def test_request_lines_and_no_access_lines_when_asked(artifact, tmp_path, quiet):
    server, port = serve_process(artifact, tmp_path, "--disable-uvicorn-access-log", "--enable-log-requests", *quiet)
    with killed_on_exit(server):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                       headers={"x-request-id": "trace-abc-123"}, timeout=60)
        assert r.status_code == 200, r.text
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        log = server.stderr.read()
    mine = [line for line in log.splitlines() if "trace-abc-123" in line]
    assert len(mine) == 2 and "received:" in mine[0] and "finished (length)" in mine[1], log
    assert mine[1].startswith("INFO:") and "3 generated" in mine[1] and "first token" in mine[1], mine
    assert '"GET /health' not in log and '"POST /v1/completions' not in log, log  # the probes' and the request's


def test_without_its_engine_the_server_exits_with_status_1(artifact, capfd):
    """The engine thread died and the server went on answering /v1/models 200 and every request
    503, exiting 0 on SIGTERM: only a liveness probe on /health restarted it."""
    engine = AsyncLLMEngine.from_model(str(artifact), num_kv_blocks=16, max_model_len=64)
    port, exited = free_port(), []

    def run():
        try:
            serve(engine, port=port, shutdown_timeout=0.5)
        except SystemExit as e:
            exited.append(e.code)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not healthy(port) and time.monotonic() < deadline:
        time.sleep(0.05)

    def broken_publish():  # a bug in the engine loop itself (not in a step, which only fails its requests)
        raise RuntimeError("injected engine loop failure")

    engine._publish = broken_publish
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code in (500, 503), r.text
    thread.join(30)
    assert exited == [1]
    err = capfd.readouterr().err
    assert err.count("injected engine loop failure") == 2, err  # the traceback once: the error and its line
    assert "the server exits so that it is restarted" in err


def test_a_port_taken_while_the_model_loaded_is_exit_status_2(artifact, capfd):
    """The CLI checks the port before loading; another process taking it meanwhile exited 3 (a
    source model's status) with only uvicorn's line."""
    engine = AsyncLLMEngine.from_model(str(artifact), num_kv_blocks=16, max_model_len=64)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(SystemExit) as e:
            serve(engine, port=taken.getsockname()[1])
    assert e.value.code == 2
    assert "error: cannot listen on 127.0.0.1" in capfd.readouterr().err
