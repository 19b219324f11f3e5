"""Shared test helpers (importable as `testing` because pytest puts tests/ on sys.path)."""

import os

import pytest
import torch


def _triton_runs_here() -> bool:
    if torch.cuda.is_available():
        return True
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


# `make test` sets TRITON_INTERPRET=1, so in CI these never skip; a bare `pytest` run without it
# skips them with this reason instead of failing inside Triton's compiler.
requires_triton = pytest.mark.skipif(
    not _triton_runs_here(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (make test)"
)


def assert_close_to_oracle(actual, oracle, same_dtype, tol, name=""):
    """Three-way check: |actual - oracle| <= |same_dtype - oracle| + tol, elementwise."""
    actual = actual.double()
    oracle = oracle.double()
    same_dtype = same_dtype.double()
    err = (actual - oracle).abs()
    bound = (same_dtype - oracle).abs() + tol
    bad = err > bound
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} elements exceed the three-way bound; "
        f"max excess {float((err - bound).max()):.3e}, max err {float(err.max()):.3e}"
    )
