"""The segments' torch twin (``kernels/segments_torch.py``) against the plain loops of
``reference/segments.py`` in fp64, padded and packed, and its packed/padded index, which
``fused_policy_loss`` shares to lay out its chunks."""

import torch

from logitless import reference as ref
from logitless.kernels import segments_torch as twin


def _batch(seed=3, b=5, t=11):
    """``(x [b, t] fp64, mask, cu_seqlens)``: right-padded lengths in 1..t, sequence 1 empty."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[1] = 0
    mask = torch.arange(t)[None] < lengths[:, None]
    x = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2.5 - 0.05
    return x, mask, torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(-1).cumsum(0)])


def close(a, b, tol=1e-10, name=""):
    scale = b.abs().max().clamp(min=1e-12)
    err = float((a - b).abs().max() / scale)
    assert err <= tol, f"{name}: relative error {err:.3e}"


def test_segments_match_loops_on_both_layouts():
    x, m, cu = _batch()
    xp = x[m]
    close(twin.segment_sum(x, m), ref.segment_sum_loop(x, m))
    close(twin.segment_sum(xp, m[m], cu), ref.segment_sum_loop(x, m))
    for fn, loop in [
        (twin.prefix_sum, ref.prefix_sum_loop),
        (twin.suffix_sum, ref.suffix_sum_loop),
    ]:
        close(fn(x, m)[m], loop(x, m)[m])
        close(fn(xp, m[m], cu), loop(x, m)[m])
    for exclusive in (False, True):
        want = ref.prefix_min_loop(x, m, exclusive=exclusive)[m]
        assert torch.equal(twin.prefix_min(x, m, exclusive=exclusive)[m], want)
        assert torch.equal(twin.prefix_min(xp, m[m], cu, exclusive=exclusive), want)
    lengths = m.sum(-1).clamp(min=1).double()
    close(twin.segment_mean(xp, m[m], cu), ref.segment_sum_loop(x, m) / lengths)
    xm = torch.where(m, x, -torch.inf).amax(-1)
    assert torch.equal(twin.segment_max(xp, m[m], cu), torch.where(m.any(-1), xm, 0.0))
    # gradient of a scan through the packed scatter/gather
    xg = xp.clone().requires_grad_()
    (twin.prefix_sum(xg, m[m], cu) * torch.arange(xp.numel())).sum().backward()
    xr = x.clone().requires_grad_()
    (ref.prefix_sum_loop(xr, m)[m] * torch.arange(xp.numel())).sum().backward()
    close(xg.grad, xr.grad[m])


def test_packed_index_lays_packed_tokens_on_the_padded_grid():
    x, m, cu = _batch()
    index = twin.packed_index(cu.int())
    assert index.shape == (5, int(m.sum(-1).max()))
    assert torch.equal(index.pad(x[m], fill=-7.0), torch.where(m, x, -7.0)[:, :index.shape[1]])
    assert torch.equal(index.unpad(x), x[m])
    assert torch.equal(twin.broadcast(torch.arange(5.0), x[m], cu), index.row.double())


def test_packed_index_from_host_sizes_is_the_same():
    # A caller that knows N and L_max on the host passes them (no device read), here for a
    # chunk of sequences, with the chunk's offsets counted from its first token.
    *_, cu = _batch()
    chunk = cu[1:5] - cu[1]  # sequences 1 (empty) to 3
    lengths = (chunk[1:] - chunk[:-1]).tolist()
    read = twin.packed_index(chunk)
    given = twin.packed_index(chunk, sum(lengths), max(lengths))
    assert read.shape == given.shape == (3, max(lengths))
    assert torch.equal(read.row, given.row) and torch.equal(read.col, given.col)
    assert given.row.dtype == given.col.dtype == torch.int64
