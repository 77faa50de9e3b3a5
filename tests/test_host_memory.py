"""import qkiln turns on huge pages for torch's large CPU tensors (host_memory.py): checked in
fresh interpreters, since torch reads the switch once, at its first allocation. The reuse of freed
blocks is left to glibc (host_memory.py says why)."""

import subprocess
import sys

_PROBE = "import os, sys\nif sys.argv[1] == 'qkiln':\n    import qkiln\nimport torch\n" \
         "print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"


def _probe(first_import: str) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE, first_import], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_import_qkiln_sets_huge_pages(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert _probe("qkiln") == "1"
    assert _probe("torch") == "None"  # the same process without qkiln


def test_an_explicit_switch_is_respected(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert _probe("qkiln") == "0"
