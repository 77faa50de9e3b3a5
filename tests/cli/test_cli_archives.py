"""An artifact archive (what `qkiln build --archive` writes and a registry stores) is accepted by
generate / serve / eval / inspect / export as it is: unpacked and verified into a temporary folder that is
gone when the command ends, SIGTERM on a server included."""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from qkiln.compile.artifact_archive import write_archive
from qkiln.compile.build import build
from qkiln.compile.recipe import preset
from serve_process import cli as _cli, killed_on_exit, serve_process as _serve
from tiny_models import write_tiny_model_and_text


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    root = tmp_path_factory.mktemp("archive")
    model_dir, text = write_tiny_model_and_text(root)
    r = preset("w4a16-rtn")
    r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, source=str(text), num_samples=2,
                                                               seq_len=32))
    artifact = build(str(model_dir), r, root / "tiny-w4", progress=False, log=lambda m: None, use_cache=False).path
    return write_archive(artifact, root / "tiny-w4.tar.gz"), text


def test_generate_into_a_pipe_closed_early_succeeds(archive, tmp_path):
    """`qkiln generate ... | head -c 1` exited 1 (click's broken-pipe exit), failing a pipefail script."""
    path, _ = archive
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    command = (f"{sys.executable} -m qkiln generate {path} --prompt hello --max-tokens 200 --temperature 1 "
               "--seed 1 | head -c 1")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], env={**os.environ, "TMPDIR": str(tmpdir)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and len(result.stdout) == 1, result
    assert "Traceback" not in result.stderr and "error" not in result.stderr
    assert list(tmpdir.iterdir()) == []  # the unpacked copy is gone


def test_generate_inspect_and_eval_take_an_archive(archive, tmp_path):
    path, text = archive
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    for args, expect in ((["generate", str(path), "--prompt", "hello", "--max-tokens", "3"], None),
                         (["inspect", str(path)], "w4a16-rtn: weights int4 asym g128 (rtn), lm_head int8"),
                         (["eval", str(path), "--data", str(text), "--seq-len", "32", "--eval-tokens", "128"],
                          '"perplexity"'),
                         (["export", str(path), "-o", str(tmp_path / "hf")], "verified with compressed-tensors")):
        process = _cli(args, tmpdir)
        try:
            out, err = process.communicate(timeout=300)
        finally:
            process.kill()  # a no-op once it ended; else it would outlive the test
        assert "error" not in err and (expect is None or expect in out), (args, out, err)
        assert list(tmpdir.iterdir()) == [], args  # the unpacked copy is gone


def test_served_archive_is_cleaned_up_on_sigterm(archive, tmp_path):
    path, _ = archive
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    server, port = _serve(path, tmpdir, "--shutdown-timeout", "0.5")
    with killed_on_exit(server):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tiny-w4", r.text
        assert len(list(tmpdir.iterdir())) == 1  # the unpacked artifact, while serving
        # generations still running at SIGTERM get --shutdown-timeout to finish, then a 503
        in_flight = ThreadPoolExecutor(4).map(lambda _: httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 1000, "ignore_eos": True},
            timeout=60), range(4))
        time.sleep(0.5)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        assert time.monotonic() - signalled < 15
        for r in in_flight:
            assert r.status_code == 200 or (r.status_code == 503 and "shut down" in r.json()["error"]["message"]), r.text
    assert list(tmpdir.iterdir()) == []


def test_serve_on_port_0_names_the_port_it_bound_and_logs_only_to_stderr(archive, tmp_path):
    """--port 0 announced http://127.0.0.1:0/v1, and uvicorn's access log went to stdout alone.
    (With an evaluation job's options too: they reach the engine, or it would not start.)"""
    import queue
    import re
    import threading

    path, _ = archive
    server = _cli(["serve", str(path), "--port", "0", "--no-enable-chunked-prefill", "--no-enable-prefix-caching"],
                  tmp_path)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stderr], daemon=True).start()
    with killed_on_exit(server):
        said = []
        while not (match := re.search(r"on http://127\.0\.0\.1:(\d+)/v1", said[-1] if said else "")):
            said.append(lines.get(timeout=120))
        port = int(match[1])
        assert port != 0 and httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        time.sleep(0.5)  # the reader thread drains the rest
        said += list(lines.queue)
        assert server.stdout.read() == ""
        assert any('"GET /health HTTP/1.1" 200' in line for line in said), said


def test_a_second_ctrl_c_still_answers_every_request(archive, tmp_path):
    """uvicorn's force exit (Ctrl-C twice) had cancelled the requests in flight: bare 500s, streams
    cut without an error event, a traceback each. They get the engine's 503 / error event instead."""
    path, _ = archive
    server, port = _serve(path, tmp_path, "--shutdown-timeout", "60")
    url = f"http://127.0.0.1:{port}"
    with killed_on_exit(server):
        body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True}

        def streamed(_):
            with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
                return [line for line in r.iter_lines() if line]

        pool = ThreadPoolExecutor(4)
        # n=8 makes each step 18 rows: with qkiln's kernels a lone 1000-token answer had ended before
        # the second Ctrl-C, and rightly got its 200
        plain = [pool.submit(httpx.post, f"{url}/v1/completions", json=body | {"n": 8}, timeout=60) for _ in range(2)]
        streams = [pool.submit(streamed, i) for i in range(2)]
        time.sleep(1.0)
        server.send_signal(signal.SIGINT)
        time.sleep(0.5)
        signalled = time.monotonic()
        server.send_signal(signal.SIGINT)  # the grace period (60 s) is not waited out
        server.wait(timeout=30)
        assert time.monotonic() - signalled < 10
        for r in plain:
            r = r.result()
            assert r.status_code == 503 and "shut down" in r.json()["error"]["message"], r.text
        for lines in streams:
            lines = lines.result()
            assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2], lines[-3:]
        err = server.stderr.read()
        assert "Traceback" not in err, err


def test_the_python_api_takes_an_archive(archive, tmp_path, monkeypatch):
    """`LLM(ARCHIVE)`, which README and the docstring promise, fell through to the source loader
    ("neither a GGUF file nor a Hugging Face model directory"): it serves what the folder serves,
    under the archive's name, and leaves no unpacked copy behind."""
    import tempfile

    from qkiln.runtime import LLM, SamplingParams

    path, _ = archive
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(str(path), num_kv_blocks=16)
    assert llm.name == "tiny-w4" and list(tmp_path.iterdir()) == []
    want = LLM(str(path.parent / "tiny-w4"), num_kv_blocks=16).generate(["It was"], params)[0].token_ids
    assert llm.generate(["It was"], params)[0].token_ids == want
