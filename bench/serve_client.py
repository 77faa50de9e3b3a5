"""The client side of `qkiln bench serve`: one streamed request, a load of them, the server process.

Owns `RequestResult` (what one request saw), `send_completion` (POST /v1/completions with
`stream: true`, timestamping every server-sent-events chunk that carries a choice, as vLLM's
benchmark_serving does), `run_load` (Poisson or all-at-once arrivals under a concurrency cap)
and `ServerProcess` (`python -m qkiln serve` on a free loopback port, stopped on close; its log
is kept, and its tail shown, only when it fails to start). `QKILN_API_KEY`, when set, is sent as
the bearer token.
A failed request is recorded with its error, never raised: the benchmark counts it as failed.
Metric definitions live in serve.py. httpx is imported inside functions.
"""

import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .report import log
from .workload import BenchConfigError, Workload


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $QKILN_API_KEY` when set (the key `qkiln serve` reads from the same variable)."""
    key = os.environ.get("QKILN_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class RequestResult:
    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def send_completion(client, url: str, payload: dict, prompt_len: int) -> RequestResult:
    """One streamed completion; timestamps every chunk that carries a choice (vLLM's rule)."""
    result = RequestResult(False, prompt_len)
    num_chunks, usage_tokens = 0, None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            async for line in resp.aiter_lines():
                data = line.strip().removeprefix("data:").strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last, num_chunks = now, num_chunks + 1
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    # the server's count: a text prompt re-tokenizes to other than its intended length
                    result.prompt_len = chunk["usage"].get("prompt_tokens", result.prompt_len)
    except Exception as e:  # one failed request is a data point ("failed"), not the end of the run
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2el_s = last - start
    result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
    result.success = num_chunks > 0
    result.error = "" if result.success else "no streamed tokens"
    return result


async def run_load(base_url: str, model_name: str, workload: Workload, concurrency: int | None,
                   request_rate: float, seed: int, prompts: list) -> tuple[list[RequestResult], float]:
    """Send every request of `workload` (Poisson gaps at `request_rate`, at most `concurrency` in flight)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)

    async def one(client, prompt, n, prompt_len):
        payload = {"model": model_name, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                   "stream": True, "stream_options": {"include_usage": True}}
        if limit is None:
            return await send_completion(client, url, payload, prompt_len)
        async with limit:
            return await send_completion(client, url, payload, prompt_len)

    pool = httpx.Limits(max_connections=concurrency or workload.num_requests, max_keepalive_connections=None)
    # no bound on a whole generation, but a server silent for 10 minutes fails the request (hung the run)
    timeout = httpx.Timeout(None, connect=60.0, read=600.0)
    async with httpx.AsyncClient(timeout=timeout, limits=pool, headers=auth_headers()) as client:
        start = time.perf_counter()
        tasks = []
        for i, (prompt, ids, n) in enumerate(zip(prompts, workload.prompts, workload.output_lens)):
            if i and math.isfinite(request_rate):  # Poisson gaps between arrivals, none after the last
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(client, prompt, n, len(ids))))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# ---- the server process ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m qkiln serve MODEL --host 127.0.0.1 --port P [extra args]`, stopped on exit."""

    def __init__(self, model: str, extra_args: list[str], startup_timeout_s: float = 600.0):
        import httpx  # before the server starts: missing, it had left the server running

        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile(prefix="qkiln-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "qkiln", "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               *extra_args]
        log(f"starting server: {' '.join(cmd)} (log: {self.log_file.name})")
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(startup_timeout_s, httpx)
        except BaseException:  # an interrupt while it loads, too: no server outlives the benchmark
            self.close(keep_log=True)
            raise

    def _wait_ready(self, timeout_s: float, httpx) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = Path(self.log_file.name).read_text(errors="replace")[-2000:]
                raise BenchConfigError(f"the server exited with code {self.proc.returncode} before it was ready; "
                                       f"its log ends with:\n{tail}")
            try:
                if httpx.get(self.base_url + "/v1/models", headers=auth_headers(), timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise BenchConfigError(f"the server did not answer /v1/models within {timeout_s:.0f} s; "
                               f"see {self.log_file.name}")

    def close(self, keep_log: bool = False) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s); its log is kept only when asked."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log_file.closed:
            self.log_file.close()
            if not keep_log:
                Path(self.log_file.name).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def served_model_name(base_url: str, fallback: str) -> str:
    import httpx

    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=auth_headers(), timeout=10.0)
        data = resp.json().get("data") or []
        return data[0]["id"] if data else fallback
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return fallback


def warmup_server(base_url: str, model_name: str, prompt: list[int], prompt_format: str, tokenizer) -> None:
    """One short request first: load-time and first-call costs are not part of the benchmark."""
    import httpx

    body = {"model": model_name, "prompt": prompt if prompt_format == "ids" else tokenizer.decode(prompt),
            "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    resp = httpx.post(base_url.rstrip("/") + "/v1/completions", json=body, headers=auth_headers(), timeout=600.0)
    if resp.status_code != 200:
        raise BenchConfigError(f"the warmup request failed with HTTP {resp.status_code}: {resp.text[:300]}; "
                               "does the server accept this prompt format (--prompt-format ids|text)?")
    # and once through the measured path: a process's first async request paid ~35 ms of httpx start-up,
    # which landed in the first level's TTFT
    asyncio.run(run_load(base_url, model_name, Workload([prompt], [2]), None, math.inf, 0, [body["prompt"]]))
