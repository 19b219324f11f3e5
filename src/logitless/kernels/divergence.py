"""The CUDA path of ``linear_divergence`` and ``linear_topk_distill``: cuBLAS GEMMs on fixed-width
vocabulary tiles, one-pass Triton epilogues, the launcher contract of ``divergence_torch``.

Both heads' tempered logits ``z = (hidden @ W^T + b) / T`` are made tile by tile exactly as the
head's CUDA path makes them (``linear_softmax.TilePlan``): ``VOCAB_TILE`` columns by a row group of
``ROW_CHUNK``-row chunks, one GEMM per chunk in the input dtype, the last chunk padded with zero
rows to a multiple of ``ROW_GRANULE``, so every GEMM is one of a few fixed heights whatever N
is. The student and the teacher get one plan each, with the same row groups (the tile budget is
split between them in proportion to their element sizes) and the same vocabulary tiles. An
epilogue program takes one row and reads both heads' tiles of that row once, ``_BLOCK_V``
columns at a time, left to right; every per-row accumulator is fp32, kept per lane (or per
column of the step) across the column loop and reduced once per row in a fixed tree, so its
order depends only on the column and results are the same bits run to run and for every N (up
to cuBLAS's choice of kernel for a chunk height, see docs/gpu.md).

- ``divergence_forward``: ``_pair_stats_kernel`` folds both heads' running maxima and sums of
  exponentials, the student's ``sum e (z - m)`` (its entropy) and, for ``beta`` 0 or 1, the
  expected logit gap that finishes the KL in one pass; for ``0 < beta < 1``,
  ``_pair_jsd_kernel`` then sums ``p (log p - log m)`` for both heads over the tiles again.
- ``divergence_backward``: per tile the GEMMs recompute both heads' logits (the same bits),
  ``_pair_grad_kernel`` overwrites the student's tile with ``dL/dz`` and the head's
  ``TileGrads`` turns it into the hidden, weight and bias gradients.
- ``topk_forward``: the student's normaliser ``(top, log l)`` from the head's own forward
  (``linear_softmax``, no target), the k logits by a gather of k weight rows per token.

Every pass forms ``log p`` as ``(x - top) k - log l`` from each head's max untempered logit
``top`` and ``log l`` kept by the forward, the difference before the product, never as
``x k - lse``: at a low temperature an ``lse`` is of the logits' size and its rounding would be
an error of every ``p`` that ``1 / T`` multiplies (``divergence_torch.log_softmax_``).
- ``topk_backward``: ``_topk_grad_kernel`` writes ``sum_i g_i 1[j = id_i] - p_j sum_i g_i``
  into the recomputed tile, then ``TileGrads``.

No atomics, no ``tl.dot``: fp32 products follow ``torch.get_float32_matmul_precision()``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from logitless.kernels import linear_softmax as head
from logitless.kernels.divergence_torch import finish_kl
from logitless.kernels.linear_softmax import (
    INTERPRET,
    TileGrads,
    TilePlan,
    load_cols,
    round_to,
    store_cols,
)
from logitless.kernels.linear_softmax_torch import mm_out_dtype
from logitless.kernels.softmax_partials import normaliser

__all__ = ["divergence_backward", "divergence_forward", "topk_backward", "topk_forward"]

# Columns an epilogue program handles per step, and its warps (as the head's epilogues).
_BLOCK_V = 2048
_WARPS = 8
# Bytes of the gathered weight rows ``[rows, k, D]`` the top-k forward holds at once.
_GATHER_BYTES = 64 * 2**20
# Which expected gap pass 1 folds: none (0 < beta < 1), E_t[z_t - z_s] (beta = 0), or
# E_s[z_s - z_t] (beta = 1). Also the gradient kernel's mode (2: the mixture).
_FORWARD_KL, _REVERSE_KL, _MIXTURE = 0, 1, 2


@triton.jit
def _log1p_small(x):
    """``log(1 + x)`` for ``x >= 0``, accurate where ``1 + x`` rounds to 1 (no libdevice)."""
    return tl.where(x < 1e-4, x * (1.0 - x * (0.5 - x * (1.0 / 3.0))), tl.log(1.0 + x))


@triton.jit
def _log2_1p(e):
    """``log2(1 + e)`` for ``0 <= e <= 1``: ``e q(e)``, ``q`` the degree-8 Chebyshev
    interpolant of ``log2(1 + e) / e`` on ``[0, 1]`` in powers of ``e`` (fp32 coefficients). In
    fp32 it is within 1.6e-7 of ``log2(1 + e)`` and 1.8e-7 relative to it, where ``1 + e``
    rounded to 1 would lose ``e`` whole: nine FMAs, no range reduction."""
    q = e * 0.0073954020626842976 - 0.04194501042366028
    q = q * e + 0.11183207482099533
    q = q * e - 0.1962389498949051
    q = q * e + 0.27522119879722595
    q = q * e - 0.3582990765571594
    q = q * e + 0.48067888617515564
    q = q * e - 0.7213395237922668
    q = q * e + 1.4426950216293335
    return q * e


@triton.jit
def _student_share(ls, lt, log_b, log_1mb):
    """``w = log((1 - beta) p_s / m) = -softplus(log(beta p_t) - log((1 - beta) p_s))``:
    tiny where the heads are nearly disjoint, and formed without cancelling there (see
    ``divergence_torch._student_share``)."""
    d = (lt + log_b) - (ls + log_1mb)
    return -(tl.maximum(d, 0.0) + _log1p_small(tl.exp(-tl.abs(d))))


@triton.jit
def _pair_fold_step(zs_row, zt_row, c0, width, m_s, l_s, m_t, l_t, gap, a_s, k2,
                    GAP: tl.constexpr, MASKED: tl.constexpr, LANES: tl.constexpr,
                    LANE: tl.constexpr):
    """Fold columns ``c0 ... c0 + LANES * LANE`` of both heads into the per-lane running state,
    as the head's ``_fold_step``: lane ``i`` takes the ``LANE`` adjacent columns ``c0 + i *
    LANE ...``. Per lane, in the units of the untempered logits ``x``: the maxima ``m_s, m_t``;
    ``l = sum 2^t`` with ``t = (x - m) k2``; ``a_s = sum 2^t_s t_s`` (log2 units); ``gap =
    sum e (x_t - x_s)`` (``GAP`` 0, teacher's ``e``) or ``sum e (x_s - x_t)`` (1, student's).
    ``MASKED``: columns at or past ``width`` are skipped and lanes that have seen no column
    (``m = -inf``) are guarded."""
    groups = c0 + tl.arange(0, LANES) * LANE
    cols = groups[:, None] + tl.arange(0, LANE)[None, :]
    xs = load_cols(zs_row, cols, width, MASKED)
    xt = load_cols(zt_row, cols, width, MASKED)
    if MASKED:
        valid = cols < width
        ws = tl.where(valid, xs, float("-inf"))
        wt = tl.where(valid, xt, float("-inf"))
    else:
        ws = xs
        wt = xt
    ms_new = tl.maximum(m_s, tl.max(ws, 1))
    mt_new = tl.maximum(m_t, tl.max(wt, 1))
    ref_s = ms_new
    ref_t = mt_new
    # Every exponent is a difference taken before the product by k2: ``x k2 - m k2`` would
    # round two numbers of the tempered logits' size (1e4 at T = 1e-3), an error of every
    # exponential (see the head's ``_fold_step``).
    if MASKED:
        # exp2(-inf - -inf) would be NaN: a lane that has seen nothing keeps its sums 0.
        had = m_s > float("-inf")
        ref_s = tl.where(ms_new > float("-inf"), ref_s, 0.0)
        ref_t = tl.where(mt_new > float("-inf"), ref_t, 0.0)
        shift_s = tl.where(had, (m_s - ref_s) * k2, 0.0)
        alpha_s = tl.where(had, tl.exp2(shift_s), 0.0)
        alpha_t = tl.where(had, tl.exp2((m_t - ref_t) * k2), 0.0)
    else:
        shift_s = (m_s - ref_s) * k2
        alpha_s = tl.exp2(shift_s)
        alpha_t = tl.exp2((m_t - ref_t) * k2)
    ts = (xs - ref_s[:, None]) * k2
    es = tl.exp2(ts)
    et = tl.exp2((xt - ref_t[:, None]) * k2)
    if MASKED:
        es = tl.where(valid, es, 0.0)
        et = tl.where(valid, et, 0.0)
        ts = tl.where(valid, ts, 0.0)
    a_s = (a_s + l_s * shift_s) * alpha_s + tl.sum(es * ts, 1)
    if GAP == 0:
        gap = gap * alpha_t + tl.sum(et * (xt - xs), 1)
    if GAP == 1:
        gap = gap * alpha_s + tl.sum(es * (xs - xt), 1)
    l_s = l_s * alpha_s + tl.sum(es, 1)
    l_t = l_t * alpha_t + tl.sum(et, 1)
    return ms_new, l_s, mt_new, l_t, gap, a_s


@triton.jit
def _lanes_reduce(m, l, k2):
    """Per-lane ``(m, l)`` (untempered units, ``l`` in powers of two relative to each lane's
    max) reduced in a fixed tree: the lanes' max ``top``, each lane's scale ``sc = 2^shift``
    and ``shift = (m - top) k2`` (0 for a lane that has seen no column), and ``sum l sc``."""
    top = tl.max(m, 0)
    live = l > 0  # the lane has seen a column
    shift = tl.where(live, (m - top) * k2, 0.0)
    sc = tl.where(live, tl.exp2(shift), 0.0)
    return top, sc, shift, tl.sum(l * sc, 0)


@triton.jit
def _merge_factors(m0, l0, m_tile, z_scale):
    """The row's new max (untempered units, as the kernels load the logits) and the factors
    and shifts (natural units: the differences of maxima times ``z_scale``, taken in that
    order) that bring the old state (``m0, l0``; ``l0 = 0``: none yet) and this tile's (max
    ``m_tile``) to it. The tile that holds the max gets a shift of exactly 0."""
    m_new = tl.maximum(m0, m_tile)
    first = l0 == 0  # m0 = -inf
    shift0 = tl.where(first, 0.0, (m0 - m_new) * z_scale)
    alpha0 = tl.where(first, 0.0, tl.exp(shift0))
    shift = (m_tile - m_new) * z_scale
    return m_new, alpha0, shift0, tl.exp(shift), shift


@triton.jit
def _pair_stats_kernel(
    zs_ptr, stride_s, zt_ptr, stride_t, state, plane, width, z_scale,
    GAP: tl.constexpr, BLOCK_V: tl.constexpr, LANE: tl.constexpr,
):
    """Fold row ``r``'s ``width`` columns of both heads' logits into its fp32 state ``[6,
    plane]``: ``top_s, l_s, top_t, l_t`` (running max of the untempered logits ``x``, sum of
    ``exp(z - top z_scale)``), ``gap`` (``sum
    e_t (z_t - z_s)`` for ``GAP`` 0, ``sum e_s (z_s - z_t)`` for ``GAP`` 1, relative to that
    head's max) and ``a_s = sum e_s (z_s - m_s)``.

    The column loop keeps its state per lane (``_pair_fold_step``), whole steps unmasked; the
    lanes are reduced once, at the end, in a fixed tree and merged into ``state``. The order
    of every sum depends only on the column, never on the row or the number of rows."""
    LANES: tl.constexpr = BLOCK_V // LANE
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_s
    zt_row = zt_ptr + row * stride_t
    k2 = z_scale * 1.4426950408889634  # log2(e); z_scale = 1 / T > 0
    neg = tl.full((LANES,), float("-inf"), tl.float32)
    zero = tl.zeros((LANES,), tl.float32)
    # The first step is guarded (it may be partial); the rest but the last are whole.
    m_s, l_s, m_t, l_t, gap, a_s = _pair_fold_step(
        zs_row, zt_row, 0, width, neg, zero, neg, zero, zero, zero, k2, GAP, True, LANES, LANE)
    whole = width // BLOCK_V * BLOCK_V
    for c0 in range(BLOCK_V, whole, BLOCK_V):
        m_s, l_s, m_t, l_t, gap, a_s = _pair_fold_step(
            zs_row, zt_row, c0, width, m_s, l_s, m_t, l_t, gap, a_s, k2, GAP, False, LANES,
            LANE)
    if (whole >= BLOCK_V) & (whole < width):
        # the tail's row pointers from the step's start: no live 64-bit pointer across the loop
        # (triton 3.6.0's ptxas spilled one there for the reverse KL)
        m_s, l_s, m_t, l_t, gap, a_s = _pair_fold_step(
            zs_row + whole, zt_row + whole, 0, width - whole, m_s, l_s, m_t, l_t, gap, a_s, k2,
            GAP, True, LANES, LANE)
    # The lanes, reduced once to the tile's maxima; a_s from log2 to natural units.
    top_s, sc_s, lane_shift_s, l_s_tile = _lanes_reduce(m_s, l_s, k2)
    top_t, sc_t, _, l_t_tile = _lanes_reduce(m_t, l_t, k2)
    a_tile = tl.sum((a_s + l_s * lane_shift_s) * sc_s, 0) * 0.6931471805599453
    s = state + row
    m0_s = tl.load(s)
    l0_s = tl.load(s + plane)
    m0_t = tl.load(s + 2 * plane)
    l0_t = tl.load(s + 3 * plane)
    ms_new, alpha0_s, shift0_s, alpha_s, shift_s = _merge_factors(m0_s, l0_s, top_s, z_scale)
    mt_new, alpha0_t, _, alpha_t, _ = _merge_factors(m0_t, l0_t, top_t, z_scale)
    tl.store(s, ms_new)
    tl.store(s + plane, l0_s * alpha0_s + l_s_tile * alpha_s)
    tl.store(s + 2 * plane, mt_new)
    tl.store(s + 3 * plane, l0_t * alpha0_t + l_t_tile * alpha_t)
    if GAP == 0:
        gap_tile = tl.sum(gap * sc_t, 0) * z_scale
        tl.store(s + 4 * plane, tl.load(s + 4 * plane) * alpha0_t + gap_tile * alpha_t)
    if GAP == 1:
        gap_tile = tl.sum(gap * sc_s, 0) * z_scale
        tl.store(s + 4 * plane, tl.load(s + 4 * plane) * alpha0_s + gap_tile * alpha_s)
    a0 = tl.load(s + 5 * plane)
    tl.store(s + 5 * plane, (a0 + l0_s * shift0_s) * alpha0_s
             + (a_tile + l_s_tile * shift_s) * alpha_s)


@triton.jit
def _pair_jsd_step(zs_row, zt_row, c0, width, acc_t, acc_s, k2, top_s, top_t, off_s, off_t,
                   log2_b, MASKED: tl.constexpr, BLOCK_V: tl.constexpr):
    """Columns ``c0 ... c0 + BLOCK_V`` added into the per-column sums, in log2 units: ``acc_t
    += b p_t (log2 b + sp(-d))`` and ``acc_s += (1 - b) p_s sp(d)``, with ``d = log2(b p_t)
    - log2((1 - b) p_s)`` and ``sp(d) = log2(1 + 2^d)``: ``log(p_t / m) = -ln 2 (log2 b +
    sp(-d))`` and ``w = -ln 2 sp(d)`` (`_student_share`). The larger of ``(1 - b) p_s`` and
    ``b p_t`` is one ``exp2``, the smaller that times ``2^-|d|``, which the softplus needs
    anyway; ``log2(1 + 2^-|d|)`` is a polynomial (`_log2_1p`)."""
    cols = c0 + tl.arange(0, BLOCK_V)
    la = (load_cols(zs_row, cols, width, MASKED) - top_s) * k2 + off_s  # log2((1 - b) p_s)
    lb = (load_cols(zt_row, cols, width, MASKED) - top_t) * k2 + off_t  # log2(b p_t)
    d = lb - la
    e = tl.exp2(-tl.abs(d))
    soft = _log2_1p(e)
    pos = tl.maximum(d, 0.0)
    big = tl.exp2(la + pos)  # 2^max(la, lb)
    small = big * e
    student_big = d <= 0.0
    term_s = tl.where(student_big, big, small) * (pos + soft)
    term_t = tl.where(student_big, small, big) * ((pos - d) + (soft + log2_b))
    if MASKED:
        valid = cols < width
        term_t = tl.where(valid, term_t, 0.0)
        term_s = tl.where(valid, term_s, 0.0)
    return acc_t + term_t, acc_s + term_s


@triton.jit
def _pair_jsd_kernel(
    zs_ptr, stride_s, zt_ptr, stride_t, top_s, log_l_s, top_t, log_l_t, acc, plane, width,
    z_scale, log_b, log_1mb, BLOCK_V: tl.constexpr,
):
    """Add row ``r``'s ``sum p_t (log p_t - log m)`` and ``sum p_s w`` (``w`` as
    `_student_share`) over ``width`` columns into ``acc[0, r]`` and ``acc[1, r]`` (fp32,
    ``plane`` apart).

    The sums are kept per column of the step (``_pair_jsd_step``), whole steps unmasked, and
    reduced once, at the end, in a fixed tree: their order depends only on the column."""
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_s
    zt_row = zt_ptr + row * stride_t
    log2e = 1.4426950408889634
    k2 = z_scale * log2e
    # log2 p = (x - top) k2 - log2 l: the normaliser in parts, never an lse of the logits'
    # size (see ``divergence_torch.log_softmax_``)
    off_s = (log_1mb - tl.load(log_l_s + row)) * log2e
    off_t = (log_b - tl.load(log_l_t + row)) * log2e
    tops = tl.load(top_s + row)
    topt = tl.load(top_t + row)
    log2_b = log_b * log2e
    acc_t = tl.zeros((BLOCK_V,), tl.float32)
    acc_s = tl.zeros((BLOCK_V,), tl.float32)
    whole = width // BLOCK_V * BLOCK_V
    for c0 in range(0, whole, BLOCK_V):
        acc_t, acc_s = _pair_jsd_step(zs_row, zt_row, c0, width, acc_t, acc_s, k2, tops, topt,
                                      off_s, off_t, log2_b, False, BLOCK_V)
    if whole < width:
        acc_t, acc_s = _pair_jsd_step(zs_row, zt_row, whole, width, acc_t, acc_s, k2, tops,
                                      topt, off_s, off_t, log2_b, True, BLOCK_V)
    # acc_t sums b p_t (log2 b + sp(-d)) = -b p_t log2(p_t / m); acc_s (1 - b) p_s (-w / ln 2)
    ln2 = 0.6931471805599453
    tl.store(acc + row, tl.load(acc + row) - tl.sum(acc_t, 0) * (ln2 * tl.exp(-log_b)))
    tl.store(acc + plane + row,
             tl.load(acc + plane + row) - tl.sum(acc_s, 0) * (ln2 * tl.exp(-log_1mb)))


@triton.jit
def _pair_grad_kernel(
    zs_ptr, stride_s, zt_ptr, stride_t, top_s, log_l_s, top_t, log_l_t, aux, grad, width,
    z_scale, log_b, log_1mb, one_minus_beta,
    MODE: tl.constexpr, INTERPRET_BF16: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Overwrite row ``r`` of the student's tile with ``dL/dx`` (``x`` its logits before the
    temperature), in its dtype: ``dz = p_s - p_t`` (``MODE`` 0), ``p_s (log p_s - log p_t -
    aux)`` (1), ``(1 - beta) p_s (w - aux)`` (2, ``aux = E_s[w]``), times ``grad[r] / T``. One
    program per real row: the launcher zeroes the last chunk's padding rows. ``log p = (x -
    top) z_scale - log l``, the difference first (the forward's normalisers in parts)."""
    r = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + r * stride_s
    zt_row = zt_ptr + r * stride_t
    top_s_r = tl.load(top_s + r)
    top_t_r = tl.load(top_t + r)
    log_l_s_r = tl.load(log_l_s + r)
    log_l_t_r = tl.load(log_l_t + r)
    aux_r = tl.load(aux + r)
    coef = tl.load(grad + r) * z_scale
    if MODE == 2:
        coef *= one_minus_beta
    for c0 in range(0, width, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        valid = cols < width
        xs = tl.load(zs_row + cols, mask=valid, other=0.0).to(tl.float32)
        xt = tl.load(zt_row + cols, mask=valid, other=0.0).to(tl.float32)
        ls = (xs - top_s_r) * z_scale - log_l_s_r
        lt = (xt - top_t_r) * z_scale - log_l_t_r
        p_s = tl.exp(ls)
        if MODE == 0:
            dz = p_s - tl.exp(lt)
        elif MODE == 1:
            dz = p_s * (ls - lt - aux_r)
        else:
            dz = p_s * (_student_share(ls, lt, log_b, log_1mb) - aux_r)
        tl.store(zs_row + cols, round_to(dz * coef, zs_ptr.dtype.element_ty, INTERPRET_BF16),
                 mask=valid)


@triton.jit
def _topk_sweep_step(z_row, c0, width, factor, top, log2_l, k2, MASKED: tl.constexpr,
                     INTERPRET_BF16: tl.constexpr, BLOCK_V: tl.constexpr):
    """Columns ``c0 ... c0 + BLOCK_V``: logits -> ``factor p_j`` in place (``factor = -sum_i
    g_i / T``, ``p = 2^((x - top) k2 - log2 l)``)."""
    cols = c0 + tl.arange(0, BLOCK_V)
    x = load_cols(z_row, cols, width, MASKED)
    dx = round_to(factor * tl.exp2((x - top) * k2 - log2_l), z_row.dtype.element_ty,
                   INTERPRET_BF16)
    store_cols(z_row, cols, dx, width, MASKED)


@triton.jit
def _topk_grad_kernel(
    z_ptr, stride_row, ids, grad, k, top, log_l, width, v0, z_scale,
    INTERPRET_BF16: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Overwrite row ``r``'s logits (before the temperature) with ``dL/dx = (sum_i g_i 1[j =
    id_i] - p_j sum_i g_i) / T`` from the upstream ``grad [n, k]`` on the log-probs at ``ids
    [n, k]`` (``k <= BLOCK_K``); a repeated id collects each of its gradients. One program per
    real row.

    The picked columns' gradients are formed first, from their logits, in a ``BLOCK_K``
    vector; the sweep then writes ``-p_j sum_i g_i`` over the whole row with no per-id work;
    last, after a barrier, the picked columns are overwritten with theirs. ``p = 2^((x - top)
    k2 - log2 l)`` from the forward's normaliser in parts (``top`` the row's max logit as the
    head's forward loaded it), the difference first."""
    r = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + r * stride_row
    top_r = tl.load(top + r)
    log2_l = tl.load(log_l + r) * 1.4426950408889634  # log2(e)
    k2 = z_scale * 1.4426950408889634
    slot = tl.arange(0, BLOCK_K)
    in_k = slot < k
    g = tl.load(grad + r * k + slot, mask=in_k, other=0.0)
    minus_total = -tl.sum(g, 0)
    at = tl.load(ids + r * k + slot, mask=in_k, other=0) - v0
    hit = in_k & (at >= 0) & (at < width)
    col = tl.where(hit, at, 0).to(tl.int32)
    g_at = tl.zeros((BLOCK_K,), tl.float32)
    for i in range(0, k):  # in the order of the ids: a repeated id sums its gradients
        g_at += tl.where(at == tl.load(ids + r * k + i) - v0, tl.load(grad + r * k + i), 0.0)
    x_at = tl.load(z_row + col, mask=hit, other=0.0).to(tl.float32)
    dx_at = round_to((g_at + minus_total * tl.exp2((x_at - top_r) * k2 - log2_l)) * z_scale,
                      z_ptr.dtype.element_ty, INTERPRET_BF16)
    tl.debug_barrier()  # the picked logits are read before the sweep overwrites them
    factor = minus_total * z_scale
    whole = width // BLOCK_V * BLOCK_V
    for c0 in range(0, whole, BLOCK_V):
        _topk_sweep_step(z_row, c0, width, factor, top_r, log2_l, k2, False, INTERPRET_BF16,
                         BLOCK_V)
    if whole < width:
        _topk_sweep_step(z_row, whole, width, factor, top_r, log2_l, k2, True, INTERPRET_BF16,
                         BLOCK_V)
    tl.debug_barrier()  # the sweep's stores land before the picked columns' (one value each)
    tl.store(z_row + col, dx_at, mask=hit)


