"""import qkiln lets torch's OpenMP workers spin longer before they sleep (host_threads.py):
checked in fresh interpreters, since libgomp reads the variable when torch loads it."""

import subprocess
import sys

_PROBE = "import os, sys\nif sys.argv[1] == 'qkiln':\n    import qkiln\nimport torch\n" \
         "print(os.environ.get('GOMP_SPINCOUNT'))"


def _probe(first_import: str) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE, first_import], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_import_qkiln_sets_the_spin_count(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _probe("qkiln") == "1000000"
    assert _probe("torch") == "None"  # the same process without qkiln


def test_an_explicit_setting_is_respected(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")
    assert _probe("qkiln") == "5000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # a wait policy chosen: qkiln adds nothing
    assert _probe("qkiln") == "None"
