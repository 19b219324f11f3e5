"""Context parallelism (``cp_group=`` of `policy_loss` and `fused_policy_loss`): the process
group a call's sequence-level reductions run over, and the collectives they use.

The contract (docs/scale.md, "Context parallelism"): every rank of ``cp_group`` passes the same
``B`` sequences in the same order, each rank its own tokens of each sequence, and rank ``r``
holds the ``r``-th contiguous piece of every sequence in token order (a piece may be empty: a
row without valid tokens, or a zero-length segment of ``cu_seqlens``). Per-token work stays
local. Inside `cp_context` the segment ops (``segments.py``) reduce over the group:

- sums and counts: one ``all_reduce`` of the local ``[B]`` (a mean stacks its sum and count
  into one ``[2, B]``), differentiable where the input requires grad (the backward all-reduces
  the incoming gradient, one more ``all_reduce``: each rank's share of the loss reaches every
  rank's tokens);
- max: ``all_reduce(MAX)``, values only;
- prefix / suffix scans: the per-rank totals ``[W, B]`` (each rank writes its own row, one
  ``all_reduce``), the totals of earlier (prefix) or later (suffix) ranks added to the local
  scan; differentiable for sums. Prefix min: the same with ``MIN``, values only.

Only the ``all_reduce`` of ``torch.distributed`` is used, so a test that wraps it counts every
collective of a call.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_STATE: dict = {"group": None}


@contextlib.contextmanager
def cp_context(group):
    """Segment ops inside reduce over ``group`` (None: local, as outside)."""
    prev = _STATE["group"]
    _STATE["group"] = group
    try:
        yield
    finally:
        _STATE["group"] = prev


def current_group():
    """The process group of the enclosing `cp_context`, or None."""
    return _STATE["group"]


def check_group(group, name: str = "cp_group") -> None:
    """``ValueError`` unless ``group`` is a process group of an initialised
    ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name}: expected a torch.distributed ProcessGroup, got "
                         f"{type(group).__name__}")


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``t`` reduced over the current group: differentiable (``torch.distributed.nn``) for a
    sum of a tensor that requires grad, a plain collective on a copy otherwise."""
    group = current_group()
    if op == dist.ReduceOp.SUM and t.requires_grad and torch.is_grad_enabled():
        return _AllReduceSum.apply(t, group)
    out = t.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


class _AllReduceSum(torch.autograd.Function):
    """A sum over ``group`` whose backward sums the incoming gradient over it: every rank
    backpropagates its own share of the loss, and a rank's input feeds every rank's share."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(g, group=ctx.group)
        return g, None


def rank_totals(local: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``[W, *local.shape]``: every rank's ``local`` in rank order (each rank fills its own
    row, the others hold the identity of ``op``; one `all_reduce`)."""
    group = current_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    fill = 0.0 if op == dist.ReduceOp.SUM else torch.inf
    rows = [local if r == rank else torch.full_like(local, fill) for r in range(world)]
    if op != dist.ReduceOp.SUM:
        rows = [r.detach() for r in rows]
    return all_reduce(torch.stack(rows), op)


def earlier(totals: torch.Tensor, *, later: bool = False, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The ``op`` (sum or min) of the rows of `rank_totals` of ranks before this one (after it,
    with ``later``): the identity where there are none."""
    rank = dist.get_rank(current_group())
    rows = totals[rank + 1:] if later else totals[:rank]
    if op == dist.ReduceOp.SUM:
        return rows.sum(0)
    pad = torch.full_like(totals[:1], torch.inf)
    return torch.cat([rows, pad]).amin(0)


def reduced(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the current group inside a `cp_context` (`all_reduce`), else ``t``."""
    return t if current_group() is None else all_reduce(t)
