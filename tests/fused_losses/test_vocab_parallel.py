"""Vocab-parallel linear_logprobs with real gloo processes on CPU, against the unsharded op."""

import os
import shutil

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
    if world == 2:  # in this spawn: starting the processes costs more than the checks
        _check_compiled(rank, world)


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


# --- torch.compile (issue 17) ---------------------------------------------------------------


def _vp_step(hidden, weight, bias, targets, group, hidden_grad):
    out = logitless.linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.9,
                                    softcap=20.0, return_entropy=True,
                                    stats=("sum_p_sq", "mean_logit", "is_top1", "lse"),
                                    vocab_parallel=group, hidden_grad=hidden_grad)
    loss = (out.logprobs.sum() + 0.3 * out.entropy.sum() + 0.2 * out.sum_p_sq.sum()
            + 0.1 * out.mean_logit.sum() + 0.01 * out.lse.square().sum())
    return loss, out.logprobs, out.entropy, out.is_top1


def _check_compiled(rank, world):
    """Compiled (aot_eager; inductor too with LOGITLESS_TEST_INDUCTOR=1; fullgraph: a graph
    break raises) vocab-parallel forward and backward against eager, in both hidden_grad
    modes, one graph holding the op once; opcheck of the forward and backward ops with the
    group's name."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)  # every rank builds the same full problem
    n, d, v = 37, 24, sum(SPLITS[world])
    lo, hi = sum(SPLITS[world][:rank]), sum(SPLITS[world][:rank + 1])
    hidden = torch.randn(n, d, dtype=torch.float64)
    weight = (torch.randn(v, d, dtype=torch.float64) / d**0.5)[lo:hi].contiguous()
    bias = torch.randn(v, dtype=torch.float64)[lo:hi].contiguous()
    targets = torch.randint(0, v, (n,))
    targets[::4] = -100
    group = dist.group.WORLD

    # inductor (a C++ compile of each graph, slow on a CPU) as test_compile.py's INDUCTOR
    inductor = os.environ.get("LOGITLESS_TEST_INDUCTOR") == "1" and shutil.which("g++")
    for backend, mode in [("aot_eager", "sum"), ("aot_eager", "partial")] + (
            [("inductor", "sum"), ("inductor", "partial")] if inductor else []):
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(_vp_step, backend=counter, fullgraph=True)
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        got = compiled(*leaves, targets, group, mode)
        want = _vp_step(*leaves, targets, group, mode)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
        assert (got[1][targets == -100] == 0).all()
        for x, y in zip(torch.autograd.grad(got[0], leaves), torch.autograd.grad(want[0], leaves)):
            torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-12)
        assert counter.frame_count == 1
        op = torch.ops.logitless.linear_logprobs
        assert sum(n.target in (op, op.default) for n in counter.graphs[0].graph.nodes) == 1

    name = group.group_name
    config = (0.9, 20.0, 1.0, -100, None, torch.float64)
    torch.library.opcheck(torch.ops.logitless.linear_logprobs.default,
                          (hidden.requires_grad_(), weight.requires_grad_(),
                           bias.requires_grad_(), targets, *config, True, True, name, "sum"))
    lp, ent, s2, _, _, _, top, log_l = torch.ops.logitless.linear_logprobs(
        hidden, weight, bias, targets, *config, True, True, name, "sum")
    # "sum" ran in the forward op's autograd check
    torch.library.opcheck(torch.ops.logitless.linear_logprobs_backward.default,
                          (hidden.detach(), weight.detach(), bias.detach(), targets,
                           top.detach(), log_l.detach(), ent.detach(), s2.detach(),
                           torch.ones_like(lp),
                           torch.ones_like(lp), None, None, None, *config, True, True, True,
                           name, "partial"))


@pytest.mark.dist  # gloo ranks, as every multi-process test: make test-dist
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_matches_unsharded(world):
    """Eager against unsharded; with 2 ranks also compiled against eager (`_check_compiled`)."""
    run_on_gloo(world, _worker)
