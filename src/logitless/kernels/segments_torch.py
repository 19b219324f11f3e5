"""PyTorch twin of the segmented kernels (``kernels/segments.py``): the CPU path and their oracle.

Every function takes either a right-padded ``x [B, T]`` with ``mask [B, T]``, or a packed
``x [N]`` with ``mask [N]`` and ``cu_seqlens [B + 1]`` (int, increasing, ``cu_seqlens[0] == 0``,
``cu_seqlens[-1] == N``, the flash-attention layout). A packed batch is scattered into a
``[B, L_max]`` grid with one vectorised index (:func:`packed_index`, no Python loop over
sequences), reduced or scanned there, and gathered back, so both layouts give bit-identical
results. Masked tokens contribute nothing to sums and are skipped by min/max; scans return
values at every position (masked ones included). Plain torch ops: autograd differentiates them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PackedIndex", "broadcast", "packed_index", "prefix_min", "prefix_sum", "segment_count",
           "segment_max", "segment_mean", "segment_sum", "suffix_sum", "to_packed", "to_padded"]


class PackedIndex(NamedTuple):
    """Where each token of a packed ``[N]`` batch sits in its right-padded ``[B, width]`` grid.

    ``row``, ``col``: int64 ``[N]``, the token's sequence and its position in that sequence.
    """

    row: torch.Tensor
    col: torch.Tensor
    shape: tuple[int, int]

    def pad(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Packed ``x [N, ...]`` on the grid ``[B, width, ...]``, ``fill`` after each
        sequence."""
        return x.new_full((*self.shape, *x.shape[1:]), fill).index_put((self.row, self.col), x)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """Grid ``y [B, T]`` (``T >= width``) back to packed ``[N]``."""
        return y[self.row, self.col]


def packed_index(cu_seqlens: torch.Tensor, total: int | None = None,
                 width: int | None = None) -> PackedIndex:
    """The :class:`PackedIndex` of the batch whose sequences start at ``cu_seqlens [B + 1]``.

    ``total`` (``N = cu_seqlens[-1]``) and ``width`` (``L_max``): pass them when the host
    already knows them, so that nothing is read back from the device. Each token's sequence is
    found by a binary search of its position among the sequence ends (static shapes, no host
    read). Under ``torch.compile`` the width defaults to ``N``, a bound on every length that
    the shapes give (reading ``L_max`` would break the graph): the grid is then ``[B, N]``.
    """
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if total is None:
        total = int(cu_seqlens[-1])
    if width is None:
        if torch.compiler.is_compiling():
            width = total
        else:
            width = int(lengths.max()) if lengths.numel() else 0
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # the number of sequence ends at or before a token is the index of its sequence
    # (an empty sequence ends where the next one starts, and is skipped)
    row = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
    col = tokens.long() - cu_seqlens[:-1].long()[row]
    return PackedIndex(row, col, (lengths.numel(), width))


def to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Packed ``x [N]`` to right-padded ``[B, L_max]`` (differentiable)."""
    return packed_index(cu_seqlens, total=x.shape[0]).pad(x, fill)


def to_packed(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Right-padded ``x [B, T]`` (T >= L_max) back to packed ``[N]`` (differentiable)."""
    return packed_index(cu_seqlens).unpad(x)


def _grid(x, mask, cu_seqlens, fill=0.0):
    if cu_seqlens is None:
        return x, mask.bool()
    index = packed_index(cu_seqlens, total=x.shape[0])
    return index.pad(x, fill), index.pad(mask.bool(), False)


def _scan_out(y, x, cu_seqlens):
    """A scan's grid ``y`` back to the layout of its input ``x``."""
    return y if cu_seqlens is None else packed_index(cu_seqlens, total=x.shape[0]).unpad(y)


def _masked_sum(x, mask, cu_seqlens):
    g, m = _grid(x, mask, cu_seqlens)
    return torch.where(m, g, torch.zeros_like(g)).sum(-1), m


def segment_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]``: ``sum_t m x`` per sequence."""
    return _masked_sum(x, mask, cu_seqlens)[0]


def segment_count(mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]`` int64: number of valid tokens per sequence (``L_i``)."""
    _, m = _grid(mask, mask, cu_seqlens)
    return m.sum(-1)


def segment_mean(x, mask, cu_seqlens=None) -> torch.Tensor:
    """``[B]``: ``sum_t m x / L_i``; 0 for a sequence without valid tokens."""
    total, m = _masked_sum(x, mask, cu_seqlens)
    return total / m.sum(-1).clamp(min=1).to(total.dtype)


def segment_max(x, mask, cu_seqlens=None, empty: float = 0.0) -> torch.Tensor:
    """``[B]``: max over valid tokens; ``empty`` for a sequence without valid tokens."""
    g, m = _grid(x, mask, cu_seqlens)
    if g.shape[-1] == 0:  # no token at all (e.g. an empty packed batch): nothing to reduce
        return g.new_full(g.shape[:-1], empty)
    out = torch.where(m, g, torch.full_like(g, -torch.inf)).amax(-1)
    return torch.where(m.any(-1), out, torch.full_like(out, empty))


def prefix_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """Like ``x``: ``sum_{j <= t} m_j x_j`` within each sequence."""
    g, m = _grid(x, mask, cu_seqlens)
    return _scan_out(torch.where(m, g, torch.zeros_like(g)).cumsum(-1), x, cu_seqlens)


def suffix_sum(x, mask, cu_seqlens=None) -> torch.Tensor:
    """Like ``x``: ``sum_{j >= t} m_j x_j`` within each sequence."""
    g, m = _grid(x, mask, cu_seqlens)
    y = torch.where(m, g, torch.zeros_like(g)).flip(-1).cumsum(-1).flip(-1)
    return _scan_out(y, x, cu_seqlens)


def prefix_min(x, mask, cu_seqlens=None, *, exclusive: bool = False) -> torch.Tensor:
    """Like ``x``: ``min(x_j : j <= t, m_j)`` (``j < t`` when ``exclusive``); ``+inf`` if none.

    The gradient reaches the arg-min token of each prefix (``torch.cummin``).
    """
    g, m = _grid(x, mask, cu_seqlens)
    vals = torch.where(m, g, torch.full_like(g, torch.inf))
    if exclusive:
        vals = torch.cat([torch.full_like(vals[..., :1], torch.inf), vals[..., :-1]], -1)
    return _scan_out(torch.cummin(vals, -1).values, x, cu_seqlens)


def broadcast(values: torch.Tensor, like: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """Per-sequence ``values [B]`` repeated at each token of ``like`` (``[B, T]`` or ``[N]``)."""
    if cu_seqlens is None:
        return values[:, None].expand_as(like)
    return values[packed_index(cu_seqlens, total=like.shape[0]).row]
