"""The CUDA path of ``linear_logprobs``: cuBLAS GEMMs for the logits, one-pass Triton epilogues.

Logits ``z = logit_scale * softcap(hidden @ W^T + b) / temperature`` are made one tile at a
time: a tile is ``VOCAB_TILE`` vocabulary columns by a *row group* of hidden states, written by
``torch.mm`` / ``torch.addmm`` (cuBLAS, with fp32 accumulation) in the input dtype. Every GEMM
has ``ROW_CHUNK`` rows but the last, whose rows are padded with zero rows to a multiple of
``ROW_GRANULE`` (128: a call pads at most 127 rows), so the GEMMs that produce a row's logits and
its hidden gradient are one of ``ROW_CHUNK / ROW_GRANULE`` heights per tile width whatever N is
(cuBLAS picks its kernel, and with it the order of the sums over D, from the shape; a row's bits
must not depend on which of these heights it gets: docs/gpu.md, "Determinism and batch
invariance"). A row group is as many chunks as fit the tile budget (``tile_bytes``, default
:data:`TILE_BYTES`).

Forward (:func:`forward`): per vocabulary tile (in vocabulary order) and row group, the chunks'
GEMMs fill the tile, then ``tile_stats_kernel`` (one program per row) reads it once, applies
the logit transform in fp32 and folds it into the row's running statistics ``m, l, a, s2,
sum_z, z_y, m_before`` (see ``softmax_partials``), kept in fp32 between launches. The fold order
is fixed (tiles left to right, ``_BLOCK_V`` columns at a time), so the statistics are the same
bits run to run and for every N.

Backward (:func:`backward`), vocabulary-outer: per tile and row group, the GEMMs recompute the
tile (the same GEMMs as the forward's, so the same bits), ``tile_grad_kernel`` turns it into
``dx = dL/dx`` in place (``x`` the logits before the transform), then per chunk
``d_hidden[chunk] += dx @ W_tile`` into an fp32 ``[N, D]`` accumulator, and ``d_weight[tile] =
dx^T @ hidden``, written once when there is one row group (else summed over the groups in an
fp32 tile). ``d_bias[tile]`` is the fp32 column sum of ``dx``. Every accumulation is taken in a
fixed order by launches that run one after another on one stream: there are no atomics, and the
gradients are bitwise reproducible.

fp32 inputs: the GEMMs are ``torch.mm`` calls, so they follow
``torch.get_float32_matmul_precision()`` (TF32 where the user allows it, IEEE otherwise); the
Triton passes hold no ``tl.dot``. bf16/fp16 products accumulated across tiles use ``addmm``'s
``out_dtype=torch.float32`` where this torch has it on this device (probed once per device),
else fp32 copies of the operands.

Under ``TRITON_INTERPRET=1`` (CPU tensors) the same code runs, with torch's CPU GEMMs in place
of cuBLAS; tests shrink :data:`VOCAB_TILE`, :data:`ROW_CHUNK`, :data:`ROW_GRANULE` and
``_BLOCK_V`` to cross their boundaries at small sizes. tanh is written with ``tl.exp`` (the
interpreter has no libdevice).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from logitless.kernels import constants
from logitless.kernels.linear_softmax_torch import addmm_acc_
from logitless.kernels.softmax_partials import Partials

__all__ = ["ROW_CHUNK", "ROW_GRANULE", "TILE_BYTES", "VOCAB_TILE", "backward", "forward"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The tiling (kernels/constants.py, priced by the cost model): vocabulary columns per tile, rows
# of every logits GEMM, default bytes of one tile. Bound here so that tests can shrink them.
VOCAB_TILE = constants.VOCAB_TILE
ROW_CHUNK = constants.ROW_CHUNK
ROW_GRANULE = constants.ROW_GRANULE
TILE_BYTES = constants.HEAD_TILE_BUDGET
# Columns an epilogue program handles per step, and its warps: fixed, so the order of the sums
# inside a row never depends on N (8 warps x 32 lanes x 8 bf16 = 2048: 16-byte loads).
_BLOCK_V = 2048
_WARPS = 8
# Every logits tile's rows start 16-element aligned (the stride rounded up to a multiple of 16):
# the runtime then specialises the stride as divisible by 16, the epilogues' loads are 16-byte
# vectors, and a lane's columns sit in one thread for every row and every N.
_ROW_ALIGN = 16
_TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@triton.jit
def tanh(x):
    # exp(-2|x|) <= 1 never overflows; libdevice tanh is not available to the interpreter.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dtype`` for the store."""
    if INTERPRET_BF16:
        # The interpreter truncates fp32 -> bf16: round with integer ops first, so the store's
        # truncation is exact.
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


