"""The CUDA path of the sampler-matched logprobs: cuBLAS GEMMs into a chunk of logits in the
compute dtype, Triton passes with one program per row over it.

The launcher contract is ``sampler_torch``'s (same ``forward`` / ``backward`` signatures and
outputs, same per-row algorithm, same kept sets); see that module's docstring for the
algorithm. Per chunk of ``R`` rows (``R`` from the byte budget, the vocabulary and the dtype,
never from N; every chunk is padded to exactly ``R`` rows so that each GEMM has one shape
whatever N is):

1. **Logits.** For each ``_COLS``-column vocabulary slice, one ``torch.mm`` / ``torch.addmm``
   (cuBLAS, fp32 accumulation) writes ``x = h W^T + b`` in the compute dtype (bf16/fp16
   rounded as PyTorch's own product rounds them) into a slice buffer, copied into the chunk
   buffer ``[R, V]`` (compute dtype). Every pass below reads ``x`` and forms
   ``z = logit_scale * softcap(x) / T_row`` in fp32 as it reads (``_tempered``, the division
   correctly rounded as torch's): half the bytes of an fp32 chunk for bf16, and the same bits
   in every pass and in the backward.
2. ``_max_kernel``: the row maximum ``m`` and ``l = sum exp(z - m)`` (online, one pass).
3. ``_threshold_kernel``: the kept set, as the pair ``(T, C)``: every token whose ordered
   key is above ``T``, and the first ``C`` (lowest ids) of those at ``T``. min-p gives the
   smallest candidate key (one pass); top-k and top-p each find their threshold key by a
   ``_FAN``-ary search over the integer keys (each pass counts, or weighs by ``exp(z - m)``,
   the tokens at or above ``_FAN`` trial keys at once, so a 32-bit key range takes 8 passes
   where a bisection takes 32) and need one more pass for the tokens strictly above it;
   top-p first sums the candidates' weights (one pass, ranks of the tied tokens by a running
   ``cumsum``; top-p's mass in fp64, as the torch path sums it). The search finds the same
   key as the torch path's radix select: the largest key whose count (or weight) reaches the
   target.
4. ``_stats_kernel``: one pass for the kept sums, the target's logit and membership, and the
   number of tokens at ``T``; it writes ``log q_y``, the kept entropy, ``log_kept_mass``,
   ``lse``, the kept ``lse`` and the stored pair (``T``, the kept count at ``T``).

Backward (:func:`backward`), vocabulary-outer: per slice, per group of whole chunks, the
forward's GEMMs (same shapes, same bits) fill a ``[rows, cols]`` tile; ``_grad_kernel``
overwrites it with ``dx`` in the compute dtype (``dz`` as in ``sampler_torch``'s module doc,
times ``logit_scale / T_row * (1 - tanh^2)``; the tie ranks carried from slice to slice in a
per-row count); then cuBLAS GEMMs give ``d_hidden`` per chunk (fp32) and ``d_weight[slice]``
once per group (fp32), and ``d_bias`` is the fp32 column sum of ``dx``. No atomics, no
``tl.dot``: each launch follows the last on one stream, the same inputs give the same bits.

Under ``TRITON_INTERPRET=1`` (CPU tensors) the same code runs with torch's CPU GEMMs; tests
shrink ``_COLS``, ``_BLOCK_V`` and ``_BLOCK_S``. The kernels use ``tl.exp`` / ``tl.log`` only
(the interpreter has no libdevice) and bitcasts for the keys.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from logitless.kernels import interpreter_compat
from logitless.kernels.linear_softmax import _round_to, _tanh
from logitless.kernels.linear_softmax_torch import _head_slice, _pad_rows, addmm_acc_
from logitless.kernels.sampler_torch import ENGINES, RowParams

interpreter_compat.apply()

__all__ = ["DEFAULT_TILE_BYTES", "backward", "chunk_stats", "forward", "row_args",
           "rows_per_chunk"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Default budget of one chunk's buffers (and of the backward's tile): 32 MiB keeps a chunk's
# logits inside the H200's L2 cache (50 MB) through the threshold passes; 99 rows at
# V=151936 in bf16.
DEFAULT_TILE_BYTES = 32 * 2**20
# Vocabulary columns per logits GEMM (and per transform launch).
_COLS = 16384
# Most rows per chunk.
_MAX_ROWS = 1024
# Columns per step of the one-value-per-column passes, and their warps.
_BLOCK_V = 2048
_WARPS = 8
# Trial keys per search pass, and the columns per step of a search pass (a [_FAN, _BLOCK_S]
# block of comparisons).
_FAN = 16
_BLOCK_S = 512
# "Every tied token": larger than any vocabulary.
_ALL = tl.constexpr(2**62)


@triton.jit
def _keys(z):
    """Ordered int32 keys of fp32 ``z``: integer order is float order, ``-0.0`` is ``+0.0``."""
    bits = z.to(tl.int32, bitcast=True)
    k = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(z == 0.0, 0, k)


@triton.jit
def _from_key(key):
    """The fp32 value of an ordered key (inverse of ``_keys``)."""
    k = key.to(tl.int32)
    bits = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tempered(x, t, softcap, scale, HAS_SOFTCAP: tl.constexpr):
    """``scale * softcap(x) / t`` in fp32, the division correctly rounded (torch's ``/``).
    The forward's logits and the backward's recomputed ones both come from here: the same
    bits, so the same kept set."""
    v = x.to(tl.float32)
    if HAS_SOFTCAP:
        v = _tanh(tl.math.div_rn(v, softcap)) * (softcap * scale)
    else:
        v = v * scale
    return tl.math.div_rn(v, t)


@triton.jit
def _load_z(x_row, cols, width, t, softcap, scale, HAS_SOFTCAP: tl.constexpr):
    """The tempered fp32 logits of columns ``cols`` of a row of the chunk (``-inf`` past
    ``width``) and which columns are real."""
    valid = cols < width
    raw = tl.load(x_row + cols, mask=valid, other=0.0)
    return tl.where(valid, _tempered(raw, t, softcap, scale, HAS_SOFTCAP), float("-inf")), valid


@triton.jit
def _max_kernel(x, stride_x, temperature, m_out, l_out, width, softcap, scale,
                HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row maximum ``m`` and ``sum exp(z - m)``, online in one pass."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * stride_x
    temp = tl.load(temperature + row)
    m = float("-inf")
    l = 0.0
    for c0 in range(0, width, BLOCK_V):
        z, _ = _load_z(x_row, c0 + tl.arange(0, BLOCK_V), width, temp, softcap, scale,
                       HAS_SOFTCAP)
        m_new = tl.maximum(m, tl.max(z, 0))  # every block holds a real column: finite
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    tl.store(m_out + row, m)
    tl.store(l_out + row, l)


@triton.jit
def _members(key, valid, t, c, seen):
    """Which columns of a block are in the set ``(t, c)`` (keys above ``t``, and the first
    ``c`` at ``t``), given ``seen`` tokens at ``t`` in the earlier blocks; and the new
    ``seen``."""
    at = valid & (key == t)
    rank = seen + tl.cumsum(at.to(tl.int32), 0)
    member = valid & ((key > t) | (at & (rank <= c)))
    return member, seen + tl.sum(at.to(tl.int32), 0)


@triton.jit
def _search(x_row, width, temp, softcap, scale, m, lo, hi, target, HAS_SOFTCAP: tl.constexpr,
            WEIGHTED: tl.constexpr, FAN: tl.constexpr, BLOCK_S: tl.constexpr):
    """The largest key ``t`` in ``[lo, hi]`` whose tokens at or above it number (or weigh,
    each ``exp(z - m)``) at least ``target`` (``lo`` when none does; ``lo`` itself is never
    tested: the caller guarantees it, as the torch path's bisection assumes). Each pass tests
    ``FAN`` evenly spaced keys; only keys above ``lo`` are tested, so every token counted is
    in the caller's candidate set."""
    j = tl.arange(0, FAN).to(tl.int64)
    while lo < hi:
        step = (hi - lo) // FAN + 1
        trial = lo + j * step
        if WEIGHTED:
            f = tl.zeros([FAN], dtype=tl.float64)
        else:
            f = tl.zeros([FAN], dtype=tl.int32)
        for c0 in range(0, width, BLOCK_S):
            z, valid = _load_z(x_row, c0 + tl.arange(0, BLOCK_S), width, temp, softcap, scale,
                               HAS_SOFTCAP)
            ge = (_keys(z)[None, :] >= trial[:, None]) & valid[None, :]
            if WEIGHTED:
                w = tl.exp(z - m).to(tl.float64)
                f += tl.sum(tl.where(ge, w[None, :], 0.0), 1)
            else:
                f += tl.sum(ge.to(tl.int32), 1)
        ok = (j > 0) & (trial <= hi) & (f >= target)
        best = tl.max(tl.where(ok, j, 0), 0)
        new_lo = lo + best * step
        hi = tl.minimum(hi, new_lo + step - 1)
        lo = new_lo
    return lo


@triton.jit
def _threshold_kernel(x, stride_x, temperature, m_in, log_min_p, top_k, top_p, t_out, c_out,
                      width, softcap, scale, HAS_SOFTCAP: tl.constexpr,
                      HAS_MIN_P: tl.constexpr, HAS_TOP_K: tl.constexpr,
                      HAS_TOP_P: tl.constexpr, ENGINE: tl.constexpr, FAN: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr):
    """The kept set of row ``r`` as ``(T, C)``: min-p, then top-k, then top-p (rows with
    ``p = 1`` untouched). ``C`` may exceed the number of tokens at ``T`` (all of them).
    ``ENGINE`` (an index into ``sampler_torch.ENGINES``) changes the rules as that module's
    doc says: 1 (SGLang) and 2 (transformers) keep every tie at top-k, SGLang every tie at
    top-p, both apply min-p last, and SGLang's rows without min-p search top-p over the whole
    row (the joint filter) and keep the intersection of the two cuts."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * stride_x
    temp = tl.load(temperature + row)
    m = tl.load(m_in + row)
    hi = _keys(m).to(tl.int64)
    # The smallest candidate key: min-p keeps z >= m + log(min_p); the smallest key of all.
    thr = float("-inf")
    if HAS_MIN_P:
        thr = m + tl.load(log_min_p + row)
    lo = hi
    lo_all = hi
    for c0 in range(0, width, BLOCK_V):
        z, valid = _load_z(x_row, c0 + tl.arange(0, BLOCK_V), width, temp, softcap, scale,
                           HAS_SOFTCAP)
        key = _keys(z)
        lo = tl.minimum(lo, tl.min(tl.where(valid & (z >= thr), key, 2147483647), 0)
                        .to(tl.int64))
        lo_all = tl.minimum(lo_all, tl.min(tl.where(valid, key, 2147483647), 0).to(tl.int64))
    floor = lo
    if ENGINE != 0:
        lo = lo_all  # min-p comes last
    t = lo
    c = tl.full([], _ALL, tl.int64)
    if HAS_TOP_K:
        k = tl.load(top_k + row)
        t = _search(x_row, width, temp, softcap, scale, m, t, hi, k, HAS_SOFTCAP, False, FAN,
                    BLOCK_S)
        if ENGINE == 0:
            above = tl.zeros([], dtype=tl.int64)
            for c0 in range(0, width, BLOCK_V):
                z, valid = _load_z(x_row, c0 + tl.arange(0, BLOCK_V), width, temp, softcap,
                                   scale, HAS_SOFTCAP)
                above += tl.sum((valid & (_keys(z) > t)).to(tl.int32), 0)
            c = k - above
    if HAS_TOP_P:
        p = tl.load(top_p + row)
        if p < 1.0:
            # where top-p starts from: the top-k survivors, or for SGLang's joint filter (a
            # row without min-p) the whole row
            t_0 = t
            c_0 = c
            if ENGINE == 1:
                joint = thr == float("-inf")
                t_0 = tl.where(joint, lo, t)
            # The mass in fp64, as the torch path sums it: a row whose boundary token sits
            # within fp32 rounding of p keeps the set the exact sums give.
            total = tl.zeros([], dtype=tl.float64)
            seen = tl.zeros([], dtype=tl.int64)
            for c0 in range(0, width, BLOCK_V):
                z, valid = _load_z(x_row, c0 + tl.arange(0, BLOCK_V), width, temp, softcap,
                                   scale, HAS_SOFTCAP)
                member, seen = _members(_keys(z), valid, t_0, c_0, seen)
                total += tl.sum(tl.where(member, tl.exp(z - m).to(tl.float64), 0.0), 0)
            target = p * total
            t_p = _search(x_row, width, temp, softcap, scale, m, t_0, hi, target, HAS_SOFTCAP,
                          True, FAN, BLOCK_S)
            if ENGINE == 1:
                t = tl.maximum(t, t_p)  # every tie kept at both cuts
            else:
                g = tl.zeros([], dtype=tl.float64)
                for c0 in range(0, width, BLOCK_V):
                    z, valid = _load_z(x_row, c0 + tl.arange(0, BLOCK_V), width, temp,
                                       softcap, scale, HAS_SOFTCAP)
                    g += tl.sum(tl.where(valid & (_keys(z) > t_p),
                                         tl.exp(z - m).to(tl.float64), 0.0), 0)
                e_t = tl.exp(_from_key(t_p) - m).to(tl.float64)
                # ceil((target - g) / e_t), at least 1; a tied weight underflowing to 0 (or a
                # NaN) keeps every tie.
                q = (target - g) / e_t
                ties = tl.where(q == q, q, float("inf"))
                ties = tl.maximum(tl.ceil(ties), 1.0)
                c_p = tl.where(ties < 4.0e18, ties, 4.0e18).to(tl.int64)
                c = tl.where(t_p > t, c_p, tl.minimum(c, c_p))
                t = t_p
    if ENGINE != 0:
        # min-p last: every token at or above the smallest candidate key, where that cuts
        c = tl.where(floor > t, _ALL, c)
        t = tl.maximum(t, floor)
    tl.store(t_out + row, t)
    tl.store(c_out + row, c)


@triton.jit
def _stats_kernel(x, stride_x, temperature, targets, m_in, l_in, t_io, c_io, lp, entropy,
                  kept_mass, lse, lse_kept, width, softcap, scale, HAS_SOFTCAP: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """Statistics of the kept set ``(T, C)``; ``c_io`` becomes the kept count at ``T``."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * stride_x
    temp = tl.load(temperature + row)
    m = tl.load(m_in + row)
    t = tl.load(t_io + row)
    c = tl.load(c_io + row)
    y = tl.load(targets + row)
    seen = tl.zeros([], dtype=tl.int64)
    l_k = 0.0
    a_k = 0.0
    z_y = 0.0
    y_in = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, width, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        z, valid = _load_z(x_row, cols, width, temp, softcap, scale, HAS_SOFTCAP)
        member, seen = _members(_keys(z), valid, t, c, seen)
        d = tl.where(member, z - m, 0.0)
        e = tl.where(member, tl.exp(d), 0.0)
        l_k += tl.sum(e, 0)
        a_k += tl.sum(e * d, 0)
        is_y = valid & (cols == y)
        z_y += tl.sum(tl.where(is_y, z, 0.0), 0)
        y_in += tl.sum((is_y & member).to(tl.int32), 0)
    full = m + tl.log(tl.load(l_in + row))
    kept = m + tl.log(l_k)
    tl.store(lp + row, tl.where(y_in > 0, z_y - kept, float("-inf")))
    tl.store(entropy + row, tl.log(l_k) - a_k / l_k)
    tl.store(kept_mass + row, kept - full)
    tl.store(lse + row, full)
    tl.store(lse_kept + row, kept)
    tl.store(c_io + row, tl.minimum(c, seen))


@triton.jit
def _grad_kernel(x, stride_x, targets, temperature, key, count, seen, lse, lse_kept, entropy,
                 g_lp, g_entropy, g_kept, g_lse, n_rows, width, v0, softcap, scale,
                 HAS_SOFTCAP: tl.constexpr, HAS_G_LP: tl.constexpr,
                 HAS_G_ENTROPY: tl.constexpr, HAS_G_KEPT: tl.constexpr,
                 HAS_G_LSE: tl.constexpr, INTERPRET_BF16: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """Overwrite row ``r``'s logits before the transform (vocabulary columns ``v0 ...``, in
    their dtype) with ``dx``; zeros for rows at or past ``n_rows`` (padding). ``seen[r]``
    counts the row's tokens at its kept key in the earlier tiles (the tie ranks) and is
    advanced. ``g_lp`` must be 0 where the target is outside the kept set."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * stride_x
    keep = row < n_rows
    r = tl.minimum(row, n_rows - 1)
    temp = tl.load(temperature + r)
    t = tl.load(key + r)
    c = tl.load(count + r)
    y = tl.load(targets + r) - v0
    lse_k = tl.load(lse_kept + r)
    coef = 0.0
    g_y = 0.0
    if HAS_G_LP:
        g_y = tl.load(g_lp + r)
        coef -= g_y
    g_p = 0.0
    if HAS_G_KEPT:
        g_k = tl.load(g_kept + r)
        coef += g_k
        g_p -= g_k
    if HAS_G_LSE:
        g_p += tl.load(g_lse + r)
    if HAS_G_ENTROPY:
        g_h = tl.load(g_entropy + r)
        h = tl.load(entropy + r)
    lse_r = tl.load(lse + r)
    factor = scale / temp
    s = tl.load(seen + r)
    for c0 in range(0, width, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        valid = cols < width
        raw = tl.load(x_row + cols, mask=valid, other=0.0)
        z = _tempered(raw, temp, softcap, scale, HAS_SOFTCAP)
        member, s = _members(_keys(z), valid, t, c, s)
        log_q = z - lse_k
        q = tl.where(member, tl.exp(log_q), 0.0)
        d = q * coef
        if HAS_G_ENTROPY:
            d -= tl.where(member, q * (log_q + h), 0.0) * g_h
        if HAS_G_KEPT or HAS_G_LSE:
            d += tl.exp(z - lse_r) * g_p
        d += tl.where(cols == y, g_y, 0.0)
        d *= factor
        if HAS_SOFTCAP:
            th = _tanh(tl.math.div_rn(raw.to(tl.float32), softcap))
            d *= 1.0 - th * th
        d = tl.where(keep, d, 0.0)
        tl.store(x_row + cols, _round_to(d, x.dtype.element_ty, INTERPRET_BF16), mask=valid)
    tl.store(seen + r, s, mask=keep)


def rows_per_chunk(v: int, tile_bytes: int, dtype: torch.dtype, softcap: float | None) -> int:
    """Rows per chunk so that the forward's buffers fit in ``tile_bytes``: the chunk's logits
    and one GEMM slice, both in the compute dtype. From the vocabulary, the budget and the
    dtype only."""
    del softcap  # applied as the logits are read: no buffer
    per_row = dtype.itemsize * (v + min(v, _COLS))
    return max(1, min(_MAX_ROWS, tile_bytes // per_row))


def row_args(params: RowParams, n: int, device):
    """Per-row kernel arguments for ``n`` rows: ``log(min_p)`` as the torch path forms it,
    and a stand-in pointer for each setting that is off."""
    log_min_p = None if params.min_p is None else torch.log(params.min_p.float())
    top_k = params.top_k
    top_p = None if params.top_p is None else params.top_p.double()
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    return dict(
        temperature=params.temperature.float().contiguous(),
        log_min_p=dummy if log_min_p is None else log_min_p.contiguous(),
        top_k=torch.zeros(1, dtype=torch.int64, device=device) if top_k is None
        else top_k.contiguous(),
        top_p=dummy if top_p is None else top_p.contiguous(),
        flags=dict(HAS_MIN_P=log_min_p is not None, HAS_TOP_K=top_k is not None,
                   HAS_TOP_P=top_p is not None, ENGINE=ENGINES.index(params.engine)),
    )


def _gemm_(out, h, w, b):
    """``out = h @ w^T (+ b)``: one cuBLAS GEMM, written in ``out``'s dtype (the compute
    dtype). The forward and the backward call it with the same shapes, so the same bits."""
    if b is None:
        torch.mm(h, w.t(), out=out)
    else:
        torch.addmm(b, h, w.t(), out=out)


def forward(hidden, weight, bias, targets, params: RowParams, *, softcap, logit_scale,
            tile_bytes: int = DEFAULT_TILE_BYTES):
    """``sampler_torch.forward``'s contract: ``(logprobs, entropy, log_kept_mass, lse,
    lse_kept, key, count)``, each ``[N]`` (fp32; key and count int64)."""
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    outs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(5)]
    outs += [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(2)]
    if n == 0:
        return tuple(outs)
    rows = rows_per_chunk(v, tile_bytes, hidden.dtype, softcap)
    cols = min(v, _COLS)
    chunk = torch.empty(rows, v, dtype=hidden.dtype, device=dev)
    part = torch.empty(rows * cols, dtype=hidden.dtype, device=dev)
    args = row_args(params, n, dev)
    targets = targets.contiguous()
    scratch = torch.empty(2, rows, dtype=torch.float32, device=dev)
    for r0 in range(0, n, rows):
        real = min(rows, n - r0)
        h = _pad_rows(hidden[r0:r0 + real], rows).contiguous()  # the backward's layout
        for c0 in range(0, v, cols):
            w, b = _head_slice(weight, bias, c0, cols, hidden.dtype)
            x = part[:rows * w.shape[0]].view(rows, w.shape[0])
            _gemm_(x, h, w, b)
            chunk[:, c0:c0 + w.shape[0]] = x
        chunk_stats(chunk[:real], targets[r0:r0 + real], args, r0,
                    [o[r0:r0 + real] for o in outs], scratch, softcap, logit_scale)
    return tuple(outs)


def chunk_stats(x, targets, args, r0, outs, scratch, softcap, logit_scale):
    """Steps 2-4 of the module doc on the logits ``x [R, V]`` before the transform (row
    stride free, unit column stride) of rows ``r0 ...`` of the call: writes ``outs``
    (``logprobs, entropy, log_kept_mass, lse, lse_kept, key, count``, each ``[R]``) from the
    per-row settings ``args`` (:func:`row_args`), using ``scratch`` (fp32 ``[2, >= R]``)."""
    rows, v = x.shape
    m, l = scratch[0], scratch[1]
    key, count = outs[5], outs[6]
    t = args["temperature"][r0:]
    common = dict(softcap=1.0 if softcap is None else float(softcap),
                  scale=float(logit_scale), HAS_SOFTCAP=softcap is not None, num_warps=_WARPS)
    _max_kernel[(rows,)](x, x.stride(0), t, m, l, v, BLOCK_V=_BLOCK_V, **common)
    _threshold_kernel[(rows,)](
        x, x.stride(0), t, m, args["log_min_p"][r0:], args["top_k"][r0:], args["top_p"][r0:],
        key, count, v, **args["flags"], FAN=_FAN, BLOCK_S=_BLOCK_S, BLOCK_V=_BLOCK_V,
        **common)
    _stats_kernel[(rows,)](x, x.stride(0), t, targets, m, l, key, count, *outs[:5], v,
                           BLOCK_V=_BLOCK_V, **common)


def grad_meta(dtype, softcap, g_lp, g_entropy, g_kept, g_lse) -> dict:
    """The constexprs and warps ``backward`` launches ``_grad_kernel`` with."""
    return dict(HAS_SOFTCAP=softcap is not None, HAS_G_LP=g_lp is not None,
                HAS_G_ENTROPY=g_entropy is not None, HAS_G_KEPT=g_kept is not None,
                HAS_G_LSE=g_lse is not None,
                INTERPRET_BF16=_INTERPRET and dtype == torch.bfloat16, BLOCK_V=_BLOCK_V,
                num_warps=_WARPS)


def backward(hidden, weight, bias, targets, params: RowParams, key, count, lse, lse_kept,
             entropy, g_lp, g_entropy, g_kept, g_lse, *, softcap, logit_scale, need_hidden,
             need_weight, need_bias, tile_bytes: int = DEFAULT_TILE_BYTES):
    """``sampler_torch.backward``'s contract: fp32 gradients of hidden, weight and bias (None
    where not needed) from the per-row upstream gradients (``[N]`` or None), except that
    ``g_lp`` must already be 0 on rows whose target is outside the kept set (``sampled.py``
    passes it so to both paths).

    Vocabulary-outer: per ``_COLS``-column slice, per group of whole chunks (as many as fit
    ``tile_bytes``), the forward's GEMMs (one per ``R``-row chunk, the same shapes, so the
    same bits) fill a ``[rows, cols]`` tile, ``_grad_kernel`` turns it into ``dx`` in place
    (the tie ranks carried from slice to slice in a per-row count), then ``d_hidden[chunk]
    += dx @ W_slice`` per chunk and ``d_weight[slice] (+)= dx^T @ h`` once per group."""
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    nothing = not (need_hidden or need_weight or need_bias) or n == 0
    if nothing:
        def zeros(need, shape):
            return torch.zeros(shape, dtype=torch.float32, device=dev) if need else None
        return zeros(need_hidden, hidden.shape), zeros(need_weight, weight.shape), \
            zeros(need_bias, v)
    rows = rows_per_chunk(v, tile_bytes, hidden.dtype, softcap)
    cols = min(v, _COLS)
    chunks = -(-n // rows)
    n_pad = chunks * rows
    per_group = max(1, min(chunks, tile_bytes // (rows * cols * hidden.element_size())))
    h_pad = _pad_rows(hidden, n_pad).contiguous()
    tile = torch.empty(per_group * rows * cols, dtype=hidden.dtype, device=dev)
    d_hidden = torch.empty(n_pad, hidden.shape[1], dtype=torch.float32, device=dev) \
        if need_hidden else None
    d_weight = torch.empty(weight.shape, dtype=torch.float32, device=dev) if need_weight \
        else None
    d_bias = torch.empty(v, dtype=torch.float32, device=dev) if need_bias else None
    args = row_args(params, n, dev)
    seen = torch.zeros(n, dtype=torch.int64, device=dev)
    per_row = [None if g is None else g.float().contiguous()
               for g in (lse, lse_kept, entropy, g_lp, g_entropy, g_kept, g_lse)]
    ptrs = [p if p is not None else per_row[0] for p in per_row]
    meta = grad_meta(hidden.dtype, softcap, *per_row[3:])
    scalars = dict(softcap=1.0 if softcap is None else float(softcap),
                   scale=float(logit_scale))
    targets, key, count = targets.contiguous(), key.contiguous(), count.contiguous()
    for c0 in range(0, v, cols):
        w, b = _head_slice(weight, bias, c0, cols, hidden.dtype)
        width = w.shape[0]
        for g0 in range(0, chunks, per_group):
            r0, g_rows = g0 * rows, min(per_group, chunks - g0) * rows
            real = max(0, min(g_rows, n - r0))
            x = tile[:g_rows * width].view(g_rows, width)
            for c in range(0, g_rows, rows):
                _gemm_(x[c:c + rows], h_pad[r0 + c:r0 + c + rows], w, b)
            _grad_kernel[(g_rows,)](
                x, x.stride(0), targets[r0:], args["temperature"][r0:], key[r0:], count[r0:],
                seen[r0:], *(p[r0:] for p in ptrs), real, width, c0, **scalars, **meta)
            if d_hidden is not None:
                for c in range(0, g_rows, rows):
                    addmm_acc_(d_hidden[r0 + c:r0 + c + rows], x[c:c + rows], w,
                                 beta=0.0 if c0 == 0 else 1.0)
            if d_weight is not None:
                addmm_acc_(d_weight[c0:c0 + width], x.t(), h_pad[r0:r0 + g_rows],
                             beta=0.0 if g0 == 0 else 1.0)
            if d_bias is not None:
                part = x.sum(0, dtype=torch.float32)
                if g0 == 0:
                    d_bias[c0:c0 + width] = part
                else:
                    d_bias[c0:c0 + width] += part
    return None if d_hidden is None else d_hidden[:n], d_weight, d_bias
