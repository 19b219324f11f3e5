"""Segmented reductions and scans over packed (``cu_seqlens``) and right-padded batches.

Every function takes either a right-padded ``x [B, T]`` with ``mask [B, T]``, or a packed
``x [N]`` with ``mask [N]`` and ``cu_seqlens [B + 1]`` (int, increasing, ``cu_seqlens[-1] == N``,
the flash-attention layout). A packed batch is scattered into a ``[B, L_max]`` grid with one
vectorised index (no Python loop over sequences), reduced or scanned there, and gathered back,
so both layouts give bit-identical results. Masked tokens contribute nothing to sums and are
skipped by min/max; scans return values at every position (masked ones included).

This is the CPU path and the oracle for the Triton versions in ``kernels/segments.py``: the
reductions, scans and packed ``broadcast`` run those (autograd in ``segments_triton.py``) when
``triton_selected`` picks Triton for ``x`` (CUDA, or ``LOGITLESS_BACKEND=triton``; fp32, bf16
and fp16 only, fp64 stays here), with the same values and gradients.
"""

import torch

from logitless.fused_losses.backend import triton_selected

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_ops(x: torch.Tensor, dtype: torch.dtype | None = None):
    """``segments_triton`` when this call runs the Triton kernels, else None."""
    dtype = x.dtype if dtype is None else dtype
    if dtype not in _TRITON_DTYPES or not triton_selected(x.device, dtype):
        return None
    from logitless.fused_losses import segments_triton

    return segments_triton


def packed_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sequence id ``[N]``, position within the sequence ``[N]`` and ``L_max`` of a packed batch."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    n = int(cu_seqlens[-1])
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    pos = torch.arange(n, device=cu_seqlens.device) - cu_seqlens[:-1].long()[seq]
    l_max = int(lengths.max()) if lengths.numel() else 0
    return seq, pos, l_max


def to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Packed ``x [N]`` to right-padded ``[B, L_max]`` (differentiable)."""
    seq, pos, l_max = packed_index(cu_seqlens)
    out = x.new_full((cu_seqlens.numel() - 1, l_max), fill)
    return out.index_put((seq, pos), x)


def to_packed(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Right-padded ``x [B, T]`` (T >= L_max) back to packed ``[N]`` (differentiable)."""
    seq, pos, _ = packed_index(cu_seqlens)
    return x[seq, pos]


def _grid(x, mask, cu_seqlens, fill=0.0):
    if cu_seqlens is None:
        return x, mask.bool()
    return to_padded(x, cu_seqlens, fill), to_padded(mask.bool(), cu_seqlens, False)


def _scan_out(y, cu_seqlens):
    return y if cu_seqlens is None else to_packed(y, cu_seqlens)


def segment_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]``: ``sum_t m x`` per sequence."""
    if (fast := _triton_ops(x)) is not None:
        return fast.segment_sum(x, mask, cu_seqlens)
    g, m = _grid(x, mask, cu_seqlens)
    return torch.where(m, g, torch.zeros_like(g)).sum(-1)


def segment_count(mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]`` int64: number of valid tokens per sequence (``L_i``)."""
    if (fast := _triton_ops(mask, torch.float32)) is not None:
        return fast.segment_count(mask, cu_seqlens)
    _, m = _grid(mask, mask, cu_seqlens)
    return m.sum(-1)


def segment_mean(x, mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]``: ``sum_t m x / L_i``; 0 for a sequence without valid tokens."""
    if (fast := _triton_ops(x)) is not None:
        return fast.segment_mean(x, mask, cu_seqlens)
    g, m = _grid(x, mask, cu_seqlens)
    total = torch.where(m, g, torch.zeros_like(g)).sum(-1)
    return total / m.sum(-1).clamp(min=1).to(total.dtype)


def segment_max(x, mask, cu_seqlens=None, empty: float = 0.0) -> torch.Tensor:
    """``[B]``: max over valid tokens; ``empty`` for a sequence without valid tokens."""
    if (fast := _triton_ops(x)) is not None:
        return fast.segment_max(x, mask, cu_seqlens, empty)
    g, m = _grid(x, mask, cu_seqlens)
    out = torch.where(m, g, torch.full_like(g, -torch.inf)).amax(-1)
    return torch.where(m.any(-1), out, torch.full_like(out, empty))


def prefix_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """Like ``x``: ``sum_{j <= t} m_j x_j`` within each sequence."""
    if (fast := _triton_ops(x)) is not None:
        return fast.prefix_sum(x, mask, cu_seqlens)
    g, m = _grid(x, mask, cu_seqlens)
    return _scan_out(torch.where(m, g, torch.zeros_like(g)).cumsum(-1), cu_seqlens)


def suffix_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """Like ``x``: ``sum_{j >= t} m_j x_j`` within each sequence."""
    if (fast := _triton_ops(x)) is not None:
        return fast.suffix_sum(x, mask, cu_seqlens)
    g, m = _grid(x, mask, cu_seqlens)
    y = torch.where(m, g, torch.zeros_like(g)).flip(-1).cumsum(-1).flip(-1)
    return _scan_out(y, cu_seqlens)


def prefix_min(x, mask, cu_seqlens=None, *, exclusive: bool = False) -> torch.Tensor:
    """Like ``x``: ``min(x_j : j <= t, m_j)`` (``j < t`` when ``exclusive``); ``+inf`` if none.

    The gradient reaches the arg-min token of each prefix (``torch.cummin``).
    """
    if (fast := _triton_ops(x)) is not None:
        return fast.prefix_min(x, mask, cu_seqlens, exclusive=exclusive)
    g, m = _grid(x, mask, cu_seqlens)
    vals = torch.where(m, g, torch.full_like(g, torch.inf))
    if exclusive:
        vals = torch.cat([torch.full_like(vals[..., :1], torch.inf), vals[..., :-1]], -1)
    return _scan_out(torch.cummin(vals, -1).values, cu_seqlens)


def broadcast(values: torch.Tensor, like: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """Per-sequence ``values [B]`` repeated at each token of ``like`` (``[B, T]`` or ``[N]``)."""
    if cu_seqlens is not None and (fast := _triton_ops(values)) is not None:
        return fast.broadcast(values, like, cu_seqlens)
    if cu_seqlens is None:
        return values[:, None].expand_as(like)
    seq, _, _ = packed_index(cu_seqlens)
    return values[seq]
