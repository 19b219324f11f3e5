"""Chunked PyTorch kernels of the two-head divergences (the CPU and fp64 path; the CUDA path is
``kernels/divergence.py``).

Student ``z_s = (hidden @ W^T + b) / T`` and teacher ``z_t = (teacher_hidden @ W_t^T + b_t) / T``
are streamed through token-major tiles ``[rows, cols]`` built by the linear-softmax twin's
tile helpers; at most four fp32 tiles of one shape exist at a time (each head's logits and a
scratch tile), plus, for bf16/fp16 inputs, the student's logit gradient in that dtype for the
backward's GEMMs, all within ``tile_bytes``. The logits themselves are fp32 whatever the
inputs' dtype (see ``_logits_fp32_into``). The tile shape depends on the vocabulary and the
budget only, and the last row block is padded as the linear-softmax twin pads it, so every pass
recomputes its tiles with the same GEMM shapes whatever N is: a logit has the same rounding in
each pass and in every batch.

- ``divergence_forward``: pass 1 folds both heads' online maxima and sums of exponentials (and,
  for ``beta`` 0 or 1, the expected logit gap, which finishes the KL in the same pass); pass 2,
  for ``0 < beta < 1`` only, sums the mixture terms with ``log m = logaddexp(log p_s +
  log(1 - beta), log p_t + log beta)``.
- ``divergence_backward``: one pass; the student's logit gradient per tile, then the GEMMs.
- ``topk_forward`` / ``topk_backward``: the student's log-softmax at k given ids per token.
"""

from __future__ import annotations

import math

import torch

from logitless.kernels.linear_softmax_torch import (
    DEFAULT_TILE_BYTES,
    MAX_COLS,
    MIN_COLS,
    ROW_BLOCK,
    Tiles,
    acc_dtype,
    addmm_acc_,
    logits_into,
    mm_out_dtype,
    pad_rows,
    row_blocks,
)


def _bytes_per_element(dtype: torch.dtype, student: bool = True) -> int:
    """Bytes one head's tile buffers take per logit: the logits and a scratch tile in fp32
    (fp64 for fp64 inputs), and for the student with bf16/fp16 inputs its logit gradient in
    that dtype (the backward's GEMM operand)."""
    acc = acc_dtype(dtype)
    return 2 * acc.itemsize + (dtype.itemsize if acc != dtype and student else 0)


