"""``linear_logprobs`` with top-k / top-p / min-p and ``vocab_parallel``: the distributed radix
select on 2 and 3 gloo ranks with unequal slices (one of a single id) gives the kept set and
numbers of one process on the whole head, and the fp64 oracle's
(``logitless.reference.sampler``); integer logits tie across the ranks' boundaries."""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.kernels import sampler_torch
from logitless.reference.sampler import sampler_kept_mask, sampler_logprobs

from testing import run_on_gloo, sampler_settings, tied_head_inputs

# Uneven, contiguous slices of the vocabulary in rank order.
SPLITS = {2: [400, 607], 3: [300, 1, 706]}
OUTS = ("logprobs", "entropy", "log_kept_mass")


def _cases(n):
    return {
        "top_k": dict(top_k=7),
        "top_p": dict(top_p=0.8),
        "min_p": dict(min_p=0.05, temperature=0.7),
        "combined": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02),
        "per_token": sampler_settings(n, 80),
        "top_k_past_the_slices": dict(top_k=800),  # more than any one slice holds
    }


def _inputs(world, seed=0, n=37, d=96):
    gen = torch.Generator().manual_seed(seed)
    v = sum(SPLITS[world])
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5 * 3
    bias = torch.randn(v, generator=gen, dtype=torch.float64)
    logits = hidden @ weight.t() + bias
    top = logits.topk(4, dim=-1).indices.gather(1, torch.randint(0, 4, (n, 1), generator=gen))
    targets = torch.where(torch.rand(n, generator=gen) < 0.6, top.squeeze(1),
                          torch.randint(0, v, (n,), generator=gen))
    targets[::6] = -100
    return hidden, weight, bias, targets


def _slice(world, rank):
    lo = sum(SPLITS[world][:rank])
    return lo, lo + SPLITS[world][rank]


def _run(h, w, b, t, group=None, **kw):
    return logitless.linear_logprobs(h, w, t, bias=b, return_entropy=True,
                                     stats=("log_kept_mass", "lse"), vocab_parallel=group, **kw)


def _loss(values, upstream):
    """``values``: the outputs by name; -inf logprobs (outside the kept set) left out."""
    return sum((torch.where(torch.isfinite(values[k]), values[k], 0.0) * u).sum()
               for k, u in zip(OUTS, upstream))


def _named(out):
    return {k: getattr(out, k) for k in OUTS}


