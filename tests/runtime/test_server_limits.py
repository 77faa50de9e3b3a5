"""What bounds a server's resources, for real over loopback sockets: at most
max_concurrent_requests requests in flight (the rest get a 429 to retry), and a deadline on
reading each request, so connections that never finish sending do not pile up."""

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from qkiln.runtime.async_engine import AsyncLLMEngine
from qkiln.runtime.server import BackgroundServer, create_app
from tiny_models import write_tiny_hf_model

READ_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    engine = AsyncLLMEngine.from_model(str(model_dir), dtype="fp32", name="tiny", num_kv_blocks=64,
                                       max_model_len=128, max_num_seqs=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    server = BackgroundServer(create_app(engine, "tiny", max_concurrent_requests=3), read_timeout=READ_TIMEOUT)
    yield server
    server.stop()


def body(**kw):
    return {"model": "tiny", "prompt": "count with me", "max_tokens": 4, "temperature": 0, "ignore_eos": True} | kw


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_requests_past_the_limit_get_429_and_go_through_once_there_is_room(server, engine):
    gate = threading.Event()
    blocked = engine.call(lambda e: gate.wait(30))  # the engine admits nothing until the gate opens
    with httpx.Client(base_url=server.url, timeout=60) as client, ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.post, "/v1/completions", json=body(n=2))
        wait_for(lambda: engine.num_open_requests == 2)
        busy = client.post("/v1/completions", json=body(n=2))  # 2 + 2 > 3
        assert busy.status_code == 429
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "server_busy"
        fits = pool.submit(client.post, "/v1/chat/completions",
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        wait_for(lambda: engine.num_open_requests == 3)
        assert client.post("/v1/completions", json=body()).status_code == 429  # chat counts too
        too_big = client.post("/v1/completions", json=body(n=4))  # could never fit: not worth a retry
        assert too_big.status_code == 400 and "--max-concurrent-requests" in too_big.json()["error"]["message"]
        for field, value in (("logit_bias", {"999999": 5}), ("stop_token_ids", [999999]),
                             ("allowed_token_ids", [1, 999999])):  # invalid whatever the load: a 400, not a 429
            invalid = client.post("/v1/completions", json=body(**{field: value}))
            assert invalid.status_code == 400 and invalid.json()["error"]["param"] == field, invalid.text
        assert client.get("/health").status_code == 200  # busy is not down
        gate.set()
        blocked.result(30)
        assert first.result(30).status_code == 200 and len(first.result().json()["choices"]) == 2
        assert fits.result(30).status_code == 200
        wait_for(lambda: engine.num_open_requests == 0)
        assert client.post("/v1/completions", json=body(n=2)).status_code == 200  # the retry goes through
        metrics = client.get("/metrics").text
        assert 'qkiln_request_refused_busy_total{model_name="tiny"} 2.0' in metrics


def test_streams_refused_and_aborted_give_their_slots_back(server, engine):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body(max_tokens=100, stream=True)) as r:
            next(r.iter_lines())  # leaving mid-stream aborts the request
        refused = client.post("/v1/completions", json=body(prompt=[], echo=True, max_tokens=0))
        assert refused.status_code == 400  # the engine refuses an empty prompt at admission
    wait_for(lambda: engine.num_open_requests == 0)


def raw_connection(server) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_connection_that_sends_nothing_is_closed(server):
    with raw_connection(server) as sock:
        start = time.monotonic()
        assert read_until_closed(sock) == b""
        assert READ_TIMEOUT * 0.8 < time.monotonic() - start < READ_TIMEOUT + 5


def test_headers_that_never_end_get_408(server):
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(READ_TIMEOUT / 2)
        sock.sendall(b"Content-Type: application/json\r\n")  # a byte now and then does not extend the deadline
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")


def test_a_body_that_stops_halfway_closes_the_connection_and_the_server_keeps_serving(server, engine):
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"model\": \"tiny\", ")
        assert read_until_closed(sock) == b""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/completions", json=body()).status_code == 200
    wait_for(lambda: engine.num_open_requests == 0)


def test_a_client_that_leaves_mid_upload_is_not_counted_as_an_invalid_request(server):
    def refused_invalid() -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("qkiln_request_refused_invalid_total")))

    before = refused_invalid()
    for _ in range(3):
        with raw_connection(server) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 200\r\n\r\n{\"model\": ")
        time.sleep(0.3)  # closed: the server reads the rest of the body and finds the client gone
    assert refused_invalid() == before  # an alert on refused requests fired on flaky networks


def test_a_response_slower_than_the_deadline_is_not_cut_and_the_connection_is_reused(server, engine):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        gate = threading.Event()
        blocked = engine.call(lambda e: gate.wait(30))
        timer = threading.Timer(READ_TIMEOUT * 3, gate.set)  # the answer takes 3 deadlines
        timer.start()
        start = time.monotonic()
        reply = client.post("/v1/completions", json=body())
        assert reply.status_code == 200 and time.monotonic() - start > READ_TIMEOUT * 2
        blocked.result(30)
        time.sleep(READ_TIMEOUT * 0.6)  # idle between requests: keep-alive's, not the read deadline's
        again = client.post("/v1/completions", json=body())
        assert again.status_code == 200


def test_pipelined_slow_second_request_is_held_to_the_deadline(server):
    with raw_connection(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in reply
    with raw_connection(server) as sock:  # its headers whole, its body cut short: parsed with the first
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nPOST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"model\": ")
        start = time.monotonic()
        reply = read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 200 ") and time.monotonic() - start < READ_TIMEOUT + 5
