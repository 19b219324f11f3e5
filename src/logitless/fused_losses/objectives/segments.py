"""Segmented reductions and scans over packed (``cu_seqlens``) and right-padded batches.

Every function takes either a right-padded ``x [B, T]`` with ``mask [B, T]``, or a packed
``x [N]`` with ``mask [N]`` and ``cu_seqlens [B + 1]`` (int, increasing, ``cu_seqlens[0] == 0``,
``cu_seqlens[-1] == N``, the flash-attention layout). Masked tokens contribute nothing to sums
and are skipped by min/max; scans return values at every position (masked ones included).

Each call runs the Triton kernels (``kernels/segments.py``, through the autograd Functions
below) when ``triton_selected`` picks Triton for ``x`` (CUDA, or ``LOGITLESS_BACKEND=triton``;
fp32, bf16 and fp16 only, fp64 stays on the twin), else the torch twin
(``kernels/segments_torch.py``); both give the same values and gradients:

- sum: ``dx_t = m_t g_b``; mean: ``dx_t = m_t g_b / max(L_b, 1)`` (both one spread launch);
- max: ``g_b`` split evenly between the valid tokens equal to the max (``amax``'s rule; the
  forward kernel counts the ties);
- prefix sum: ``dx_j = m_j sum_{t >= j} g_t`` (a suffix scan of ``g``, masked at the output) and
  the suffix sum the other way round;
- prefix min: ``g_t`` to the arg-min token of the prefix, which the forward kernel returns
  (ties to the latest token, as ``torch.cummin``); nothing where the prefix has no valid token;
- broadcast (packed): the backward is an unmasked segment sum. Padded broadcast stays a
  zero-copy ``expand``, whose backward is one ``sum``.

The Functions' backward passes are not differentiable again (``once_differentiable``); they
accept fp64 so that ``gradcheck`` can run on them.

Given ``group=`` (a context-parallel process group: ``cp_group=`` of `policy_loss`, which the
batch carries to every call) every reduction and scan here also runs over the group's ranks
(``context_parallel.py``: the contract and the collectives): the local result first, as
above, then one ``all_reduce``; ``group=None`` (the default) is local. Only the padded
layout (the grid `policy_loss` works on) is taken there; ``segment_max`` and ``prefix_min``
give values only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from logitless.fused_losses.backend import triton_selected
from logitless.fused_losses.objectives import context_parallel as cp
from logitless.kernels import segments_torch as twin
from logitless.kernels.segments_torch import to_packed, to_padded

__all__ = ["broadcast", "prefix_min", "prefix_sum", "segment_count", "segment_max", "segment_mean",
           "segment_sum", "suffix_sum", "to_packed", "to_padded"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _on_triton(x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether this call on ``x`` (computing in ``dtype``, else ``x``'s) runs the kernels."""
    dtype = x.dtype if dtype is None else dtype
    return dtype in _TRITON_DTYPES and triton_selected(x.device, dtype)


def _kernels():
    """The Triton launchers, imported on first use: the twin serves where Triton is absent."""
    from logitless.kernels import segments

    return segments


class _SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens):
        ctx.save_for_backward(mask, cu_seqlens)
        ctx.shape = x.shape
        return _kernels().segment_reduce(x, mask, cu_seqlens, "sum")[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        mask, cu_seqlens = ctx.saved_tensors
        return _kernels().segment_spread(g.contiguous(), ctx.shape, mask, cu_seqlens), None, None


class _SegmentMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens):
        out, count = _kernels().segment_reduce(x, mask, cu_seqlens, "mean")
        ctx.save_for_backward(mask, cu_seqlens, count)
        ctx.shape = x.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        mask, cu_seqlens, count = ctx.saved_tensors
        dx = _kernels().segment_spread(g.contiguous(), ctx.shape, mask, cu_seqlens, count=count)
        return dx, None, None


class _SegmentMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens, empty):
        out, ties = _kernels().segment_reduce(x, mask, cu_seqlens, "max", empty=empty)
        ctx.save_for_backward(x, mask, cu_seqlens, out, ties)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, mask, cu_seqlens, out, ties = ctx.saved_tensors
        dx = _kernels().segment_spread(g.contiguous(), x.shape, mask, cu_seqlens, count=ties,
                                       x=x, ref=out)
        return dx, None, None, None


