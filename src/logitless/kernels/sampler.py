"""The CUDA path of the sampler-matched logprobs: cuBLAS GEMMs into a chunk of logits in the
compute dtype, Triton passes with a program per row and vocabulary slice over it.

The launcher contract is ``sampler_torch``'s (same ``forward`` / ``backward`` signatures and
outputs, same kept-set rule, same kept sets); see that module's docstring for the rule. Per
chunk of ``R`` rows (``R`` from the byte budget, the vocabulary and the dtype, never from N;
1024 at V=151936 in bf16 with the default budget; the last chunk's GEMM padded to a multiple
of ``ROW_GRANULE`` rows, as the head's (``constants.row_blocks``), so that a row's logits come
from one of a few fixed GEMM heights wherever it lies; the Triton passes run over the chunk's
real rows only):

1. **Logits.** One ``torch.mm`` / ``torch.addmm`` (cuBLAS, fp32 accumulation) of the whole
   head writes ``x = h W^T + b`` in the compute dtype (``_COLS``-column slices when tests
   shrink it). ``_transform_kernel`` reads it once and writes ``z = logit_scale * softcap(x) /
   T_row`` in fp32 (``_tempered``: the division correctly rounded, as torch's), with each
   slice's maximum and smallest key. Every later pass reads these values: the same bits in
   every pass.
2. Every pass below is a ``[rows, S]`` launch, one program per real row and ``SLICE_COLS``-column
   slice,
   each keeping its sums per lane and reducing once at the end, writing per-slice partial
   results; a merge then combines a row's slices in slice order (fp64 for masses). No atomics,
   no host read: a row's results do not depend on the other rows or on its place in the chunk.
3. **The kept set** as the pair ``(T, C)``: every token whose ordered key is above ``T``, and
   the first ``C`` (lowest ids) of those at ``T``. min-p's floor is ``key(m + log min_p)``;
   top-k and top-p each find their key by a fixed number of ``FAN_KEYS``-trial search passes
   (``_fan_kernel``: the count, or fp32 mass ``exp(z - m)``, of each slice at or above 8
   trial keys; ``_search_step_kernel`` sums them in fp64 and narrows the row's range 9-fold),
   the largest key whose count (mass) reaches the target, as the torch path's radix select
   finds it: 11 passes over the fp32 keys, or, for 16-bit logits without a softcap, 6 over
   the logits' own values and a ``_settle_kernel`` (``_Passes.search``); one more fan pass
   gives the tokens (mass) at and above the key. The engines' rules (SGLang's joint filter
   and kept ties, min-p last) are ``sampler_torch``'s table (``engine_rules``).
4. ``_stats_kernel``: the kept sums, the ties at ``T`` and those before the target; the merge,
   one launch of ``_finish_kernel``, writes the chunk's rows of ``log q_y``, the kept
   entropy, ``log_kept_mass``, ``lse``, the row maximum ``m`` and the kept set's normaliser
   relative to it (``log sum_K exp(z - m)``, what the backward takes) and the stored pair
   (the smallest kept key and the kept tokens at it).

Backward (:func:`backward`), vocabulary-outer: per group of whole chunks, the forward's GEMMs
(same shapes, same bits) fill a tile whose rows are padded to whole steps; ``_cut_kernel``
finds per row the column past the last kept tie, and ``_grad_kernel`` overwrites the tile with
``dx`` in the compute dtype (``dz`` as in ``sampler_torch``'s module doc, times ``logit_scale
/ T_row * (1 - tanh^2)``). Without a softcap both tell the kept tokens by comparing the raw
logit with two per-row values (:func:`_value_cuts`): no division per element. Then cuBLAS GEMMs
give ``d_hidden`` per chunk (fp32) and ``d_weight`` once per group (fp32), and ``d_bias`` is
the fp32 column sum of ``dx``.

Under ``TRITON_INTERPRET=1`` (CPU tensors) the same code runs with torch's CPU GEMMs; tests
shrink ``_COLS``, ``SLICE_COLS`` and the blocks. docs/gpu.md ("Sampler-matched logprobs on the
GPU") gives the SASS figures and the cost model's prediction.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from logitless.kernels import constants
from logitless.kernels.linear_softmax import round_to, tanh, tile_rows
from logitless.kernels.linear_softmax_torch import addmm_acc_, head_slice, pad_rows
from logitless.kernels.sampler_torch import (
    RowParams,
    engine_rules,
    key_floats,
    ordered_keys,
)

__all__ = ["DEFAULT_TILE_BYTES", "backward", "chunk_stats", "forward", "row_args",
           "rows_per_chunk"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Default budget of one chunk's buffers and of the backward's tile (kernels/constants.py).
DEFAULT_TILE_BYTES = constants.SAMPLER_TILE_BUDGET
# Vocabulary columns per logits GEMM: the whole head at once by default (one GEMM per chunk, no
# partial last wave of column tiles); tests shrink it.
_COLS = 2**18
# Most rows per chunk, and vocabulary columns per program of a pass (kernels/constants.py; tests
# shrink them); the columns per step and warps of the passes.
_MAX_ROWS = constants.SAMPLER_ROWS
# The last chunk's rows are padded to a multiple of this many (kernels/constants.py; tests
# shrink it).
_GRANULE = constants.ROW_GRANULE
SLICE_COLS = constants.SAMPLER_SLICE
BLOCK_COLS = 2048
WARPS = 8
# Columns per step of the transform pass (4 a thread: within its issue budget), and of the
# backward's tie-cut pass (one block reduction per step: 16 a thread).
TRANSFORM_BLOCK = 1024
CUT_BLOCK = 4096
# Trial keys per search pass, and the columns per step of a search pass (a [FAN_KEYS, SEARCH_BLOCK]
# block of comparisons, kept per lane across the slice).
FAN_KEYS = 8
SEARCH_BLOCK = 1024
# Rows per program of a search pass's merge.
_BLOCK_R = 64
# Searches over a 16-bit dtype's values where the logits allow it (tests turn it off to
# compare with the search over the fp32 keys).
_VALUE_SEARCH = True


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
        v = tanh(tl.math.div_rn(v, softcap)) * (softcap * scale)
    else:
        v = v * scale
    return tl.math.div_rn(v, t)


@triton.jit
def _load_z(x_row, cols, width, t, softcap, scale, HAS_SOFTCAP: tl.constexpr):
    """The tempered fp32 logits of columns ``cols`` of a row of the chunk (``-inf`` past
    ``width``; the row is padded, the load unmasked) and which columns are real."""
    valid = cols < width
    raw = tl.load(x_row + cols)
    return tl.where(valid, _tempered(raw, t, softcap, scale, HAS_SOFTCAP), float("-inf")), valid


@triton.jit
def _transform_kernel(x, stride_x, temperature, z, stride_z, part_m, part_k, n_slices, width,
                      span, softcap, scale, HAS_SOFTCAP: tl.constexpr, SLICE: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """Slice ``s`` of row ``r``: the tempered fp32 logits written to ``z``, and the slice's
    maximum and smallest key, kept per lane across the column loop and reduced once at the
    end."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    x_row = x + row * stride_x
    z_row = z + row * stride_z
    temp = tl.load(temperature + row)
    c_lo = s * SLICE
    c_hi = tl.minimum(span, c_lo + SLICE)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    kmin = tl.full([BLOCK_V], 2147483647, tl.int32)
    for c0 in range(c_lo, c_hi, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        zz, valid = _load_z(x_row, cols, width, temp, softcap, scale, HAS_SOFTCAP)
        tl.store(z_row + cols, zz)  # -inf in the row's padding, up to ``span``
        m = tl.maximum(m, zz)
        kmin = tl.minimum(kmin, tl.where(valid, _keys(zz), 2147483647))
    at = row * n_slices + s
    tl.store(part_m + at, tl.max(m, 0))
    tl.store(part_k + at, tl.min(kmin, 0))


@triton.jit
def _trial_z(lo, st, j: tl.constexpr):
    """Trial ``j``'s key ``lo + (j + 1) st`` as a float (a key past the fp32 range only ever
    lies above the search's upper end: its count is never read)."""
    trial = lo + (j + 1) * st
    return _from_key(tl.minimum(tl.maximum(trial, -2147483647), 2147483647))


@triton.jit
def _trial(lo, st, j: tl.constexpr, t_row, mag, like, VALUE_KEYS: tl.constexpr,
           MASK: tl.constexpr, KEY_TY: tl.constexpr, HI: tl.constexpr):
    """Trial ``j``'s threshold on the tempered logits. With ``VALUE_KEYS`` the trial key is
    an ordered key of the logits' own 16-bit values ``u = sign(scale) x`` (``[-HI - 1, HI]``,
    -inf to +inf), and the threshold is its tempered logit, formed as the transform forms it
    (``fl(fl(u |scale|) / T)``, nondecreasing in ``u``); otherwise ``_trial_z``."""
    if VALUE_KEYS:
        trial = tl.minimum(tl.maximum(lo + (j + 1) * st, -HI - 1), HI)
        return tl.math.div_rn(_value_at(trial, like, MASK, KEY_TY) * mag, t_row)
    else:
        return _trial_z(lo, st, j)


@triton.jit
def _fan_kernel(z, stride_z, m_in, base, step, part, n_slices, span, temperature, mag, like,
                WEIGHTED: tl.constexpr, VALUE_KEYS: tl.constexpr, MASK: tl.constexpr,
                KEY_TY: tl.constexpr, HI: tl.constexpr, FAN: tl.constexpr,
                SLICE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Slice ``s`` of row ``r``: how many tokens (or how much ``exp(z - m)``, fp32) lie at or
    above each of the ``FAN`` (8) trial keys ``base + (j + 1) step`` (fp32 keys of ``z``, or
    with ``VALUE_KEYS`` keys of the 16-bit logits: ``_trial``); nothing is read for a row
    whose ``step`` is 0 (its search is over). Per-lane sums across the column loop, one per
    trial (a 0/1 times the weight: two instructions per trial and element), each reduced once
    at the end in a fixed tree."""
    tl.static_assert(FAN == 8)
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    st = tl.load(step + row)
    lo = tl.load(base + row)
    t_row = 1.0
    if VALUE_KEYS:
        t_row = tl.load(temperature + row)
    t0 = _trial(lo, st, 0, t_row, mag, like, VALUE_KEYS, MASK, KEY_TY, HI)
    t1 = _trial(lo, st, 1, t_row, mag, like, VALUE_KEYS, MASK, KEY_TY, HI)
    t2 = _trial(lo, st, 2, t_row, mag, like, VALUE_KEYS, MASK, KEY_TY, HI)
    t3 = _trial(lo, st, 3, t_row, mag, like, VALUE_KEYS, MASK, KEY_TY, HI)
    t4 = _trial(lo, st, 4, t_row, mag, like, VALUE_KEYS, MASK, KEY_TY, HI)
    t5 = _trial(lo, st, 5, t_row, mag, like, VALUE_KEYS, MASK, KEY_TY, HI)
    t6 = _trial(lo, st, 6, t_row, mag, like, VALUE_KEYS, MASK, KEY_TY, HI)
    t7 = _trial(lo, st, 7, t_row, mag, like, VALUE_KEYS, MASK, KEY_TY, HI)
    # exp(z - m) as exp2(z log2(e) - m log2(e)): one FFMA before the exp2
    m2 = tl.load(m_in + row) * 1.4426950408889634
    z_row = z + row * stride_z
    c_lo = s * SLICE
    c_hi = tl.minimum(span, c_lo + SLICE)  # whole steps: the padding holds -inf
    c_end = tl.where(st > 0, c_hi, c_lo)
    f0 = tl.zeros([BLOCK_S], dtype=tl.float32)
    f1 = tl.zeros([BLOCK_S], dtype=tl.float32)
    f2 = tl.zeros([BLOCK_S], dtype=tl.float32)
    f3 = tl.zeros([BLOCK_S], dtype=tl.float32)
    f4 = tl.zeros([BLOCK_S], dtype=tl.float32)
    f5 = tl.zeros([BLOCK_S], dtype=tl.float32)
    f6 = tl.zeros([BLOCK_S], dtype=tl.float32)
    f7 = tl.zeros([BLOCK_S], dtype=tl.float32)
    for c0 in range(c_lo, c_end, BLOCK_S):
        cols = c0 + tl.arange(0, BLOCK_S)
        zz = tl.load(z_row + cols)
        if WEIGHTED:
            w = tl.exp2(zz * 1.4426950408889634 - m2)
            f0 += (zz >= t0).to(tl.float32) * w
            f1 += (zz >= t1).to(tl.float32) * w
            f2 += (zz >= t2).to(tl.float32) * w
            f3 += (zz >= t3).to(tl.float32) * w
            f4 += (zz >= t4).to(tl.float32) * w
            f5 += (zz >= t5).to(tl.float32) * w
            f6 += (zz >= t6).to(tl.float32) * w
            f7 += (zz >= t7).to(tl.float32) * w
        else:
            f0 += (zz >= t0).to(tl.float32)
            f1 += (zz >= t1).to(tl.float32)
            f2 += (zz >= t2).to(tl.float32)
            f3 += (zz >= t3).to(tl.float32)
            f4 += (zz >= t4).to(tl.float32)
            f5 += (zz >= t5).to(tl.float32)
            f6 += (zz >= t6).to(tl.float32)
            f7 += (zz >= t7).to(tl.float32)
    out = part + (row * n_slices + s) * FAN
    tl.store(out, tl.sum(f0, 0))
    tl.store(out + 1, tl.sum(f1, 0))
    tl.store(out + 2, tl.sum(f2, 0))
    tl.store(out + 3, tl.sum(f3, 0))
    tl.store(out + 4, tl.sum(f4, 0))
    tl.store(out + 5, tl.sum(f5, 0))
    tl.store(out + 6, tl.sum(f6, 0))
    tl.store(out + 7, tl.sum(f7, 0))


@triton.jit
def _search_step_kernel(part, lo, hi, step, target, n_rows, n_slices, FAN: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    """One search pass's merge, for ``BLOCK_R`` rows: each trial's count (mass) summed over
    the slices in slice order in fp64, then the row's range narrowed to the largest trial that
    reaches ``target`` (``lo`` itself is never tested) and the next pass's ``step`` (0 once
    the range is one key)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    j = tl.arange(0, FAN)
    f = tl.zeros([BLOCK_R, FAN], dtype=tl.float64)
    for s in range(0, n_slices):
        at = (rows[:, None].to(tl.int64) * n_slices + s) * FAN + j[None, :]
        f += tl.load(part + at, mask=live[:, None], other=0.0).to(tl.float64)
    a = tl.load(lo + rows, mask=live, other=0)
    b = tl.load(hi + rows, mask=live, other=0)
    st = tl.load(step + rows, mask=live, other=0)
    goal = tl.load(target + rows, mask=live, other=0.0)
    trial = a[:, None] + (j[None, :] + 1).to(tl.int64) * st[:, None]
    ok = (trial <= b[:, None]) & (f >= goal[:, None])
    best = tl.max(tl.where(ok, j[None, :] + 1, 0), 1).to(tl.int64)
    new_lo = a + best * st
    active = st > 0
    b = tl.where(active, tl.minimum(b, new_lo + st - 1), b)
    a = tl.where(active, new_lo, a)
    st = tl.where(a < b, (b - a) // (FAN + 1) + 1, 0)
    tl.store(lo + rows, a, mask=live)
    tl.store(hi + rows, b, mask=live)
    tl.store(step + rows, st, mask=live)


@triton.jit
def _settle_kernel(found, lo, hi, temperature, mag, like, n_rows, MASK: tl.constexpr,
                   KEY_TY: tl.constexpr, HI: tl.constexpr, BLOCK_R: tl.constexpr):
    """The end of a search in the 16-bit values: ``found`` holds the largest value key whose
    tempered logit's tokens reach the target (``-HI - 1``, -inf's, when none does). That
    logit is the largest fp32 key that reaches it; clamped to the row's ``[lo, hi]`` it is the
    fp32 search's answer, written over ``lo`` (kept where nothing was found)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    k = tl.load(found + rows, mask=live, other=0)
    a = tl.load(lo + rows, mask=live, other=0)
    b = tl.load(hi + rows, mask=live, other=0)
    t = tl.load(temperature + rows, mask=live, other=1.0)
    z = tl.math.div_rn(_value_at(k, like, MASK, KEY_TY) * mag, t)  # k lies in [-HI - 1, HI]
    key = _keys(z).to(tl.int64)
    key = tl.where(k > -HI - 1, tl.minimum(tl.maximum(key, a), b), a)
    tl.store(lo + rows, key, mask=live)


@triton.jit
def _stats_kernel(z, stride_z, targets, m_in, t_in, part, part_k, n_slices, width, span,
                  CANONICAL: tl.constexpr, SLICE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Slice ``s`` of row ``r`` against the cut key ``T``: ``sum exp(z - m)`` over the slice,
    the mass and ``sum e (z - m)`` strictly above ``T``, the tokens at ``T`` and those of them
    before the target; with ``CANONICAL`` (a cut from min-p's floor may hold no token at
    ``T``) also the smallest key above ``T`` and its count. Per-lane state, reduced once at
    the end."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    m = tl.load(m_in + row)
    m2 = m * 1.4426950408889634
    t = tl.load(t_in + row).to(tl.int32)
    tz = _from_key(t)  # float order is key order (the stored keys are never -1, -0.0's)
    y = tl.load(targets + row)
    z_row = z + row * stride_z
    c_lo = s * SLICE
    c_hi = tl.minimum(span, c_lo + SLICE)  # whole steps: the padding holds -inf
    l_f = tl.zeros([BLOCK_V], dtype=tl.float32)
    l_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    a_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    n_t = tl.zeros([BLOCK_V], dtype=tl.float32)
    n_b = tl.zeros([BLOCK_V], dtype=tl.float32)
    k_a = tl.full([BLOCK_V], 2147483647, tl.int32)
    n_k = tl.zeros([BLOCK_V], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        valid = cols < width
        zz = tl.load(z_row + cols)
        above = zz > tz
        e = tl.exp2(zz * 1.4426950408889634 - m2)  # exp(z - m); 0 past the slice
        l_f += e
        e_a = tl.where(above, e, 0.0)
        l_a += e_a
        a_a += e_a * tl.where(above, zz - m, 0.0)
        at = zz == tz  # the padding's -inf: taken off by the caller when T is -inf's key
        n_t += at.to(tl.float32)
        n_b += (at & (cols < y)).to(tl.float32)
        if CANONICAL:
            ka = tl.where(above & valid, _keys(zz), 2147483647)
            n_k = tl.where(ka < k_a, 1.0, tl.where(above & (ka == k_a), n_k + 1.0, n_k))
            k_a = tl.minimum(k_a, ka)
    out = part + (row * n_slices + s) * 6
    tl.store(out, tl.sum(l_f, 0))
    tl.store(out + 1, tl.sum(l_a, 0))
    tl.store(out + 2, tl.sum(a_a, 0))
    tl.store(out + 3, tl.sum(n_t, 0))
    tl.store(out + 4, tl.sum(n_b, 0))
    if CANONICAL:
        k_min = tl.min(k_a, 0)
        tl.store(out + 5, tl.sum(tl.where(k_a == k_min, n_k, 0.0), 0))
        tl.store(part_k + row * n_slices + s, k_min)


@triton.jit
def _finish_kernel(part, part_k, n_slices, m_in, t_in, c_in, z, stride_z, targets, n_rows,
                   width, pad, lp_out, ent_out, lkm_out, lse_out, m_out, logk_out, key_out,
                   count_out, CANONICAL: tl.constexpr, BLOCK_R: tl.constexpr):
    """The statistics pass's merge and the chunk's results, for ``BLOCK_R`` rows: the
    slices' partial sums added in slice order in fp64, the kept ties at ``T`` (a count times
    one weight), the target's membership, and ``log q_y``, the kept entropy,
    ``log_kept_mass``, ``lse``, the row maximum ``m``, the kept set's normaliser relative to
    it (``log sum_K exp(z - m)``) and the stored pair written straight into the outputs.
    With ``CANONICAL`` (a min-p floor may be a key no token has) the stored pair is the
    smallest kept key and the kept tokens at it."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    r64 = rows.to(tl.int64)
    # the pass's first five fields (l_f, l_a, a_a, n_t, n_b), summed over the slices
    f = tl.arange(0, 8)
    sums = tl.zeros([BLOCK_R, 8], dtype=tl.float64)
    k_min = tl.full([BLOCK_R], 2147483647, tl.int32)
    for s in range(0, n_slices):
        at = part + (r64 * n_slices + s)[:, None] * 6 + f[None, :]
        sums += tl.load(at, mask=live[:, None] & (f < 5)[None, :], other=0.0).to(tl.float64)
        if CANONICAL:
            k_min = tl.minimum(k_min, tl.load(part_k + r64 * n_slices + s, mask=live, other=0))
    l_f = tl.sum(tl.where(f == 0, sums, 0.0), 1)
    l_a = tl.sum(tl.where(f == 1, sums, 0.0), 1)
    a_a = tl.sum(tl.where(f == 2, sums, 0.0), 1)
    n_t = tl.sum(tl.where(f == 3, sums, 0.0), 1)
    n_b = tl.sum(tl.where(f == 4, sums, 0.0), 1)
    m = tl.load(m_in + rows, mask=live, other=0.0)
    t = tl.load(t_in + rows, mask=live, other=0)
    c = tl.load(c_in + rows, mask=live, other=0)
    z_t = _from_key(t)
    # a cut at -inf also counted the rows' -inf padding: not tokens
    n_t = tl.where(z_t == float("-inf"), n_t - pad, n_t)
    kept_t = tl.minimum(c.to(tl.float64), n_t)
    e_t = tl.exp(z_t - m).to(tl.float64)
    md = m.to(tl.float64)
    l_k = l_a + kept_t * e_t
    a_k = a_a + kept_t * e_t * (z_t.to(tl.float64) - md)
    y = tl.minimum(tl.maximum(tl.load(targets + rows, mask=live, other=0), 0), width - 1)
    z_y = tl.load(z + r64 * stride_z + y, mask=live, other=0.0)
    y_key = _keys(z_y).to(tl.int64)
    y_in = (y_key > t) | ((y_key == t) & (n_b + 1.0 <= c.to(tl.float64)))
    log_f = tl.log(l_f)
    log_k = tl.log(l_k)
    lp = tl.where(y_in, (z_y.to(tl.float64) - md) - log_k, float("-inf"))
    entropy = log_k - a_k / l_k
    key = t
    count = kept_t.to(tl.int64)
    if CANONICAL:
        n_min = tl.zeros([BLOCK_R], dtype=tl.float64)
        for s in range(0, n_slices):
            k_s = tl.load(part_k + r64 * n_slices + s, mask=live, other=0)
            n_s = tl.load(part + (r64 * n_slices + s) * 6 + 5, mask=live, other=0.0)
            n_min += tl.where(k_s == k_min, n_s.to(tl.float64), 0.0)
        key = tl.where(kept_t > 0, t, k_min.to(tl.int64))
        count = tl.where(kept_t > 0, kept_t, n_min).to(tl.int64)
    tl.store(lp_out + rows, lp.to(tl.float32), mask=live)
    tl.store(ent_out + rows, entropy.to(tl.float32), mask=live)
    tl.store(lkm_out + rows, (log_k - log_f).to(tl.float32), mask=live)
    tl.store(lse_out + rows, (md + log_f).to(tl.float32), mask=live)
    tl.store(m_out + rows, m, mask=live)
    tl.store(logk_out + rows, log_k.to(tl.float32), mask=live)
    tl.store(key_out + rows, key, mask=live)
    tl.store(count_out + rows, count, mask=live)


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
def _at_and_above(raw, valid, temp, softcap, scale, sign, t, lo_u, hi_u,
                  HAS_SOFTCAP: tl.constexpr):
    """Which columns hold the kept key ``t`` and which lie above it (``_grad_kernel``'s doc)."""
    if HAS_SOFTCAP:
        k = _keys(_tempered(raw, temp, softcap, scale, HAS_SOFTCAP))
        above = k > t
        at = valid & (k == t)
    else:
        u = raw.to(tl.float32) * sign
        above = u >= hi_u
        at = valid & (u >= lo_u) & ~above
    return at, above


@triton.jit
def _tile_row(x, stride_x, n_rows):
    """This program's row of a backward tile, its start, whether it is a real row, and the
    real row whose per-row values it reads (padding rows read the last one's)."""
    row = tl.program_id(0).to(tl.int64)
    return row, x + row * stride_x, row < n_rows, tl.minimum(row, n_rows - 1)


@triton.jit
def _cut_kernel(x, stride_x, temperature, key, count, seen, u_at, u_above, cut, n_rows,
                width, span, softcap, scale, sign, HAS_SOFTCAP: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """Row ``r`` of a tile: the column past the last of its kept tokens at the kept key (the
    first ``count - seen`` of the tile's, lowest ids first; ``seen`` kept in earlier tiles) in
    ``cut``, and ``seen`` advanced. It reads blocks only up to the one holding that token (a
    tie count per block); the ranks inside that block are one ``cumsum`` after the loop."""
    row, x_row, keep, r = _tile_row(x, stride_x, n_rows)
    temp = tl.load(temperature + r)
    s = tl.load(seen + r)
    need = (tl.minimum(tl.load(count + r), 2**40) - s).to(tl.int32)
    t = tl.load(key + r).to(tl.int32)
    lo_u = tl.load(u_at + r)
    hi_u = tl.load(u_above + r)
    c0 = 0
    n = tl.zeros([], dtype=tl.int32)
    done = need <= 0
    while (c0 < span) & (done == 0):  # whole steps: the rows are padded to ``span``
        cols = c0 + tl.arange(0, BLOCK_V)
        valid = cols < width
        raw = tl.load(x_row + cols)
        at, _ = _at_and_above(raw, valid, temp, softcap, scale, sign, t, lo_u, hi_u,
                              HAS_SOFTCAP)
        nb = tl.sum(at.to(tl.int32), 0)
        done = n + nb >= need
        n = tl.where(done, n, n + nb)
        c0 = tl.where(done, c0, c0 + BLOCK_V)
    cols = c0 + tl.arange(0, BLOCK_V)
    valid = cols < width
    raw = tl.load(x_row + cols, mask=cols < span, other=0.0)
    at, _ = _at_and_above(raw, valid, temp, softcap, scale, sign, t, lo_u, hi_u, HAS_SOFTCAP)
    rank = n + tl.cumsum(at.to(tl.int32), 0)
    last = tl.min(tl.where(at & (rank >= need), cols, 2147483647), 0)
    end = tl.where(need <= 0, 0, tl.where(done, last + 1, width))
    tl.store(cut + row, end)
    tl.store(seen + r, tl.where(done, s + tl.maximum(need, 0), s + n), mask=keep)


@triton.jit
def _grad_kernel(x, stride_x, targets, temperature, key, cut, u_at, u_above, top, log_kept,
                 log_full, entropy, g_lp, g_entropy, g_kept, g_lse, n_rows, width, span, v0,
                 softcap, scale, sign, HAS_SOFTCAP: tl.constexpr, CLAMP: tl.constexpr,
                 HAS_G_LP: tl.constexpr, HAS_G_ENTROPY: tl.constexpr,
                 HAS_G_KEPT: tl.constexpr, HAS_G_LSE: tl.constexpr,
                 INTERPRET_BF16: tl.constexpr, BLOCK_V: tl.constexpr):
    """Overwrite row ``r``'s logits before the transform (vocabulary columns ``v0 ...``, in
    their dtype) with ``dx``; zeros for rows at or past ``n_rows`` (padding). The kept tokens
    at the kept key are those before column ``cut[r]`` (:func:`_cut_kernel`). ``g_lp`` must
    be 0 where the target is outside the kept set.

    Without a softcap the tempered logit is a nondecreasing function of ``u = sign x`` (the
    raw logit, its sign flipped for a negative scale), so the kept key's tokens are those with
    ``u`` in ``[u_at, u_above)`` and the tokens above it those with ``u >= u_above``
    (:func:`_value_cuts`, the same bits as the forward's keys, without a division per
    element). ``log q = (z - m) - log_kept`` (``log p`` with ``log_full``) is formed without a
    number of ``m``'s size: ``z - m`` as ``(x - x_top) scale / T`` from the raw logits, where
    ``x_top = sign top`` is a raw logit whose tempered logit is ``m`` (exact in fp32 for 16-bit
    logits, near ``m`` for fp32 ones), then one ``exp2``. With ``CLAMP`` (fp32 logits, where
    several raw values may give the tempered ``m``) it is capped at 0, so that every token at
    ``m`` has ``q = exp(-log_kept)`` as in the forward (a one-token set: ``q = 1``, its
    gradient 0). With a softcap every element's logit is formed as the forward's, and ``top``
    is ``m``."""
    row, x_row, keep, r = _tile_row(x, stride_x, n_rows)
    temp = tl.load(temperature + r)
    end = tl.load(cut + row)
    y = (tl.load(targets + r) - v0).to(tl.int32)
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
    factor = scale / temp
    log2e = 1.4426950408889634
    lk2 = tl.load(log_kept + r) * log2e
    lf2 = tl.load(log_full + r) * log2e
    if HAS_SOFTCAP:
        k2 = log2e
        x_top = tl.load(top + r)  # m
    else:
        k2 = factor * log2e
        x_top = tl.load(top + r) * sign
    t = tl.load(key + r).to(tl.int32)
    lo_u = tl.load(u_at + r)
    hi_u = tl.load(u_above + r)
    for c0 in range(0, span, BLOCK_V):  # whole steps: the rows are padded to ``span``
        cols = c0 + tl.arange(0, BLOCK_V)
        valid = cols < width
        raw = tl.load(x_row + cols)
        at, above = _at_and_above(raw, valid, temp, softcap, scale, sign, t, lo_u, hi_u,
                                  HAS_SOFTCAP)
        if HAS_SOFTCAP:
            z = _tempered(raw, temp, softcap, scale, HAS_SOFTCAP)
            dz = z - x_top  # z - m
        else:
            dz = raw.to(tl.float32) - x_top  # (z - m) T / scale
        log2_q = dz * k2 - lk2
        if CLAMP:
            log2_q = tl.minimum(log2_q, -lk2)
        member = valid & (above | (at & (cols < end)))
        q = tl.where(member, tl.exp2(log2_q), 0.0)
        d = q * coef
        if HAS_G_ENTROPY:
            d -= tl.where(member, q * (log2_q * 0.6931471805599453 + h), 0.0) * g_h
        if HAS_G_KEPT or HAS_G_LSE:
            log2_p = dz * k2 - lf2
            if CLAMP:
                log2_p = tl.minimum(log2_p, -lf2)
            d += tl.exp2(log2_p) * g_p
        d += tl.where(cols == y, g_y, 0.0)
        d *= factor
        if HAS_SOFTCAP:
            th = tanh(tl.math.div_rn(raw.to(tl.float32), softcap))
            d *= 1.0 - th * th
        d = tl.where(keep, d, 0.0)
        tl.store(x_row + cols, round_to(d, x.dtype.element_ty, INTERPRET_BF16))


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


def _span(width: int) -> int:
    """A row's columns padded to whole steps of every pass (a multiple of 16 too)."""
    step = max(BLOCK_COLS, SEARCH_BLOCK, TRANSFORM_BLOCK, CUT_BLOCK, 16)
    return -(-width // step) * step


def search_passes(fan: int, bits: int = 32) -> int:
    """Passes of a ``fan``-trial search over ``bits``-bit keys (the fp32 keys, or a 16-bit
    dtype's values): each divides the range by ``fan + 1``, and a fixed number of them (no
    host read) settles any range below ``2^bits``."""
    passes = 0
    while (fan + 1) ** passes < 2**bits:
        passes += 1
    return passes


def row_args(params: RowParams, n: int, device):
    """Per-row settings as the passes take them: the temperature (fp32), ``log(min_p)`` as the
    torch path forms it, ``top_k`` and ``top_p`` (fp64); None where off; the engine's
    ``rules`` (``sampler_torch.engine_rules``)."""
    return dict(
        temperature=params.temperature.float().contiguous(),
        log_min_p=None if params.min_p is None else torch.log(params.min_p.float()),
        top_k=params.top_k,
        top_p=None if params.top_p is None else params.top_p.double(),
        rules=engine_rules(params.engine),
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
    """``sampler_torch.forward``'s contract: ``(logprobs, entropy, log_kept_mass, lse, m,
    log_kept, key, count)``, each ``[N]`` (fp32; key and count int64)."""
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    outs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(6)]
    outs += [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(2)]
    if n == 0:
        return tuple(outs)
    rows = rows_per_chunk(v, tile_bytes, hidden.dtype, softcap)
    cols = min(v, _COLS)
    # rows padded to whole steps of the transform pass (unmasked loads at any V)
    chunk = torch.empty(rows, _span(v), dtype=hidden.dtype, device=dev)[:, :v]
    part = torch.empty(rows * cols, dtype=hidden.dtype, device=dev) if cols < v else None
    bufs = _Buffers(rows, v, dev)
    args = row_args(params, n, dev)
    targets = targets.contiguous()
    for r0, real, padded in constants.row_blocks(n, rows, _GRANULE):
        h = pad_rows(hidden[r0:r0 + real], padded).contiguous()  # the backward's layout
        for c0 in range(0, v, cols):
            w, b = head_slice(weight, bias, c0, cols, hidden.dtype)
            if part is None:
                _gemm_(chunk[:padded], h, w, b)
            else:
                x = part[:padded * w.shape[0]].view(padded, w.shape[0])
                _gemm_(x, h, w, b)
                chunk[:padded, c0:c0 + w.shape[0]] = x
        # The GEMM is R rows tall, or for the last chunk a multiple of the granule (a row's
        # bits must not depend on the height: docs/gpu.md), the passes run over the real rows
        # only: as many launches for every N, and no program spent on a padding row (a row's
        # results never depend on the others')
        chunk_stats(chunk[:real], targets[r0:r0 + real], args, r0,
                    [o[r0:r0 + real] for o in outs], softcap, logit_scale, bufs)
    # A row with a NaN or inf logit has no distribution: its logprob is NaN (as the torch
    # path's), not the -inf that means "outside the kept set".
    outs[0] = torch.where(torch.isfinite(outs[3]), outs[0], torch.nan)
    return tuple(outs)


class _Buffers:
    """One chunk's buffers for :func:`chunk_stats` (for up to ``rows`` rows): the tempered
    fp32 logits and the per-slice partial results."""

    def __init__(self, rows, v, device):
        self.rows, self.v = rows, v
        self.slices = -(-v // SLICE_COLS)
        s = self.slices
        # rows padded to whole steps of every pass (the transform fills the padding with -inf)
        self.z = torch.empty(rows, _span(v), dtype=torch.float32, device=device)[:, :v]
        self.m = torch.empty(rows, s, dtype=torch.float32, device=device)
        self.k = torch.empty(rows, s, dtype=torch.int32, device=device)
        self.fan = torch.zeros(rows, s, FAN_KEYS, dtype=torch.float32, device=device)
        self.stats = torch.empty(rows, s, 6, dtype=torch.float32, device=device)


def _key_of(z: torch.Tensor) -> torch.Tensor:
    """The ordered int64 key of fp32 ``z`` (``_keys``, in torch)."""
    return ordered_keys(z.float()).long()


def _float_of(key: torch.Tensor) -> torch.Tensor:
    """The fp32 value of an ordered key (``_from_key``, in torch)."""
    return key_floats(key.int(), torch.float32)


class _Passes:
    """The passes of :func:`chunk_stats` over one chunk's tempered logits, each a ``[R, S]``
    launch (a program per row and vocabulary slice) and a merge of its per-slice partial
    results in slice order (fp64 for masses) by a few ``[R]``-sized torch ops: no host read,
    no atomics, a row's results independent of the other rows."""

    def __init__(self, bufs: _Buffers, width: int, m: torch.Tensor, values=None):
        self.b, self.width, self.m = bufs, width, m
        self.grid = (m.shape[0], -(-width // SLICE_COLS))  # the chunk's rows, its slices
        # (logits, temperature, |scale|) where the search runs in the 16-bit logits' values
        self.values = values

    def _fan(self, base, step, weighted: bool, values: bool):
        b = self.b
        x, temp, mag = self.values if values else (b.z, self.m, 1.0)
        bits = 8 * x.element_size()
        _fan_kernel[self.grid](b.z, b.z.stride(0), self.m, base, step, b.fan, b.slices,
                               _span(self.width), temp, mag, x, WEIGHTED=weighted,
                               VALUE_KEYS=values, MASK=(1 << (bits - 1)) - 1,
                               KEY_TY=tl.int16 if bits == 16 else tl.int32,
                               HI=_INF_BITS[x.dtype], FAN=FAN_KEYS, SLICE=SLICE_COLS,
                               BLOCK_S=SEARCH_BLOCK, num_warps=WARPS)

    def fan(self, base, step, weighted: bool):
        """``[R, FAN]``: count (or fp64 mass) of tokens at or above ``base + (j + 1) step``."""
        self._fan(base, step, weighted, values=False)
        return self.b.fan[:self.grid[0], :self.grid[1]].double().sum(1)

    def search(self, lo, hi, target, weighted: bool, active=None):
        """The largest key ``t`` in ``[lo, hi]`` whose tokens at or above it number (weigh) at
        least ``target`` (``lo`` when none does; ``lo`` itself is never tested); rows not
        ``active`` keep ``lo``. A fixed number of ``FAN``-trial passes: 11 over the fp32 keys,
        or, for 16-bit logits without a softcap, 6 over the logits' own values (the count at
        a tempered logit changes only at the row's logits, all of which are the tempered
        16-bit values: the largest value that reaches the target gives the largest key) and
        one ``_settle_kernel``."""
        target = target.double().contiguous()
        b = self.b
        rows = self.grid[0]
        if self.values is None:
            bits, start, end = 32, lo.clone(), hi.clone()
        else:
            bits = 16
            top = _INF_BITS[self.values[0].dtype]
            start = torch.full_like(lo, -top - 1)
            end = torch.full_like(hi, top)
        if active is not None:
            end = torch.where(active, end, start)
        step = torch.where(start < end, (end - start) // (FAN_KEYS + 1) + 1, 0)
        for _ in range(search_passes(FAN_KEYS, bits)):
            self._fan(start, step, weighted, values=self.values is not None)
            _search_step_kernel[(triton.cdiv(rows, _BLOCK_R),)](
                b.fan, start, end, step, target, rows, b.slices, FAN=FAN_KEYS, BLOCK_R=_BLOCK_R,
                num_warps=4)
        if self.values is None:
            return start
        x, temp, mag = self.values
        found, lo = start, lo.clone()
        _settle_kernel[(triton.cdiv(rows, _BLOCK_R),)](
            found, lo, hi.contiguous(), temp, mag, x, rows, MASK=0x7FFF, KEY_TY=tl.int16,
            HI=_INF_BITS[x.dtype], BLOCK_R=_BLOCK_R, num_warps=4)
        return lo

    def at_and_above(self, t, weighted: bool):
        """Per row: the count (mass) at or above key ``t`` and strictly above it."""
        f = self.fan(t - 1, torch.ones_like(t), weighted)
        return f[:, 0], f[:, 1]


def chunk_stats(x, targets, args, r0, outs, softcap, logit_scale, bufs=None):
    """The kept set and statistics of the logits ``x [R, V]`` before the transform (row
    stride free, unit column stride) of rows ``r0 ...`` of the per-row settings ``args``
    (:func:`row_args`): ``(logprobs, entropy, log_kept_mass, lse, m, log_kept, key,
    count)``, each ``[R]``, written into ``outs`` when given (module doc, steps 2-4)."""
    rows, v = x.shape
    dev = x.device
    if bufs is None or bufs.rows < rows or bufs.v != v:
        bufs = _Buffers(rows, v, dev)
    z = bufs.z[:rows, :v]
    if x.stride(0) < _span(v) or x.stride(1) != 1:  # the transform reads whole steps
        padded = x.new_empty(rows, _span(v))
        padded[:, :v] = x
        x = padded[:, :v]
    s = -(-v // SLICE_COLS)
    temp = args["temperature"][r0:r0 + rows]
    _transform_kernel[(rows, s)](
        x, x.stride(0), temp, z, z.stride(0), bufs.m, bufs.k, bufs.slices, v, _span(v),
        softcap=1.0 if softcap is None else float(softcap), scale=float(logit_scale),
        HAS_SOFTCAP=softcap is not None, SLICE=SLICE_COLS, BLOCK_V=TRANSFORM_BLOCK, num_warps=WARPS)
    pm, pk = bufs.m[:rows, :s], bufs.k[:rows, :s]
    m = pm.amax(1)
    # 16-bit logits without a softcap: the searches run over their own values (6 passes)
    values = None
    if _VALUE_SEARCH and x.element_size() == 2 and softcap is None:
        values = (x, temp, abs(float(logit_scale)))
    passes = _Passes(bufs, v, m.contiguous(), values)
    passes.z = z
    rules = args["rules"]
    hi = _key_of(m)
    lo_all = pk.amin(1).long()
    # min-p's candidates: z >= m + log(min_p), the keys from key(m + log(min_p)) up
    log_min_p = _rows(args["log_min_p"], r0, rows)
    thr = None if log_min_p is None else m + log_min_p
    floor = None if thr is None else torch.maximum(_key_of(thr), lo_all)
    lo = floor if (floor is not None and rules.min_p_first) else lo_all
    t = lo
    c = torch.full_like(t, _ALL_TIES)
    top_k = _rows(args["top_k"], r0, rows)
    if top_k is not None:
        t = passes.search(t, hi, top_k, weighted=False)
        if not rules.top_k_ties:
            at_or_above, above = passes.at_and_above(t, weighted=False)
            c = top_k - above.long()
            ties_k = (at_or_above - above).long()
    top_p = _rows(args["top_p"], r0, rows)
    if top_p is not None:
        on = top_p < 1.0
        t_0, c_0 = t, c
        if rules.joint_top_p:  # rows without min-p: top-p over the whole row
            joint = torch.ones_like(on) if thr is None else thr == -math.inf
            t_0 = torch.where(joint, lo, t)
            c_0 = torch.where(joint, _ALL_TIES, c)
        # the candidates' mass in fp64: those above t_0, and the kept ties at t_0
        at_or_above, above = passes.at_and_above(t_0, weighted=True)
        if not rules.top_k_ties and top_k is not None:
            n_at = torch.where(t_0 == t, ties_k, 0)
            kept_at = torch.minimum(c_0, n_at).double()
            total = above + kept_at * _weight(t_0, m)
            total = torch.where(c_0 >= n_at, at_or_above, total)
        else:
            total = at_or_above
        target = top_p * total
        t_p = passes.search(t_0, hi, target, weighted=True, active=on)
        if rules.top_p_ties:
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
    if floor is not None and not rules.min_p_first:
        # min-p last: every token at or above the smallest candidate key, where that cuts
        c = torch.where(floor > t, _ALL_TIES, c)
        t = torch.maximum(t, floor)
    if outs is None:
        outs = [torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(6)]
        outs += [torch.empty(rows, dtype=torch.int64, device=dev) for _ in range(2)]
    return _final_stats(passes, targets, t.contiguous(), c, m, floor is not None, outs)


def _rows(x, r0, rows):
    return None if x is None else x[r0:r0 + rows]


def _weight(key, m):
    """``exp(z - m)`` (fp64) of the tokens at ``key``."""
    return torch.exp(_float_of(key) - m).double()


# "Every tied token": larger than any vocabulary.
_ALL_TIES = 2**62


def _final_stats(passes: _Passes, targets, t, c, m, canonical: bool, outs):
    """The statistics of the kept set ``(t, c)``: one ``[R, S]`` pass and one merge launch
    (``_finish_kernel``) that writes ``outs``."""
    b = passes.b
    rows = passes.grid[0]
    targets = targets.contiguous()
    _stats_kernel[passes.grid](passes.z, passes.z.stride(0), targets, passes.m, t, b.stats,
                               b.k, b.slices, passes.width, _span(passes.width),
                               CANONICAL=canonical,
                               SLICE=SLICE_COLS, BLOCK_V=BLOCK_COLS, num_warps=WARPS)
    _finish_kernel[(triton.cdiv(rows, _BLOCK_R),)](
        b.stats, b.k, b.slices, passes.m, t, c.contiguous(), passes.z, passes.z.stride(0),
        targets, rows, passes.width, float(_span(passes.width) - passes.width), *outs,
        CANONICAL=canonical, BLOCK_R=_BLOCK_R, num_warps=4)
    return tuple(outs)


@triton.jit
def _value_at(k, like, MASK: tl.constexpr, KEY_TY: tl.constexpr):
    """The value (fp32) of ``like``'s dtype whose ordered key is ``k``."""
    bits = tl.where(k < 0, k ^ MASK, k).to(KEY_TY)
    return bits.to(like.dtype.element_ty, bitcast=True).to(tl.float32)


@triton.jit
def _value_cuts_kernel(key, top, temperature, u_at, u_above, u_top, like, n_rows, mag,
                       LO: tl.constexpr, HI: tl.constexpr, MASK: tl.constexpr,
                       KEY_TY: tl.constexpr, STEPS: tl.constexpr, BLOCK_R: tl.constexpr):
    """:func:`_value_cuts` for ``BLOCK_R`` rows: three bisections over the ordered keys
    ``[LO, HI]`` of ``like``'s dtype (-inf to +inf), each step forming the candidate's tempered
    logit as the forward does (``_tempered`` without a softcap)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    k = tl.load(key + rows, mask=live, other=0).to(tl.int32)
    k_top = _keys(tl.load(top + rows, mask=live, other=0.0))
    t = tl.load(temperature + rows, mask=live, other=1.0)
    for which in tl.static_range(3):
        lo = tl.full([BLOCK_R], LO, tl.int64)  # int64: the fp32 range's ends sum past int32
        hi = tl.full([BLOCK_R], HI + 1, tl.int64)  # past every value: none
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) >> 1
            zk = _keys(tl.math.div_rn(_value_at(tl.minimum(mid, HI), like, MASK, KEY_TY) * mag,
                                      t))
            if which == 0:
                ok = zk >= k
            elif which == 1:
                ok = zk > k
            else:
                ok = zk >= k_top
            more = lo < hi
            hi = tl.where(ok & more, mid, hi)
            lo = tl.where(~ok & more, mid + 1, lo)
        u = tl.where(lo <= HI, _value_at(tl.minimum(lo, HI), like, MASK, KEY_TY), float("nan"))
        if which == 0:
            tl.store(u_at + rows, u, mask=live)
        elif which == 1:
            tl.store(u_above + rows, u, mask=live)
        else:
            tl.store(u_top + rows, u, mask=live)


# +inf's bit pattern per dtype (the largest ordered key of a non-NaN value).
_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}


def _value_cuts(key, top, temperature, scale: float, dtype):
    """Per row, for logits ``x`` of ``dtype`` and ``u = sign(scale) x``: the smallest ``u``
    whose tempered logit ``fl(fl(u |scale|) / T)`` (the forward's, ``_tempered`` without a
    softcap: nondecreasing in ``u``) has at least the key ``key``, the smallest whose key is
    above it, and the smallest whose tempered logit is the row maximum ``top`` (fp32 values;
    NaN where none is). Three bisections over the ordered keys of ``dtype``'s finite values
    and infinities in one launch (:func:`_value_cuts_kernel`), the same products and correctly
    rounded divisions as the kernels': the backward tells the kept tokens by comparing ``u``
    with the first two numbers, with the forward's bits, and forms ``z - m`` from ``u`` minus
    the third (``_grad_kernel``)."""
    n = key.shape[0]
    kd = torch.int16 if dtype.itemsize == 2 else torch.int32
    # the ordered keys of +inf and -inf in ``dtype``'s own width (+inf's bit pattern; -inf's,
    # the sign bit set, flipped: minus the pattern, less one)
    hi_key = _INF_BITS[dtype]
    lo_key = -hi_key - 1
    u_at = torch.empty(n, dtype=torch.float32, device=key.device)
    u_above = torch.empty_like(u_at)
    u_top = torch.empty_like(u_at)
    like = torch.empty(1, dtype=dtype, device=key.device)
    bits = 8 * kd.itemsize
    _value_cuts_kernel[(triton.cdiv(n, _BLOCK_R),)](
        key.contiguous(), top.contiguous(), temperature.float().contiguous(), u_at, u_above,
        u_top, like, n,
        abs(float(scale)), LO=lo_key, HI=hi_key, MASK=(1 << (bits - 1)) - 1,
        KEY_TY=tl.int16 if bits == 16 else tl.int32, STEPS=bits + 1, BLOCK_R=_BLOCK_R,
        num_warps=2)
    return u_at, u_above, u_top


def grad_meta(dtype, softcap, g_lp, g_entropy, g_kept, g_lse) -> dict:
    """The constexprs and warps ``backward`` launches ``_grad_kernel`` with."""
    return dict(HAS_SOFTCAP=softcap is not None,
                CLAMP=softcap is None and dtype.itemsize > 2, HAS_G_LP=g_lp is not None,
                HAS_G_ENTROPY=g_entropy is not None, HAS_G_KEPT=g_kept is not None,
                HAS_G_LSE=g_lse is not None,
                INTERPRET_BF16=_INTERPRET and dtype == torch.bfloat16, BLOCK_V=BLOCK_COLS,
                num_warps=WARPS)


def backward(hidden, weight, bias, targets, params: RowParams, key, count, m, log_kept,
             log_kept_mass, entropy, g_lp, g_entropy, g_kept, g_lse, *, softcap, logit_scale,
             need_hidden, need_weight, need_bias, tile_bytes: int = DEFAULT_TILE_BYTES):
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
    blocks = list(constants.row_blocks(n, rows, _GRANULE))
    chunks = len(blocks)
    n_pad = blocks[-1][0] + blocks[-1][2]  # the last chunk padded as the forward pads it
    per_group = max(1, min(chunks, tile_bytes // (rows * cols * hidden.element_size())))
    h_pad = pad_rows(hidden, n_pad).contiguous()
    # rows padded to whole steps: the tie-cut and dx passes read and write unmasked
    tile = torch.empty(per_group * rows * _span(cols), dtype=hidden.dtype, device=dev)
    d_hidden = torch.empty(n_pad, hidden.shape[1], dtype=torch.float32, device=dev) \
        if need_hidden else None
    d_weight = torch.empty(weight.shape, dtype=torch.float32, device=dev) if need_weight \
        else None
    d_bias = torch.empty(v, dtype=torch.float32, device=dev) if need_bias else None
    args = row_args(params, n, dev)
    seen = torch.zeros(n, dtype=torch.int64, device=dev)
    cut = torch.empty(per_group * rows, dtype=torch.int32, device=dev)
    per_row = [None if g is None else g.float().contiguous()
               for g in (log_kept, log_kept - log_kept_mass, entropy, g_lp, g_entropy, g_kept,
                         g_lse)]
    ptrs = [p if p is not None else per_row[0] for p in per_row]
    meta = grad_meta(hidden.dtype, softcap, *per_row[3:])
    scalars = dict(softcap=1.0 if softcap is None else float(softcap),
                   scale=float(logit_scale))
    targets, key, count = targets.contiguous(), key.contiguous(), count.contiguous()
    scalars["sign"] = -1.0 if logit_scale < 0 else 1.0
    m = m.float().contiguous()
    if softcap is None:
        # top: the smallest u whose tempered logit is m (``z - m`` from ``u - top``)
        u_at, u_above, top = _value_cuts(key, m, args["temperature"], float(logit_scale),
                                         hidden.dtype)
    else:
        u_at = u_above = args["temperature"]  # not read: the keys are formed per element
        top = m
    for c0 in range(0, v, cols):
        w, b = head_slice(weight, bias, c0, cols, hidden.dtype)
        width = w.shape[0]
        for g0 in range(0, chunks, per_group):
            r0 = g0 * rows
            g_rows = min(per_group * rows, n_pad - r0)
            real = max(0, min(g_rows, n - r0))
            x = tile_rows(tile, g_rows, width, _span(width))
            for c in range(0, g_rows, rows):
                _gemm_(x[c:c + rows], h_pad[r0 + c:r0 + c + rows], w, b)
            cut_meta = dict(HAS_SOFTCAP=meta["HAS_SOFTCAP"], BLOCK_V=CUT_BLOCK,
                            num_warps=meta["num_warps"])
            rows_args = (args["temperature"][r0:], key[r0:])
            # the passes run over the real rows; the padding rows of the tile (the GEMM's, for
            # its bits) are zeroed for the column sum and the GEMMs below
            if real < g_rows:
                x[real:].zero_()
            _cut_kernel[(real,)](x, x.stride(0), *rows_args, count[r0:], seen[r0:],
                                   u_at[r0:], u_above[r0:], cut, real, width, _span(width),
                                   **scalars, **cut_meta)
            _grad_kernel[(real,)](
                x, x.stride(0), targets[r0:], *rows_args, cut, u_at[r0:], u_above[r0:],
                top[r0:], *(p[r0:] for p in ptrs), real, width, _span(width), c0, **scalars,
                **meta)
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
