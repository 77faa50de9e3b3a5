"""The CLI tests run qkiln in subprocesses: qkiln's CPU kernels are compiled here first, once, so a
subprocess's first load (minutes on a fresh machine) does not run into the tests' timeouts."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def native_kernels_compiled():
    from qkiln.plugins import cpu_native

    cpu_native.native_extension()  # None where they cannot build: the subprocesses fall back alike
