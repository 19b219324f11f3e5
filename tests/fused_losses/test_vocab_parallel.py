"""Vocab-parallel linear_logprobs with real gloo processes on CPU, against the unsharded op."""

import pytest
import torch
import torch.distributed as dist

import logitless

from testing import run_on_gloo, tied_head_inputs

# Uneven, contiguous slices of the vocabulary in rank order.
SPLITS = {2: [400, 607], 3: [300, 1, 706]}


def _worker(rank, world):
    for softcap in (None, 5.0):
        _check_rank(rank, world, softcap)
    _check_ties(rank, world)


def _check_ties(rank, world):
    """is_top1 on tied maxima split over ranks: the first maximum wins, as unsharded."""
    hidden, weight, bias, targets = tied_head_inputs(v=sum(SPLITS[world]))
    expected = (hidden @ weight.t() + bias).argmax(-1) == targets  # exact: integer logits
    lo = sum(SPLITS[world][:rank])
    hi = lo + SPLITS[world][rank]
    out = logitless.linear_logprobs(hidden, weight[lo:hi], targets, bias=bias[lo:hi],
                                    stats=("is_top1",), vocab_parallel=dist.group.WORLD)
    assert torch.equal(out.is_top1, expected)


def _check_rank(rank, world, softcap):
    torch.manual_seed(0)  # every rank builds the same full problem
    n, d, v = 29, 48, sum(SPLITS[world])
    hidden = torch.randn(n, d, dtype=torch.float64)
    weight = torch.randn(v, d, dtype=torch.float64) / d**0.5
    bias = torch.randn(v, dtype=torch.float64)
    targets = torch.randint(0, v, (n,))
    targets[::5] = -100
    upstream = [torch.randn(n, dtype=torch.float64) for _ in range(3)]
    opts = dict(return_entropy=True, stats=("sum_p_sq", "mean_logit", "is_top1"),
                softcap=softcap, temperature=0.8)

    def loss(out):
        return sum((t * u).sum() for t, u in
                   zip((out.logprobs, out.entropy, out.sum_p_sq), upstream))

    full = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    expected = logitless.linear_logprobs(full[0], full[1], targets, bias=full[2], **opts)
    loss(expected).backward()

    lo = sum(SPLITS[world][:rank])
    hi = lo + SPLITS[world][rank]
    h = hidden.clone().requires_grad_(True)
    w = weight[lo:hi].clone().requires_grad_(True)
    b = bias[lo:hi].clone().requires_grad_(True)
    out = logitless.linear_logprobs(h, w, targets, bias=b, vocab_parallel=dist.group.WORLD,
                                    **opts)
    loss(out).backward()
    for k in ("logprobs", "entropy", "sum_p_sq", "mean_logit"):
        torch.testing.assert_close(getattr(out, k), getattr(expected, k), rtol=1e-12,
                                   atol=1e-12)
    assert torch.equal(out.is_top1, expected.is_top1)
    torch.testing.assert_close(h.grad, full[0].grad, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(w.grad, full[1].grad[lo:hi], rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(b.grad, full[2].grad[lo:hi], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_matches_unsharded(world):
    run_on_gloo(world, _worker)