def stats_meta(beta: float) -> dict:
    """The constexprs and warps ``divergence_forward`` launches ``_pair_stats_kernel`` with."""
    gap = _FORWARD_KL if beta == 0.0 else _REVERSE_KL if beta == 1.0 else _MIXTURE
    return dict(GAP=gap, BLOCK_V=_BLOCK_V, LANE=head.LANE_COLS, num_warps=_WARPS)


def jsd_meta() -> dict:
    """The constexprs and warps of ``_pair_jsd_kernel``."""
    return dict(BLOCK_V=_BLOCK_V, num_warps=_WARPS)


def grad_meta(beta: float, dtype: torch.dtype) -> dict:
    """The constexprs and warps of ``_pair_grad_kernel`` (``dtype``: the student's)."""
    return dict(MODE=stats_meta(beta)["GAP"], INTERPRET_BF16=_bf16_interpreted(dtype),
                BLOCK_V=_BLOCK_V, num_warps=_WARPS)


def topk_grad_meta(dtype: torch.dtype, k: int = 1) -> dict:
    """The constexprs and warps of ``_topk_grad_kernel`` for ``k`` ids a row."""
    return dict(INTERPRET_BF16=_bf16_interpreted(dtype), BLOCK_V=_BLOCK_V,
                BLOCK_K=triton.next_power_of_2(max(int(k), 1)), num_warps=_WARPS)


