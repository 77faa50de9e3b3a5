"""import qkiln sets up host memory (host_memory.py): checked in fresh interpreters, since the
settings are process-wide and must come before torch's first allocation."""

import subprocess
import sys

import pytest

# Page faults while a 16 MB tensor is allocated, filled and freed 5 times after a first time:
# with freed memory kept the same heap block is reused (no faults); glibc's defaults give the
# memory back and fault it in again every time (thousands of faults).
_PROBE = """
import os, resource, sys
if sys.argv[1] == "qkiln":
    import qkiln
import torch
x = torch.ones(4 << 20)
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    x = torch.ones(4 << 20)
    del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, os.environ.get("THP_MEM_ALLOC_ENABLE"))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


def _probe(first_import: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, first_import], capture_output=True,
                         text=True, check=True).stdout.split()
    return int(out[0]), out[1]


def test_import_qkiln_keeps_freed_memory_and_sets_huge_pages(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.delenv("QKILN_KEEP_FREED_MEMORY", raising=False)
    faults, thp = _probe("qkiln")
    assert faults < 50 and thp == "1"
    plain_faults, plain_thp = _probe("torch")  # the same process without qkiln
    assert plain_faults > 500 and plain_thp == "None"


def test_switches_are_respected(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.setenv("QKILN_KEEP_FREED_MEMORY", "0")
    faults, thp = _probe("qkiln")
    assert faults > 500 and thp == "0"