class _PrefixSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens, reverse):
        ctx.save_for_backward(mask, cu_seqlens)
        ctx.reverse = reverse
        return _kernels().segment_scan(x, mask, cu_seqlens,
                                       "suffix_sum" if reverse else "prefix_sum")[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        mask, cu_seqlens = ctx.saved_tensors
        # Output t of a prefix sum holds x_j for every j <= t (masked t included).
        op = "prefix_sum" if ctx.reverse else "suffix_sum"
        dx = _kernels().segment_scan(g, mask, cu_seqlens, op, mask_output=True)[0]
        return dx, None, None, None


class _PrefixMin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens, exclusive):
        want = ctx.needs_input_grad[0]
        out, idx = _kernels().segment_scan(x, mask, cu_seqlens, "prefix_min",
                                           exclusive=exclusive, want_index=want)
        if want:
            ctx.save_for_backward(idx)
            ctx.shape, ctx.dtype = x.shape, x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        hit = idx >= 0
        dx = torch.zeros(ctx.shape, dtype=ctx.dtype, device=g.device)
        dx.scatter_add_(-1, torch.where(hit, idx, 0), torch.where(hit, g, 0).to(ctx.dtype))
        return dx, None, None, None


class _BroadcastPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, shape, cu_seqlens):
        ctx.save_for_backward(cu_seqlens)
        return _kernels().segment_spread(values.contiguous(), shape, None, cu_seqlens)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (cu_seqlens,) = ctx.saved_tensors
        return _kernels().segment_reduce(g.contiguous(), None, cu_seqlens, "sum")[0], None, None


def _local_segment_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]``: ``sum_t m x`` per sequence."""
    if _on_triton(x):
        return _SegmentSum.apply(x, mask, cu_seqlens)
    return twin.segment_sum(x, mask, cu_seqlens)


def _local_segment_count(mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]`` int64: number of valid tokens per sequence (``L_i``)."""
    if _on_triton(mask, torch.float32):
        return _kernels().segment_reduce(mask, mask, cu_seqlens, "count")[0]
    return twin.segment_count(mask, cu_seqlens)