LANE_COLS = 8  # columns one lane folds per step: one 16-byte load of bf16


@triton.jit
def load_cols(z_row, cols, width, MASKED: tl.constexpr):
    """The row's logits at ``cols`` in fp32 (``MASKED``: 0 at or past ``width``)."""
    if MASKED:
        return tl.load(z_row + cols, mask=cols < width, other=0.0).to(tl.float32)
    return tl.load(z_row + cols).to(tl.float32)


@triton.jit
def store_cols(z_row, cols, dx, width, MASKED: tl.constexpr):
    """``dx`` written over the row at ``cols`` (``MASKED``: not at or past ``width``)."""
    if MASKED:
        tl.store(z_row + cols, dx, mask=cols < width)
    else:
        tl.store(z_row + cols, dx)


@triton.jit
def _transform(x, softcap, HAS_SOFTCAP: tl.constexpr, FLIP: tl.constexpr):
    """``w = +-u``, ``u = tanh(x / c)`` when soft-capping, else ``x``: the logit is ``z = w *
    |z_scale| (* c)``, signed so that the row's largest ``w`` is its largest logit. ``u`` is
    what the backward recomputes before any product (``_grad_step``)."""
    if HAS_SOFTCAP:
        x = tanh(x / softcap)
    if FLIP:
        x = -x
    return x


@triton.jit
def _fold_step(z_row, c0, width, tgt, m, l, a, s2, sum_w, m_before, softcap, k2,
               HAS_SOFTCAP: tl.constexpr, FLIP: tl.constexpr, WANT_S2: tl.constexpr,
               WANT_SUM_Z: tl.constexpr, MASKED: tl.constexpr, LANES: tl.constexpr,
               LANE: tl.constexpr):
    """Fold columns ``c0 ... c0 + LANES * LANE`` into the per-lane running state: lane ``i``
    takes the ``LANE`` adjacent columns ``c0 + i * LANE ...`` (reduced inside the lane, no
    exchange between lanes). Per lane: the max ``m`` of ``w``; ``l = sum 2^t``, ``a = sum 2^t
    t`` and ``s2 = sum 4^t`` with ``t = (w - m) k2`` (log2 units); ``sum_w``; ``m_before``,
    the max of the lane's groups of ``LANE`` columns that lie wholly before ``tgt``.
    ``MASKED``: columns at or past ``width`` are skipped and lanes that have seen no column
    yet (``m = -inf``) are guarded; otherwise every column is real and every lane has seen
    one."""
    groups = c0 + tl.arange(0, LANES) * LANE
    cols = groups[:, None] + tl.arange(0, LANE)[None, :]
    w = _transform(load_cols(z_row, cols, width, MASKED), softcap, HAS_SOFTCAP, FLIP)
    if MASKED:
        valid = cols < width
        w = tl.where(valid, w, float("-inf"))
    w_max = tl.max(w, 1)
    m_new = tl.maximum(m, w_max)
    ref = m_new
    if MASKED:
        # exp2(-inf - -inf) would be NaN: a lane that has seen nothing keeps l = a = 0.
        had = m > float("-inf")
        ref = tl.where(m_new > float("-inf"), ref, 0.0)
        shift = tl.where(had, (m - ref) * k2, 0.0)
        alpha = tl.where(had, tl.exp2(shift), 0.0)
    else:
        shift = (m - ref) * k2
        alpha = tl.exp2(shift)
    # The difference first, then the product: exact near the maximum, where the logits' own
    # size (1e4 at T = 1e-3) would round ``w k2`` and ``m k2`` by 1e-3 each.
    t = (w - ref[:, None]) * k2
    if MASKED:
        # Past the width t = -inf (NaN when logit_scale = 0): e = 0 and t = 0 there, so that
        # e * t is 0, not NaN.
        e = tl.where(valid, tl.exp2(t), 0.0)
        t = tl.where(valid, t, 0.0)
    else:
        e = tl.exp2(t)
    a = (a + l * shift) * alpha + tl.sum(e * t, 1)
    l = l * alpha + tl.sum(e, 1)
    if WANT_S2:
        s2 = s2 * (alpha * alpha) + tl.sum(e * e, 1)
    if WANT_SUM_Z:
        if MASKED:
            w = tl.where(valid, w, 0.0)
        sum_w += tl.sum(w, 1)
    m_before = tl.where(groups + (LANE - 1) < tgt, tl.maximum(m_before, w_max), m_before)
    return m_new, l, a, s2, sum_w, m_before


