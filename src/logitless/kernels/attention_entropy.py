"""Flash-style attention entropy: per query block, stream key blocks, never store ``T x T``.

Each program owns ``BLOCK_M`` queries of one (batch row, query head) and walks the key blocks
they can see, keeping per query, in base-2 units (``t = s log2(e)``), the running max ``m``,
``l = sum 2^(t - m)`` and ``a = sum 2^(t - m) (t - m)``. ``a`` is kept relative to ``m``
(rescaled as ``a <- 2^(m - m') (a + l (m - m'))`` when the max moves) so that the finish
``H = ln 2 (log2 l - a / l)`` does not cancel ``lse`` against ``sum p s``, both large.

Work layout (GPU):

- ``log2(e)`` is folded into the score scale on the host, so the exponentials are ``exp2``
  (one ``ex2`` instruction each) and the scores need one multiply.
- Key blocks come in three ranges: blocks that every query of the block sees (no mask: below
  the causal diagonal, inside the window and the packed sequence of every query), and the
  boundary blocks before and after them (the causal diagonal, the window's far edge,
  sequence edges, the tail past ``T``), which build the full ``[BLOCK_M, BLOCK_N]``
  visibility mask.
- A padding mask (``key_valid``) comes with each batch row's span, ``key_span``: the first
  valid key, one past the last, and whether every key between them is valid. No block
  outside the span is visited, and the blocks across its ends are boundary blocks. Where
  the span is whole (left or right padding) the wholly visible blocks run as without a mask;
  a row with holes takes one select per score there.
- An invisible key's score becomes ``-2e30`` (``m`` starts at ``-1e30`` and never falls), so
  its weight ``2^(t - m)`` is 0 and so is its share of ``a``, in one select and whatever the
  score was: no ``-inf`` times 0 to guard against.
- One 1-D grid of ``cdiv(T, BLOCK_M) * B * Hq`` programs (grid dimension 0 holds up to
  ``2^31 - 1``, so any ``B * Hq`` works); query blocks are handed out last block first, the
  heaviest under a causal mask, so the short ones fill the tail of the schedule; the heads
  of one query block are neighbours, so a GQA group's key blocks are read while in L2.
- One block configuration per (head dim, dtype) from ``block_config``, no autotuning (which
  would time every new shape inside the training step and could pick a different reduction
  order from run to run). Checked for register spills by ``tests/kernels``' sm_90 compile
  tests.

Key blocks outside the causal diagonal, the sliding window or the packed sequences of the
block's queries are not visited. Blocks whose queries are all unselected (``query_valid``)
visit nothing and write 0. A selected query that sees a NaN score gets NaN (``l`` is NaN;
``l != 0`` keeps it). Scores accumulate in fp32 from fp32/bf16/fp16 inputs; offsets are
int64. The visibility contract is the one documented in ``attention_entropy_torch.py``; no
libdevice calls (tanh is built from ``exp2``), so the kernel runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["BlockConfig", "attention_entropy_triton", "block_config"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


class BlockConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# (BLOCK_M, BLOCK_N, warps, stages) per padded head dim, for 16-bit inputs (wgmma tiles) and
# for fp32 (IEEE products: no tensor cores, the [BLOCK_M, BLOCK_D] and [BLOCK_D, BLOCK_N]
# operands live in registers, so the tiles are smaller). BLOCK_M is a multiple of BLOCK_N.
_CONFIGS_16 = {
    16: BlockConfig(128, 64, 8, 3),
    32: BlockConfig(128, 64, 8, 3),
    64: BlockConfig(128, 64, 8, 3),
    128: BlockConfig(128, 64, 8, 3),
    256: BlockConfig(128, 32, 8, 2),
}
_CONFIGS_32 = {
    16: BlockConfig(32, 32, 8, 2),
    32: BlockConfig(32, 32, 8, 2),
    64: BlockConfig(32, 32, 8, 2),
    128: BlockConfig(32, 16, 8, 1),
    256: BlockConfig(32, 32, 8, 1),
}
# The interpreter runs programs one by one in numpy: small blocks keep tests short while a
# T of a few dozen already spans several key blocks and several boundary blocks per query
# block; tests pass other configs (BLOCK_M = 2 BLOCK_N, 4 BLOCK_N) through `config=`.
_INTERPRET_CONFIG = BlockConfig(32, 32, 4, 1)


def padded_head_dim(d: int) -> int:
    """The ``BLOCK_D`` that holds head dim ``d`` (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(d))


