"""Context parallelism (``cp_group=`` of `policy_loss` and `fused_policy_loss`): the process
group a call's sequence-level reductions run over, and the collectives they use.

The contract (docs/scale.md, "Context parallelism"): every rank of ``cp_group`` passes the same
``B`` sequences in the same order, each rank its own tokens of each sequence, and rank ``r``
holds the ``r``-th contiguous piece of every sequence in token order (a piece may be empty: a
row without valid tokens, or a zero-length segment of ``cu_seqlens``). Per-token work stays
local. Given the group (their ``group=`` argument: the batch's ``cp_group``, passed at every
call, never a module state) the segment ops (``segments.py``) reduce over it:

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

Where `fused_policy_loss` runs each rank's tokens in chunks of its own (no term reads a whole
sequence: `cp_sequence_terms`), the objective's inputs carry `ChunkedGroup` instead of the group:
the chunks differ from rank to rank, so a sequence-level collective there would pair mismatched
chunks (a hang, or wrong sums). Every collective here refuses it with a ``ValueError`` before it
runs, on every rank alike.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def check_group(group, name: str = "cp_group") -> None:
    """``ValueError`` unless ``group`` is a process group of an initialised
    ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name}: expected a torch.distributed ProcessGroup, got "
                         f"{type(group).__name__}")


class ChunkedGroup:
    """The ``cp_group`` of an objective's inputs on `fused_policy_loss`'s chunks of one rank's
    tokens: not a process group; the collectives here refuse it (`check_not_chunked`)."""

    def __init__(self, objective: str):
        self.objective = objective

    def __repr__(self) -> str:
        return f"ChunkedGroup({self.objective!r})"


@functools.cache
def chunked_group(objective: str) -> ChunkedGroup:
    """The `ChunkedGroup` of ``objective``: one object per name (a compiled chunk loss keeps
    its graph from call to call)."""
    return ChunkedGroup(objective)


def check_not_chunked(group) -> None:
    """``ValueError`` when ``group`` is a `ChunkedGroup`: the objective reduced over the
    context-parallel group inside chunks of one rank's tokens, which its registration did not
    declare (``reads_sequences``)."""
    if isinstance(group, ChunkedGroup):
        raise ValueError(
            f"objective: {group.objective!r} runs a collective over x.cp_group (a segment op "
            "with group=x.cp_group), but fused_policy_loss runs each rank's tokens in chunks "
            f"of its own for it; {group.objective!r} reads whole sequences under cp_group: "
            "register it with reads_sequences=True")


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``t`` reduced over ``group``: differentiable (`_AllReduceSum`) for a sum of a tensor
    that requires grad, a plain collective on a copy otherwise."""
    check_not_chunked(group)
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


def rank_totals(local: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``[W, *local.shape]``: every rank's ``local`` in rank order over ``group`` (each rank
    fills its own row, the others hold the identity of ``op``; one `all_reduce`)."""
    check_not_chunked(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    fill = 0.0 if op == dist.ReduceOp.SUM else torch.inf
    rows = [local if r == rank else torch.full_like(local, fill) for r in range(world)]
    if op != dist.ReduceOp.SUM:
        rows = [r.detach() for r in rows]
    return all_reduce(torch.stack(rows), group, op)


def earlier(totals: torch.Tensor, group, *, later: bool = False,
            op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The ``op`` (sum or min) of the rows of `rank_totals` of ranks of ``group`` before this
    one (after it, with ``later``): the identity where there are none."""
    check_not_chunked(group)
    rank = dist.get_rank(group)
    rows = totals[rank + 1:] if later else totals[:rank]
    if op == dist.ReduceOp.SUM:
        return rows.sum(0)
    pad = torch.full_like(totals[:1], torch.inf)
    return torch.cat([rows, pad]).amin(0)


def reduced(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over ``group`` (`all_reduce`); ``t`` itself when ``group`` is None."""
    return t if group is None else all_reduce(t, group)
