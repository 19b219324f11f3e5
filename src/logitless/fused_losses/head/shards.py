"""A vocabulary sharded over a ``torch.distributed`` process group (``vocab_parallel``): each
rank holds a contiguous slice of the head, the slices in vocabulary-id order by rank.

:func:`vocab_offset` places this rank's slice; :func:`resolve` turns a process group's name
(as a custom op's schema carries it) back into the group; :class:`GroupReduction` is the
sampler passes' reduction hook (``kernels.sampler_torch.Reduction``) over a group, which makes
the radix select of top-k / top-p / min-p distributed.
"""

from __future__ import annotations

import torch

from logitless.kernels.sampler_torch import Reduction

__all__ = ["GroupReduction", "resolve", "vocab_offset"]


def vocab_offset(v_local: int, group, device) -> tuple[int, int]:
    """(first global vocab id of this rank's slice, total vocab size) over the group."""
    dist = torch.distributed
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([v_local], dtype=torch.int64, device=device), group=group)
    sizes = [int(s.item()) for s in sizes]
    rank = dist.get_rank(group)
    return sum(sizes[:rank]), sum(sizes)


def resolve(group_name: str):
    """The process group of ``ProcessGroup.group_name`` (as torch's functional collectives
    resolve it)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


class GroupReduction(Reduction):
    """The sampler passes' reductions over ``group``, whose ranks hold the vocabulary's slices
    in rank order; ``vocab_total`` is the whole vocabulary's size."""

    sharded = True

    def __init__(self, group, vocab_total: int):
        self.group, self.vocab_total = group, vocab_total

    def vocab(self, v_local: int) -> int:
        return self.vocab_total

    def _all_reduce(self, x, op):
        x = x.clone()
        torch.distributed.all_reduce(x, op=op, group=self.group)
        return x

    def max(self, x):
        return self._all_reduce(x, torch.distributed.ReduceOp.MAX)

    def min(self, x):
        return self._all_reduce(x, torch.distributed.ReduceOp.MIN)

    def sum(self, x):
        return self._all_reduce(x, torch.distributed.ReduceOp.SUM)

    def before(self, x):
        dist = torch.distributed
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        rank = dist.get_rank(self.group)
        return sum(parts[:rank], torch.zeros_like(x))
