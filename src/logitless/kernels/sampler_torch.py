"""Chunked PyTorch path of the sampler-matched logprobs (top-k, top-p, min-p, per-token
temperature as vLLM applies them; the semantics are in ``logitless.reference.sampler``).

Rows go through in chunks of ``R`` whole-vocabulary rows, ``R`` from the byte budget and the
vocabulary only (never from the number of tokens, so a token's results do not depend on its
batch); only one chunk's ``[R, V]`` logits and a few same-shaped temporaries ever exist. The
algorithm per chunk, which a one-program-per-row kernel can follow tile by tile:

1. logits ``z`` (GEMMs over vocabulary slices), the row maximum ``m`` and the full
   normaliser ``lse``;
2. min-p: candidates ``z >= m + log(min_p)`` (``min_p = 0``: ``log 0 = -inf``, all);
3. top-k: the ``k``-th largest candidate by a radix select over the **ordered integer keys**
   of the logits (the float's bit pattern, negatives flipped, so integer order is float
   order): the largest key ``t`` with ``#{key >= t} >= k``, found a byte at a time from the
   top with a per-row 256-bin histogram of the keys sharing the bytes chosen so far (4 passes
   for fp32 keys; a kernel can equally bisect, 32 counting passes); then the
   ``k - #{key > t}`` tokens tied at ``t`` with the lowest vocabulary ids are kept;
4. top-p: the same select with each candidate weighted by ``exp(z - m)``: the largest key
   ``t`` whose candidates at or above it hold at least ``p`` of the candidates' mass; the
   ``ceil((p L - G) / e_t)`` tokens tied at ``t`` with the lowest ids are kept (``G``: the
   mass strictly above ``t``, ``e_t``: a tied token's weight). Rows with ``p = 1`` are left
   alone;
5. the kept set is now a prefix of the vocabulary ordered by (logit descending, id
   ascending): it is stored as two numbers per row, the key ``t`` of its smallest logit and how
   many of the tokens at ``t`` it holds (lowest ids first); the backward rebuilds it from them;
6. ``log q_y``, the kept distribution's entropy and ``log_kept_mass``.

The backward recomputes the chunk's logits and the kept set, and forms with ``q`` (the kept
distribution, 0 outside it) and ``p`` (the full softmax)
``dz = g_lp (1[j=y] - q) - g_H q (log q + H) + g_kept (q - p) + g_lse p``
(``g_lp`` taken as 0 on rows whose target is outside the kept set: their logprob is ``-inf``
and carries no gradient), then the transform's derivative and the GEMMs, accumulating in fp32
(fp64 for fp64 inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from logitless.kernels.linear_softmax_torch import (
    DEFAULT_TILE_BYTES,
    _head_slice,
    _pad_rows,
    _row_blocks,
    acc_dtype,
    addmm_acc_,
    logits_into,
    through_transform_,
)

__all__ = ["RowParams", "backward", "forward", "rows_per_chunk"]

# Vocabulary columns per GEMM of a chunk's logits.
_COLS = 16384
# Most rows per chunk.
_MAX_ROWS = 1024


@dataclass
class RowParams:
    """Per-row sampler settings, each ``[N]`` (None: off). ``temperature`` and ``min_p`` in the
    accumulation dtype, ``top_p`` fp64, ``top_k`` int64 (values above ``V`` mean all)."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None

    def rows(self, sl: slice, padded: int) -> RowParams:
        """The settings of rows ``sl``, padded with no-op values up to ``padded`` rows."""
        def cut(x, fill):
            return None if x is None else _pad_rows(x[sl], padded, fill)
        return RowParams(cut(self.temperature, 1.0), cut(self.top_k, 2**62),
                         cut(self.top_p, 1.0), cut(self.min_p, 0.0))