def _tile_shape(v: int, tile_bytes: int, bytes_per_element: int) -> tuple[int, int]:
    """Rows and vocab columns per tile so that the heads' buffers (``bytes_per_element`` per
    logit together) fit in ``tile_bytes``: up to ``ROW_BLOCK`` token rows, the vocabulary split
    to fit, at most ``MAX_COLS`` columns (the linear-softmax twin's bounds). From the
    vocabulary and the budget only, never from the number of tokens: a token's results must not
    depend on the batch it comes in."""
    elems = max(1, tile_bytes // bytes_per_element)
    rows = max(1, min(ROW_BLOCK, elems // min(v, MIN_COLS)))
    return rows, max(1, min(v, MAX_COLS, elems // rows))


class _Heads:
    """Tile buffers for the student (and the teacher, when given) at one tile shape. The last
    row block is padded with zero rows as the linear-softmax twin pads it (``row_blocks``), so
    every GEMM that makes a row's logits has a shape that does not depend on N."""

    def __init__(self, n, v, hidden, t_hidden, tile_bytes):
        per = _bytes_per_element(hidden.dtype)
        if t_hidden is not None:
            per += _bytes_per_element(t_hidden.dtype, student=False)
        self.rows, self.cols = _tile_shape(v, tile_bytes, per)
        self.row_blocks = list(row_blocks(n, self.rows))
        rows, cols = self.row_blocks[0][2] if n else 1, min(self.cols, v)
        self.s = Tiles(rows, cols, hidden.dtype, hidden.device, None)
        # The teacher's tiles need no low-precision buffer: its logits are fp32 and it has no
        # gradient.
        self.t = None if t_hidden is None else Tiles(rows, cols, acc_dtype(t_hidden.dtype),
                                                      t_hidden.device, None)
        self.padded, self.v = rows, v

    def blocks(self, n, v):
        """``(row slice, col slice)`` of every tile, vocabulary innermost; the row slice holds
        the block's real rows only."""
        for r0, real, padded in self.row_blocks:
            self.padded = padded
            for c0 in range(0, v, self.cols):
                yield slice(r0, r0 + real), slice(c0, c0 + self.cols)

    def logits(self, tiles, hidden, weight, bias, rows, cols, temperature):
        """Tempered logits ``[real rows, cols]`` of one tile (a view of the padded block's
        tile) and a scratch view of the same shape."""
        b = None if bias is None else bias[cols]
        h, w = pad_rows(hidden[rows], self.padded), weight[cols]
        if hidden.dtype == tiles.acc:
            z, _ = tiles.logits(h, w, b, temperature, None, 1.0, vocab_major=False)
        else:
            z = tiles.view(tiles.z, h.shape[0], w.shape[0])
            _logits_fp32_into(z, h, w, b, temperature)
        real = rows.stop - rows.start
        return z[:real], tiles.view(tiles.scratch, real, z.shape[1])

    def accumulate(self, dz, hidden, weight, d_hidden, d_weight, d_bias, rows, cols):
        """Add one tile's logit gradient ``dz [real rows, cols]`` into the parameter gradients.
        The GEMMs take the whole padded tile (padding rows zeroed), in the inputs' dtype (as the
        linear-softmax twin does); a padded block's hidden gradient goes through a padded
        accumulator."""
        if d_bias is not None:
            d_bias[cols] += dz.sum(0)
        real, width = dz.shape
        # dz views the first rows of a tile buffer (offset 0): the whole padded tile.
        full = dz.as_strided((self.padded, width), (width, 1))
        full[real:].zero_()
        low = self.s.low
        dx = full if low is None else self.s.view(low, self.padded, width).copy_(full)
        if d_hidden is not None:
            first, last = cols.start == 0, cols.start + width >= self.v
            if real == self.padded:
                dh = d_hidden[rows]
            else:
                if first:
                    self.dh = d_hidden.new_empty(self.padded, d_hidden.shape[1])
                dh = self.dh
            addmm_acc_(dh, dx, weight[cols], beta=0.0 if first else 1.0)
            if last and real != self.padded:
                d_hidden[rows] = dh[:real]
        if d_weight is not None:
            addmm_acc_(d_weight[cols], dx.t(), pad_rows(hidden[rows], self.padded))


def _logits_fp32_into(z, hidden, weight, bias, temperature):
    """Tempered logits ``[rows, cols]`` of bf16/fp16 operands written into the fp32 tile ``z``
    without rounding them to the inputs' dtype first (TRL's divergence kernels keep their
    logits in fp32 too). A divergence's logit gradient is a difference of two heads' logits
    (``log p_s - log p_t`` for the reverse KL), which takes their rounding whole: bf16 logits
    put the weight gradient outside the bf16 reference's error at V=1007. Where the probe
    (`mm_out_dtype`) finds the fp32-output GEMM, the GEMM writes fp32 directly; elsewhere the
    tile's operands are upcast (the row block and the weight columns, ``D`` wide, never a tile
    of logits)."""
    if mm_out_dtype(z.device, hidden.dtype):
        torch.addmm(z, hidden, weight.t(), beta=0.0, out_dtype=torch.float32, out=z)
        if bias is not None:
            z.add_(bias)
    else:
        b = None if bias is None else bias.float()
        logits_into(z, None, None, hidden.float(), weight.float(), b, 1.0, None, 1.0,
                    vocab_major=False)
    if temperature != 1.0:
        z.mul_(1.0 / temperature)


def _fold(m, l, z, scratch):
    """Online logsumexp update of one head with tile ``z``; returns ``exp(z - m_new)`` (in
    ``scratch``) and the factor the running sums were rescaled by."""
    m_new = torch.maximum(m, z.amax(1))
    scale = torch.exp(m - m_new)
    e = torch.sub(z, m_new.unsqueeze(1), out=scratch).exp_()
    l.mul_(scale).add_(e.sum(1))
    m.copy_(m_new)
    return e, scale


def divergence_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, *, beta: float,
                       temperature: float, tile_bytes: int = DEFAULT_TILE_BYTES,
                       entropy: bool = False):
    """Per-token generalized JSD and what the backward needs.

    hidden ``[N, D]``, weight ``[V, D]``, bias ``[V]`` or None; the teacher's the same with its
    own ``D_t``. Returns ``(divergence, top_s, log_l_s, top_t, log_l_t, aux)``, each ``[N]``
    fp32 (fp64 for fp64 inputs): each head's normaliser as the backward reads it (its maximum
    tempered logit ``top`` and ``log l``, ``lse = top + log l``; see `log_softmax_`); ``aux``
    is the per-token ``E_s[log((1 - beta) p_s / m)]`` (KL(student || m) plus
    ``log(1 - beta)``, formed without cancelling) for ``0 < beta < 1`` and the divergence
    itself otherwise. With ``entropy``, a seventh tensor: the student's entropy
    ``lse_s - E_s[z_s]``, its expected logit folded in pass 1.
    """
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    m_s = hidden.new_full((n,), -math.inf, dtype=acc)
    m_t, l_s, l_t, gap = m_s.clone(), *(hidden.new_zeros(n, dtype=acc) for _ in range(3))
    x_s = hidden.new_zeros(n, dtype=acc) if entropy else None
    heads = _Heads(n, v, hidden, t_hidden, tile_bytes)
    for rows, cols in heads.blocks(n, v):
        zs, scr_s = heads.logits(heads.s, hidden, weight, bias, rows, cols, temperature)
        zt, scr_t = heads.logits(heads.t, t_hidden, t_weight, t_bias, rows, cols, temperature)
        es, scale_s = _fold(m_s[rows], l_s[rows], zs, scr_s)
        et, scale_t = _fold(m_t[rows], l_t[rows], zt, scr_t)
        if x_s is not None:  # before the gaps below overwrite es and zs
            x_s[rows] = x_s[rows] * scale_s + torch.linalg.vecdot(es, zs)
        # The expected gap of the distribution the KL is taken under: E_t[z_t - z_s] for the
        # forward KL, E_s[z_s - z_t] for the reverse one.
        if beta == 0.0:
            gap[rows] = gap[rows] * scale_t + et.mul_(zt.sub_(zs)).sum(1)
        elif beta == 1.0:
            gap[rows] = gap[rows] * scale_s + es.mul_(zs.sub_(zt)).sum(1)
    norm = (m_s, l_s.log(), m_t, l_t.log())
    extra = () if x_s is None else (m_s + norm[1] - x_s / l_s,)
    if beta in (0.0, 1.0):
        div = finish_kl(beta, gap, l_s, l_t, m_s - m_t, norm[1], norm[3])
        return div, *norm, div, *extra
    log_b, log_1mb = math.log(beta), math.log1p(-beta)
    kl_t, share = hidden.new_zeros(n, dtype=acc), hidden.new_zeros(n, dtype=acc)
    for rows, cols in heads.blocks(n, v):
        zs, scr_s = heads.logits(heads.s, hidden, weight, bias, rows, cols, temperature)
        zt, scr_t = heads.logits(heads.t, t_hidden, t_weight, t_bias, rows, cols, temperature)
        log_m = _log_mixture_(zs, zt, [x[rows] for x in norm], log_b, log_1mb, scr_s, scr_t)
        # E_s[w], w = log((1 - beta) p_s / m), each w from its softplus (see _student_share)
        share[rows] += _student_share(zs, zt, log_b, log_1mb).mul_(zs.exp()).sum(1)
        # KL(t || m)'s terms p_t (log p_t - log m), formed in scratch
        kl_t[rows] += torch.exp(zt, out=scr_s).mul_(zt.sub_(log_m)).sum(1)
    # KL(s || m) = E_s[w] - log(1 - beta)
    div = beta * kl_t + (1.0 - beta) * (share - log_1mb)
    return div, *norm, share, *extra


def finish_kl(beta: float, gap, l_s, l_t, top_gap, log_l_s, log_l_t):
    """The KL of ``beta`` 0 or 1 from pass 1: the expected gap ``gap / l`` (``l`` the sum of
    exponentials it was folded with) is ``E_t[z_t - z_s]`` for the forward KL, which is then
    ``E_t[z_t - z_s] - lse_t + lse_s``, or ``E_s[z_s - z_t]`` for the reverse one. The
    logsumexps' difference is taken in parts, ``top_gap = top_s - top_t`` (the heads' maximum
    tempered logits, an exact difference near a tie) and ``log l_s - log l_t``: at a low
    temperature each ``lse`` is of the logits' size and its rounding would be the KL's error
    (which the reverse KL's gradient reads back)."""
    if beta == 0.0:
        return gap / l_t + top_gap - (log_l_t - log_l_s)
    return gap / l_s - top_gap - (log_l_s - log_l_t)


def _student_share(log_ps, log_pt, log_b, log_1mb):
    """``w = log((1 - beta) p_s / m) = -softplus(log(beta p_t) - log((1 - beta) p_s))``,
    elementwise, accurate where the heads are nearly disjoint: there ``w`` is tiny, and forming
    it as ``log p_s + log(1 - beta) - log m`` would cancel two numbers of order 1 (the JSD's
    gradient is ``(1 - beta) p_s (w - E_s[w])``). Written as ``max(d, 0) + log1p(exp(-|d|))``:
    torch's ``softplus`` rounds its vectorised bulk and its scalar tail differently on CPU, so a
    row's ``w`` would depend on where the row lies in its tile."""
    d = (log_pt + log_b).sub_(log_ps + log_1mb)
    tail = torch.log1p(torch.exp(-d.abs()))
    return d.clamp_(min=0.0).add_(tail).neg_()


def log_softmax_(z, top, log_l):
    """Turn tempered logits ``z [rows, cols]`` into ``log p = (z - top) - log l`` in place, from
    the normaliser in parts (``top``: the row's maximum logit, the same bits as ``z``'s, and
    ``log l``). Never ``z - lse``: at a low temperature ``lse`` is of the logits' size (1e4 at
    T = 1e-3) and its rounding would be an error of every ``p`` that the chain factor ``1 / T``
    multiplies; ``z - top`` is exact near the maximum, as ``log_softmax`` on materialised logits
    is."""
    return z.sub_(top.unsqueeze(1)).sub_(log_l.unsqueeze(1))


def _log_mixture_(zs, zt, norm, log_b, log_1mb, scr_s, scr_t):
    """Turn the logits tiles into ``log p_s`` and ``log p_t`` in place (``norm``: ``(top_s,
    log_l_s, top_t, log_l_t)`` of the tile's rows) and return ``log m = logaddexp(log p_s +
    log(1 - beta), log p_t + log beta)`` (in ``scr_t``)."""
    log_softmax_(zs, *norm[:2])
    log_softmax_(zt, *norm[2:])
    torch.add(zs, log_1mb, out=scr_s)
    torch.add(zt, log_b, out=scr_t)
    return torch.logaddexp(scr_s, scr_t, out=scr_t)


def divergence_backward(hidden, weight, bias, t_hidden, t_weight, t_bias, top_s, log_l_s, top_t,
                        log_l_t, aux, grad, *, beta: float, temperature: float,
                        need_hidden: bool, need_weight: bool, need_bias: bool,
                        tile_bytes: int = DEFAULT_TILE_BYTES, d_weight=None, d_bias=None):
    """Gradients of the student's hidden, weight and bias (fp32; fp64 for fp64 inputs) from
    the per-token upstream ``grad``. With ``p_s``, ``p_t``, ``m`` recomputed per tile, the
    gradient of the divergence with respect to the student's tempered logits is
    ``p_s - p_t`` (``beta = 0``), ``p_s (log p_s - log p_t - KL)`` (``beta = 1``), else
    ``(1 - beta) p_s (log p_s - log m - KL(s || m)) = (1 - beta) p_s (w - E_s[w])`` with
    ``w = log((1 - beta) p_s / m)`` (`_student_share`); it is scaled by ``grad / T``.

    ``d_weight`` / ``d_bias``: accumulators (in the accumulation dtype) to add the weight and
    bias gradients to, instead of fresh zeroed ones (a caller summing over chunks). ``top_s``
    ... ``log_l_t``: the heads' normalisers from `divergence_forward`."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    d_hidden = hidden.new_empty(hidden.shape, dtype=acc) if need_hidden else None
    if need_weight and d_weight is None:
        d_weight = weight.new_zeros(weight.shape, dtype=acc)
    if need_bias and d_bias is None:
        d_bias = weight.new_zeros(v, dtype=acc)
    d_weight, d_bias = (d_weight if need_weight else None), (d_bias if need_bias else None)
    heads = _Heads(n, v, hidden, t_hidden, tile_bytes)
    scale = grad.to(acc) / temperature
    log_b, log_1mb = (math.log(beta), math.log1p(-beta)) if 0.0 < beta < 1.0 else (0.0, 0.0)
    for rows, cols in heads.blocks(n, v):
        zs, scr_s = heads.logits(heads.s, hidden, weight, bias, rows, cols, temperature)
        zt, _ = heads.logits(heads.t, t_hidden, t_weight, t_bias, rows, cols, temperature)
        log_softmax_(zs, top_s[rows], log_l_s[rows])
        log_softmax_(zt, top_t[rows], log_l_t[rows])
        if beta == 0.0:
            dz = zs.exp_().sub_(zt.exp_())
        elif beta == 1.0:
            ps = torch.exp(zs, out=scr_s)
            dz = ps.mul_(zs.sub_(zt).sub_(aux[rows].unsqueeze(1)))
        else:  # aux: E_s[w] (divergence_forward), so dz = (1 - beta) p_s (w - E_s[w])
            share = _student_share(zs, zt, log_b, log_1mb)
            ps = torch.exp(zs, out=scr_s)
            dz = ps.mul_(share.sub_(aux[rows].unsqueeze(1))).mul_(1.0 - beta)
        dz.mul_(scale[rows].unsqueeze(1))
        heads.accumulate(dz, hidden, weight, d_hidden, d_weight, d_bias, rows, cols)
    return d_hidden, d_weight, d_bias


def topk_forward(hidden, weight, bias, ids, *, temperature: float,
                 tile_bytes: int = DEFAULT_TILE_BYTES):
    """The student's tempered log-softmax at ``ids [N, k]`` (int64 in ``[0, V)``) and its
    per-token normaliser as `topk_backward` reads it (`log_softmax_`): ``(logprobs [N, k], top
    [N], log_l [N])``, fp32 (fp64 for fp64 inputs)."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    m = hidden.new_full((n,), -math.inf, dtype=acc)
    l = hidden.new_zeros(n, dtype=acc)
    z_ids = hidden.new_zeros(ids.shape, dtype=acc)
    heads = _Heads(n, v, hidden, None, tile_bytes)
    for rows, cols in heads.blocks(n, v):
        z, scratch = heads.logits(heads.s, hidden, weight, bias, rows, cols, temperature)
        local = ids[rows] - cols.start
        inside = (local >= 0) & (local < z.shape[1])
        picked = z.gather(1, local.clamp(0, z.shape[1] - 1))
        z_ids[rows] += torch.where(inside, picked, 0.0)
        _fold(m[rows], l[rows], z, scratch)
    log_l = l.log()
    return log_softmax_(z_ids, m, log_l), m, log_l


def topk_backward(hidden, weight, bias, ids, top, log_l, grad, *, temperature: float,
                  need_hidden: bool, need_weight: bool,
                  need_bias: bool, tile_bytes: int = DEFAULT_TILE_BYTES):
    """Gradients from ``grad [N, k]`` on the top-k logprobs: with ``p`` the student's softmax,
    ``d z_j = (sum_i grad_i 1[j = id_i] - p_j sum_i grad_i) / T``."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    d_hidden = hidden.new_empty(hidden.shape, dtype=acc) if need_hidden else None
    d_weight = weight.new_zeros(weight.shape, dtype=acc) if need_weight else None
    d_bias = weight.new_zeros(v, dtype=acc) if need_bias else None
    grad = grad.to(acc) / temperature
    total = grad.sum(1)
    heads = _Heads(n, v, hidden, None, tile_bytes)
    for rows, cols in heads.blocks(n, v):
        z, _ = heads.logits(heads.s, hidden, weight, bias, rows, cols, temperature)
        dz = log_softmax_(z, top[rows], log_l[rows]).exp_().mul_(-total[rows].unsqueeze(1))
        local = ids[rows] - cols.start
        inside = (local >= 0) & (local < dz.shape[1])
        dz.scatter_add_(1, local.clamp(0, dz.shape[1] - 1), torch.where(inside, grad[rows], 0.0))
        heads.accumulate(dz, hidden, weight, d_hidden, d_weight, d_bias, rows, cols)
    return d_hidden, d_weight, d_bias


def topk_ids(hidden, weight, bias, k: int, *, temperature: float,
             tile_bytes: int = DEFAULT_TILE_BYTES):
    """The ids of the ``k`` largest tempered logits of each row of ``hidden [N, D]``, int64
    ``[N, k]`` in descending order of logit, streamed through the tiles (a running top-k
    merged with each tile's; fp32 logits for bf16/fp16 inputs, as every pass here); no
    gradient. Ties fall as ``torch.topk`` breaks them."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    vals = hidden.new_full((n, k), -math.inf, dtype=acc)
    ids = torch.zeros(n, k, dtype=torch.int64, device=hidden.device)
    heads = _Heads(n, v, hidden, None, tile_bytes)
    for rows, cols in heads.blocks(n, v):
        z, _ = heads.logits(heads.s, hidden, weight, bias, rows, cols, temperature)
        top = z.topk(min(k, z.shape[1]), dim=1)
        cand = torch.cat([vals[rows], top.values], 1)
        cand_ids = torch.cat([ids[rows], top.indices + cols.start], 1)
        best = cand.topk(k, dim=1)
        vals[rows], ids[rows] = best.values, cand_ids.gather(1, best.indices)
    return ids