def _bf16_interpreted(dtype):
    return INTERPRET and dtype == torch.bfloat16


class _Fp32Plan(TilePlan):
    """A head's plan whose logits tile is fp32 whatever the inputs' dtype: a divergence's
    logit gradient is a difference of two heads' logits (``log p_s - log p_t`` for the reverse
    KL), which takes their rounding whole, so bf16 logits put the gradient outside the bf16
    reference's error (TRL's divergence kernels keep their logits in fp32 too). The GEMM writes
    fp32 directly where torch can (CUDA, torch >= 2.8); elsewhere each chunk's operands are
    upcast. For bf16/fp16 inputs ``low`` holds the student's logit gradient in their dtype,
    the operand of the backward's GEMMs (``TileGrads``)."""

    def __init__(self, hidden, weight, tile_bytes, low: bool):
        super().__init__(hidden, weight, tile_bytes)
        size, dev = self.tile.numel(), hidden.device
        self.low = torch.empty(size, dtype=hidden.dtype, device=dev) \
            if low and hidden.dtype != torch.float32 else None
        if self.tile.dtype != torch.float32:
            self.tile = torch.empty(size, dtype=torch.float32, device=dev)
        self.direct = self.low is not None and mm_out_dtype(dev, hidden.dtype)

    def logits(self, weight, bias, v0, v1, r0, rows) -> torch.Tensor:
        """The untransformed fp32 logits ``[rows, v1 - v0]`` of a group, one GEMM per
        chunk (rows :func:`head.row_stride` apart, as the head's)."""
        z = head.tile_rows(self.tile, rows, v1 - v0)
        w_t, b = weight[v0:v1].t(), None if bias is None else bias[v0:v1].float()
        if weight.dtype != torch.float32 and not self.direct:
            w_t = w_t.float()
        for c in range(0, rows, head.ROW_CHUNK):
            h = self.hidden[r0 + c:r0 + c + head.ROW_CHUNK]
            out = z[c:c + head.ROW_CHUNK]
            if self.direct:
                torch.addmm(out, h, w_t, beta=0.0, out_dtype=torch.float32, out=out)
                if b is not None:
                    out.add_(b)
            elif b is None:
                torch.mm(h.float(), w_t, out=out)
            else:
                torch.addmm(b, h.float(), w_t, out=out)
        return z

    def dx(self, z):
        """The logit gradient written over ``z`` in the inputs' dtype (``z`` itself for fp32
        inputs)."""
        return z if self.low is None else self.low[:z.numel()].view(z.shape).copy_(z)


