"""Segmented reductions and scans over right-padded ``[B, T]`` and packed ``[N]`` batches.

Layouts (the contract of the torch twin ``kernels/segments_torch.py``, these kernels' oracle):
a padded ``x [B, T]`` with ``mask [B, T]`` (any strides), or a packed ``x [N]`` with
``mask [N]`` and ``cu_seqlens [B + 1]`` (int32/int64, flash-attention layout). Masked tokens add
nothing to sums and are skipped by max/min; scans write every position, masked ones included.

Design. One program owns ``BLOCK_B`` sequences and walks their tokens in ``[BLOCK_B, BLOCK_T]``
tiles, carrying the running sum / count / max / (min, arg-min) per sequence from tile to tile,
so every op is one launch whatever ``T`` and reads each token once. Packed sequences of one
program may differ in length: the walk runs to the longest, shorter rows are masked off. The
lengths are read on the device (no host synchronisation, no ``L_max``). Sums accumulate in
fp32 (bf16/fp16/fp32 inputs) or fp64 (fp64 inputs, kept so that ``gradcheck`` can run on the
autograd functions); results are stored in the input dtype, as the torch twins return them.
Offsets are int64. No libdevice calls, so everything runs under ``TRITON_INTERPRET=1``.

Block sizes come from a heuristic on the mean sequence length, not from autotuning: these
kernels are bound by launch latency and memory, and autotuning would benchmark (and
synchronise the host) the first time each shape bucket appears, inside the training step.
A packed program walks to its longest sequence, so one very long sequence among short ones
costs its neighbours masked lanes. NaN inputs to max/min: unspecified (torch propagates them).

Launchers (no autograd here; ``fused_losses/objectives/segments.py`` builds the Functions):
``segment_reduce`` (sum, mean, max with its tie count, count), ``segment_scan`` (prefix or
suffix sum, inclusive or exclusive prefix min with its arg-min index) and ``segment_spread``
(per-sequence values written at every token, optionally masked, divided by a count, or kept
only where ``x`` equals a per-sequence reference: the backward of the reductions).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["segment_reduce", "segment_scan", "segment_spread"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Reduction and scan selectors (constexpr).
OP_SUM, OP_MEAN, OP_MAX, OP_COUNT, OP_MIN = 0, 1, 2, 3, 4
_REDUCE_OPS = {"sum": OP_SUM, "mean": OP_MEAN, "max": OP_MAX, "count": OP_COUNT}


def launch_blocks(mean_length: int) -> tuple[int, int, int]:
    """``(BLOCK_B, BLOCK_T, num_warps)`` for sequences of about ``mean_length`` tokens."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter runs programs one by one in numpy: small tiles so that tests cross
        # several token blocks and several sequences per program at small sizes.
        return 4, 16, 1
    # About 2-4k elements per tile: long sequences get a program each, short ones share one.
    block_t = min(max(triton.next_power_of_2(max(mean_length, 1)), 32), 2048)
    block_b = max(1, min(64, 2048 // block_t))
    return block_b, block_t, 8 if block_t >= 2048 else 4


@triton.jit
def _rows(pid, B, T, CU, BLOCK_B: tl.constexpr, PACKED: tl.constexpr):
    """Sequence ids of this program, their first packed token (0 when padded), their lengths."""
    rows = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = rows < B
    if PACKED:
        start = tl.load(CU + rows, mask=live, other=0).to(tl.int64)
        length = tl.load(CU + rows + 1, mask=live, other=0).to(tl.int64) - start
    else:
        start = tl.zeros([BLOCK_B], dtype=tl.int64)
        length = tl.where(live, T, 0).to(tl.int64)
    return rows, start, length


@triton.jit
def _row_base(rows, start, stride_b, stride_t, PACKED: tl.constexpr):
    """Element offset of each sequence's first token in a tensor with these strides."""
    if PACKED:
        return start * stride_t
    return rows * stride_b


@triton.jit
def _min_last(v1, i1, v2, i2):
    # Ties go to the later index, as torch.cummin, so the gradient lands on the same token.
    take = v2 <= v1
    return tl.where(take, v2, v1), tl.where(take, i2, i1)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _segment_reduce_kernel(
    X, M, CU, OUT, CNT,
    B, T,
    stride_xb, stride_xt, stride_mb, stride_mt,
    empty,
    OP: tl.constexpr, HAS_MASK: tl.constexpr, PACKED: tl.constexpr, FP64: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows, start, length = _rows(tl.program_id(0), B, T, CU, BLOCK_B, PACKED)
    x_base = _row_base(rows, start, stride_xb, stride_xt, PACKED)
    m_base = _row_base(rows, start, stride_mb, stride_mt, PACKED)
    acc_t = tl.float64 if FP64 else tl.float32
    if OP == 2:
        acc = tl.full([BLOCK_B], float("-inf"), acc_t)
    else:
        acc = tl.zeros([BLOCK_B], dtype=acc_t)
    # sum/mean/count: valid tokens so far; max: valid tokens equal to the running max.
    cnt = tl.zeros([BLOCK_B], dtype=tl.int64)
    for i in range(0, tl.cdiv(tl.max(length, axis=0), BLOCK_T)):
        pos = i * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        ok = pos[None, :] < length[:, None]
        if HAS_MASK:
            m = tl.load(M + m_base[:, None] + pos[None, :] * stride_mt, mask=ok, other=0)
            ok = ok & (m != 0)
        x_ptr = X + x_base[:, None] + pos[None, :] * stride_xt
        if OP == 2:
            x = tl.load(x_ptr, mask=ok, other=float("-inf")).to(acc_t)
            new = tl.maximum(acc, tl.max(x, axis=1))
            ties = tl.sum((ok & (x == new[:, None])).to(tl.int64), axis=1)
            cnt = tl.where(acc == new, cnt, 0) + ties
            acc = new
        else:
            if OP != 3:
                acc += tl.sum(tl.load(x_ptr, mask=ok, other=0.0).to(acc_t), axis=1)
            if OP != 0:
                cnt += tl.sum(ok.to(tl.int64), axis=1)
    live = rows < B
    if OP == 0:
        tl.store(OUT + rows, acc, mask=live)
    elif OP == 1:
        tl.store(OUT + rows, acc / tl.maximum(cnt, 1).to(acc_t), mask=live)
        tl.store(CNT + rows, cnt, mask=live)
    elif OP == 2:
        tl.store(OUT + rows, tl.where(cnt > 0, acc, empty), mask=live)
        tl.store(CNT + rows, cnt, mask=live)
    else:
        tl.store(OUT + rows, cnt, mask=live)


@triton.jit
def _segment_scan_kernel(
    X, M, CU, OUT, IDX,
    B, T,
    stride_xb, stride_xt, stride_mb, stride_mt, stride_ob,
    OP: tl.constexpr, REVERSE: tl.constexpr, EXCLUSIVE: tl.constexpr,
    MASK_IN: tl.constexpr, MASK_OUT: tl.constexpr, WANT_INDEX: tl.constexpr,
    PACKED: tl.constexpr, FP64: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows, start, length = _rows(tl.program_id(0), B, T, CU, BLOCK_B, PACKED)
    x_base = _row_base(rows, start, stride_xb, stride_xt, PACKED)
    m_base = _row_base(rows, start, stride_mb, stride_mt, PACKED)
    o_base = _row_base(rows, start, stride_ob, 1, PACKED)
    acc_t = tl.float64 if FP64 else tl.float32
    if OP == 4:
        carry = tl.full([BLOCK_B], float("inf"), acc_t)
    else:
        carry = tl.zeros([BLOCK_B], dtype=acc_t)
    carry_idx = tl.full([BLOCK_B], -1, tl.int64)
    col = tl.arange(0, BLOCK_T)
    for i in range(0, tl.cdiv(tl.max(length, axis=0), BLOCK_T)):
        # k-th token of the walk: from the start, or from the end for a suffix scan, so one
        # forward cumsum serves both and every row of the tile ends its walk at its own length.
        k = i * BLOCK_T + col.to(tl.int64)
        live = k[None, :] < length[:, None]
        if REVERSE:
            pos = length[:, None] - 1 - k[None, :]
        else:
            pos = k[None, :] + tl.zeros([BLOCK_B, 1], dtype=tl.int64)
        # An exclusive scan reads each column's predecessor: the inclusive scan of the shifted
        # sequence, with nothing before the first token.
        src = pos - 1 if EXCLUSIVE else pos
        take = live & (src >= 0)
        if MASK_IN:
            m = tl.load(M + m_base[:, None] + src * stride_mt, mask=take, other=0)
            take = take & (m != 0)
        x_ptr = X + x_base[:, None] + src * stride_xt
        if OP == 4:
            v = tl.load(x_ptr, mask=take, other=float("inf")).to(acc_t)
            v = tl.where(take, v, float("inf"))
            if WANT_INDEX:
                # Packed: index into x; padded: position in the row.
                j = tl.where(take, src + start[:, None], -1)
                v, j = tl.associative_scan((v, j), 1, _min_last)
                # The carry comes from earlier tokens: it wins only when strictly smaller.
                keep = carry[:, None] < v
                v = tl.where(keep, carry[:, None], v)
                j = tl.where(keep, carry_idx[:, None], j)
                last = col[None, :] == BLOCK_T - 1
                carry_idx = tl.sum(tl.where(last, j, 0), axis=1)
                tl.store(IDX + o_base[:, None] + pos, j, mask=live)
            else:
                v = tl.minimum(tl.associative_scan(v, 1, _min), carry[:, None])
            carry = tl.min(v, axis=1)
            y = v
        else:
            x = tl.load(x_ptr, mask=take, other=0.0).to(acc_t)
            y = tl.cumsum(x, axis=1) + carry[:, None]
            # The next block's carry is this block's last prefix, read off y (exact: one
            # nonzero term). `carry += tl.sum(x)` would be the same sum, but triton 3.6.0's
            # thread-locality pass asserts on a loop-carried reduction with a second use.
            carry = tl.sum(tl.where(col[None, :] == BLOCK_T - 1, y, 0.0), axis=1)
        if MASK_OUT:
            m_out = tl.load(M + m_base[:, None] + pos * stride_mt, mask=live, other=0)
            y = tl.where(m_out != 0, y, 0.0)
        tl.store(OUT + o_base[:, None] + pos, y, mask=live)


@triton.jit
def _segment_spread_kernel(
    V, CNT, X, REF, M, CU, OUT,
    B, T,
    stride_xb, stride_xt, stride_mb, stride_mt, stride_ob,
    HAS_CNT: tl.constexpr, HAS_REF: tl.constexpr, HAS_MASK: tl.constexpr,
    PACKED: tl.constexpr, FP64: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows, start, length = _rows(tl.program_id(0), B, T, CU, BLOCK_B, PACKED)
    live_row = rows < B
    acc_t = tl.float64 if FP64 else tl.float32
    v = tl.load(V + rows, mask=live_row, other=0.0).to(acc_t)
    if HAS_CNT:
        v = v / tl.maximum(tl.load(CNT + rows, mask=live_row, other=1), 1).to(acc_t)
    if HAS_REF:
        ref = tl.load(REF + rows, mask=live_row, other=0.0).to(acc_t)
        x_base = _row_base(rows, start, stride_xb, stride_xt, PACKED)
    m_base = _row_base(rows, start, stride_mb, stride_mt, PACKED)
    o_base = _row_base(rows, start, stride_ob, 1, PACKED)
    for i in range(0, tl.cdiv(tl.max(length, axis=0), BLOCK_T)):
        pos = i * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        live = pos[None, :] < length[:, None]
        keep = live
        if HAS_MASK:
            m = tl.load(M + m_base[:, None] + pos[None, :] * stride_mt, mask=live, other=0)
            keep = keep & (m != 0)
        if HAS_REF:
            x = tl.load(X + x_base[:, None] + pos[None, :] * stride_xt, mask=live, other=0.0)
            keep = keep & (x.to(acc_t) == ref[:, None])
        y = tl.where(keep, v[:, None], 0.0)
        tl.store(OUT + o_base[:, None] + pos[None, :], y, mask=live)


def _layout(x: torch.Tensor, cu_seqlens: torch.Tensor | None, name: str = "x"):
    """``(B, T, packed, strides of x)``; raises on a shape the kernels do not take."""
    b, t, packed = _shape_layout(x.shape, x.device, cu_seqlens, name)
    return b, t, packed, ((0, x.stride(0)) if packed else (x.stride(0), x.stride(1)))


def _shape_layout(shape, device, cu_seqlens, name):
    if cu_seqlens is None:
        if len(shape) != 2:
            raise ValueError(f"{name} must be [B, T] without cu_seqlens, got {tuple(shape)}")
        return shape[0], shape[1], False
    if len(shape) != 1:
        raise ValueError(f"{name} must be packed [N] with cu_seqlens, got {tuple(shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be [B + 1], got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, {name} on {device}")
    return cu_seqlens.numel() - 1, shape[0], True


def _mask_arg(mask: torch.Tensor | None, like: torch.Tensor):
    """The mask as bytes (nonzero = valid, the ``mask.bool()`` of the torch twin) and strides."""
    if mask is None:
        return None, (0, 0)
    if mask.shape != like.shape:
        raise ValueError(f"mask must have the shape of x {tuple(like.shape)}, got "
                         f"{tuple(mask.shape)}")
    if mask.device != like.device:
        raise ValueError(f"mask is on {mask.device}, x on {like.device}")
    m = mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
    strides = (m.stride(0), m.stride(1)) if m.dim() == 2 else (0, m.stride(0))
    return m, strides


def _check_float(x: torch.Tensor, name: str = "x") -> None:
    if x.dtype not in _FLOATS:
        raise ValueError(f"{name} must be fp32, bf16, fp16 or fp64, got {x.dtype}")


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    # The interpreter truncates fp32 -> bf16 on store (the compiled kernel rounds to nearest
    # even): there the kernels write fp32 and torch rounds, so tests see the GPU's rounding.
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return torch.float32
    return dtype


def _grid(b: int, block_b: int) -> tuple[int]:
    return (triton.cdiv(b, block_b),)


def segment_reduce(x: torch.Tensor, mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                   op: str, *, empty: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sequence reduction of ``x [B, T]`` or packed ``x [N]``: ``(out [B], count [B])``.

    ``op``: ``sum`` (``sum_t m x``), ``mean`` (``sum_t m x / max(L, 1)``, ``count`` = ``L``),
    ``max`` (over valid tokens, ``empty`` where none; ``count`` = how many valid tokens equal the
    max, for the tie-splitting backward), ``count`` (``out`` = ``L`` int64, ``x`` unused beyond
    its shape). ``out`` has ``x``'s dtype (int64 for ``count``); ``count`` is int64 or None.
    ``mask`` None means every token is valid.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    code = _REDUCE_OPS[op]
    if code != OP_COUNT:
        _check_float(x)
    b, t, packed, (sxb, sxt) = _layout(x, cu_seqlens)
    m, (smb, smt) = _mask_arg(mask, x)
    out_dtype = torch.int64 if code == OP_COUNT else x.dtype
    out = torch.empty(b, dtype=_store_dtype(out_dtype), device=x.device)
    cnt = torch.empty(b, dtype=torch.int64, device=x.device) if code in (OP_MEAN, OP_MAX) else None
    if b == 0:
        return out.to(out_dtype), cnt
    block_b, block_t, warps = launch_blocks(t // b if packed else t)
    _segment_reduce_kernel[_grid(b, block_b)](
        x, m, cu_seqlens, out, cnt, b, t, sxb, sxt, smb, smt, float(empty),
        OP=code, HAS_MASK=m is not None, PACKED=packed, FP64=x.dtype == torch.float64,
        BLOCK_B=block_b, BLOCK_T=block_t, num_warps=warps,
    )
    return out.to(out_dtype), cnt


def segment_scan(x: torch.Tensor, mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                 op: str, *, exclusive: bool = False, mask_output: bool = False,
                 want_index: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sequence scan of ``x [B, T]`` or packed ``x [N]``: ``(out like x, index or None)``.

    ``op``: ``prefix_sum`` (``sum_{j<=t} m_j x_j``), ``suffix_sum`` (``sum_{j>=t} m_j x_j``),
    ``prefix_min`` (``min(x_j : m_j, j <= t)``, ``j < t`` when ``exclusive``; ``+inf`` if none).
    With ``mask_output`` the mask zeroes the output instead of the input (``m_t * scan(x)_t``,
    the backward of the sums). ``want_index`` (prefix_min) also returns the arg-min int64: the
    position in the row (padded) or in ``x`` (packed), -1 where the prefix has no valid token;
    ties go to the latest token, as ``torch.cummin``. ``out`` is contiguous, of ``x``'s dtype.
    """
    ops = {"prefix_sum": (OP_SUM, False), "suffix_sum": (OP_SUM, True),
           "prefix_min": (OP_MIN, False)}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
    code, reverse = ops[op]
    if (exclusive or want_index) and code != OP_MIN:
        raise ValueError("exclusive and want_index apply to prefix_min only")
    if mask_output and mask is None:
        raise ValueError("mask_output needs a mask")
    _check_float(x)
    b, t, packed, (sxb, sxt) = _layout(x, cu_seqlens)
    m, (smb, smt) = _mask_arg(mask, x)
    out = torch.empty(x.shape, dtype=_store_dtype(x.dtype), device=x.device)
    idx = torch.empty(x.shape, dtype=torch.int64, device=x.device) if want_index else None
    if b == 0 or x.numel() == 0:
        return out.to(x.dtype), idx
    block_b, block_t, warps = launch_blocks(t // b if packed else t)
    _segment_scan_kernel[_grid(b, block_b)](
        x, m, cu_seqlens, out, idx, b, t, sxb, sxt, smb, smt, 0 if packed else t,
        OP=code, REVERSE=reverse, EXCLUSIVE=exclusive, MASK_IN=m is not None and not mask_output,
        MASK_OUT=mask_output, WANT_INDEX=want_index, PACKED=packed,
        FP64=x.dtype == torch.float64, BLOCK_B=block_b, BLOCK_T=block_t, num_warps=warps,
    )
    return out.to(x.dtype), idx


def segment_spread(values: torch.Tensor, shape: torch.Size | tuple[int, ...],
                   mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None, *,
                   count: torch.Tensor | None = None, x: torch.Tensor | None = None,
                   ref: torch.Tensor | None = None) -> torch.Tensor:
    """``values [B]`` written at every token of a new contiguous ``[B, T]`` or ``[N]`` tensor.

    ``y_t = values_b / max(count_b, 1)`` (``count`` optional) where ``mask_t`` (optional) and
    ``x_t == ref_b`` (optional pair, the max backward), else 0. Dtype of ``values``.
    """
    _check_float(values, "values")
    shape = torch.Size(shape)
    b, t, packed = _shape_layout(shape, values.device, cu_seqlens, "shape")
    if values.shape != (b,):
        raise ValueError(f"values must be [B] = [{b}], got {tuple(values.shape)}")
    if (x is None) != (ref is None):
        raise ValueError("x and ref go together")
    sxb, sxt = 0, 0
    if x is not None:
        if x.shape != shape or ref.shape != (b,):
            raise ValueError(f"x must be {tuple(shape)} and ref [{b}], got {tuple(x.shape)} "
                             f"and {tuple(ref.shape)}")
        _, _, _, (sxb, sxt) = _layout(x, cu_seqlens)
    out = torch.empty(shape, dtype=_store_dtype(values.dtype), device=values.device)
    m, (smb, smt) = _mask_arg(mask, out)
    if b == 0 or out.numel() == 0:
        return out.to(values.dtype)
    block_b, block_t, warps = launch_blocks(t // b if packed else t)
    _segment_spread_kernel[_grid(b, block_b)](
        values, count, x, ref, m, cu_seqlens, out, b, t, sxb, sxt, smb, smt,
        0 if packed else t,
        HAS_CNT=count is not None, HAS_REF=x is not None, HAS_MASK=m is not None,
        PACKED=packed, FP64=values.dtype == torch.float64,
        BLOCK_B=block_b, BLOCK_T=block_t, num_warps=warps,
    )
    return out.to(values.dtype)