def _local_segment_mean(x, mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]``: ``sum_t m x / L_i``; 0 for a sequence without valid tokens."""
    if _on_triton(x):
        return _SegmentMean.apply(x, mask, cu_seqlens)
    return twin.segment_mean(x, mask, cu_seqlens)


def _local_segment_max(x, mask, cu_seqlens=None, empty: float = 0.0) -> torch.Tensor:
    """``[B]``: max over valid tokens; ``empty`` for a sequence without valid tokens."""
    if _on_triton(x):
        return _SegmentMax.apply(x, mask, cu_seqlens, float(empty))
    return twin.segment_max(x, mask, cu_seqlens, empty)


def _local_prefix_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """Like ``x``: ``sum_{j <= t} m_j x_j`` within each sequence."""
    if _on_triton(x):
        return _PrefixSum.apply(x, mask, cu_seqlens, False)
    return twin.prefix_sum(x, mask, cu_seqlens)


def _local_suffix_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """Like ``x``: ``sum_{j >= t} m_j x_j`` within each sequence."""
    if _on_triton(x):
        return _PrefixSum.apply(x, mask, cu_seqlens, True)
    return twin.suffix_sum(x, mask, cu_seqlens)


def _local_prefix_min(x, mask, cu_seqlens=None, *, exclusive: bool = False) -> torch.Tensor:
    """Like ``x``: ``min(x_j : j <= t, m_j)`` (``j < t`` when ``exclusive``); ``+inf`` if none.

    The gradient reaches the arg-min token of each prefix (``torch.cummin``).
    """
    if _on_triton(x):
        return _PrefixMin.apply(x, mask, cu_seqlens, exclusive)
    return twin.prefix_min(x, mask, cu_seqlens, exclusive=exclusive)


def broadcast(values: torch.Tensor, like: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """Per-sequence ``values [B]`` repeated at each token of ``like`` (``[B, T]`` or ``[N]``)."""
    if cu_seqlens is not None and _on_triton(values):
        return _BroadcastPacked.apply(values, like.shape, cu_seqlens)
    return twin.broadcast(values, like, cu_seqlens)


def _cp_layout(x, cu_seqlens, name, grad_ok=True):
    """Over a group: only the padded grid, and (``grad_ok`` False) no gradient."""
    if cu_seqlens is not None:
        raise ValueError(f"cu_seqlens: {name} under cp_group takes the padded [B, T] grid "
                         "(policy_loss lays a packed batch out on it first)")
    if not grad_ok and x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"cp_group: {name} over ranks gives values only (pass a detached x)")


def segment_sum(x, mask, cu_seqlens=None, *, group=None) -> torch.Tensor:
    """``[B]``: ``sum_t m x`` per sequence."""
    local = _local_segment_sum(x, mask, cu_seqlens)
    if group is None:
        return local
    _cp_layout(x, cu_seqlens, "segment_sum")
    return cp.all_reduce(local, group)


def segment_count(mask, cu_seqlens=None, *, group=None) -> torch.Tensor:
    """``[B]`` int64: number of valid tokens per sequence (``L_i``)."""
    local = _local_segment_count(mask, cu_seqlens)
    if group is None:
        return local
    _cp_layout(mask, cu_seqlens, "segment_count")
    return cp.all_reduce(local, group)


def segment_mean(x, mask, cu_seqlens=None, *, group=None) -> torch.Tensor:
    """``[B]``: ``sum_t m x / L_i``; 0 for a sequence without valid tokens."""
    if group is None:
        return _local_segment_mean(x, mask, cu_seqlens)
    _cp_layout(x, cu_seqlens, "segment_mean")
    total = _local_segment_sum(x, mask)
    count = _local_segment_count(mask).to(total.dtype)
    total, count = cp.all_reduce(torch.stack([total, count]), group).unbind()
    return total / count.clamp(min=1)


def segment_max(x, mask, cu_seqlens=None, empty: float = 0.0, *,
                group=None) -> torch.Tensor:
    """``[B]``: max over valid tokens; ``empty`` for a sequence without valid tokens."""
    if group is None:
        return _local_segment_max(x, mask, cu_seqlens, empty)
    _cp_layout(x, cu_seqlens, "segment_max", grad_ok=False)
    out = cp.all_reduce(_local_segment_max(x.detach(), mask, None, -torch.inf), group,
                        dist.ReduceOp.MAX)
    return torch.where(torch.isneginf(out), torch.full_like(out, empty), out)


def _scan_sum(x, mask, cu_seqlens, reverse, group):
    local = (_local_suffix_sum if reverse else _local_prefix_sum)(x, mask, cu_seqlens)
    if group is None:
        return local
    _cp_layout(x, cu_seqlens, "suffix_sum" if reverse else "prefix_sum")
    # this rank's totals are the scan's last prefix (first suffix): no second pass
    if local.shape[-1] == 0:
        mine = local.new_zeros(local.shape[:-1])
    else:
        mine = local[:, 0] if reverse else local[:, -1]
    totals = cp.rank_totals(mine, group)
    return local + cp.earlier(totals, group, later=reverse)[:, None]


def prefix_sum(x, mask, cu_seqlens=None, *, group=None) -> torch.Tensor:
    """Like ``x``: ``sum_{j <= t} m_j x_j`` within each sequence."""
    return _scan_sum(x, mask, cu_seqlens, False, group)


def suffix_sum(x, mask, cu_seqlens=None, *, group=None) -> torch.Tensor:
    """Like ``x``: ``sum_{j >= t} m_j x_j`` within each sequence."""
    return _scan_sum(x, mask, cu_seqlens, True, group)


def prefix_min(x, mask, cu_seqlens=None, *, exclusive: bool = False,
               group=None) -> torch.Tensor:
    """Like ``x``: ``min(x_j : j <= t, m_j)`` (``j < t`` when ``exclusive``); ``+inf`` if none.

    The gradient reaches the arg-min token of each prefix (``torch.cummin``).
    """
    local = _local_prefix_min(x, mask, cu_seqlens, exclusive=exclusive)
    if group is None:
        return local
    _cp_layout(x, cu_seqlens, "prefix_min", grad_ok=False)
    mins = -_local_segment_max(-x.detach(), mask, None, -torch.inf)  # +inf where none
    before = cp.earlier(cp.rank_totals(mins, group, dist.ReduceOp.MIN), group,
                        op=dist.ReduceOp.MIN)
    return torch.minimum(local, before[:, None])
