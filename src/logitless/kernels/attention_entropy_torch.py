"""Chunked PyTorch twin of the attention-entropy kernel: same algorithm, bounded memory.

Queries are taken in chunks of ``block_q`` rows and keys streamed in chunks of ``block_k``, so
the largest temporary is one ``[B, Hq, block_q, block_k]`` score tile (the chunk sizes follow a
fixed element budget), never ``T x T``. Per query the running statistics are

- ``m``: the largest visible score so far,
- ``l = sum_j e^(s_j - m)``,
- ``a = sum_j e^(s_j - m) (s_j - m)``, kept relative to ``m`` so that the entropy
  ``H = log l - a / l`` never subtracts two large numbers (``lse`` and ``sum p s``).

Key chunks that no query of the chunk can see (above the causal diagonal, outside the window
or outside the query's packed sequence) are skipped. Inputs may be fp32/bf16/fp16; everything
is computed in fp32.

Visibility contract (shared with ``attention_entropy.py``), for query row ``i`` and key ``j``
of batch row ``b``: ``key_valid[b, j]``; ``seg_start[b, i] <= j < seg_end[b, i]``; causal
``j <= i``; window ``i - j < window`` (and ``j - i < window`` when not causal). Rows with
``query_valid[b, i]`` False, or that see no key, get 0; a row that sees a NaN score gets NaN
(``l`` is NaN then, and ``l != 0`` keeps it).
"""

from __future__ import annotations

import torch

__all__ = ["attention_entropy_chunked"]

# Elements of one fp32 score tile: 2**21 is 8 MiB; the update keeps a few such temporaries.
_TILE_ELEMENTS = 2**21
# A finite "minus infinity" for the running max: e^(m - m_new) and l * (m - m_new) stay
# well defined (0) while a row has seen no key yet, where a true -inf would give NaN.
_NEG = -1.0e30


def _key_range(
    q0: int,
    q1: int,
    t: int,
    causal: bool,
    window: int | None,
    seg_start: torch.Tensor | None,
    seg_end: torch.Tensor | None,
) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that any query in rows ``[q0, q1)`` may see."""
    lo, hi = 0, t
    if seg_start is not None:
        lo = int(seg_start[:, q0].min())
        hi = int(seg_end[:, q1 - 1].max())
    if causal:
        hi = min(hi, q1)
    if window is not None:
        lo = max(lo, q0 - window + 1)
        if not causal:
            hi = min(hi, q1 - 1 + window)
    return lo, hi


def _all_visible(
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    causal: bool,
    window: int | None,
    seg_start: torch.Tensor | None,
    seg_end: torch.Tensor | None,
    key_valid: torch.Tensor | None,
) -> bool:
    """True when every query of rows ``[q0, q1)`` sees every key of ``[k0, k1)``: the tile then
    needs no mask (most tiles of a long causal sequence lie wholly below the diagonal)."""
    if causal and k1 - 1 > q0:
        return False
    if window is not None and (q1 - 1 - k0 >= window or (not causal and k1 - 1 - q0 >= window)):
        return False
    if seg_start is not None:
        inside = (seg_start[:, q0:q1] <= k0) & (seg_end[:, q0:q1] >= k1)
        if not bool(inside.all()):
            return False
    return key_valid is None or bool(key_valid[:, k0:k1].all())


def _visibility(
    rows: torch.Tensor,
    cols: torch.Tensor,
    causal: bool,
    window: int | None,
    seg_start: torch.Tensor | None,
    seg_end: torch.Tensor | None,
    key_valid: torch.Tensor | None,
) -> torch.Tensor | None:
    """Boolean ``[B or 1, rows, cols]`` visibility of a tile, or None when all is visible."""
    i = rows[:, None]
    j = cols[None, :]
    vis = None

    def both(x, y):
        return y if x is None else x & y

    if causal:
        vis = both(vis, j <= i)
    if window is not None:
        vis = both(vis, i - j < window)
        if not causal:
            vis = both(vis, j - i < window)
    if vis is not None:
        vis = vis[None]
    if seg_start is not None:
        lo = seg_start[:, rows][:, :, None]
        hi = seg_end[:, rows][:, :, None]
        vis = both(vis, (j[None] >= lo) & (j[None] < hi))
    if key_valid is not None:
        vis = both(vis, key_valid[:, cols][:, None, :])
    return vis


def attention_entropy_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: int | None = None,
    softcap: float | None = None,
    seg_start: torch.Tensor | None = None,
    seg_end: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Attention entropy per query, fp32 ``[B, Hq, T]``.

    q ``[B, Hq, T, d]``, k ``[B, Hk, T, d]`` (``Hq`` a multiple of ``Hk``, any strides);
    seg_start / seg_end int ``[B, T]``, key_valid / query_valid bool ``[B, T]`` as in the module
    docstring. ``block_q`` / ``block_k`` override the chunk sizes (tests use small ones).
    """
    b, hq, t, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    if block_k is None:
        block_k = min(512, max(t, 1))
    if block_q is None:
        block_q = max(16, min(1024, _TILE_ELEMENTS // max(1, b * hq * block_k)))
    out = torch.zeros(b, hq, t, dtype=torch.float32, device=q.device)
    positions = torch.arange(t, device=q.device)
    for q0 in range(0, t, block_q):
        q1 = min(q0 + block_q, t)
        if query_valid is not None and not bool(query_valid[:, q0:q1].any()):
            continue
        lo, hi = _key_range(q0, q1, t, causal, window, seg_start, seg_end)
        n = q1 - q0
        # [B, Hk, group * n, d]: a query head's rows sit next to those of its key head's group.
        qc = q[:, :, q0:q1].float().reshape(b, hk, group * n, d)
        m = torch.full((b, hk, group, n), _NEG, device=q.device)
        l = torch.zeros_like(m)
        a = torch.zeros_like(m)
        for k0 in range((lo // block_k) * block_k, hi, block_k):
            k1 = min(k0 + block_k, hi)
            kc = k[:, :, k0:k1].float()
            # In-place from here on: the score tile and p are the only tile-sized buffers.
            s = (qc @ kc.transpose(-1, -2)).view(b, hk, group, n, k1 - k0).mul_(scale)
            if softcap is not None:
                s.div_(softcap).tanh_().mul_(softcap)
            if not _all_visible(q0, q1, k0, k1, causal, window, seg_start, seg_end, key_valid):
                vis = _visibility(
                    positions[q0:q1],
                    positions[k0:k1],
                    causal,
                    window,
                    seg_start,
                    seg_end,
                    key_valid,
                )
                # -inf replaces hidden scores outright, so a NaN there cannot leak.
                s.masked_fill_(~vis[:, None, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            s.sub_(m_new[..., None])  # s - m', -inf at hidden keys
            p = torch.exp(s)
            # Hidden keys: p = 0 and s - m' = -inf; clamp so their product is 0, not NaN.
            s.clamp_(min=_NEG)
            alpha = torch.exp(m - m_new)
            a = alpha * (a + l * (m - m_new))
            l = alpha * l + p.sum(-1)
            a += p.mul_(s).sum(-1)
            m = m_new
        seen = l != 0  # NaN when the row saw a NaN: kept, never read as "saw nothing"
        l_safe = torch.where(seen, l, torch.ones_like(l))
        h = torch.where(seen, torch.log(l_safe) - a / l_safe, torch.zeros_like(l))
        out[:, :, q0:q1] = h.reshape(b, hq, n)
    if query_valid is not None:
        # where, not a product: an unselected row computed beside selected ones may be NaN.
        out = torch.where(query_valid[:, None, :], out, torch.zeros_like(out))
    return out
