"""A head held as an FSDP2 DTensor (``fully_shard``: ``Shard(0)`` over the vocabulary on a 1-D
mesh), run as a vocabulary-parallel head without gathering the weight.

Under FSDP2 the ranks are data parallel: each holds its own tokens and one slice of the head's
rows. :func:`sharded_logprobs` all-gathers the tokens instead of the weight (the hidden rows,
``N_r x D`` a rank, padded to the largest ``N_r``; the targets and any per-token setting), runs
``linear_logprobs(..., vocab_parallel=<the mesh's group>, hidden_grad="partial")`` on the local
slice ``weight.to_local()`` for every gathered token, and each rank keeps its own tokens'
results. In the backward the output gradients are all-gathered (every slice needs every token's
gradient), the hidden-gradient partials are summed over the ranks by one all-reduce and each
rank keeps its own rows.

Gradients, as FSDP2's data parallelism has them. Each rank's loss is that of its own tokens.
The hidden gradient a rank receives is its own loss's. The weight (and bias) gradient lands on
the parameter as a ``Shard(0)`` DTensor: the mean over the ranks of each rank's loss gradient,
``(1/world) sum_r d loss_r / d W_shard``, what FSDP2's reduce-scatter (an average by default)
gives the head when it is unsharded in a module forward. So the whole step equals one process
running every rank's tokens through the unsharded head with the loss ``mean_r loss_r``.

TRL's fused head gathers a DTensor weight with ``full_tensor()`` instead; its backward keeps
each rank's slice of its *own* gradient only (no reduction over ranks: rank r's shard holds
``d loss_r / d W_shard``), which equals the above only when every rank scores the same tokens.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

__all__ = ["ShardedHead", "is_dtensor", "sharded_head", "sharded_logprobs"]

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch built without distributed
    DTensor, Shard = None, None


def is_dtensor(x) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


class ShardedHead:
    """The local slices of a DTensor head and the process group of its mesh."""

    def __init__(self, weight, bias):
        self.group = weight.device_mesh.get_group()
        self.world = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)
        self.weight = _ScaleGrad.apply(weight.to_local(), 1.0 / self.world)
        self.bias = None if bias is None else _ScaleGrad.apply(bias.to_local(), 1.0 / self.world)


def sharded_head(weight, bias) -> ShardedHead | None:
    """None for a plain head; for a DTensor head, its checked `ShardedHead` (``ValueError``
    unless ``weight`` and ``bias`` are ``Shard(0)`` on one 1-D mesh)."""
    if not is_dtensor(weight):
        if is_dtensor(bias):
            raise ValueError("bias is a DTensor but weight is not: pass both sharded "
                             "(FSDP2 Shard(0)) or both plain")
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"weight: a DTensor head must be sharded over the vocabulary on a 1-D "
                         f"mesh, placements (Shard(0),) (FSDP2's fully_shard); got "
                         f"{tuple(weight.placements)} on a {mesh.ndim}-D mesh")
    if bias is not None and not (is_dtensor(bias) and bias.device_mesh == mesh
                                 and tuple(bias.placements) == (Shard(0),)):
        raise ValueError("bias: with a DTensor weight the bias must be a DTensor on the "
                         "weight's mesh with placements (Shard(0),), or None")
    world, v = mesh.size(), weight.shape[0]
    chunk = -(-v // world)  # FSDP2 shards as torch.chunk: every rank's row count is known here
    if v - (world - 1) * chunk <= 0:
        # refused on every rank alike (a rank with no rows would leave the others waiting)
        raise ValueError(f"weight: FSDP2's Shard(0) of a {v}-row vocabulary over {world} ranks "
                         f"leaves a rank no rows (torch.chunk of {chunk}); a vocabulary-parallel "
                         f"head needs at least one row a rank")
    return ShardedHead(weight, bias)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled by ``scale`` (the mean over data-parallel ranks),
    in place: its one consumer is the vocab-parallel op, whose backward returns a fresh weight
    gradient, and a copy would hold a second shard-sized gradient at the peak."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.mul_(ctx.scale), None


class _Layout:
    """Where each rank's rows lie in the gathered rows: ``counts[r]`` rows from rank r, in rank
    order; the exchange pads every rank's rows to ``max(counts)``."""

    def __init__(self, n_local: int, head: ShardedHead, device):
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(head.world)]
        torch.distributed.all_gather(sizes, torch.tensor([n_local], dtype=torch.int64,
                                                         device=device), group=head.group)
        self.counts = [int(s.item()) for s in sizes]
        self.pad = max(self.counts)
        self.start = sum(self.counts[:head.rank])
        self.n = n_local
        self.group = head.group

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``x`` (``[n_local, ...]``), concatenated in rank order."""
        padded = x.new_zeros((self.pad, *x.shape[1:]))
        padded[:self.n] = x
        parts = [torch.empty_like(padded) for _ in self.counts]
        torch.distributed.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:c] for p, c in zip(parts, self.counts)])

    def own(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.start:self.start + self.n]


class _GatherHidden(torch.autograd.Function):
    """All ranks' hidden rows; backward: the partial gradients (each rank's vocabulary slice's
    share, for every token) summed over the ranks by one all-reduce, this rank's rows kept."""

    @staticmethod
    def forward(ctx, hidden, layout: _Layout):
        ctx.layout = layout
        return layout.gather(hidden)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        torch.distributed.all_reduce(g, group=ctx.layout.group)
        return ctx.layout.own(g), None


