"""Flash-style attention entropy: per query block, stream key blocks, never store ``T x T``.

Each program owns ``BLOCK_M`` queries of one (batch row, query head) and walks the key blocks
they can see, keeping per query the running max ``m``, ``l = sum e^(s - m)`` and
``a = sum e^(s - m) (s - m)``. ``a`` is kept relative to ``m`` (rescaled as
``a <- e^(m - m') (a + l (m - m'))`` when the max moves) so that the finish
``H = log l - a / l`` does not cancel ``lse`` against ``sum p s``, which are both large.

Key blocks above the causal diagonal, outside the sliding window, or outside the packed
sequences of the block's queries are not visited. Blocks whose queries are all unselected
(``query_valid``) visit nothing and write 0. Scores ``s = scale * q.k`` accumulate in fp32 from
fp32/bf16/fp16 inputs; offsets are int64. The visibility contract is the one documented in
``attention_entropy_torch.py``; no libdevice calls (tanh is built from ``exp``), so the kernel
runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["attention_entropy_triton"]


def _configs() -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter runs programs one by one in numpy: one config, blocks big enough to
        # keep the Python loop short and small enough to exercise several key blocks in tests.
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in [
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 4, 3),
            (128, 64, 8, 3),
            (128, 32, 4, 3),
            (128, 128, 8, 2),
            (64, 128, 4, 2),
        ]
    ]


@triton.autotune(configs=_configs(), key=["T_BUCKET", "BLOCK_D", "IS_CAUSAL", "HAS_WINDOW"])
@triton.heuristics(
    {
        "HAS_SEG": lambda args: args["SEG_START"] is not None,
        "HAS_KEY_VALID": lambda args: args["KEY_VALID"] is not None,
        "HAS_QUERY_VALID": lambda args: args["QUERY_VALID"] is not None,
    }
)
@triton.jit
def _attention_entropy_fwd(
    Q,
    K,
    OUT,
    SEG_START,
    SEG_END,
    KEY_VALID,
    QUERY_VALID,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    T,
    HQ,
    GROUP,
    D,
    scale,
    softcap,
    window,
    T_BUCKET,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr,
    HAS_QUERY_VALID: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
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

    # The key range [lo, hi) that some query of this block may see.
    lo = first * 0
    hi = T + first * 0
    if HAS_SEG:
        lo = tl.load(SEG_START + row0 + first).to(tl.int32)
        hi = tl.load(SEG_END + row0 + last).to(tl.int32)
        seg_lo = tl.load(SEG_START + row0 + offs_m, mask=row_ok, other=0)
        seg_hi = tl.load(SEG_END + row0 + offs_m, mask=row_ok, other=0)
    if IS_CAUSAL:
        hi = tl.minimum(hi, last + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, first - window + 1)
        if not IS_CAUSAL:
            hi = tl.minimum(hi, last + window)
    row_sel = row_ok
    if HAS_QUERY_VALID:
        row_sel = row_sel & (tl.load(QUERY_VALID + row0 + offs_m, mask=row_ok, other=0) != 0)
        # A block with no selected query visits no key.
        hi = tl.where(tl.max(row_sel.to(tl.int32), axis=0) > 0, hi, lo)
    lo = (lo // BLOCK_N) * BLOCK_N

    # Finite "minus infinity" for m: e^(m - m') and l (m - m') stay 0, not NaN, while a row
    # has seen no key.
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    a = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < T
        # K^T tile [BLOCK_D, BLOCK_N]
        kt_ptrs = k_base + offs_n[None, :].to(tl.int64) * stride_kt + offs_d[:, None] * stride_kd
        kt = tl.load(kt_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST_DOT:
            # The interpreter stores bf16 as uint16 and would multiply the raw bits; exact fp32
            # copies give the product a GPU forms with fp32 accumulation.
            kt = kt.to(tl.float32)
        # "ieee": fp32 inputs keep full precision (TF32 would cost ~1e-3 relative on the
        # scores); bf16/fp16 inputs are exact in the fp32 accumulator either way.
        s = tl.dot(q, kt, input_precision="ieee") * scale
        if HAS_SOFTCAP:
            # cap * tanh(s / cap) with tanh from exp (no libdevice under the interpreter):
            # e = e^(-2|x|) <= 1 never overflows, and (1 - e) / (1 + e) keeps precision near 0.
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -t, t)
        vis = row_ok[:, None] & col_ok[None, :]
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
        s_vis = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s_vis, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s_vis - m_new[:, None])
        # where, not p * (s - m'): a key the row cannot see must not matter even if its score
        # is inf or NaN (garbage in padding).
        shifted = tl.where(vis, s - m_new[:, None], 0.0)
        a = alpha * (a + l * (m - m_new)) + tl.sum(p * shifted, axis=1)
        l = alpha * l + tl.sum(p, axis=1)
        m = m_new

    seen = row_sel & (l != 0)  # a NaN l (the row saw a NaN) stays NaN
    l_safe = tl.where(seen, l, 1.0)
    ent = tl.where(seen, tl.log(l_safe) - a / l_safe, 0.0)
    tl.store(OUT + pid_bh.to(tl.int64) * T + offs_m, ent, mask=row_ok)


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
) -> torch.Tensor:
    """Attention entropy per query, fp32 ``[B, Hq, T]``, by the Triton kernel.

    q ``[B, Hq, T, d]``, k ``[B, Hk, T, d]`` (any strides, same dtype); seg_start / seg_end int
    ``[B, T]``, key_valid / query_valid ``[B, T]``, contiguous (the caller normalises them).
    """
    b, hq, t, d = q.shape
    hk = k.shape[1]
    out = torch.empty(b, hq, t, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))

    def grid(meta):
        return (triton.cdiv(t, meta["BLOCK_M"]), b * hq)

    _attention_entropy_fwd[grid](
        q,
        k,
        out,
        seg_start,
        seg_end,
        key_valid,
        query_valid,
        *q.stride(),
        *k.stride(),
        t,
        hq,
        hq // hk,
        d,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(window) if window is not None else 0,
        triton.next_power_of_2(t),
        IS_CAUSAL=causal,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        UPCAST_DOT=os.environ.get("TRITON_INTERPRET") == "1" and q.dtype == torch.bfloat16,
        BLOCK_D=block_d,
    )
    return out
