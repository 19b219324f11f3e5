"""Properties of the segmented reductions and scans over drawn layouts, empty ones included (no
sequence, sequences without tokens, a padded width of 0): padded and packed, on the torch twin
and on Triton, equal to the plain loops of `logitless.reference.segments`."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitless import reference
from logitless.fused_losses.objectives import segments
from properties.strategies import backend, seeds

from testing import requires_triton

BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


@st.composite
def segment_batches(draw):
    """Right-padded ``x [B, T]`` (fp32) and mask with holes; B and T may be 0."""
    lengths = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    width = max(lengths, default=0) + draw(st.integers(0, 1))
    gen = torch.Generator().manual_seed(draw(seeds))
    x = torch.randn(len(lengths), width, generator=gen)
    grid = torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
    holes = torch.rand(len(lengths), width, generator=gen) < draw(st.sampled_from([0.0, 0.3]))
    return x, grid, grid & ~holes


def _loop_max(x, mask, empty):
    values = [[float(x[i, t]) for t in range(x.shape[1]) if mask[i, t]]
              for i in range(x.shape[0])]
    return torch.tensor([max(v) if v else empty for v in values], dtype=torch.float64)


def _check(name, got, want):
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{name}: {m}", equal_nan=False)


@pytest.mark.parametrize("backend_name", BACKENDS)
@given(batch=segment_batches(), packed=st.booleans(), empty=st.sampled_from([0.0, -math.inf]))
def test_segment_ops_match_loops(backend_name, batch, packed, empty):
    x, grid, mask = batch
    x64 = x.double()
    want = {
        "sum": reference.segment_sum_loop(x64, mask),
        "mean": reference.segment_sum_loop(x64, mask) / mask.sum(-1).clamp(min=1),
        "max": _loop_max(x, mask, empty),
        "count": mask.sum(-1),
        "prefix_sum": reference.prefix_sum_loop(x64, mask),
        "suffix_sum": reference.suffix_sum_loop(x64, mask),
        "prefix_min": reference.prefix_min_loop(x64, mask),
    }
    if packed:
        lengths = grid.sum(-1)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        args = (x[grid], mask[grid], cu)
        for k in ("prefix_sum", "suffix_sum", "prefix_min"):
            want[k] = want[k][grid]
    else:
        args = (x, mask, None)
    with backend(backend_name):
        got = {
            "sum": segments.segment_sum(*args),
            "mean": segments.segment_mean(*args),
            "max": segments.segment_max(*args, empty=empty),
            "count": segments.segment_count(args[1], args[2]),
            "prefix_sum": segments.prefix_sum(*args),
            "suffix_sum": segments.suffix_sum(*args),
            "prefix_min": segments.prefix_min(*args),
        }
    for k, v in want.items():
        _check(k, got[k], v)
