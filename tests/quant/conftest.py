"""Run quant tests single-threaded: their tensors are tiny, and on a shared 2-core machine OpenMP
threads spinning against other processes made them ~50x slower. Restored afterwards."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