def _plans(hidden, weight, t_hidden, t_weight, tile_bytes):
    """The student's and the teacher's plans, with the same row groups: ``tile_bytes`` (default
    the head's ``TILE_BYTES``) bounds both fp32 tiles and the student's low-precision gradient
    tile together, at least one chunk each."""
    budget = head.TILE_BYTES if tile_bytes is None else int(tile_bytes)
    cols = min(head.VOCAB_TILE, weight.shape[0])
    low = hidden.element_size() if hidden.dtype != torch.float32 else 0
    chunks = max(1, budget // ((8 + low) * cols * head.ROW_CHUNK))
    # ``TilePlan`` sizes its groups by its inputs' element size: each plan's budget is exactly
    # ``chunks`` of its chunk tiles in that size, so both get the same groups.
    return tuple(_Fp32Plan(h, w, chunks * h.element_size() * cols * head.ROW_CHUNK, student)
                 for h, w, student in ((hidden, weight, True), (t_hidden, t_weight, False)))


def _pair_tiles(plans, weights, biases):
    """Per vocabulary tile and row group: ``(v0, v1, gi, r0, rows, z_s, z_t)``, both heads'
    untransformed logits ``[rows, v1 - v0]`` in their tiles."""
    ps, pt = plans
    for v0, v1 in ps.tiles():
        for gi, (r0, rows) in enumerate(ps.groups):
            yield (v0, v1, gi, r0, rows, ps.logits(weights[0], biases[0], v0, v1, r0, rows),
                   pt.logits(weights[1], biases[1], v0, v1, r0, rows))


def divergence_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, *, beta: float,
                       temperature: float, tile_bytes: int | None = None,
                       entropy: bool = False):
    """Per-token generalized JSD, as ``divergence_torch.divergence_forward`` (fp32 results):
    ``(divergence, top_s, log_l_s, top_t, log_l_t, aux)`` and, with ``entropy``, the student's
    entropy; ``top``: each head's maximum untempered logit, as the kernels load them.
    ``tile_bytes`` bounds both heads' logits tiles together (default the head's
    ``TILE_BYTES``)."""
    n = hidden.shape[0]
    state = torch.zeros(6, n, dtype=torch.float32, device=hidden.device)
    state[0].fill_(-math.inf)
    state[2].fill_(-math.inf)
    z_scale = 1.0 / float(temperature)
    if n:
        plans = _plans(hidden, weight, t_hidden, t_weight, tile_bytes)
        meta = stats_meta(beta)
        for v0, v1, _, r0, rows, zs, zt in _pair_tiles(plans, (weight, t_weight),
                                                        (bias, t_bias)):
            _pair_stats_kernel[(plans[0].real_rows(r0, rows),)](
                zs, zs.stride(0), zt, zt.stride(0), state[:, r0:], n, v1 - v0, z_scale, **meta)
    top_s, l_s, top_t, l_t, gap, a_s = state
    norm = (top_s, l_s.log(), top_t, l_t.log())
    extra = (norm[1] - a_s / l_s,) if entropy else ()
    if beta in (0.0, 1.0):
        div = finish_kl(beta, gap, l_s, l_t, (top_s - top_t) * z_scale, norm[1], norm[3])
        return div, *norm, div, *extra
    acc = torch.zeros(2, n, dtype=torch.float32, device=hidden.device)
    if n:
        for v0, v1, _, r0, rows, zs, zt in _pair_tiles(plans, (weight, t_weight),
                                                        (bias, t_bias)):
            _pair_jsd_kernel[(plans[0].real_rows(r0, rows),)](
                zs, zs.stride(0), zt, zt.stride(0), *(x[r0:] for x in norm), acc[:, r0:], n,
                v1 - v0, z_scale, math.log(beta), math.log1p(-beta), **jsd_meta())
    kl_t, share = acc  # share: E_s[w]; KL(s || m) = E_s[w] - log(1 - beta)
    div = beta * kl_t + (1.0 - beta) * (share - math.log1p(-beta))
    return div, *norm, share, *extra


