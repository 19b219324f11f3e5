"""Which implementation a call runs: the Triton kernels or their torch twins."""

from __future__ import annotations

import os

import torch

__all__ = ["triton_selected"]


def triton_selected(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a call on tensors of this device and dtype runs the Triton kernels.

    ``LOGITLESS_BACKEND`` (``triton`` | ``torch`` | unset, read at each call), else by device:
    Triton on CUDA/XPU, torch on CPU. fp64 always takes the torch path (it exists for gradcheck
    and oracles, not for speed). Shared by every op with a Triton kernel and a torch twin.
    """
    choice = os.environ.get("LOGITLESS_BACKEND", "auto").lower()
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"LOGITLESS_BACKEND must be 'triton', 'torch' or unset, got {choice!r}")
    if choice == "torch" or dtype == torch.float64 or (choice == "auto" and device.type == "cpu"):
        return False
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "LOGITLESS_BACKEND=triton on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before the process starts"
        )
    try:
        import triton  # noqa: F401
    except ImportError:  # no triton for this platform
        if choice == "triton":
            raise
        return False
    return True