@triton.jit
def tile_stats_kernel(
    logits, stride_row, targets, state, plane, width, v0, softcap, z_scale,
    HAS_SOFTCAP: tl.constexpr, FLIP: tl.constexpr, WANT_S2: tl.constexpr,
    WANT_SUM_Z: tl.constexpr, BLOCK_V: tl.constexpr, LANE: tl.constexpr,
):
    """Fold row ``r``'s ``width`` logits (vocabulary columns ``v0 ...``) into its statistics.

    ``state`` is fp32 ``[8, plane]`` (m, l, a, s2, sum_z, z_y, m_before, relative to the running
    max ``m``, and ``top``, the largest ``w`` of ``_transform``: ``m = top * unit``), read and
    written at column ``r``; ``targets[r]`` is the row's target index in this weight's
    vocabulary (below 0 or past the end when it lies in another slice). ``FLIP``: ``z_scale <
    0``. Tiles are merged by ``top``, in ``w`` units, so the shift of the tile that holds the
    maximum is exactly 0 and ``l`` is exact relative to ``top`` (natural units would round
    ``top * unit`` apart from ``top * unit * log2(e)``: a relative error of ``l`` of 1e-3 for
    logits of 1e4, at T = 1e-3, that the backward's ``p`` would inherit).

    The column loop keeps its state per lane (``_fold_step``); the lanes are reduced once, at
    the end, in a fixed tree and merged into ``state``. The order of every sum depends only on
    the column, never on the row or the number of rows.
    """
    LANES: tl.constexpr = BLOCK_V // LANE
    row = tl.program_id(0).to(tl.int64)
    z_row = logits + row * stride_row
    # The target, relative to this slice, as int32 in [0, width] (width: past the slice).
    tgt_raw = tl.load(targets + row) - v0
    has_t = (tgt_raw >= 0) & (tgt_raw < width)
    tgt = tl.minimum(tl.maximum(tgt_raw, 0), width).to(tl.int32)
    scale = tl.abs(z_scale)  # the unit of w: z = w * scale
    if HAS_SOFTCAP:
        scale = scale * softcap
    k2 = scale * 1.4426950408889634  # log2(e)
    neg = tl.full((LANES,), float("-inf"), tl.float32)
    zero = tl.zeros((LANES,), tl.float32)
    # The first step is guarded (it may be partial); the rest but the last are whole.
    m, l, a, s2, sum_w, m_lane = _fold_step(
        z_row, 0, width, tgt, neg, zero, zero, zero, zero, neg, softcap, k2,
        HAS_SOFTCAP, FLIP, WANT_S2, WANT_SUM_Z, True, LANES, LANE)
    whole = width // BLOCK_V * BLOCK_V
    for c0 in range(BLOCK_V, whole, BLOCK_V):
        m, l, a, s2, sum_w, m_lane = _fold_step(
            z_row, c0, width, tgt, m, l, a, s2, sum_w, m_lane, softcap, k2,
            HAS_SOFTCAP, FLIP, WANT_S2, WANT_SUM_Z, False, LANES, LANE)
    if (whole >= BLOCK_V) & (whole < width):
        m, l, a, s2, sum_w, m_lane = _fold_step(
            z_row, whole, width, tgt, m, l, a, s2, sum_w, m_lane, softcap, k2,
            HAS_SOFTCAP, FLIP, WANT_S2, WANT_SUM_Z, True, LANES, LANE)
    # The lanes, reduced once: to the slice's max, in log2 units.
    w_top = tl.max(m, 0)
    live = l > 0  # the lane has seen a column (its max counts 2^0 = 1)
    shift = tl.where(live, (m - w_top) * k2, 0.0)
    sc = tl.where(live, tl.exp2(shift), 0.0)
    l_t = tl.sum(l * sc, 0)
    a_t = tl.sum((a + l * shift) * sc, 0)
    s2_t = tl.sum(s2 * (sc * sc), 0)
    # The target's group of LANE columns: its columns before the target.
    part = (tgt // LANE) * LANE + tl.arange(0, LANE)
    before = part < tgt
    x_p = tl.load(z_row + part, mask=before, other=0.0).to(tl.float32)
    w_p = tl.where(before, _transform(x_p, softcap, HAS_SOFTCAP, FLIP), float("-inf"))
    w_before = tl.maximum(tl.max(m_lane, 0), tl.max(w_p, 0))
    x_y = tl.load(z_row + tl.where(has_t, tgt, 0), mask=has_t, other=0.0).to(tl.float32)
    # Merged into the row's state by ``top`` (w units; m = top * scale, the exact largest
    # logit): the shift of the tile that holds the maximum is exactly 0.
    s = state + row
    top0 = tl.load(s + 7 * plane)
    l0 = tl.load(s + plane)
    top = tl.maximum(top0, w_top)
    first = l0 == 0  # top0 = -inf
    shift0 = tl.where(first, 0.0, (top0 - top) * k2)
    alpha0 = tl.where(first, 0.0, tl.exp2(shift0))
    shift_t = (w_top - top) * k2
    alpha_t = tl.exp2(shift_t)
    tl.store(s + 7 * plane, top)
    tl.store(s, top * scale)
    tl.store(s + plane, l0 * alpha0 + l_t * alpha_t)
    a_new = (tl.load(s + 2 * plane) + l0 * shift0 * 0.6931471805599453) * alpha0 \
        + (a_t + l_t * shift_t) * (0.6931471805599453 * alpha_t)
    tl.store(s + 2 * plane, a_new)
    if WANT_S2:
        tl.store(s + 3 * plane,
                 tl.load(s + 3 * plane) * (alpha0 * alpha0) + s2_t * (alpha_t * alpha_t))
    if WANT_SUM_Z:
        tl.store(s + 4 * plane, tl.load(s + 4 * plane) + tl.sum(sum_w, 0) * scale)
    z_y = tl.where(has_t, _transform(x_y, softcap, HAS_SOFTCAP, FLIP) * scale, 0.0)
    tl.store(s + 5 * plane, tl.load(s + 5 * plane) + z_y)
    # No column before the target: -inf (logit_scale = 0 would make -inf * 0 = NaN).
    z_before = tl.where(w_before > float("-inf"), w_before * scale, float("-inf"))
    tl.store(s + 6 * plane, tl.maximum(tl.load(s + 6 * plane), z_before))


@triton.jit
def _grad_step(z_row, c0, width, tgt, top, log_l2, coef, g_y, g_h2, two_g_s2, shift, softcap,
               k2, dx_scale, HAS_SOFTCAP: tl.constexpr, HAS_G_ENTROPY: tl.constexpr,
               HAS_G_SUM_P_SQ: tl.constexpr, MASKED: tl.constexpr,
               INTERPRET_BF16: tl.constexpr, BLOCK_V: tl.constexpr):
    """Columns ``c0 ... c0 + BLOCK_V`` of one row, logits -> ``dx`` in place (``MASKED``: the
    columns at or past ``width`` are left alone). In log2 units: ``q = log2 p = (u - top) k2 -
    log2 l``, ``u`` as ``_transform`` makes it (unsigned: ``top`` and ``k2`` carry the sign);
    ``u - top`` is a difference of two numbers the forward saw, exact at the maximum, and no
    product comes before it for the compiler to fuse into it."""
    cols = c0 + tl.arange(0, BLOCK_V)
    x = load_cols(z_row, cols, width, MASKED)
    if HAS_SOFTCAP:
        t = tanh(x / softcap)
        q = (t - top) * k2 - log_l2
    else:
        q = (x - top) * k2 - log_l2
    p = tl.exp2(q)
    c = coef
    if HAS_G_ENTROPY:
        c -= g_h2 * q
    if HAS_G_SUM_P_SQ:
        c += two_g_s2 * p
    dz = p * c + tl.where(cols == tgt, g_y, 0.0) + shift
    dx = dz * dx_scale
    if HAS_SOFTCAP:
        dx *= 1.0 - t * t
    store_cols(z_row, cols, round_to(dx, z_row.dtype.element_ty, INTERPRET_BF16), width,
                MASKED)


@triton.jit
def tile_grad_kernel(
    logits, stride_row, targets, top, log_l, entropy, sum_p_sq,
    g_lp, g_entropy, g_sum_p_sq, g_mean_logit, g_lse,
    n_rows, width, v0, softcap, z_scale, inv_vocab_total,
    HAS_SOFTCAP: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENTROPY: tl.constexpr,
    HAS_G_SUM_P_SQ: tl.constexpr, HAS_G_MEAN: tl.constexpr, HAS_G_LSE: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Overwrite row ``r``'s logits (before the transform) with ``dL/dx``, in their dtype.

    With ``p = exp(z - lse)``: ``dz = p (-g_lp + g_lse - g_H (log p + H) + 2 g_S2 (p - S2))
    + g_lp 1[j = y] + g_mean / V``, then ``dx = dz z_scale (1 - tanh(x / c)^2)``. The
    normaliser comes in two parts, ``lse = top * |z_scale| (* c) + log_l``: ``top`` from the
    forward's state (its plane 7, w units) and ``log_l``, so that ``p`` is recomputed from a
    difference of the logits as the forward saw them (see ``_grad_step``). Rows at or past
    ``n_rows`` (the padding of the last chunk) are written as zeros. Whole steps of
    ``BLOCK_V`` columns run unmasked; the last partial one is masked.
    """
    row = tl.program_id(0).to(tl.int64)
    z_row = logits + row * stride_row
    keep = row < n_rows
    r = tl.minimum(row, n_rows - 1)  # padding rows load the last real row's scalars
    log_l2 = tl.load(log_l + r) * 1.4426950408889634  # log2(e): p = 2^((u - top) k2 - log_l2)
    top_r = tl.load(top + r)
    top_r = tl.where(z_scale < 0, -top_r, top_r)  # w = -u when the scale is negative
    # The target relative to this slice, as int32 in [-1, width] (outside: never matched).
    tgt = tl.minimum(tl.maximum(tl.load(targets + r) - v0, -1), width).to(tl.int32)
    coef = 0.0
    g_y = 0.0
    g_h2 = 0.0
    two_g_s2 = 0.0
    if HAS_G_LP:
        g_y = tl.load(g_lp + r)
        coef -= g_y
    if HAS_G_LSE:
        coef += tl.load(g_lse + r)
    if HAS_G_ENTROPY:
        g_h = tl.load(g_entropy + r)
        coef -= g_h * tl.load(entropy + r)
        g_h2 = g_h * 0.6931471805599453  # g_H log p = g_H ln(2) log2 p
    if HAS_G_SUM_P_SQ:
        two_g_s2 = 2.0 * tl.load(g_sum_p_sq + r)
        coef -= two_g_s2 * tl.load(sum_p_sq + r)
    shift = 0.0
    if HAS_G_MEAN:
        shift = tl.load(g_mean_logit + r) * inv_vocab_total
    k2 = z_scale * 1.4426950408889634
    if HAS_SOFTCAP:
        k2 = z_scale * softcap * 1.4426950408889634  # u = tanh(x / c), z = u c z_scale
    dx_scale = tl.where(keep, z_scale, 0.0)  # padding rows: dx = 0
    whole = width // BLOCK_V * BLOCK_V
    for c0 in range(0, whole, BLOCK_V):
        _grad_step(z_row, c0, width, tgt, top_r, log_l2, coef, g_y, g_h2, two_g_s2, shift,
                   softcap, k2, dx_scale, HAS_SOFTCAP, HAS_G_ENTROPY, HAS_G_SUM_P_SQ, False,
                   INTERPRET_BF16, BLOCK_V)
    if whole < width:
        _grad_step(z_row, whole, width, tgt, top_r, log_l2, coef, g_y, g_h2, two_g_s2, shift,
                   softcap, k2, dx_scale, HAS_SOFTCAP, HAS_G_ENTROPY, HAS_G_SUM_P_SQ, True,
                   INTERPRET_BF16, BLOCK_V)


def row_stride(width: int) -> int:
    """The row stride (elements) of a logits tile ``width`` columns wide: a multiple of 16."""
    return -(-int(width) // _ROW_ALIGN) * _ROW_ALIGN


def tile_rows(buf: torch.Tensor, rows: int, width: int, ld: int | None = None) -> torch.Tensor:
    """The first ``rows`` rows of ``width`` columns of the flat buffer ``buf``, ``ld``
    (:func:`row_stride`) elements apart. On CPU the columns past ``width`` are zeroed: torch's
    CPU GEMM in bf16 reads an operand's row padding (times zero; torch 2.13), so a NaN left
    there by the allocator or by earlier use would reach the product. cuBLAS reads only the
    ``width`` columns: nothing is filled on CUDA."""
    ld = row_stride(width) if ld is None else ld
    full = buf[:rows * ld].view(rows, ld)
    if ld > width and buf.device.type == "cpu":
        full[:, width:].zero_()
    return full[:, :width]


def stats_meta(dtype: torch.dtype, softcap, want_s2: bool, want_sum_z: bool,
               negative_scale: bool = False) -> dict:
    """The constexprs and warps ``forward`` launches ``tile_stats_kernel`` with
    (``negative_scale``: ``logit_scale / temperature < 0``)."""
    del dtype  # one program for every dtype: the tile's element type comes with its pointer
    return dict(HAS_SOFTCAP=softcap is not None, FLIP=bool(negative_scale),
                WANT_S2=bool(want_s2), WANT_SUM_Z=bool(want_sum_z), BLOCK_V=_BLOCK_V,
                LANE=LANE_COLS, num_warps=_WARPS)


def grad_meta(dtype: torch.dtype, softcap, g_lp, g_entropy, g_sum_p_sq, g_mean_logit,
              g_lse) -> dict:
    """The constexprs and warps ``backward`` launches ``tile_grad_kernel`` with."""
    return dict(
        HAS_SOFTCAP=softcap is not None, HAS_G_LP=g_lp is not None,
        HAS_G_ENTROPY=g_entropy is not None, HAS_G_SUM_P_SQ=g_sum_p_sq is not None,
        HAS_G_MEAN=g_mean_logit is not None, HAS_G_LSE=g_lse is not None,
        INTERPRET_BF16=INTERPRET and dtype == torch.bfloat16, BLOCK_V=_BLOCK_V,
        num_warps=_WARPS,
    )


def _check_inputs(hidden, weight, bias, targets):
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, D], got shape {tuple(hidden.shape)}")
    n, d = hidden.shape
    if hidden.dtype not in _TORCH_DTYPES:
        raise ValueError(f"hidden must be bf16, fp16 or fp32, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [V, {d}], got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(
            f"hidden, weight and bias must share a dtype, got {hidden.dtype}, {weight.dtype}"
            f", {None if bias is None else bias.dtype}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    if targets.shape != (n,) or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 [{n}], got {targets.dtype} shape {tuple(targets.shape)}"
        )


class TilePlan:
    """Row chunks, row groups and vocabulary tiles of one call, with its tile buffer.

    ``hidden`` is cut into ``ROW_CHUNK``-row chunks, the last one padded with zero rows to a
    multiple of ``ROW_GRANULE`` (``constants.row_blocks``; a copy only when N is not such a
    multiple); a row group is a run of chunks whose tile fits ``tile_bytes`` (at least one
    chunk), the groups evened out to within one chunk, the partial chunk in the last.
    """

    def __init__(self, hidden, weight, tile_bytes):
        n, d = hidden.shape
        self.n, self.v = n, weight.shape[0]
        self.cols = min(VOCAB_TILE, self.v)
        blocks = list(constants.row_blocks(n, ROW_CHUNK, ROW_GRANULE))
        chunks = len(blocks)
        self.n_pad = blocks[-1][0] + blocks[-1][2]
        if self.n_pad == n:
            self.hidden = hidden.contiguous()
        else:
            self.hidden = hidden.new_zeros(self.n_pad, d)
            self.hidden[:n] = hidden
        row_bytes = self.cols * hidden.element_size()
        budget = TILE_BYTES if tile_bytes is None else int(tile_bytes)
        per_group = max(1, budget // (row_bytes * ROW_CHUNK))
        groups = triton.cdiv(chunks, per_group)
        q, rem = divmod(chunks, groups)
        self.groups, r0 = [], 0
        for i in range(groups):
            rows = min((q + (i < rem)) * ROW_CHUNK, self.n_pad - r0)
            self.groups.append((r0, rows))
            r0 += rows
        self.tile = torch.empty(max(r for _, r in self.groups) * row_stride(self.cols),
                                dtype=hidden.dtype, device=hidden.device)

    def tiles(self):
        for v0 in range(0, self.v, self.cols):
            yield v0, min(v0 + self.cols, self.v)

    def logits(self, weight, bias, v0, v1, r0, rows) -> torch.Tensor:
        """The untransformed logits ``[rows, v1 - v0]`` of a group, one GEMM per chunk (rows
        :func:`row_stride` apart)."""
        z = tile_rows(self.tile, rows, v1 - v0)
        w_t = weight[v0:v1].t()
        for c in range(0, rows, ROW_CHUNK):
            h = self.hidden[r0 + c:r0 + c + ROW_CHUNK]
            out = z[c:c + ROW_CHUNK]
            if bias is None:
                torch.mm(h, w_t, out=out)
            else:
                torch.addmm(bias[v0:v1], h, w_t, out=out)
        return z

    def real_rows(self, r0, rows) -> int:
        """Rows of the group ``(r0, rows)`` that are not padding."""
        return max(0, min(rows, self.n - r0))


class TileGrads:
    """The hidden, weight and bias gradients of one backward, taken tile by tile from the
    logit gradient ``dx`` of each (vocabulary tile, row group) of a :class:`TilePlan`: a fixed
    order of GEMMs on one stream, no atomics. Shared by every CUDA head backward
    (``linear_logprobs`` here, the divergences in ``kernels/divergence.py``)."""

    def __init__(self, plan: TilePlan, weight, need_hidden: bool, need_weight: bool,
                 need_bias: bool, d_weight=None, d_bias=None):
        dev = weight.device
        self.plan = plan
        # ``d_weight`` / ``d_bias`` given (fp32, a caller's accumulators): every tile adds into
        # them. Otherwise every tile of them is written whole by its first row group.
        self.into = d_weight is not None, d_bias is not None
        self.d_weight = d_weight if d_weight is not None else \
            torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_weight else None
        self.d_bias = d_bias if d_bias is not None else \
            torch.empty(plan.v, dtype=torch.float32, device=dev) if need_bias else None
        self.d_hidden = torch.empty(plan.n_pad, plan.hidden.shape[1], dtype=torch.float32,
                                    device=dev) if need_hidden else None
        # d_weight's tiles are summed over row groups in fp32 when there are several.
        self.acc = None
        if need_weight and d_weight is None and len(plan.groups) > 1 \
                and weight.dtype != torch.float32:
            self.acc = torch.empty(plan.cols, weight.shape[1], dtype=torch.float32, device=dev)

    def add(self, dx, w, v0, v1, gi, r0, rows) -> None:
        """Add the logit gradient ``dx [rows, v1 - v0]`` of row group ``gi`` (first row ``r0``)
        against the weight tile ``w = weight[v0:v1]``."""
        if self.d_hidden is not None:
            for c in range(0, rows, ROW_CHUNK):
                addmm_acc_(self.d_hidden[r0 + c:r0 + c + ROW_CHUNK], dx[c:c + ROW_CHUNK], w,
                             beta=0.0 if v0 == 0 else 1.0)
        d_weight = self.d_weight
        if d_weight is not None and self.into[0]:
            addmm_acc_(d_weight[v0:v1], dx.t(), self.plan.hidden[r0:r0 + rows], beta=1.0)
        elif d_weight is not None:
            h = self.plan.hidden[r0:r0 + rows]
            if self.acc is not None:
                addmm_acc_(self.acc[:v1 - v0], dx.t(), h, beta=0.0 if gi == 0 else 1.0)
            elif gi == 0:
                torch.mm(dx.t(), h, out=d_weight[v0:v1])
            else:  # fp32 inputs: the tile is its own fp32 accumulator
                torch.addmm(d_weight[v0:v1], dx.t(), h, out=d_weight[v0:v1])
        if self.d_bias is not None:
            part = dx.sum(0, dtype=torch.float32)
            if gi == 0 and not self.into[1]:
                self.d_bias[v0:v1] = part
            else:
                self.d_bias[v0:v1] += part

    def end_tile(self, v0, v1) -> None:
        """After the last row group of the tile ``v0:v1``."""
        if self.acc is not None:
            self.d_weight[v0:v1] = self.acc[:v1 - v0]

    def result(self):
        """``(d_hidden [N, D] fp32, d_weight in the weight's dtype, d_bias [V] fp32)``, None
        where not asked for."""
        d_hidden = None if self.d_hidden is None else self.d_hidden[:self.plan.n]
        return d_hidden, self.d_weight, self.d_bias


def forward(hidden, weight, bias, targets, *, temperature: float, softcap: float | None,
            logit_scale: float, want_s2: bool, want_sum_z: bool,
            tile_bytes: int | None = None) -> Partials:
    """Per-token softmax statistics of ``z = logit_scale * softcap(h W^T + b) / T``.

    hidden ``[N, D]``, weight ``[V, D]`` (any strides), bias ``[V]`` or None, all one dtype
    (bf16/fp16/fp32); targets int64 ``[N]``, indices into this weight's vocabulary, below 0 or
    at least V when the target lies in a slice before or after it (``z_y = 0``; ``m_before``
    -inf or the slice's max). ``tile_bytes`` bounds the logits tile (default
    :data:`TILE_BYTES`; at least one ``ROW_CHUNK``-row chunk). Returns fp32 ``[N]`` partials
    (m, l, a, s2, sum_z, z_y, m_before, top; ``s2`` / ``sum_z`` zeros unless asked for;
    ``top`` the largest logit in the units of ``_transform``, which :func:`backward` reads).
    """
    _check_inputs(hidden, weight, bias, targets)
    n = hidden.shape[0]
    state = new_state(n, hidden.device)
    if n == 0:
        return Partials(*state)
    plan = TilePlan(hidden, weight, tile_bytes)
    targets = targets.contiguous()
    scalars = dict(softcap=1.0 if softcap is None else float(softcap),
                   z_scale=float(logit_scale) / float(temperature))
    meta = stats_meta(hidden.dtype, softcap, want_s2, want_sum_z, scalars["z_scale"] < 0)
    for v0, v1 in plan.tiles():
        for r0, rows in plan.groups:
            real = plan.real_rows(r0, rows)
            z = plan.logits(weight, bias, v0, v1, r0, rows)
            tile_stats_kernel[(real,)](
                z, z.stride(0), targets[r0:], state[:, r0:], n, v1 - v0, v0, **scalars, **meta)
    return Partials(*state)


# The planes of ``tile_stats_kernel``'s state that start at -inf (m, m_before, top); the
# others start at 0.
NEG_INF_PLANES = (0, 6, 7)


def new_state(n: int, device) -> torch.Tensor:
    """The starting state of ``tile_stats_kernel``, fp32 ``[8, n]``."""
    state = torch.zeros(8, n, dtype=torch.float32, device=device)
    for plane in NEG_INF_PLANES:
        state[plane].fill_(float("-inf"))
    return state


def backward(hidden, weight, bias, targets, top, log_l, entropy, sum_p_sq,
             g_lp, g_entropy, g_sum_p_sq, g_mean_logit, *, temperature: float,
             softcap: float | None, logit_scale: float, vocab_total: int,
             need_hidden: bool, need_weight: bool, need_bias: bool,
             tile_bytes: int | None = None, g_lse=None,
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of hidden, weight and bias from per-token upstream gradients.

    top, log_l, entropy, sum_p_sq: fp32 ``[N]`` statistics of the whole vocabulary, the first
    two the normaliser ``lse`` in the parts :func:`forward` gives (its partials' ``top`` and
    ``log l``; ``softmax_partials.normaliser``), entropy / sum_p_sq None when their upstream
    gradient is. g_*: ``[N]`` or None (that term is skipped; the entropy term costs nothing
    unless ``g_entropy`` is given). With ``p = exp(z - lse)`` recomputed per tile,
    ``dz = g_lp (1[j=y] - p) - g_entropy p (log p + H) + 2 g_sum_p_sq p (p - S2)
    + g_mean_logit / vocab_total + g_lse p``, ``dx = dz * logit_scale / T * (1 - tanh(x/c)^2)``.

    Returns ``d_hidden = dx @ W`` (fp32 ``[N, D]``), ``d_weight = dx^T @ hidden`` (``[V, D]``
    in the inputs' dtype, from GEMMs with fp32 accumulation) and ``d_bias = sum dx`` (fp32
    ``[V]``), None where not needed.
    """
    _check_inputs(hidden, weight, bias, targets)
    if g_entropy is not None and entropy is None:
        raise ValueError("entropy is required when g_entropy is given")
    if g_sum_p_sq is not None and sum_p_sq is None:
        raise ValueError("sum_p_sq is required when g_sum_p_sq is given")
    if need_bias and bias is None:
        raise ValueError("need_bias=True but bias is None")
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    if n == 0 or not (need_hidden or need_weight or need_bias):
        zeros = lambda need, shape, dtype: torch.zeros(shape, dtype=dtype, device=dev) \
            if need else None
        return (zeros(need_hidden, hidden.shape, torch.float32),
                zeros(need_weight, weight.shape, weight.dtype), zeros(need_bias, v, torch.float32))
    plan = TilePlan(hidden, weight, tile_bytes)
    grads = TileGrads(plan, weight, need_hidden, need_weight, need_bias)
    per_row = lambda t: None if t is None else t.float().contiguous()
    rows_args = [per_row(t) for t in (top, log_l, entropy, sum_p_sq, g_lp, g_entropy,
                                      g_sum_p_sq, g_mean_logit, g_lse)]
    # Unused pointers still need a tensor: top stands in for them (never read).
    ptrs = [t if t is not None else rows_args[0] for t in rows_args]
    meta = grad_meta(hidden.dtype, softcap, *rows_args[4:])
    scalars = dict(softcap=1.0 if softcap is None else float(softcap),
                   z_scale=float(logit_scale) / float(temperature),
                   inv_vocab_total=1.0 / vocab_total)
    targets = targets.contiguous()
    for v0, v1 in plan.tiles():
        w = weight[v0:v1]
        for gi, (r0, rows) in enumerate(plan.groups):
            real = plan.real_rows(r0, rows)
            dx = plan.logits(weight, bias, v0, v1, r0, rows)
            # One program per real row; the last chunk's padding rows are zeroed by one fill
            # (under the interpreter, a program per padding row cost most of a small call).
            tile_grad_kernel[(real,)](
                dx, dx.stride(0), targets[r0:], *(p[r0:] for p in ptrs), real, v1 - v0, v0,
                **scalars, **meta)
            dx[real:].zero_()
            grads.add(dx, w, v0, v1, gi, r0, rows)
        grads.end_tile(v0, v1)
    return grads.result()
