"""A vocabulary sharded over a ``torch.distributed`` process group (``vocab_parallel``): each
rank holds a contiguous slice of the head, the slices in vocabulary-id order by rank.

:func:`vocab_offset` places this rank's slice; :func:`resolve` turns a process group's name
(as a custom op's schema carries it) back into the group; :class:`GroupReduction` is the
sampler passes' reduction hook (``kernels.sampler_torch.Reduction``) over a group, which makes
the radix select of top-k / top-p / min-p distributed.
"""

from __future__ import annotations

import dataclasses

import torch

from logitless.kernels.sampler_torch import Reduction
from logitless.kernels.softmax_partials import Partials, rescale_to

__all__ = ["GroupReduction", "VocabShard", "all_reduce_partials", "check_vocab_parallel",
           "resolve", "vocab_offset"]

HIDDEN_GRADS = ("sum", "partial")


def check_vocab_parallel(vocab_parallel, hidden_grad) -> None:
    """``vocab_parallel`` None or a process group; ``hidden_grad`` ``"sum"`` or ``"partial"``."""
    if vocab_parallel is not None and not isinstance(vocab_parallel,
                                                     torch.distributed.ProcessGroup):
        raise ValueError(f"vocab_parallel must be None or a torch.distributed ProcessGroup, got "
                         f"{type(vocab_parallel).__name__}")
    if hidden_grad not in HIDDEN_GRADS:
        raise ValueError(f"hidden_grad must be 'sum' or 'partial', got {hidden_grad!r}")


def vocab_offset(v_local: int, group, device) -> tuple[int, int]:
    """(first global vocab id of this rank's slice, total vocab size) over the group."""
    sizes = _slice_sizes(v_local, group, device)
    return sum(sizes[:torch.distributed.get_rank(group)]), sum(sizes)


def _slice_sizes(v_local: int, group, device) -> list[int]:
    """Every rank's vocabulary slice size, in rank order (one all-gather)."""
    dist = torch.distributed
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([v_local], dtype=torch.int64, device=device), group=group)
    return [int(s.item()) for s in sizes]


def all_reduce_partials(parts: Partials, group) -> Partials:
    """Combine per-rank partials: max of the maxima (of the maxima before the target, and of
    a kernel's ``top``), then sums rescaled to the common maximum."""
    dist = torch.distributed
    maxima = torch.stack([parts.m, parts.m_before, *(() if parts.top is None else (parts.top,))])
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    m, m_before, *top = maxima.unbind(0)
    local = rescale_to(parts, m)
    sums = torch.stack([local.l, local.a, local.s2, local.sum_z, local.z_y])
    dist.all_reduce(sums, group=group)
    return Partials(m, *sums.unbind(0), m_before, *top)


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's slice of a vocabulary sharded over ``group`` (`fused_policy_loss`'s
    ``vocab_parallel``): the group, what becomes of the hidden gradient (``hidden_grad``, as
    `linear_logprobs` takes it), and, once placed (`place`), the slice's first global id,
    the whole vocabulary's size and the largest slice's (every rank plans its chunks by it,
    so that the ranks run the same collectives)."""

    group: object
    hidden_grad: str = "sum"
    offset: int = 0
    total: int = 0
    largest: int = 0

    def place(self, v_local: int, device) -> VocabShard:
        """The shard with its offsets, from an all-gather of the slices' sizes."""
        sizes = _slice_sizes(v_local, self.group, device)
        rank = torch.distributed.get_rank(self.group)
        return dataclasses.replace(self, offset=sum(sizes[:rank]), total=sum(sizes),
                                   largest=max(sizes))

    def partials(self, parts: Partials) -> Partials:
        """The slices' partials merged over the group (`all_reduce_partials`)."""
        return all_reduce_partials(parts, self.group)

    def hidden(self, d_hidden):
        """This rank's hidden-gradient rows summed over the group (``hidden_grad="sum"``), or
        left as they are (``"partial"``; None stays None)."""
        if d_hidden is not None and self.hidden_grad == "sum":
            torch.distributed.all_reduce(d_hidden, group=self.group)
        return d_hidden

    def kl(self, kl, top_s, log_l_s, top_t, log_l_t, unit: float = 1.0):
        """KL(policy || reference) over the whole vocabulary from each rank's over its slice,
        with each head's normaliser ``(top, log l)`` over its slice: ``(kl, top_s, log_l_s,
        top_t, log_l_t)`` of the whole vocabulary, the same on every rank. ``unit``: the
        tempered logit of a ``top`` of 1 (1 for the torch passes; the Triton passes keep the
        untempered maximum, ``1 / T``). A slice's ``E_s[z_s - z_t]`` is ``kl + (top_s -
        top_t) unit + (log l_s - log l_t)``; its weight in the whole expectation is its share
        of the policy's sum of exponentials."""
        dist = torch.distributed
        tops = torch.stack([top_s, top_t])
        dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=self.group)
        gap = kl + (top_s - top_t) * unit + (log_l_s - log_l_t)
        w_s = torch.exp((top_s - tops[0]) * unit + log_l_s)
        sums = torch.stack([w_s, w_s * gap, torch.exp((top_t - tops[1]) * unit + log_l_t)])
        dist.all_reduce(sums, group=self.group)
        log_l_s, log_l_t = sums[0].log(), sums[2].log()
        whole = sums[1] / sums[0] - (tops[0] - tops[1]) * unit - (log_l_s - log_l_t)
        return whole, tops[0], log_l_s, tops[1], log_l_t


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