def _no_rows(hidden, weight, need_hidden, need_weight, need_bias):
    """The gradients of an empty batch (or of a call that needs none)."""
    make = lambda need, shape, dtype: torch.zeros(shape, dtype=dtype, device=hidden.device) \
        if need else None
    return (make(need_hidden, hidden.shape, torch.float32),
            make(need_weight, weight.shape, weight.dtype),
            make(need_bias, weight.shape[0], torch.float32))


def divergence_backward(hidden, weight, bias, t_hidden, t_weight, t_bias, top_s, log_l_s, top_t,
                        log_l_t, aux, grad, *, beta: float, temperature: float,
                        need_hidden: bool, need_weight: bool, need_bias: bool,
                        tile_bytes: int | None = None, d_weight=None, d_bias=None):
    """Gradients of the student's hidden (fp32), weight (its dtype) and bias (fp32) from the
    per-token upstream ``grad``, as ``divergence_torch.divergence_backward``; with
    ``d_weight`` / ``d_bias`` (fp32 accumulators) the weight's and bias's are added into them
    (no ``[V, D]`` temporary, nothing rounded to the weight's dtype) and returned."""
    n = hidden.shape[0]
    if n == 0 or not (need_hidden or need_weight or need_bias):
        return _no_rows(hidden, weight, need_hidden, need_weight, need_bias)
    plans = _plans(hidden, weight, t_hidden, t_weight, tile_bytes)
    grads = TileGrads(plans[0], weight, need_hidden, need_weight, need_bias,
                      d_weight=d_weight if need_weight else None,
                      d_bias=d_bias if need_bias else None)
    mixed = 0.0 < beta < 1.0
    scalars = dict(z_scale=1.0 / float(temperature),
                   log_b=math.log(beta) if mixed else 0.0,
                   log_1mb=math.log1p(-beta) if mixed else 0.0, one_minus_beta=1.0 - beta)
    per_row = [t.float().contiguous() for t in (top_s, log_l_s, top_t, log_l_t, aux, grad)]
    meta = grad_meta(beta, plans[0].tile.dtype)  # fp32: the gradient is rounded by plans[0].dx
    for v0, v1, gi, r0, rows, zs, zt in _pair_tiles(plans, (weight, t_weight), (bias, t_bias)):
        real = plans[0].real_rows(r0, rows)
        _pair_grad_kernel[(real,)](
            zs, zs.stride(0), zt, zt.stride(0), *(t[r0:] for t in per_row), v1 - v0, **scalars,
            **meta)
        zs[real:].zero_()  # the last chunk's padding rows: no gradient
        grads.add(plans[0].dx(zs), weight[v0:v1], v0, v1, gi, r0, rows)
        if gi == len(plans[0].groups) - 1:
            grads.end_tile(v0, v1)
    return grads.result()