def rows_per_chunk(v: int, tile_bytes: int, dtype: torch.dtype, softcap: float | None) -> int:
    """Rows per chunk so that a chunk's buffers fit in ``tile_bytes``: the logits and two
    temporaries in the accumulation dtype, ``tanh`` when soft-capping, the keys, the radix
    select's digits and fp64 weights, and masks. From the vocabulary, the budget and the dtype
    only."""
    acc = acc_dtype(dtype).itemsize
    per_elem = acc * (4 if softcap is not None else 3) + 36
    return max(1, min(_MAX_ROWS, tile_bytes // (v * per_elem)))


def _chunk_logits(h, weight, bias, params: RowParams, softcap, logit_scale):
    """Tempered logits ``[R, V]`` of one chunk in the accumulation dtype and ``tanh(x / c)``
    when soft-capping (else None)."""
    r, v = h.shape[0], weight.shape[0]
    acc = acc_dtype(h.dtype)
    z = torch.empty(r, v, dtype=acc, device=h.device)
    cap = torch.empty_like(z) if softcap is not None else None
    cols = min(v, _COLS)
    buf = torch.empty(r * cols, dtype=acc, device=h.device)
    low = torch.empty(r * cols, dtype=h.dtype, device=h.device) if acc != h.dtype else None
    tbuf = torch.empty(r * cols, dtype=acc, device=h.device) if softcap is not None else None
    for c0 in range(0, v, cols):
        w, b = _head_slice(weight, bias, c0, cols, h.dtype)
        n = w.shape[0]
        x = buf[:r * n].view(r, n)
        t = logits_into(x, None if low is None else low[:r * n].view(r, n),
                        None if tbuf is None else tbuf[:r * n].view(r, n), h, w, b, 1.0,
                        softcap, logit_scale, vocab_major=False)
        z[:, c0:c0 + n] = x
        if t is not None:
            cap[:, c0:c0 + n] = t
    z /= params.temperature.unsqueeze(1)
    return z, cap


def _ordered_keys(z: torch.Tensor) -> torch.Tensor:
    """Integers ordered as the floats ``z`` are (``-0.0`` taken as ``+0.0``)."""
    if z.dtype == torch.float64:
        bits, flip = (z + 0.0).view(torch.int64), 0x7FFFFFFFFFFFFFFF
    else:
        bits, flip = (z + 0.0).view(torch.int32), 0x7FFFFFFF
    return torch.where(bits < 0, bits ^ flip, bits)


def _candidate_keys(keys, cand):
    """``keys`` with the non-candidates at the dtype's minimum (below every candidate, with
    weight 0, so they never count)."""
    return torch.where(cand, keys, torch.iinfo(keys.dtype).min)


def _largest_key(kk, weight, target):
    """Per row, the largest key ``t`` with ``sum(weight[kk >= t]) >= target`` (``weight``
    None: a count), by radix select: 8 bits at a time from the top, a per-row 256-bin
    histogram (weighted for top-p) of the next byte of the keys that share the bytes chosen so
    far; the chosen byte is the largest whose bins from it upward, plus the weight already
    known to lie above, reach the target. 4 passes for fp32 keys (8 for fp64)."""
    bits = torch.iinfo(kk.dtype).bits
    sign = torch.iinfo(kk.dtype).min
    ukey = kk ^ sign  # unsigned order as a bit pattern: the byte digits compare as 0..255
    rows = kk.shape[0]
    prefix = torch.zeros(rows, dtype=kk.dtype, device=kk.device)
    above = torch.zeros_like(target) if weight is not None else \
        torch.zeros(rows, dtype=torch.int64, device=kk.device)
    ones = None
    for shift in range(bits - 8, -1, -8):
        digit = ((ukey >> shift) & 255).long()
        if shift + 8 < bits:
            match = (ukey >> (shift + 8)) == (prefix >> (shift + 8)).unsqueeze(1)
        else:
            match = None
        if weight is None:
            if ones is None:
                ones = torch.ones(1, dtype=torch.int64, device=kk.device).expand_as(digit)
            w = ones if match is None else match.long()
        else:
            w = weight if match is None else torch.where(match, weight, 0.0)
        hist = torch.zeros(rows, 256, dtype=w.dtype, device=kk.device).scatter_add_(1, digit, w)
        # mass at or above each byte value: suffix sums, plus what lies above the prefix
        upward = hist.flip(1).cumsum(1).flip(1) + above.unsqueeze(1)
        reach = upward >= target.unsqueeze(1)
        # the largest byte that reaches (byte 0 when none does: only when lo is the answer)
        chosen = torch.where(reach, torch.arange(256, device=kk.device), 0).amax(1)
        nxt = (chosen + 1).clamp(max=255)
        above = torch.where(chosen < 255, upward.gather(1, nxt.unsqueeze(1)).squeeze(1),
                            above)
        prefix = prefix | (chosen.to(kk.dtype) << shift)
    return prefix ^ sign


def _prefix(keys, t, c):
    """The tokens with key above ``t`` and the first ``c`` (lowest ids) with key ``t``."""
    at = keys == t.unsqueeze(1)
    rank = at.cumsum(1)
    return (keys > t.unsqueeze(1)) | (at & (rank <= c.unsqueeze(1)))


def _kept_set(z, m, keys, params: RowParams):
    """The kept set of a chunk (bool ``[R, V]``), following steps 2-4 of the module doc."""
    cand = torch.ones_like(z, dtype=torch.bool)
    if params.min_p is not None:
        cand = z >= (m + torch.log(params.min_p)).unsqueeze(1)
    if params.top_k is not None:
        kk = _candidate_keys(keys, cand)
        t = _largest_key(kk, None, params.top_k)
        c = params.top_k - (kk > t.unsqueeze(1)).sum(1)
        cand = cand & _prefix(keys, t, c)
    if params.top_p is not None:
        # The mass is summed in fp64: a row whose boundary token sits within fp32 rounding of
        # p then keeps the set the exact sums give, whatever the order of summation.
        e = torch.where(cand, torch.exp(z - m.unsqueeze(1)), 0.0).double()
        target = params.top_p.double() * e.sum(1)
        kk = _candidate_keys(keys, cand)
        t = _largest_key(kk, e, target)
        g = torch.where(kk > t.unsqueeze(1), e, 0.0).sum(1)
        e_t = torch.where(kk == t.unsqueeze(1), e, 0.0).amax(1)
        big = float(2**62)  # a tied weight underflowing to 0: keep every tie
        c = torch.ceil((target - g) / e_t).clamp(min=1).nan_to_num(nan=big, posinf=big).long()
        cut = cand & _prefix(keys, t, c)
        cand = torch.where((params.top_p < 1).unsqueeze(1), cut, cand)
    return cand


def _stats(z, targets, kept):
    """Per row: max, full lse, kept lse, entropy of the kept distribution, logprob of the
    target (-inf outside the kept set), log_kept_mass."""
    m = z.amax(1)
    zm = z - m.unsqueeze(1)
    e = torch.exp(zm)
    l_full = e.sum(1)
    e = torch.where(kept, e, 0.0)
    l_kept = e.sum(1)
    entropy = torch.log(l_kept) - torch.where(kept, e * zm, 0.0).sum(1) / l_kept
    lse_full = m + torch.log(l_full)
    lse_kept = m + torch.log(l_kept)
    idx = targets.unsqueeze(1)
    y_kept = kept.gather(1, idx).squeeze(1)
    lp = torch.where(y_kept, z.gather(1, idx).squeeze(1) - lse_kept, -math.inf)
    return lp, entropy, lse_kept - lse_full, lse_full, lse_kept


def forward(hidden, weight, bias, targets, params: RowParams, *, softcap, logit_scale,
            tile_bytes: int = DEFAULT_TILE_BYTES):
    """Sampler-matched statistics of ``z = logit_scale * softcap(hidden W^T + b) / T_row``.

    hidden ``[N, D]`` in the compute dtype, weight ``[V, D]`` and bias in any float dtype,
    targets int64 ``[N]`` in ``[0, V)``. Returns ``(logprobs, entropy, log_kept_mass, lse,
    lse_kept, key, count)``, each ``[N]``: the last two describe the kept set (step 5)."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    key_dtype = torch.int64
    outs = [torch.empty(n, dtype=acc, device=hidden.device) for _ in range(5)]
    key = torch.empty(n, dtype=key_dtype, device=hidden.device)
    count = torch.empty(n, dtype=torch.int64, device=hidden.device)
    rows = rows_per_chunk(v, tile_bytes, hidden.dtype, softcap)
    for r0, real, padded in _row_blocks(n, rows):
        sl = slice(r0, r0 + real)
        h = _pad_rows(hidden[sl], padded)
        tgt = _pad_rows(targets[sl], padded, 0)
        p = params.rows(sl, padded)
        z, _ = _chunk_logits(h, weight, bias, p, softcap, logit_scale)
        keys = _ordered_keys(z)
        kept = _kept_set(z, z.amax(1), keys, p)
        for out, x in zip(outs, _stats(z, tgt, kept)):
            out[sl] = x[:real]
        t = torch.where(kept, keys, torch.iinfo(keys.dtype).max).amin(1)
        key[sl] = t[:real]
        count[sl] = (kept & (keys == t.unsqueeze(1))).sum(1)[:real]
    return (*outs, key, count)


def backward(hidden, weight, bias, targets, params: RowParams, key, count, lse, lse_kept,
             entropy, g_lp, g_entropy, g_kept, g_lse, *, softcap, logit_scale, need_hidden,
             need_weight, need_bias, tile_bytes: int = DEFAULT_TILE_BYTES):
    """Gradients of hidden, weight and bias (fp32; fp64 for fp64 inputs) from the per-row
    upstream gradients (``[N]`` or None); see the module doc for ``dz``."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    d_hidden = hidden.new_empty(hidden.shape, dtype=acc) if need_hidden else None
    d_weight = weight.new_zeros(weight.shape, dtype=acc) if need_weight else None
    d_bias = weight.new_zeros(v, dtype=acc) if need_bias else None
    if not (need_hidden or need_weight or need_bias) or n == 0:
        return (None if d_hidden is None else d_hidden.zero_()), d_weight, d_bias
    rows = rows_per_chunk(v, tile_bytes, hidden.dtype, softcap)
    cols = min(v, _COLS)
    for r0, real, padded in _row_blocks(n, rows):
        sl = slice(r0, r0 + real)
        h = _pad_rows(hidden[sl], padded)
        tgt = _pad_rows(targets[sl], padded, 0)
        p = params.rows(sl, padded)
        per_row = [None if g is None else _pad_rows(g[sl], padded)
                   for g in (key, count, lse, lse_kept, entropy, g_lp, g_entropy, g_kept, g_lse)]
        t, c, lse_r, lse_k, ent, glp, gh, gk, gl = per_row
        z, cap = _chunk_logits(h, weight, bias, p, softcap, logit_scale)
        keys = _ordered_keys(z)
        kept = _prefix(keys, t, c)
        dz = _logit_grad(z, tgt, kept, lse_r, lse_k, ent, glp, gh, gk, gl)
        dz[real:] = 0.0  # padding rows
        dx = through_transform_(dz, cap, logit_scale, 1.0)
        dx /= p.temperature.unsqueeze(1)
        if d_bias is not None:
            d_bias += dx[:real].sum(0)
        if acc != hidden.dtype:
            dx = dx.to(hidden.dtype)
        for c0 in range(0, v, cols):
            w, _ = _head_slice(weight, None, c0, cols, hidden.dtype)
            piece = dx[:, c0:c0 + w.shape[0]]
            if d_hidden is not None:
                dh = d_hidden[sl]
                addmm_acc_(dh, piece[:real], w, beta=0.0 if c0 == 0 else 1.0)
            if d_weight is not None:
                addmm_acc_(d_weight[c0:c0 + w.shape[0]], piece[:real].t(), h[:real])
    return d_hidden, d_weight, d_bias


def _logit_grad(z, targets, kept, lse, lse_kept, entropy, g_lp, g_entropy, g_kept, g_lse):
    """``d loss / d z`` of one chunk, ``[R, V]`` (``z`` is overwritten)."""
    log_q = z - lse_kept.unsqueeze(1)
    q = torch.where(kept, torch.exp(log_q), 0.0)
    coef = torch.zeros_like(lse)
    y_kept = kept.gather(1, targets.unsqueeze(1)).squeeze(1)
    if g_lp is not None:
        g_lp = torch.where(y_kept, g_lp, 0.0)
        coef = coef - g_lp
    if g_kept is not None:
        coef = coef + g_kept
    dz = q * coef.unsqueeze(1)
    if g_entropy is not None:
        dz -= torch.where(kept, q * (log_q + entropy.unsqueeze(1)), 0.0) \
            * g_entropy.unsqueeze(1)
    g_p = None
    if g_kept is not None:
        g_p = -g_kept
    if g_lse is not None:
        g_p = g_lse if g_p is None else g_p + g_lse
    if g_p is not None:
        dz += torch.exp(z - lse.unsqueeze(1)) * g_p.unsqueeze(1)
    if g_lp is not None:
        dz.scatter_add_(1, targets.unsqueeze(1), g_lp.unsqueeze(1))
    return dz
