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

import math
import os

import torch
import triton
import triton.language as tl

from logitless.kernels import interpreter_compat
from logitless.kernels.linear_softmax import _round_to, _tanh
from logitless.kernels.linear_softmax_torch import _head_slice, _pad_rows, addmm_acc_
from logitless.kernels.sampler_torch import ENGINES, RowParams, _key_floats, _ordered_keys

interpreter_compat.apply()

__all__ = ["DEFAULT_TILE_BYTES", "backward", "chunk_stats", "forward", "row_args",
           "rows_per_chunk"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Default budget of one chunk's buffers (and of the backward's tile): at V=151936 in bf16 a
# chunk of 1024 rows (its logits, 311 MB, and their tempered fp32 copy, 622 MB), so that every
# GEMM is 1024 rows tall and the head is read once per 1024 rows.
DEFAULT_TILE_BYTES = 2**30
# Vocabulary columns per logits GEMM: the whole head at once by default (one GEMM per chunk, no
# partial last wave of column tiles); tests shrink it.
_COLS = 2**18
# Most rows per chunk.
_MAX_ROWS = 1024
# Vocabulary columns per program of a pass (its slice; 19 slices at V=151936, so a 1024-row
# chunk's pass runs 19456 programs), and the columns per step and warps of the passes.
_SLICE = 8192
_BLOCK_V = 2048
_WARPS = 8
# Trial keys per search pass, and the columns per step of a search pass (a [_FAN, _BLOCK_S]
# block of comparisons, kept per lane across the slice).
_FAN = 16
_BLOCK_S = 512


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
def _transform_kernel(x, stride_x, temperature, z, stride_z, part_m, part_l, part_k, n_slices,
                      width, softcap, scale, HAS_SOFTCAP: tl.constexpr, SLICE: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """Slice ``s`` of row ``r``: the tempered fp32 logits written to ``z``, and the slice's
    maximum, ``sum exp(z - max)`` and smallest key. Per-lane running state across the column
    loop, reduced once at the end (a fixed tree)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    x_row = x + row * stride_x
    z_row = z + row * stride_z
    temp = tl.load(temperature + row)
    c_lo = s * SLICE
    c_hi = tl.minimum(width, c_lo + SLICE)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_V], dtype=tl.float32)
    kmin = tl.full([BLOCK_V], 2147483647, tl.int32)
    for c0 in range(c_lo, c_hi, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        zz, valid = _load_z(x_row, cols, c_hi, temp, softcap, scale, HAS_SOFTCAP)
        tl.store(z_row + cols, zz, mask=valid)
        m_new = tl.maximum(m, zz)
        # a lane with no real column yet keeps m = -inf and l = 0
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        l = l * alpha + tl.where(valid, tl.exp(zz - m_new), 0.0)
        m = m_new
        kmin = tl.minimum(kmin, tl.where(valid, _keys(zz), 2147483647))
    top = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, l * tl.exp(m - top)), 0)
    at = row * n_slices + s
    tl.store(part_m + at, top)
    tl.store(part_l + at, total)
    tl.store(part_k + at, tl.min(kmin, 0))


@triton.jit
def _fan_kernel(z, stride_z, m_in, base, step, part, n_slices, width, WEIGHTED: tl.constexpr,
                FAN: tl.constexpr, SLICE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Slice ``s`` of row ``r``: how many tokens (or how much ``exp(z - m)``, fp32) lie at or
    above each of the ``FAN`` trial keys ``base + j step``; nothing is read (and nothing
    written) for a row whose ``step`` is 0 (its search is over). Per-lane sums across the
    column loop, one fixed tree per trial at the end."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    st = tl.load(step + row)
    lo = tl.load(base + row)
    j = tl.arange(0, FAN).to(tl.int64)
    trial = lo + j * st
    # the trial keys as floats (a key past the fp32 range only ever lies above the search's
    # upper end: its count is never read)
    trial = tl.minimum(tl.maximum(trial, -2147483647), 2147483647)
    zt = _from_key(trial)
    m = tl.load(m_in + row)
    z_row = z + row * stride_z
    c_lo = s * SLICE
    c_hi = tl.minimum(width, c_lo + SLICE)
    c_end = tl.where(st > 0, c_hi, c_lo)
    f = tl.zeros([FAN, BLOCK_S], dtype=tl.float32)
    for c0 in range(c_lo, c_end, BLOCK_S):
        cols = c0 + tl.arange(0, BLOCK_S)
        zz = tl.load(z_row + cols, mask=cols < c_hi, other=float("-inf"))
        ge = zz[None, :] >= zt[:, None]
        if WEIGHTED:
            f += tl.where(ge, tl.exp(zz - m)[None, :], 0.0)
        else:
            f += ge.to(tl.float32)
    at = (row * n_slices + s) * FAN + j
    tl.store(part + at, tl.sum(f, 1))


@triton.jit
def _stats_kernel(z, stride_z, targets, m_in, t_in, part, part_k, n_slices, width,
                  SLICE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Slice ``s`` of row ``r`` against the cut key ``T``: the mass and ``sum e (z - m)``
    strictly above ``T``, the tokens at ``T`` and those of them before the target, the
    target's logit, and the smallest key above ``T`` with its count. Per-lane state, reduced
    once at the end."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    m = tl.load(m_in + row)
    t = tl.load(t_in + row).to(tl.int32)
    y = tl.load(targets + row)
    z_row = z + row * stride_z
    c_lo = s * SLICE
    c_hi = tl.minimum(width, c_lo + SLICE)
    l_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    a_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    n_t = tl.zeros([BLOCK_V], dtype=tl.float32)
    n_b = tl.zeros([BLOCK_V], dtype=tl.float32)
    z_y = tl.zeros([BLOCK_V], dtype=tl.float32)
    k_a = tl.full([BLOCK_V], 2147483647, tl.int32)
    n_k = tl.zeros([BLOCK_V], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        valid = cols < c_hi
        zz = tl.load(z_row + cols, mask=valid, other=float("-inf"))
        key = _keys(zz)
        above = valid & (key > t)
        d = zz - m
        e = tl.where(above, tl.exp(d), 0.0)
        l_a += e
        a_a += e * tl.where(above, d, 0.0)
        at = valid & (key == t)
        n_t += at.to(tl.float32)
        n_b += (at & (cols < y)).to(tl.float32)
        z_y += tl.where(cols == y, zz, 0.0)
        ka = tl.where(above, key, 2147483647)
        n_k = tl.where(ka < k_a, 1.0, tl.where(above & (ka == k_a), n_k + 1.0, n_k))
        k_a = tl.minimum(k_a, ka)
    k_min = tl.min(k_a, 0)
    at = row * n_slices + s
    out = part + at * 6
    tl.store(out, tl.sum(l_a, 0))
    tl.store(out + 1, tl.sum(a_a, 0))
    tl.store(out + 2, tl.sum(n_t, 0))
    tl.store(out + 3, tl.sum(n_b, 0))
    tl.store(out + 4, tl.sum(z_y, 0))
    tl.store(out + 5, tl.sum(tl.where(k_a == k_min, n_k, 0.0), 0))
    tl.store(part_k + at, k_min)


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
    in the compute dtype (the GEMM's output), their tempered fp32 copy, and one GEMM slice when
    the vocabulary takes several. From the vocabulary, the budget and the dtype only (at the
    reference shape, V=151936 in bf16, the default budget gives ``_MAX_ROWS`` = 1024 rows: the
    GEMMs are 1024 rows tall)."""
    del softcap  # applied as the logits are read: no buffer
    cols = min(v, _COLS)
    per_row = dtype.itemsize * v + 4 * v + (dtype.itemsize * cols if cols < v else 0)
    return max(1, min(_MAX_ROWS, tile_bytes // per_row))


def search_passes(fan: int) -> int:
    """Passes of a ``fan``-trial search over the fp32 keys: each divides the range by ``fan``,
    and a fixed number of them (no host read) settles any range below ``2^32``."""
    passes = 0
    while fan ** passes < 2**32:
        passes += 1
    return passes


def row_args(params: RowParams, n: int, device):
    """Per-row settings as the passes take them: the temperature (fp32), ``log(min_p)`` as the
    torch path forms it, ``top_k`` and ``top_p`` (fp64); None where off."""
    return dict(
        temperature=params.temperature.float().contiguous(),
        log_min_p=None if params.min_p is None else torch.log(params.min_p.float()),
        top_k=params.top_k,
        top_p=None if params.top_p is None else params.top_p.double(),
        engine=ENGINES.index(params.engine),
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
    part = torch.empty(rows * cols, dtype=hidden.dtype, device=dev) if cols < v else None
    bufs = _Buffers(rows, v, dev)
    args = row_args(params, n, dev)
    targets = targets.contiguous()
    for r0 in range(0, n, rows):
        real = min(rows, n - r0)
        h = _pad_rows(hidden[r0:r0 + real], rows).contiguous()  # the backward's layout
        for c0 in range(0, v, cols):
            w, b = _head_slice(weight, bias, c0, cols, hidden.dtype)
            if part is None:
                _gemm_(chunk, h, w, b)
            else:
                x = part[:rows * w.shape[0]].view(rows, w.shape[0])
                _gemm_(x, h, w, b)
                chunk[:, c0:c0 + w.shape[0]] = x
        # every chunk is R rows: the passes' launches do not depend on N (padding rows: the
        # settings of row 0 of the chunk, results dropped)
        row_set = {k: None if args[k] is None else _pad_rows(args[k][r0:r0 + real], rows, fill)
                   for k, fill in _PADDING.items()}
        row_set["engine"] = args["engine"]
        res = chunk_stats(chunk, _pad_rows(targets[r0:r0 + real], rows, 0), row_set, 0, None,
                          softcap, logit_scale, bufs)
        for o, x in zip(outs, res):
            o[r0:r0 + real] = x[:real]
    # A row with a NaN or inf logit has no distribution: its logprob is NaN (as the torch
    # path's), not the -inf that means "outside the kept set".
    outs[0] = torch.where(torch.isfinite(outs[3]), outs[0], torch.nan)
    return tuple(outs)


# Padding rows' settings: no-op values (their results are dropped).
_PADDING = dict(temperature=1.0, log_min_p=-math.inf, top_k=2**62, top_p=1.0)


class _Buffers:
    """One chunk's buffers for :func:`chunk_stats`: the tempered fp32 logits and the
    per-slice partial results."""

    def __init__(self, rows, v, device):
        self.rows, self.v = rows, v
        self.slices = -(-v // _SLICE)
        s = self.slices
        self.z = torch.empty(rows, v, dtype=torch.float32, device=device)
        self.m = torch.empty(rows, s, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, s, dtype=torch.float32, device=device)
        self.k = torch.empty(rows, s, dtype=torch.int32, device=device)
        self.fan = torch.zeros(rows, s, _FAN, dtype=torch.float32, device=device)
        self.stats = torch.empty(rows, s, 6, dtype=torch.float32, device=device)


def _key_of(z: torch.Tensor) -> torch.Tensor:
    """The ordered int64 key of fp32 ``z`` (``_keys``, in torch)."""
    return _ordered_keys(z.float()).long()


def _float_of(key: torch.Tensor) -> torch.Tensor:
    """The fp32 value of an ordered key (``_from_key``, in torch)."""
    return _key_floats(key.int(), torch.float32)


class _Passes:
    """The passes of :func:`chunk_stats` over one chunk's tempered logits, each a ``[R, S]``
    launch (a program per row and vocabulary slice) and a merge of its per-slice partial
    results in slice order (fp64 for masses) by a few ``[R]``-sized torch ops: no host read,
    no atomics, a row's results independent of the other rows."""

    def __init__(self, bufs: _Buffers, width: int, m: torch.Tensor):
        self.b, self.width, self.m = bufs, width, m
        self.grid = (bufs.rows, -(-width // _SLICE))

    def fan(self, base, step, weighted: bool):
        """``[R, FAN]``: count (or fp64 mass) of tokens at or above ``base + j step``."""
        b = self.b
        _fan_kernel[self.grid](b.z, b.z.stride(0), self.m, base, step, b.fan, b.slices,
                               self.width, WEIGHTED=weighted, FAN=_FAN, SLICE=_SLICE,
                               BLOCK_S=_BLOCK_S, num_warps=_WARPS)
        return b.fan[:self.grid[0], :self.grid[1]].double().sum(1)

    def search(self, lo, hi, target, weighted: bool, active=None):
        """The largest key ``t`` in ``[lo, hi]`` whose tokens at or above it number (weigh) at
        least ``target`` (``lo`` when none does; ``lo`` itself is never tested); rows not
        ``active`` keep ``lo``. A fixed number of ``FAN``-trial passes."""
        j = torch.arange(_FAN, device=lo.device)
        if active is not None:
            hi = torch.where(active, hi, lo)
        for _ in range(search_passes(_FAN)):
            step = torch.where(lo < hi, (hi - lo) // _FAN + 1, 0)
            f = self.fan(lo, step, weighted)
            trial = lo.unsqueeze(1) + j * step.unsqueeze(1)
            ok = (j > 0) & (trial <= hi.unsqueeze(1)) & (f >= target.unsqueeze(1))
            best = torch.where(ok, j, 0).amax(1)
            new_lo = lo + best * step
            hi = torch.where(step > 0, torch.minimum(hi, new_lo + step - 1), hi)
            lo = torch.where(step > 0, new_lo, lo)
        return lo

    def at_and_above(self, t, weighted: bool):
        """Per row: the count (mass) at or above key ``t`` and strictly above it."""
        f = self.fan(t, torch.ones_like(t), weighted)
        return f[:, 0], f[:, 1]


def chunk_stats(x, targets, args, r0, outs, softcap, logit_scale, bufs=None):
    """The kept set and statistics of the logits ``x [R, V]`` before the transform (row
    stride free, unit column stride) of rows ``r0 ...`` of the per-row settings ``args``
    (:func:`row_args`): ``(logprobs, entropy, log_kept_mass, lse, lse_kept, key, count)``,
    each ``[R]``, written into ``outs`` when given (module doc, steps 2-4)."""
    rows, v = x.shape
    dev = x.device
    if bufs is None or bufs.rows < rows or bufs.v < v:
        bufs = _Buffers(rows, v, dev)
    z = bufs.z[:rows, :v]
    s = -(-v // _SLICE)
    temp = args["temperature"][r0:r0 + rows]
    _transform_kernel[(rows, s)](
        x, x.stride(0), temp, z, z.stride(0), bufs.m, bufs.l, bufs.k, bufs.slices, v,
        softcap=1.0 if softcap is None else float(softcap), scale=float(logit_scale),
        HAS_SOFTCAP=softcap is not None, SLICE=_SLICE, BLOCK_V=_BLOCK_V, num_warps=_WARPS)
    pm, pl, pk = bufs.m[:rows, :s], bufs.l[:rows, :s], bufs.k[:rows, :s]
    m = pm.amax(1)
    l_full = torch.where(pm == -math.inf, 0.0,
                         pl.double() * torch.exp(pm.double() - m.double().unsqueeze(1))).sum(1)
    passes = _Passes(bufs, v, m.contiguous())
    passes.z = z
    engine = args["engine"]
    hi = _key_of(m)
    lo_all = pk.amin(1).long()
    # min-p's candidates: z >= m + log(min_p), the keys from key(m + log(min_p)) up
    log_min_p = _rows(args["log_min_p"], r0, rows)
    thr = None if log_min_p is None else m + log_min_p
    floor = None if thr is None else torch.maximum(_key_of(thr), lo_all)
    lo = floor if (floor is not None and engine == 0) else lo_all  # vLLM: min-p first
    t = lo
    c = torch.full_like(t, _ALL_TIES)
    top_k = _rows(args["top_k"], r0, rows)
    if top_k is not None:
        t = passes.search(t, hi, top_k, weighted=False)
        if engine == 0:
            at_or_above, above = passes.at_and_above(t, weighted=False)
            c = top_k - above.long()
            ties_k = (at_or_above - above).long()
    top_p = _rows(args["top_p"], r0, rows)
    if top_p is not None:
        on = top_p < 1.0
        t_0, c_0 = t, c
        if engine == 1:  # SGLang without min-p: top-p over the whole row (the joint filter)
            joint = torch.ones_like(on) if thr is None else thr == -math.inf
            t_0 = torch.where(joint, lo, t)
            c_0 = torch.where(joint, _ALL_TIES, c)
        # the candidates' mass in fp64: those above t_0, and the kept ties at t_0
        at_or_above, above = passes.at_and_above(t_0, weighted=True)
        if engine == 0 and top_k is not None:
            n_at = torch.where(t_0 == t, ties_k, 0)
            kept_at = torch.minimum(c_0, n_at).double()
            total = above + kept_at * _weight(t_0, m)
            total = torch.where(c_0 >= n_at, at_or_above, total)
        else:
            total = at_or_above
        target = top_p * total
        t_p = passes.search(t_0, hi, target, weighted=True, active=on)
        if engine == 1:
            t = torch.where(on, torch.maximum(t, t_p), t)  # every tie kept at both cuts
        else:
            _, g = passes.at_and_above(t_p, weighted=True)
            e_t = _weight(t_p, m)
            # ceil((target - g) / e_t), at least 1; a tied weight underflowing to 0 (or a NaN)
            # keeps every tie
            q = (target - g) / e_t
            ties = torch.where(q == q, q, math.inf).ceil().clamp(min=1.0)
            c_p = torch.where(ties < 4.0e18, ties, 4.0e18).long()
            c_new = torch.where(t_p > t, c_p, torch.minimum(c, c_p))
            c = torch.where(on, c_new, c)
            t = torch.where(on, t_p, t)
    if floor is not None and engine != 0:
        # min-p last: every token at or above the smallest candidate key, where that cuts
        c = torch.where(floor > t, _ALL_TIES, c)
        t = torch.maximum(t, floor)
    res = _final_stats(passes, targets, t.contiguous(), c, m, l_full)
    if outs is not None:
        for o, r in zip(outs, res):
            o.copy_(r)
    return res


def _rows(x, r0, rows):
    return None if x is None else x[r0:r0 + rows]


def _weight(key, m):
    """``exp(z - m)`` (fp64) of the tokens at ``key``."""
    return torch.exp(_float_of(key) - m).double()


# "Every tied token": larger than any vocabulary.
_ALL_TIES = 2**62


def _final_stats(passes: _Passes, targets, t, c, m, l_full):
    """The statistics of the kept set ``(t, c)`` from one ``[R, S]`` pass and its merge: the
    stored pair made canonical (the smallest kept key and the kept tokens at it)."""
    b = passes.b
    rows, s = passes.grid
    _stats_kernel[passes.grid](passes.z, passes.z.stride(0), targets.contiguous(), passes.m, t,
                               b.stats, b.k, b.slices, passes.width, SLICE=_SLICE,
                               BLOCK_V=_BLOCK_V, num_warps=_WARPS)
    part = b.stats[:rows, :s].double()
    l_a, a_a, n_t, n_b, z_y = (part[:, :, i].sum(1) for i in range(5))
    k_s = b.k[:rows, :s].long()
    k_min = k_s.amin(1)
    n_min = torch.where(k_s == k_min.unsqueeze(1), part[:, :, 5], 0.0).sum(1)
    kept_t = torch.minimum(c.double(), n_t)
    z_t = _float_of(t).double()
    e_t = torch.exp(_float_of(t) - m).double()
    md = m.double()
    l_k = l_a + kept_t * e_t
    a_k = a_a + kept_t * e_t * (z_t - md)
    y_key = _key_of(z_y.float())
    y_in = (y_key > t) | ((y_key == t) & (n_b + 1 <= c.double()))
    full = md + torch.log(l_full)
    kept = md + torch.log(l_k)
    lp = torch.where(y_in, z_y - kept, -math.inf)
    entropy = torch.log(l_k) - a_k / l_k
    key = torch.where(kept_t > 0, t, k_min)
    count = torch.where(kept_t > 0, kept_t, n_min).long()
    return (*(x.float() for x in (lp, entropy, kept - full, full, kept)), key, count)


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
