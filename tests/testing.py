"""Shared test helpers (importable as `testing` because pytest puts tests/ on sys.path)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_on_gloo(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes of one gloo group on loopback;
    an assertion failing in any of them fails the caller. ``fn`` must be module-level."""
    mp.spawn(_gloo_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True)
