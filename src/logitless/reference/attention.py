"""Reference for attention entropy: the full ``T x T`` probabilities, then ``-sum p log p``.

Visibility of key ``j`` from query ``i`` (indices inside one sequence; in the padded layout the
row index, padding included, as transformers' masks count it):

- ``attention_mask[j]`` is 1 (padded layout) and ``j`` lies in the query's sequence (packed);
- causal: ``j <= i``;
- ``window = W``: ``i - j < W`` (the query itself and the ``W - 1`` keys before it, which is
  transformers' ``sliding_window = W`` and flash-attn's ``window_size = (W - 1, 0)``); without
  ``causal`` also ``j - i < W`` (flash-attn's ``window_size = (W - 1, W - 1)``).

Queries whose ``attention_mask`` or ``query_mask`` is 0, and rows that see no key, get 0;
a selected row that sees a NaN (its query, or a visible key) gets NaN.
"""

from __future__ import annotations

import itertools

import torch

from logitless.fused_losses.oplib import check_positive_number

__all__ = ["attention_entropy", "attention_visibility"]


def attention_visibility(
    n: int, *, causal: bool, window: int | None, device: torch.device | None = None
) -> torch.Tensor:
    """Boolean ``[n, n]`` matrix, ``[i, j]`` True when query ``i`` may attend to key ``j``."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    visible = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= i - j < window
        if not causal:
            visible &= j - i < window
    return visible


def _entropy_one(
    q: torch.Tensor,
    k: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q ``[Hq, T, d]``, k ``[Hk, T, d]``, visible ``[T, T]`` -> entropies ``[Hq, T]``."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    s = scale * q @ k.transpose(-1, -2)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1)
    # 0 log 0 = 0 (a NaN p stays NaN); a row that sees nothing softmaxes to NaN and is set to
    # 0 below.
    plogp = torch.where(p == 0, torch.zeros_like(p), p * torch.log(p))
    h = -plogp.sum(-1)
    return torch.where(visible.any(-1), h, torch.zeros_like(h))


def attention_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    query_mask: torch.Tensor | None = None,
    reduce_heads: str | None = None,
) -> torch.Tensor:
    """Per-query attention entropy from the materialised probabilities, in the inputs' dtype.

    Padded: q ``[B, Hq, T, d]``, k ``[B, Hk, T, d]``, attention_mask / query_mask ``[B, T]``
    -> ``[B, Hq, T]``. Packed: q ``[total, Hq, d]``, k ``[total, Hk, d]``, cu_seqlens
    ``[S + 1]``, query_mask ``[total]`` -> ``[total, Hq]``. Scores ``s = scale * q.k`` (default
    ``d ** -0.5``), then ``softcap * tanh(s / softcap)``; ``H = -sum_j p_j log p_j``.
    ``reduce_heads="mean"`` averages over the head dimension. Run it in fp64 for the oracle.
    """
    for name, value in (("scale", scale), ("softcap", softcap)):
        if value is not None:
            check_positive_number(name, value)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        b, _, t, _ = q.shape
        out = q.new_zeros(b, q.shape[1], t)
        for i in range(b):
            visible = attention_visibility(t, causal=causal, window=window, device=q.device)
            rows = torch.ones(t, dtype=torch.bool, device=q.device)
            if attention_mask is not None:
                valid = attention_mask[i].bool()
                visible = visible & valid[None, :]
                rows &= valid
            if query_mask is not None:
                rows &= query_mask[i].bool()
            h = _entropy_one(q[i], k[i], visible, scale, softcap)
            out[i] = torch.where(rows, h, torch.zeros_like(h))
        return out.mean(1) if reduce_heads == "mean" else out

    out = q.new_zeros(q.shape[0], q.shape[1])
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        n = end - start
        visible = attention_visibility(n, causal=causal, window=window, device=q.device)
        h = _entropy_one(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), visible, scale, softcap
        )
        out[start:end] = h.transpose(0, 1)
    if query_mask is not None:
        out = torch.where(query_mask.bool()[:, None], out, torch.zeros_like(out))
    return out.mean(1) if reduce_heads == "mean" else out
