"""The sampler path's chunked torch kernels: the ordered keys, the kept set against the fp64
reference on tie-heavy integer logits, and batch invariance."""

import pytest
import torch

from logitless.kernels import sampler_torch
from logitless.kernels.sampler_torch import RowParams
from logitless.reference.sampler import sampler_kept_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ordered_keys_sort_like_the_floats(dtype):
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 3.0, -3.0],
                           dtype=dtype)
    z = torch.cat([special, torch.randn(300, dtype=dtype) * 50]).unsqueeze(0)
    keys = sampler_torch.ordered_keys(z)[0]
    zz = z[0]
    # key order is float order, and equal floats (0.0 and -0.0 included) get equal keys
    assert torch.equal(zz.unsqueeze(0) < zz.unsqueeze(1), keys.unsqueeze(0) < keys.unsqueeze(1))
    assert torch.equal(zz.unsqueeze(0) == zz.unsqueeze(1),
                       keys.unsqueeze(0) == keys.unsqueeze(1))


def _rebuild(keys, key, count):
    """The kept set ``[R, V]`` the backward rebuilds from the stored (key, count) pairs."""
    kd = keys.dtype
    seen = torch.zeros(keys.shape[0], dtype=torch.int32)
    return sampler_torch._prefix_slice(keys.t().contiguous(), key.to(kd), count.int(),
                                       seen)[0].t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cols", [4096, 5])
def test_kept_set_matches_reference_on_tied_integer_logits(dtype, cols, monkeypatch):
    """Integer logits in [-3, 3] over 41 ids: every row has ties at the k-th value and at the
    top-p boundary; the kept set must be the reference's (lowest ids kept first), whether the
    passes take the vocabulary in one slice or in slices of 5 (tie ranks carried across)."""
    monkeypatch.setattr(sampler_torch, "_COLS", cols)
    gen = torch.Generator().manual_seed(3)
    n, v = 300, 41
    z = torch.randint(-3, 4, (n, v), generator=gen).to(dtype)
    k = torch.randint(1, v + 3, (n,), generator=gen)
    p = torch.rand(n, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    min_p = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0,
                        torch.rand(n, generator=gen, dtype=torch.float64) * 0.3)
    params = RowParams(torch.ones(n, dtype=dtype), k, p.to(dtype), min_p.to(dtype))
    keys = sampler_torch.ordered_keys(z)
    targets = torch.randint(0, v, (n,), generator=gen)
    got, outs = sampler_torch.select(z, targets, params)
    want = sampler_kept_mask(z.double(), k, p, min_p)
    assert torch.equal(got, want)
    # the boundary ties really are split in some rows (lowest ids kept)
    t = torch.where(want, z, float("inf")).amin(1, keepdim=True)
    split = ((z == t) & ~want).any(1) & ((z == t) & want).any(1)
    assert int(split.sum()) > 20
    # the stored (key, count) pair is the set's smallest key and its kept ties, and it
    # rebuilds the same set (what the backward does)
    kmin = torch.where(got, keys, torch.iinfo(keys.dtype).max).amin(1)
    assert torch.equal(outs[-2], kmin.long())
    assert torch.equal(outs[-1], (got & (keys == kmin.unsqueeze(1))).sum(1))
    assert torch.equal(_rebuild(keys, outs[-2], outs[-1]), got)
    # the target's logprob: -inf exactly where the reference drops it
    y_kept = want.gather(1, targets.unsqueeze(1)).squeeze(1)
    assert torch.equal(torch.isfinite(outs[0]), y_kept)


def test_results_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(4)
    n, d, v = 70, 24, 301
    h = torch.randn(n, d, generator=gen)
    w = torch.randn(v, d, generator=gen) / d**0.5 * 3
    t = torch.randint(0, v, (n,), generator=gen)
    params = RowParams(torch.rand(n, generator=gen) + 0.5, torch.randint(1, 40, (n,)),
                       torch.rand(n, generator=gen) * 0.9 + 0.1, None)
    kw = dict(softcap=None, logit_scale=1.0, tile_bytes=8 * 2**10 * 30)
    assert sampler_torch.rows_per_chunk(v, kw["tile_bytes"], h.dtype, None) < n
    full = sampler_torch.forward(h, w, None, t, params, **kw)
    part = sampler_torch.forward(h[:5], w, None, t[:5], params.rows(slice(0, 5), 5), **kw)
    for a, b in zip(full, part):
        assert torch.equal(a[:5], b)


def test_top_p_boundary_within_fp32_rounding_matches_the_exact_sums():
    """A row whose cumulative mass passes p = 0.9 within fp32 rounding of it (fp32 sums, in
    the radix select's order, keep one token fewer): the kept set is the one the exact (fp64)
    sums give."""
    z = torch.randn(256, 4099, generator=torch.Generator().manual_seed(0))[216:217] * 2
    probs = torch.softmax(z.double(), 1).sort(1, descending=True).values.cumsum(1)
    margin = torch.where(probs < 0.9, 0.9 - probs, probs - 0.9).min()
    assert margin < 2e-7
    params = RowParams(torch.ones(1), None, torch.full((1,), 0.9, dtype=torch.float64), None)
    got, _ = sampler_torch.select(z, torch.zeros(1, dtype=torch.int64), params)
    assert torch.equal(got, sampler_kept_mask(z.double(), top_p=0.9))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("setting", [dict(top_k=3), dict(min_p=0.1), dict(top_p=0.9),
                                     dict(top_k=4, top_p=0.8, min_p=0.05)])
def test_a_non_finite_hidden_row_gives_nan(bad, setting):
    """A NaN or inf in a hidden row: that row's logprob is NaN, as on the plain path, not the
    -inf meaning "outside the kept set" (which the TRL adapter would drop as a sampler
    mismatch, hiding a diverged model); the other rows are unchanged."""
    import logitless

    gen = torch.Generator().manual_seed(3)
    h, w = torch.randn(5, 8, generator=gen), torch.randn(13, 8, generator=gen)
    t = torch.randint(0, 13, (5,), generator=gen)
    clean = logitless.linear_logprobs(h, w, t, **setting).logprobs
    h[2, 4] = bad
    assert torch.isnan(logitless.linear_logprobs(h, w, t).logprobs[2])  # the plain path
    got = logitless.linear_logprobs(h, w, t, **setting).logprobs
    assert torch.isnan(got[2])
    keep = torch.arange(5) != 2
    torch.testing.assert_close(got[keep], clean[keep], rtol=0, atol=0)
