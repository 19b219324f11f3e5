import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The suite runs small shapes on a 2-core machine: one intra-op thread avoids OpenMP
    spin-waits (measured 5x to 20x faster on the tiny-model tests). A test that needs the
    cores (the 2**31-logits case) raises it for itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