def _check_against_one_process(rank, world, inputs, kw, hidden_grad="sum"):
    """Values and gradients of the sharded call equal the unsharded call's and the oracle's."""
    hidden, weight, bias, targets = inputs
    n = targets.shape[0]
    gen = torch.Generator().manual_seed(5)
    upstream = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in OUTS]
    lo, hi = _slice(world, rank)

    full = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    want = _run(*full[:3], targets, **kw)
    _loss(_named(want), upstream).backward()
    ref_leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    ref = sampler_logprobs(*ref_leaves[:2], targets, ref_leaves[2], **kw)
    _loss(ref, upstream).backward()

    mine = [hidden.clone(), weight[lo:hi].clone(), bias[lo:hi].clone()]
    mine = [x.requires_grad_(True) for x in mine]
    got = _run(*mine, targets, dist.group.WORLD, hidden_grad=hidden_grad, **kw)
    _loss(_named(got), upstream).backward()
    d_hidden = mine[0].grad
    if hidden_grad == "partial":  # this rank's share: the caller sums
        dist.all_reduce(d_hidden)
    for k in OUTS:
        assert torch.equal(torch.isinf(getattr(got, k)), torch.isinf(getattr(want, k))), k
        torch.testing.assert_close(getattr(got, k), getattr(want, k), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(getattr(got, k), ref[k], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-12, atol=1e-12)
    for g, w, r, sl in ((d_hidden, full[0].grad, ref_leaves[0].grad, slice(None)),
                        (mine[1].grad, full[1].grad, ref_leaves[1].grad, slice(lo, hi)),
                        (mine[2].grad, full[2].grad, ref_leaves[2].grad, slice(lo, hi))):
        torch.testing.assert_close(g, w[sl], rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(g, r[sl], rtol=1e-9, atol=1e-10)


def _check_tied_kept_sets(rank, world, kw):
    """Integer logits with every row's values repeated on another rank: the kept set, read
    from the logprobs of every token down to one below the oracle's smallest kept logit, is
    the oracle's exactly (lowest ids first among the ties, wherever the rank boundaries cut
    the tied runs). Returns the rows whose boundary splits a run of ties held by several
    ranks."""
    hidden, weight, bias, _ = tied_head_inputs(n=4, d=24, v=sum(SPLITS[world]), seed=3)
    z = hidden @ weight.t() + bias
    v = z.shape[1]
    t = kw.get("temperature", 1.0)
    t = t.unsqueeze(1) if isinstance(t, torch.Tensor) else t
    want = sampler_kept_mask(z / t, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"),
                             kw.get("sampler", "vllm"))
    edge = torch.where(want, z, float("inf")).amin(1, keepdim=True)
    row, ids = (z >= edge - 1).nonzero(as_tuple=True)  # the kept set and the ids just past it
    per_row = {k: x[row] if isinstance(x, torch.Tensor) else x for k, x in kw.items()}
    lo, hi = _slice(world, rank)
    got = _run(hidden[row], weight[lo:hi], bias[lo:hi], ids, dist.group.WORLD, **per_row)
    assert torch.equal(torch.isfinite(got.logprobs), want[row, ids])
    at_edge = z == edge
    # the rank holding each id
    owner = torch.bucketize(torch.arange(v), torch.tensor(SPLITS[world]).cumsum(0), right=True)
    ranks = torch.tensor([len(owner[r].unique()) for r in at_edge])
    return (at_edge & ~want).any(1) & (ranks > 1)


def _check_triton_selected(rank, world):
    """Where Triton is selected (``LOGITLESS_BACKEND=triton``, fp32, the interpreter): one
    process runs the Triton sampler, the sharded call the torch twin's passes with the group's
    reduction; the same kept sets, and the numbers within fp32 rounding."""
    from logitless.kernels import sampler

    calls = []
    forward = sampler.forward
    sampler.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    os.environ["LOGITLESS_BACKEND"] = "triton"
    try:
        hidden, weight, bias, targets = (x.float() if x.is_floating_point() else x
                                         for x in _inputs(world, seed=3, n=7, d=32))
        kw = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02)
        lo, hi = _slice(world, rank)
        upstream = [torch.randn(7, generator=torch.Generator().manual_seed(6)) for _ in OUTS]
        full = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
        want = _run(*full, targets, **kw)
        _loss(_named(want), upstream).backward()
        assert calls, "one process ran the Triton sampler"
        mine = [x.clone().requires_grad_(True) for x in (hidden, weight[lo:hi], bias[lo:hi])]
        got = _run(*mine, targets, dist.group.WORLD, **kw)
        _loss(_named(got), upstream).backward()
    finally:
        del os.environ["LOGITLESS_BACKEND"]
        sampler.forward = forward
    for k in OUTS:
        assert torch.equal(torch.isinf(getattr(got, k)), torch.isinf(getattr(want, k))), k
        torch.testing.assert_close(getattr(got, k), getattr(want, k), rtol=1e-5, atol=1e-5)
    for g, w, sl in ((mine[0].grad, full[0].grad, slice(None)),
                     (mine[1].grad, full[1].grad, slice(lo, hi)),
                     (mine[2].grad, full[2].grad, slice(lo, hi))):
        torch.testing.assert_close(g, w[sl], rtol=1e-4, atol=1e-5)


def _worker(rank, world):
    inputs = _inputs(world)
    n = inputs[3].shape[0]
    for kw in _cases(n).values():
        _check_against_one_process(rank, world, inputs, kw)
    _check_against_one_process(rank, world, _inputs(world, seed=1), _cases(n)["combined"],
                               hidden_grad="partial")
    if world == 2:
        # the rest is per-rank logic (slice carry, engine rules, ties straddling ranks, the
        # Triton route) that three ranks cross at a first, a one-id middle and a last slice
        return
    # the sampler passes in slices of 5 ids: tie ranks and histograms carry slice to slice
    sampler_torch._COLS = 5
    _check_against_one_process(rank, world, _inputs(world, seed=2, n=11, d=16),
                               _cases(11)["per_token"])
    sampler_torch._COLS = 1024
    # SGLang's and transformers' rules (every tie at the top-k boundary kept, SGLang's joint
    # top-k/top-p, min-p last) cross the ranks the same way
    for engine in ("sglang", "transformers"):
        for name in ("combined", "per_token", "top_k"):
            _check_against_one_process(rank, world, inputs, {**_cases(n)[name], "sampler": engine})
        _check_against_one_process(rank, world, inputs, dict(top_k=40, top_p=0.9,
                                                             sampler=engine))
    split = 0
    gen = torch.Generator().manual_seed(4)
    for kw in (dict(top_k=9), dict(top_p=0.7, temperature=3.0),
               dict(top_k=torch.randint(2, 60, (4,), generator=gen), top_p=0.95, min_p=0.001,
                    temperature=torch.rand(4, generator=gen, dtype=torch.float64) * 2 + 2)):
        split += int(_check_tied_kept_sets(rank, world, kw).sum())
        for engine in ("sglang", "transformers"):
            _check_tied_kept_sets(rank, world, {**kw, "sampler": engine})
    assert split >= 4, "ties held by several ranks must straddle the kept set's boundary"
    # CPU tensors: Triton runs them under the interpreter only (`make test-dist` sets it)
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        _check_triton_selected(rank, world)


@pytest.mark.dist  # gloo ranks, as every multi-process test: make test-dist
@pytest.mark.parametrize("world", [2, 3])
def test_truncations_on_a_sharded_vocabulary_match_one_process(world):
    run_on_gloo(world, _worker)