def topk_forward(hidden, weight, bias, ids, *, temperature: float,
                 tile_bytes: int | None = None):
    """The student's tempered log-softmax at ``ids [N, k]`` (int64 in ``[0, V)``) and its
    normaliser as `topk_backward` reads it, fp32: ``(logprobs [N, k], top [N], log_l [N])``
    (``softmax_partials.normaliser`` of the head's own forward pass, no target; ``top`` the max
    of the untempered logits). The k logits are gathered, ``h . W[id] + b[id]`` rounded to the
    input dtype as the head's GEMM rounds them; ``log q = (z - top) / T - log l``."""
    n, d = hidden.shape
    no_target = torch.full((n,), -1, dtype=torch.int64, device=hidden.device)
    parts = head.forward(hidden, weight, bias, no_target, temperature=temperature,
                         softcap=None, logit_scale=1.0, want_s2=False, want_sum_z=False,
                         tile_bytes=tile_bytes)
    top, log_l = normaliser(parts)
    k = ids.shape[1]
    z = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    step = max(1, _GATHER_BYTES // (k * d * hidden.element_size()))
    for r0 in range(0, n, step):
        sel = ids[r0:r0 + step]
        h = hidden[r0:r0 + step].unsqueeze(2)
        if bias is None:
            picked = torch.bmm(weight[sel], h)
        else:
            picked = torch.baddbmm(bias[sel].unsqueeze(2), weight[sel], h)
        z[r0:r0 + step] = picked.squeeze(2)
    logprobs = z.sub_(top.unsqueeze(1)).div_(float(temperature)).sub_(log_l.unsqueeze(1))
    return logprobs, top, log_l


def topk_backward(hidden, weight, bias, ids, top, log_l, grad, *, temperature: float,
                  need_hidden: bool, need_weight: bool, need_bias: bool,
                  tile_bytes: int | None = None):
    """Gradients from ``grad [N, k]`` on the top-k log-probs, as
    ``divergence_torch.topk_backward``: ``d z_j = sum_i g_i 1[j = id_i] - p_j sum_i g_i``."""
    n, k = ids.shape
    if n == 0 or not (need_hidden or need_weight or need_bias):
        return _no_rows(hidden, weight, need_hidden, need_weight, need_bias)
    plan = TilePlan(hidden, weight, tile_bytes)
    grads = TileGrads(plan, weight, need_hidden, need_weight, need_bias)
    ids, grad = ids.contiguous(), grad.float().contiguous()
    top, log_l = top.float().contiguous(), log_l.float().contiguous()
    meta = topk_grad_meta(hidden.dtype, k)
    for v0, v1 in plan.tiles():
        for gi, (r0, rows) in enumerate(plan.groups):
            dx = plan.logits(weight, bias, v0, v1, r0, rows)
            real = plan.real_rows(r0, rows)
            _topk_grad_kernel[(real,)](
                dx, dx.stride(0), ids[r0:], grad[r0:], k, top[r0:], log_l[r0:], v1 - v0, v0,
                1.0 / float(temperature), **meta)
            dx[real:].zero_()
            grads.add(dx, weight[v0:v1], v0, v1, gi, r0, rows)
        grads.end_tile(v0, v1)
    return grads.result()