class _OwnRows(torch.autograd.Function):
    """This rank's rows of results every rank holds for all tokens; backward: the gradients of
    every rank's rows, all-gathered in one exchange (a zero gradient where none came)."""

    @staticmethod
    def forward(ctx, layout: _Layout, *outs):
        ctx.layout = layout
        ctx.meta = [(o.shape[1:], o.dtype) for o in outs]
        return tuple(layout.own(o).clone() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        layout = ctx.layout
        acc = torch.float64 if any(dt == torch.float64 for _, dt in ctx.meta) else torch.float32
        stacked = torch.stack([g.to(acc) for g in grads], dim=1)  # [n_local, k]
        full = layout.gather(stacked)
        return (None, *(full[:, i].to(dt) for i, (_, dt) in enumerate(ctx.meta)))


_PER_TOKEN = ("temperature", "top_k", "top_p", "min_p")


def sharded_logprobs(run: Callable, head: ShardedHead, hidden, targets, *, kept_ids,
                     vocab_parallel, gather_weight, hidden_grad, return_entropy, stats,
                     **kw):
    """``linear_logprobs`` on a DTensor head (``run`` is `linear_logprobs` itself, called on
    the gathered tokens and the local slices). ``kw``: the call's other arguments."""
    if is_dtensor(hidden):
        raise ValueError("hidden must be a plain tensor (each rank's own tokens) with a DTensor "
                         "head, got a DTensor")
    for name, value in (("vocab_parallel", vocab_parallel), ("gather_weight", gather_weight),
                        ("kept_ids", kept_ids)):
        if value is not None:
            raise ValueError(f"{name} is unsupported with a DTensor weight (FSDP2): the "
                             f"vocabulary is sharded over the weight's mesh, without a gather")
    if hidden_grad != "sum":
        raise ValueError(f"hidden_grad must be 'sum' with a DTensor weight (each rank receives "
                         f"its own tokens' hidden gradient), got {hidden_grad!r}")
    if isinstance(kw.get("ignore_index"), bool) or not isinstance(kw.get("ignore_index"),
                                                                  numbers.Integral):
        raise ValueError(f"ignore_index must be an integer token id, got "
                         f"{kw.get('ignore_index')!r}")
    for name in _PER_TOKEN:
        value = kw.get(name)
        if isinstance(value, torch.Tensor) and value.dim() and \
                tuple(value.shape) != tuple(targets.shape):
            raise ValueError(f"{name} must be a number or a tensor of targets' shape "
                             f"{tuple(targets.shape)}, got {tuple(value.shape)}")
    d = hidden.shape[-1]
    layout = _Layout(targets.numel(), head, hidden.device)
    h_all = _GatherHidden.apply(hidden.reshape(-1, d), layout)
    t_all = layout.gather(targets.reshape(-1))
    for name in _PER_TOKEN:
        value = kw.get(name)
        if isinstance(value, torch.Tensor) and value.dim():
            kw[name] = layout.gather(value.reshape(-1))
    out = run(h_all, head.weight, t_all, bias=head.bias, vocab_parallel=head.group,
              hidden_grad="partial", return_entropy=return_entropy, stats=stats, **kw)
    names = [n for n in ("logprobs", "entropy", "sum_p_sq", "mean_logit", "lse",
                         "log_kept_mass", "is_top1") if getattr(out, n) is not None]
    diff = [n for n in names if getattr(out, n).dtype.is_floating_point]
    own = dict(zip(diff, _OwnRows.apply(layout, *(getattr(out, n) for n in diff))))
    for n in names:
        value = own[n] if n in own else layout.own(getattr(out, n))
        setattr(out, n, value.reshape(targets.shape))
    return out
