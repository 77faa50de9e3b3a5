"""`qkiln serve` as a real process on a free loopback port, for tests of what its signals, exit
statuses and log lines do."""

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def cli(args, tmpdir, **kw) -> subprocess.Popen:
    """`python -m qkiln ARGS` with its temporary files under `tmpdir`; stdout and stderr piped."""
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    return subprocess.Popen([sys.executable, "-m", "qkiln", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(path, tmpdir, *args) -> tuple[subprocess.Popen, int]:
    """`qkiln serve PATH ARGS` on a free port, once /health answers: (process, port)."""
    port = free_port()
    server = cli(["serve", str(path), "--port", str(port), *args], tmpdir)
    deadline = time.monotonic() + 120
    while not healthy(port):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(server.stderr.read())
        time.sleep(0.2)
    return server, port


def healthy(port: int) -> bool:
    """Whether a server on this loopback port answers GET /health with 200."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def killed_on_exit(server: subprocess.Popen):
    """The process is killed when the block ends, if it is still running (a failed assertion must
    not leave a server behind)."""
    try:
        yield server
    finally:
        if server.poll() is None:
            server.kill()
