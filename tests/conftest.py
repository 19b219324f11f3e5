import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def triton_interpreter_available() -> bool:
    """The Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 (set by `make test`)."""
    if torch.cuda.is_available():
        return True
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"
