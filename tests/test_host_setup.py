"""import qkiln sets up the host before torch loads, checked in fresh interpreters since torch and
libgomp read these variables once: huge pages for torch's large CPU tensors (host_memory.py;
torch reads the switch at its first allocation; freed blocks are left to glibc, host_memory.py
says why) and a longer OpenMP spin before workers sleep (host_threads.py; libgomp reads it when
torch loads it)."""

import subprocess
import sys

_PROBE = "import os, sys\nif sys.argv[1] == 'qkiln':\n    import qkiln\nimport torch\n" \
         "print(os.environ.get(sys.argv[2]))"


def _probe(first_import: str, variable: str) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE, first_import, variable], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_import_qkiln_sets_huge_pages(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert _probe("qkiln", "THP_MEM_ALLOC_ENABLE") == "1"
    assert _probe("torch", "THP_MEM_ALLOC_ENABLE") == "None"  # the same process without qkiln


def test_an_explicit_huge_page_switch_is_respected(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert _probe("qkiln", "THP_MEM_ALLOC_ENABLE") == "0"


def test_import_qkiln_sets_the_spin_count(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _probe("qkiln", "GOMP_SPINCOUNT") == "1000000"
    assert _probe("torch", "GOMP_SPINCOUNT") == "None"


def test_an_explicit_spin_setting_is_respected(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")
    assert _probe("qkiln", "GOMP_SPINCOUNT") == "5000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # a wait policy chosen: qkiln adds nothing
    assert _probe("qkiln", "GOMP_SPINCOUNT") == "None"