def block_config(head_dim: int, dtype: torch.dtype, interpret: bool = False) -> BlockConfig:
    """The launch configuration for a head dim and input dtype (fixed, no autotuning)."""
    if interpret:
        return _INTERPRET_CONFIG
    block_d = padded_head_dim(head_dim)
    if block_d > 256:
        raise ValueError(
            f"q must have a head dim of at most 256 on the Triton path, got {head_dim}"
        )
    table = _CONFIGS_32 if dtype == torch.float32 else _CONFIGS_16
    return table[block_d]


@triton.jit
def _scores(q, kt, qk_scale, cap2, HAS_SOFTCAP: tl.constexpr):
    """Scores of a tile in base-2 units, ``log2(e) * s``, fp32."""
    # "ieee": fp32 inputs keep full precision (TF32 would cost ~1e-3 relative on the scores);
    # bf16/fp16 inputs are exact in the fp32 accumulator either way.
    x = tl.dot(q, kt, input_precision="ieee") * qk_scale
    if HAS_SOFTCAP:
        # log2(e) cap tanh(s / cap); x = 2 log2(e) s / cap here, so e = e^(-2|s / cap|) <= 1
        # never overflows and (1 - e) / (1 + e) keeps precision near 0.
        e = tl.exp2(-tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        x = cap2 * tl.where(x < 0, -th, th)
    return x


@triton.jit
def _visit(
    q, k_base, m, l, a, start_n, offs_m, offs_d, d_ok, seg_lo, seg_hi, KEY_VALID, row0,
    stride_kt, stride_kd, T, qk_scale, cap2, key_floor, window,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KEY_VALID: tl.constexpr,
    FOLD_SCALE: tl.constexpr, EVEN_D: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold key block ``[start_n, start_n + BLOCK_N)`` into ``(m, l, a)``. Unmasked blocks
    (``MASKED`` False) are wholly visible to every query of the block, up to the padding
    mask; masked ones build the full visibility tile.

    A key the query cannot see gets the score ``-2e30`` (in base-2 units) by one select: ``m``
    never falls below ``-1e30``, so its shift is at most ``-1e30``, its ``2^shift`` is 0 and
    so is its share ``2^shift * shift`` of ``a``, whatever its score was (inf or NaN garbage
    in padding included). No second select, and no ``-inf`` times 0."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kt_ptrs = k_base + offs_n[None, :].to(tl.int64) * stride_kt + offs_d[:, None] * stride_kd
    if MASKED:
        col_ok = offs_n < T
        kt = tl.load(kt_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0)
    elif EVEN_D:
        kt = tl.load(kt_ptrs)
    else:
        kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
    if UPCAST_DOT:
        # The interpreter stores bf16 as uint16 and would multiply the raw bits; exact fp32
        # copies give the product a GPU forms with fp32 accumulation.
        kt = kt.to(tl.float32)
    if MASKED:
        t = _scores(q, kt, qk_scale, cap2, HAS_SOFTCAP)
        vis = col_ok[None, :] & (offs_m[:, None] >= 0)
        if HAS_KEY_VALID:
            kv = tl.load(KEY_VALID + row0 + offs_n, mask=col_ok, other=0)
            vis = vis & (kv[None, :] != 0)
        if HAS_SEG:
            vis = vis & (offs_n[None, :] >= seg_lo[:, None]) & (offs_n[None, :] < seg_hi[:, None])
        if IS_CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            vis = vis & (offs_m[:, None] - offs_n[None, :] < window)
            if not IS_CAUSAL:
                vis = vis & (offs_n[None, :] - offs_m[:, None] < window)
        t = tl.where(vis, t, -2.0e30)
        m_new = tl.maximum(m, tl.max(t, axis=1))
        shifted = t - m_new[:, None]
    elif HAS_SOFTCAP or not FOLD_SCALE:
        t = _scores(q, kt, qk_scale, cap2, HAS_SOFTCAP)
        if HAS_KEY_VALID:
            kv = tl.load(KEY_VALID + row0 + offs_n) != 0
            t = tl.where(kv[None, :], t, -2.0e30)
        m_new = tl.maximum(m, tl.max(t, axis=1))
        shifted = t - m_new[:, None]
    else:
        # The scale is folded into the shift: max(s x) = s max(x) exactly (s > 0, rounding
        # is monotone), and x s - m' is one FMA per score, not a product and a difference.
        # ``key_floor`` is -2e30 / s: the invisible score before the scale.
        t = tl.dot(q, kt, input_precision="ieee")
        if HAS_KEY_VALID:
            kv = tl.load(KEY_VALID + row0 + offs_n) != 0
            t = tl.where(kv[None, :], t, key_floor)
        m_new = tl.maximum(m, tl.max(t, axis=1) * qk_scale)
        shifted = t * qk_scale - m_new[:, None]
    p = tl.exp2(shifted)
    alpha = tl.exp2(m - m_new)
    a = alpha * (a + l * (m - m_new)) + tl.sum(p * shifted, axis=1)
    l = alpha * l + tl.sum(p, axis=1)
    return m_new, l, a


@triton.jit
def _attention_entropy_fwd(
    Q, K, OUT, SEG_START, SEG_END, KEY_VALID, QUERY_VALID, KEY_SPAN,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    T, HQ, BH, GROUP, D, qk_scale, cap2, key_floor, window,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr,
    HAS_QUERY_VALID: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # 1-D grid: the query block varies slowest and runs last block first.
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    pid_m = num_m - 1 - pid // BH
    pid_bh = pid % BH
    b = (pid_bh // HQ).to(tl.int64)
    h = (pid_bh % HQ).to(tl.int64)
    hk = h // GROUP
    row0 = b * T  # start of this batch row in the [B, T] side arrays

    first = pid_m * BLOCK_M
    last = tl.minimum(first + BLOCK_M, T) - 1
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < D

    q_ptrs = (
        Q
        + b * stride_qb
        + h * stride_qh
        + offs_m[:, None].to(tl.int64) * stride_qt
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # [lo, hi): the keys some query of the block may see; [full_lo, full_hi): those every
    # query of the block sees (up to the padding mask).
    lo = first * 0
    hi = T + first * 0
    full_lo = lo
    full_hi = hi
    seg_lo = offs_m
    seg_hi = offs_m
    if HAS_SEG:
        # Segment bounds are non-decreasing along the row: the first query has the lowest,
        # the last the highest.
        lo = tl.load(SEG_START + row0 + first).to(tl.int32)
        hi = tl.load(SEG_END + row0 + last).to(tl.int32)
        full_lo = tl.load(SEG_START + row0 + last).to(tl.int32)
        full_hi = tl.load(SEG_END + row0 + first).to(tl.int32)
        seg_lo = tl.load(SEG_START + row0 + offs_m, mask=row_ok, other=0)
        seg_hi = tl.load(SEG_END + row0 + offs_m, mask=row_ok, other=0)
    if IS_CAUSAL:
        hi = tl.minimum(hi, last + 1)
        full_hi = tl.minimum(full_hi, first + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, first - window + 1)
        full_lo = tl.maximum(full_lo, last - window + 1)
        if not IS_CAUSAL:
            hi = tl.minimum(hi, last + window)
            full_hi = tl.minimum(full_hi, first + window)
    contiguous = lo == lo  # True (a runtime scalar) unless the padding mask says otherwise
    if HAS_KEY_VALID:
        # The row's valid keys lie in [span_lo, span_hi): no block outside is visited, and
        # the blocks that straddle its ends are boundary blocks. Where the valid keys fill
        # the span (left or right padding: ``contiguous``), the wholly visible blocks need no
        # per-key select.
        span_lo = tl.load(KEY_SPAN + 3 * b)
        span_hi = tl.load(KEY_SPAN + 3 * b + 1)
        contiguous = tl.load(KEY_SPAN + 3 * b + 2) != 0
        lo = tl.maximum(lo, span_lo)
        hi = tl.minimum(hi, span_hi)
        full_lo = tl.maximum(full_lo, span_lo)
        full_hi = tl.minimum(full_hi, span_hi)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    # No whole block visible to all: every block is a boundary block.
    some_full = full_lo < full_hi
    full_lo = tl.where(some_full, full_lo, lo)
    full_hi = tl.where(some_full, full_hi, lo)
    row_sel = row_ok
    if HAS_QUERY_VALID:
        row_sel = row_sel & (tl.load(QUERY_VALID + row0 + offs_m, mask=row_ok, other=0) != 0)
        # A block with no selected query visits no key.
        any_sel = tl.max(row_sel.to(tl.int32), axis=0) > 0
        hi = tl.where(any_sel, hi, lo)
        full_lo = tl.where(any_sel, full_lo, lo)
        full_hi = tl.where(any_sel, full_hi, lo)

    # Finite "minus infinity" for m: 2^(m - m') and l (m - m') stay 0, not NaN, while a row
    # has seen no key.
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    a = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh
    # The key ranges in order. 0: the leading boundary blocks (window, sequence or span
    # start); 1: the wholly visible blocks of a row whose valid keys fill its span, or with
    # no padding mask (no select); 2: those of a row with holes in its mask (a select per
    # score); 3: the trailing boundary blocks (diagonal, ends, tail). Ranges 0 and 3 build
    # the visibility tile.
    mid = tl.where(contiguous, full_hi, full_lo)
    for phase in tl.static_range(4):
        if phase == 0:
            start, end = lo, full_lo
        elif phase == 1:
            start, end = full_lo, mid
        elif phase == 2:
            start, end = mid, full_hi
        else:
            start, end = full_hi, hi
        if phase != 2 or HAS_KEY_VALID:
            for start_n in range(start, end, BLOCK_N):
                m, l, a = _visit(
                    q, k_base, m, l, a, start_n, offs_m, offs_d, d_ok, seg_lo, seg_hi,
                    KEY_VALID, row0, stride_kt, stride_kd, T, qk_scale, cap2, key_floor,
                    window, phase % 3 == 0, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_SEG,
                    HAS_KEY_VALID and phase != 1, FOLD_SCALE, EVEN_D, UPCAST_DOT, BLOCK_N,
                )

    seen = row_sel & (l != 0)  # a NaN l (the row saw a NaN) stays NaN
    l_safe = tl.where(seen, l, 1.0)
    ent = tl.where(seen, 0.6931471805599453 * (tl.log2(l_safe) - a / l_safe), 0.0)
    tl.store(OUT + pid_bh.to(tl.int64) * T + offs_m, ent, mask=row_ok)


def grid_size(b: int, hq: int, t: int, block_m: int) -> tuple[int]:
    """The 1-D launch grid: one program per (query block, batch row, query head)."""
    return (triton.cdiv(t, block_m) * b * hq,)


def kernel_scalars(scale: float, softcap: float | None) -> tuple[float, float]:
    """``(qk_scale, cap2)``: the dot product's multiplier and the softcap's, with log2(e)
    folded in (and the softcap's tanh argument doubled, as its exp2 form needs)."""
    if softcap is None:
        return scale * _LOG2E, 1.0
    return 2.0 * _LOG2E * scale / softcap, _LOG2E * softcap


def key_span(key_valid: torch.Tensor) -> torch.Tensor:
    """Per batch row of ``key_valid`` ``[B, T]``, int32 ``[B, 3]``: the first valid key, one
    past the last, and 1 where every key between them is valid (0 otherwise, and for a row
    with no valid key, whose span is empty). A few small device ops, no host read."""
    valid = key_valid != 0
    t = valid.shape[1]
    idx = torch.arange(t, device=valid.device, dtype=torch.int32)
    first = torch.where(valid, idx, t).amin(1)
    end = torch.where(valid, idx + 1, 0).amax(1)
    contiguous = valid.sum(1, dtype=torch.int32) == end - first
    return torch.stack([first, end, contiguous.to(torch.int32)], 1)


def attention_entropy_triton(
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
    config: BlockConfig | None = None,
) -> torch.Tensor:
    """Attention entropy per query, fp32 ``[B, Hq, T]``, by the Triton kernel.

    q ``[B, Hq, T, d]``, k ``[B, Hk, T, d]`` (any strides, same dtype); seg_start / seg_end int
    ``[B, T]``, key_valid / query_valid ``[B, T]``, contiguous (the caller normalises them).
    ``config`` overrides ``block_config`` (tests).
    """
    b, hq, t, d = q.shape
    hk = k.shape[1]
    out = torch.empty(b, hq, t, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if config is None:
        config = block_config(d, q.dtype, interpret)
    block_d = padded_head_dim(d)
    qk_scale, cap2 = kernel_scalars(float(scale), softcap)
    span = None if key_valid is None else key_span(key_valid)
    # Folding the scale into the shift takes the invisible score -2e30 / qk_scale, finite in
    # fp32 for qk_scale >= 1e-8; below that (no real model's scale) the scores are scaled first.
    fold = softcap is None and qk_scale >= 1e-8
    key_floor = -2.0e30 / qk_scale if fold else -2.0e30
    _attention_entropy_fwd[grid_size(b, hq, t, config.block_m)](
        q, k, out, seg_start, seg_end, key_valid, query_valid, span,
        *q.stride(), *k.stride(),
        t, hq, b * hq, hq // hk, d, qk_scale, cap2, key_floor,
        int(window) if window is not None else 0,
        IS_CAUSAL=causal,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SEG=seg_start is not None,
        HAS_KEY_VALID=key_valid is not None,
        HAS_QUERY_VALID=query_valid is not None,
        FOLD_SCALE=fold,
        EVEN_D=block_d == d,
        UPCAST_DOT=interpret and q.dtype == torch.bfloat16,
        BLOCK_D=block_d,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
