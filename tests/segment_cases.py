"""Batches and calls shared by the segment tests (``tests/kernels``, ``tests/fused_losses``).

Odd sizes on purpose: B=5 sequences (the interpreter's programs own 4, so the last program is
ragged), T=37 (three token blocks of 16, the last partial) and T=32 (a whole number of blocks),
a sequence without valid tokens, and for the packed layout an empty sequence too.
"""

import contextlib

import pytest
import torch

from logitless.fused_losses.objectives import segments
from logitless.kernels import segments_torch

SUMS = ("segment_sum", "segment_mean", "prefix_sum", "suffix_sum")
PICKS = ("segment_max", "prefix_min", "prefix_min_exclusive")


def batch(layout, t=37, dtype=torch.float32, seed=0, ties=False):
    """``(x, mask, cu_seqlens)``: padded [5, t] or packed with lengths (t, 0, 9, 16, 1, 23)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "padded":
        shape = (5, t)
        cu = None
    else:
        lengths = torch.tensor([t, 0, 9, 16, 1, 23])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        shape = (int(lengths.sum()),)
    if ties:  # few distinct values: maxima and prefix minima tie
        x = torch.randint(-2, 3, shape, generator=gen).to(torch.float64)
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    mask = torch.rand(shape, generator=gen) < 0.7
    if layout == "padded":
        mask[2] = False  # a sequence without valid tokens
        mask[0, -1] = True
    else:
        mask[int(cu[3]):int(cu[4])] = False
    return x.to(dtype), mask, cu


def call(module, op, x, mask, cu):
    """``op`` (a name of ``SUMS`` or ``PICKS``) from ``module`` on the batch."""
    if op == "prefix_min_exclusive":
        return module.prefix_min(x, mask, cu, exclusive=True)
    if op == "segment_max":
        return module.segment_max(x, mask, cu, empty=-5.0)
    return getattr(module, op)(x, mask, cu)


def on_torch(op, x, mask, cu):
    """The torch twin, whatever ``LOGITLESS_BACKEND`` says."""
    return call(segments_torch, op, x, mask, cu)


@contextlib.contextmanager
def triton_forced():
    """The public ops run the Triton kernels and their autograd Functions, fp64 too (which the
    backend rule keeps on the twin) so that ``gradcheck`` can run on them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segments, "_on_triton", lambda *_: True)
        yield


def on_triton(op, x, mask, cu):
    """The public op on the Triton kernels (see :func:`triton_forced`)."""
    with triton_forced():
        return call(segments, op, x, mask, cu)
