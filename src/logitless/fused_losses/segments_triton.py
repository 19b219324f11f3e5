"""Autograd over the segmented Triton kernels (``kernels/segments.py``).

``fused_losses/segments.py`` calls these when :func:`backend.triton_selected` picks Triton for
the tensor (CUDA, or ``LOGITLESS_BACKEND=triton``; fp64 stays on the torch twins there, though
the functions here accept it so that ``gradcheck`` can run on them). Values and gradients are
those of the torch twins:

- sum: ``dx_t = m_t g_b``; mean: ``dx_t = m_t g_b / max(L_b, 1)`` (both one spread launch);
- max: ``g_b`` split evenly between the valid tokens equal to the max (``amax``'s rule; the
  forward kernel counts the ties);
- prefix sum: ``dx_j = m_j sum_{t >= j} g_t`` (a suffix scan of ``g``, masked at the output) and
  the suffix sum the other way round;
- prefix min: ``g_t`` to the arg-min token of the prefix, which the forward kernel returns
  (ties to the latest token, as ``torch.cummin``); nothing where the prefix has no valid token;
- broadcast (packed): the backward is an unmasked segment sum. Padded broadcast stays a
  zero-copy ``expand``, whose backward is one ``sum``.

The backward passes are not differentiable again (``once_differentiable``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from logitless.kernels import segments as kernels


class _SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens):
        ctx.save_for_backward(mask, cu_seqlens)
        ctx.shape = x.shape
        return kernels.segment_reduce(x, mask, cu_seqlens, "sum")[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        mask, cu_seqlens = ctx.saved_tensors
        return kernels.segment_spread(g.contiguous(), ctx.shape, mask, cu_seqlens), None, None


class _SegmentMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens):
        out, count = kernels.segment_reduce(x, mask, cu_seqlens, "mean")
        ctx.save_for_backward(mask, cu_seqlens, count)
        ctx.shape = x.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        mask, cu_seqlens, count = ctx.saved_tensors
        dx = kernels.segment_spread(g.contiguous(), ctx.shape, mask, cu_seqlens, count=count)
        return dx, None, None


class _SegmentMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens, empty):
        out, ties = kernels.segment_reduce(x, mask, cu_seqlens, "max", empty=empty)
        ctx.save_for_backward(x, mask, cu_seqlens, out, ties)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, mask, cu_seqlens, out, ties = ctx.saved_tensors
        dx = kernels.segment_spread(g.contiguous(), x.shape, mask, cu_seqlens, count=ties, x=x,
                                    ref=out)
        return dx, None, None, None


class _PrefixSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens, reverse):
        ctx.save_for_backward(mask, cu_seqlens)
        ctx.reverse = reverse
        return kernels.segment_scan(x, mask, cu_seqlens,
                                    "suffix_sum" if reverse else "prefix_sum")[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        mask, cu_seqlens = ctx.saved_tensors
        # Output t of a prefix sum holds x_j for every j <= t (masked t included).
        op = "prefix_sum" if ctx.reverse else "suffix_sum"
        dx = kernels.segment_scan(g, mask, cu_seqlens, op, mask_output=True)[0]
        return dx, None, None, None


class _PrefixMin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, cu_seqlens, exclusive):
        want = ctx.needs_input_grad[0]
        out, idx = kernels.segment_scan(x, mask, cu_seqlens, "prefix_min", exclusive=exclusive,
                                        want_index=want)
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
        return kernels.segment_spread(values.contiguous(), shape, None, cu_seqlens)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (cu_seqlens,) = ctx.saved_tensors
        return kernels.segment_reduce(g.contiguous(), None, cu_seqlens, "sum")[0], None, None


def segment_sum(x, mask, cu_seqlens=None):
    return _SegmentSum.apply(x, mask, cu_seqlens)


def segment_count(mask, cu_seqlens=None):
    return kernels.segment_reduce(mask, mask, cu_seqlens, "count")[0]


def segment_mean(x, mask, cu_seqlens=None):
    return _SegmentMean.apply(x, mask, cu_seqlens)


def segment_max(x, mask, cu_seqlens=None, empty=0.0):
    return _SegmentMax.apply(x, mask, cu_seqlens, float(empty))


def prefix_sum(x, mask, cu_seqlens=None):
    return _PrefixSum.apply(x, mask, cu_seqlens, False)


def suffix_sum(x, mask, cu_seqlens=None):
    return _PrefixSum.apply(x, mask, cu_seqlens, True)


def prefix_min(x, mask, cu_seqlens=None, *, exclusive=False):
    return _PrefixMin.apply(x, mask, cu_seqlens, exclusive)


def broadcast(values, like, cu_seqlens=None):
    if cu_seqlens is None:
        if values.shape != like.shape[:1] or like.dim() != 2:
            raise ValueError(f"values must be [B] for like [B, T], got {tuple(values.shape)} and "
                             f"{tuple(like.shape)}")
        return values[:, None].expand_as(like)
    return _BroadcastPacked.apply(values, like.shape, cu_seqlens)
