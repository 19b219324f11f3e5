"""The CUDA path of ``linear_logprobs``: cuBLAS GEMMs for the logits, one-pass Triton epilogues.

Logits ``z = logit_scale * softcap(hidden @ W^T + b) / temperature`` are made one tile at a
time: a tile is ``VOCAB_TILE`` vocabulary columns by a *row group* of hidden states, written by
``torch.mm`` / ``torch.addmm`` (cuBLAS, with fp32 accumulation) in the input dtype. Every GEMM
has exactly ``ROW_CHUNK`` rows: hidden is padded with zero rows to a whole number of chunks, so
the GEMMs that produce a row's logits and its hidden gradient have the same shape whatever N is
(cuBLAS picks its kernel, and with it the order of the sums over D, from the shape). A row group
is as many chunks as fit the tile budget (``tile_bytes``, default :data:`TILE_BYTES`).

Forward (:func:`forward`): per vocabulary tile (in vocabulary order) and row group, the chunks'
GEMMs fill the tile, then ``_tile_stats_kernel`` (one program per row) reads it once, applies
the logit transform in fp32 and folds it into the row's running statistics ``m, l, a, s2,
sum_z, z_y, m_before`` (see ``softmax_partials``), kept in fp32 between launches. The fold order
is fixed (tiles left to right, ``_BLOCK_V`` columns at a time), so the statistics are the same
bits run to run and for every N.

Backward (:func:`backward`), vocabulary-outer: per tile and row group, the GEMMs recompute the
tile (the same GEMMs as the forward's, so the same bits), ``_tile_grad_kernel`` turns it into
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
of cuBLAS; tests shrink :data:`VOCAB_TILE`, :data:`ROW_CHUNK` and ``_BLOCK_V`` to cross their
boundaries at small sizes. tanh is written with ``tl.exp`` (the interpreter has no libdevice).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from logitless.kernels import interpreter_compat
from logitless.kernels.linear_softmax_torch import addmm_acc_
from logitless.kernels.softmax_partials import Partials

interpreter_compat.apply()

__all__ = ["ROW_CHUNK", "TILE_BYTES", "VOCAB_TILE", "backward", "forward"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Vocabulary columns per tile: fixed, so tile boundaries (and the fold order of the statistics)
# never depend on N. gpu_plan.VOCAB_TILE must equal it.
VOCAB_TILE = 8192
# Rows of every logits GEMM (hidden is padded to whole chunks). gpu_plan.ROW_CHUNK equals it.
ROW_CHUNK = 1024
# Default bytes of one tile (a row group by VOCAB_TILE columns in the input dtype):
# 16384 bf16 rows. gpu_plan.HEAD_TILE_BUDGET equals it.
TILE_BYTES = 256 * 2**20
# Columns an epilogue program handles per step, and its warps: fixed, so the order of the sums
# inside a row never depends on N (8 warps x 32 lanes x 8 bf16 = 2048: 16-byte loads).
_BLOCK_V = 2048
_WARPS = 8
_TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@triton.jit
def _tanh(x):
    # exp(-2|x|) <= 1 never overflows; libdevice tanh is not available to the interpreter.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _round_to(x, dtype: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dtype`` for the store."""
    if INTERPRET_BF16:
        # The interpreter truncates fp32 -> bf16: round with integer ops first, so the store's
        # truncation is exact.
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _tile_stats_kernel(
    logits, stride_row, targets, state, plane, width, v0, softcap, z_scale,
    HAS_SOFTCAP: tl.constexpr, WANT_S2: tl.constexpr, WANT_SUM_Z: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Fold row ``r``'s ``width`` logits (vocabulary columns ``v0 ...``) into its statistics.

    ``state`` is fp32 ``[7, plane]`` (m, l, a, s2, sum_z, z_y, m_before, relative to the running
    max ``m``), read and written at column ``r``; ``targets[r]`` is the row's target index in
    this weight's vocabulary (below 0 or past the end when it lies in another slice).
    """
    row = tl.program_id(0).to(tl.int64)
    z_row = logits + row * stride_row
    tgt = tl.load(targets + row) - v0
    s = state + row
    m = tl.load(s)
    l = tl.load(s + plane)
    a = tl.load(s + 2 * plane)
    s2 = tl.load(s + 3 * plane)
    sum_z = tl.load(s + 4 * plane)
    z_y = tl.load(s + 5 * plane)
    m_before = tl.load(s + 6 * plane)
    for c0 in range(0, width, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        valid = cols < width
        x = tl.load(z_row + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            x = softcap * _tanh(x / softcap)
        z = tl.where(valid, x * z_scale, float("-inf"))
        # Every block holds a real column, so m_new is finite.
        m_new = tl.maximum(m, tl.max(z, 0))
        shift = m - m_new
        alpha = tl.exp(shift)
        d = z - m_new
        e = tl.exp(d)
        # First block: l = 0 and shift = -inf; past the width e = 0 and d = -inf. 0 * -inf
        # would poison a with NaN.
        a = (a + l * tl.where(l > 0, shift, 0.0)) * alpha + tl.sum(e * tl.where(valid, d, 0.0), 0)
        l = l * alpha + tl.sum(e, 0)
        if WANT_S2:
            s2 = s2 * (alpha * alpha) + tl.sum(e * e, 0)
        if WANT_SUM_Z:
            sum_z += tl.sum(tl.where(valid, z, 0.0), 0)
        z_y += tl.sum(tl.where(valid & (cols == tgt), z, 0.0), 0)
        m_before = tl.maximum(m_before, tl.max(tl.where(cols < tgt, z, float("-inf")), 0))
        m = m_new
    tl.store(s, m)
    tl.store(s + plane, l)
    tl.store(s + 2 * plane, a)
    tl.store(s + 3 * plane, s2)
    tl.store(s + 4 * plane, sum_z)
    tl.store(s + 5 * plane, z_y)
    tl.store(s + 6 * plane, m_before)


@triton.jit
def _tile_grad_kernel(
    logits, stride_row, targets, lse, entropy, sum_p_sq,
    g_lp, g_entropy, g_sum_p_sq, g_mean_logit, g_lse,
    n_rows, width, v0, softcap, z_scale, inv_vocab_total,
    HAS_SOFTCAP: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENTROPY: tl.constexpr,
    HAS_G_SUM_P_SQ: tl.constexpr, HAS_G_MEAN: tl.constexpr, HAS_G_LSE: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Overwrite row ``r``'s logits (before the transform) with ``dL/dx``, in their dtype.

    With ``p = exp(z - lse)``: ``dz = p (-g_lp + g_lse - g_H (log p + H) + 2 g_S2 (p - S2))
    + g_lp 1[j = y] + g_mean / V``, then ``dx = dz z_scale (1 - tanh(x / c)^2)``. Rows at or
    past ``n_rows`` (the padding of the last chunk) are written as zeros.
    """
    row = tl.program_id(0).to(tl.int64)
    z_row = logits + row * stride_row
    keep = row < n_rows
    r = tl.minimum(row, n_rows - 1)  # padding rows load the last real row's scalars
    lse_r = tl.load(lse + r)
    tgt = tl.load(targets + r) - v0
    coef = 0.0
    g_y = 0.0
    if HAS_G_LP:
        g_y = tl.load(g_lp + r)
        coef -= g_y
    if HAS_G_LSE:
        coef += tl.load(g_lse + r)
    if HAS_G_ENTROPY:
        g_h = tl.load(g_entropy + r)
        coef -= g_h * tl.load(entropy + r)
    if HAS_G_SUM_P_SQ:
        two_g_s2 = 2.0 * tl.load(g_sum_p_sq + r)
        coef -= two_g_s2 * tl.load(sum_p_sq + r)
    shift = 0.0
    if HAS_G_MEAN:
        shift = tl.load(g_mean_logit + r) * inv_vocab_total
    for c0 in range(0, width, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        valid = cols < width
        x = tl.load(z_row + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            t = _tanh(x / softcap)
            z = t * (softcap * z_scale)
        else:
            z = x * z_scale
        log_p = z - lse_r
        p = tl.exp(log_p)
        c = coef
        if HAS_G_ENTROPY:
            c -= g_h * log_p
        if HAS_G_SUM_P_SQ:
            c += two_g_s2 * p
        dz = p * c + tl.where(cols == tgt, g_y, 0.0) + shift
        dx = dz * z_scale
        if HAS_SOFTCAP:
            dx *= 1.0 - t * t
        dx = tl.where(keep, dx, 0.0)
        tl.store(z_row + cols, _round_to(dx, logits.dtype.element_ty, INTERPRET_BF16),
                 mask=valid)


def stats_meta(dtype: torch.dtype, softcap, want_s2: bool, want_sum_z: bool) -> dict:
    """The constexprs and warps ``forward`` launches ``_tile_stats_kernel`` with."""
    del dtype  # one program for every dtype: the tile's element type comes with its pointer
    return dict(HAS_SOFTCAP=softcap is not None, WANT_S2=bool(want_s2),
                WANT_SUM_Z=bool(want_sum_z), BLOCK_V=_BLOCK_V, num_warps=_WARPS)


def grad_meta(dtype: torch.dtype, softcap, g_lp, g_entropy, g_sum_p_sq, g_mean_logit,
              g_lse) -> dict:
    """The constexprs and warps ``backward`` launches ``_tile_grad_kernel`` with."""
    return dict(
        HAS_SOFTCAP=softcap is not None, HAS_G_LP=g_lp is not None,
        HAS_G_ENTROPY=g_entropy is not None, HAS_G_SUM_P_SQ=g_sum_p_sq is not None,
        HAS_G_MEAN=g_mean_logit is not None, HAS_G_LSE=g_lse is not None,
        INTERPRET_BF16=_INTERPRET and dtype == torch.bfloat16, BLOCK_V=_BLOCK_V,
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


class _Plan:
    """Row chunks, row groups and vocabulary tiles of one call, with its tile buffer.

    ``hidden`` is padded with zero rows to a whole number of ``ROW_CHUNK``-row chunks (a copy
    only when N is not a multiple); a row group is a run of whole chunks whose tile fits
    ``tile_bytes`` (at least one chunk), the groups evened out to within one chunk.
    """

    def __init__(self, hidden, weight, tile_bytes):
        n, d = hidden.shape
        self.n, self.v = n, weight.shape[0]
        self.cols = min(VOCAB_TILE, self.v)
        chunks = triton.cdiv(n, ROW_CHUNK)
        self.n_pad = chunks * ROW_CHUNK
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
            rows = (q + (i < rem)) * ROW_CHUNK
            self.groups.append((r0, rows))
            r0 += rows
        self.tile = torch.empty(max(r for _, r in self.groups) * self.cols, dtype=hidden.dtype,
                                device=hidden.device)

    def tiles(self):
        for v0 in range(0, self.v, self.cols):
            yield v0, min(v0 + self.cols, self.v)

    def logits(self, weight, bias, v0, v1, r0, rows) -> torch.Tensor:
        """The untransformed logits ``[rows, v1 - v0]`` of a group, one GEMM per chunk."""
        z = self.tile[:rows * (v1 - v0)].view(rows, v1 - v0)
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
    logit gradient ``dx`` of each (vocabulary tile, row group) of a :class:`_Plan`: a fixed
    order of GEMMs on one stream, no atomics. Shared by every CUDA head backward
    (``linear_logprobs`` here, the divergences in ``kernels/divergence.py``)."""

    def __init__(self, plan: _Plan, weight, need_hidden: bool, need_weight: bool,
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
    (m, l, a, s2, sum_z, z_y, m_before; ``s2`` / ``sum_z`` zeros unless asked for).
    """
    _check_inputs(hidden, weight, bias, targets)
    n = hidden.shape[0]
    state = torch.zeros(7, n, dtype=torch.float32, device=hidden.device)
    if n == 0:
        return Partials(*state)
    state[0].fill_(float("-inf"))
    state[6].fill_(float("-inf"))
    plan = _Plan(hidden, weight, tile_bytes)
    targets = targets.contiguous()
    meta = stats_meta(hidden.dtype, softcap, want_s2, want_sum_z)
    scalars = dict(softcap=1.0 if softcap is None else float(softcap),
                   z_scale=float(logit_scale) / float(temperature))
    for v0, v1 in plan.tiles():
        for r0, rows in plan.groups:
            real = plan.real_rows(r0, rows)
            z = plan.logits(weight, bias, v0, v1, r0, rows)
            _tile_stats_kernel[(real,)](
                z, z.stride(0), targets[r0:], state[:, r0:], n, v1 - v0, v0, **scalars, **meta)
    return Partials(*state)


def backward(hidden, weight, bias, targets, lse, entropy, sum_p_sq,
             g_lp, g_entropy, g_sum_p_sq, g_mean_logit, *, temperature: float,
             softcap: float | None, logit_scale: float, vocab_total: int,
             need_hidden: bool, need_weight: bool, need_bias: bool,
             tile_bytes: int | None = None, g_lse=None,
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of hidden, weight and bias from per-token upstream gradients.

    lse, entropy, sum_p_sq: fp32 ``[N]`` statistics of the whole vocabulary (entropy /
    sum_p_sq may be None when their upstream gradient is). g_*: ``[N]`` or None (that term is
    skipped; the entropy term costs nothing unless ``g_entropy`` is given). With ``p = exp(z -
    lse)`` recomputed per tile,
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
    plan = _Plan(hidden, weight, tile_bytes)
    grads = TileGrads(plan, weight, need_hidden, need_weight, need_bias)
    per_row = lambda t: None if t is None else t.float().contiguous()
    rows_args = [per_row(t) for t in (lse, entropy, sum_p_sq, g_lp, g_entropy, g_sum_p_sq,
                                      g_mean_logit, g_lse)]
    # Unused pointers still need a tensor: lse stands in for them (never read).
    ptrs = [t if t is not None else rows_args[0] for t in rows_args]
    meta = grad_meta(hidden.dtype, softcap, *rows_args[3:])
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
            _tile_grad_kernel[(real,)](
                dx, dx.stride(0), targets[r0:], *(p[r0:] for p in ptrs), real, v1 - v0, v0,
                **scalars, **meta)
            dx[real:].zero_()
            grads.add(dx, w, v0, v1, gi, r0, rows)
        grads.end_tile(v0, v1)
    return grads.result()
