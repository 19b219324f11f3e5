"""``attention_entropy``: per-query entropy of the attention distribution, in O(T) memory.

Public entry point: checks the inputs, turns both layouts (padded ``[B, H, T, d]`` with an
attention mask, packed ``[total, H, d]`` with flash-attn's ``cu_seqlens``) into one description
(per-row segment bounds, key and query validity) and runs the Triton kernel or its chunked
torch twin. Forward only: the op refuses inputs that require grad.
"""

from __future__ import annotations

import torch

from logitless.fused_losses.backend import triton_selected
from logitless.fused_losses.oplib import Op, check_positive_number
from logitless.kernels.attention_entropy_torch import attention_entropy_chunked

__all__ = ["attention_entropy", "check_positive_number"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_mask(name: str, mask: torch.Tensor | None, shape: tuple[int, ...], device) -> None:
    if mask is None:
        return
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(mask.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise ValueError(f"{name} must be bool or integer 0/1, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"{name} must be on {device}, got {mask.device}")


def _check_inputs(q, k, *, scale, window, softcap, reduce_heads) -> None:
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise ValueError("q and k must be tensors")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k must be on q's device {q.device}, got {k.device}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError(
            "attention_entropy has no backward: q and k must not require grad "
            "(call it under torch.no_grad() or pass q.detach(), k.detach())"
        )
    if q.dim() != k.dim():
        raise ValueError(f"q and k must have the same rank, got q {q.dim()}-D and k {k.dim()}-D")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head dim, got q {q.shape[-1]} and k {k.shape[-1]}"
        )
    if q.shape[-1] == 0:
        raise ValueError("q must have a head dim of at least 1")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (keys i - window < j <= i), got {window}")
    for name, value in (("scale", scale), ("softcap", softcap)):
        if value is not None:
            check_positive_number(name, value)
    if reduce_heads not in (None, "mean"):
        raise ValueError(f"reduce_heads must be None or 'mean', got {reduce_heads!r}")


def _segments(cu_seqlens: torch.Tensor, total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``[1, total]`` start and end (exclusive) of the token's packed sequence."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [num_seqs + 1]")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must hold at least [0, total]")
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths < 0).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at q.shape[0] = {total}, "
            f"got {cu_seqlens.tolist()}"
        )
    start = torch.repeat_interleave(cu[:-1], lengths)
    end = torch.repeat_interleave(cu[1:], lengths)
    return start.to(torch.int32)[None], end.to(torch.int32)[None]


def attention_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    query_mask: torch.Tensor | None = None,
    reduce_heads: str | None = None,
) -> torch.Tensor:
    """Entropy of each query's attention distribution, ``H_i = -sum_j p_ij log p_ij``, in fp32.

    Layouts:

    - padded: q ``[B, Hq, T, d]``, k ``[B, Hk, T, d]``, optional ``attention_mask [B, T]``
      (1 = token, 0 = padding; left or right) and ``query_mask [B, T]`` -> ``[B, Hq, T]``;
    - packed: q ``[total, Hq, d]``, k ``[total, Hk, d]`` with ``cu_seqlens [S + 1]`` (int,
      flash-attn's layout; sequences never see each other) and ``query_mask [total]``
      -> ``[total, Hq]``.

    ``Hq`` must be a multiple of ``Hk`` (GQA/MQA: query head ``h`` reads key head
    ``h // (Hq / Hk)``). Scores are ``s_ij = scale * q_i . k_j`` (``scale`` defaults to
    ``d ** -0.5``), then ``softcap * tanh(s / softcap)`` when ``softcap`` is given, and
    ``p_i = softmax_j(s_ij)`` over the keys query ``i`` sees:

    - keys whose ``attention_mask`` is 1, in the query's own sequence;
    - ``causal``: keys ``j <= i``;
    - ``window = W``: keys with ``i - j < W``, i.e. the query and the ``W - 1`` keys before it
      (transformers' ``sliding_window = W``, flash-attn's ``window_size = (W - 1, 0)``); when
      not causal also ``j - i < W`` (flash-attn's ``(W - 1, W - 1)``).

    Indices count positions in the row, padding included, as transformers' masks do.
    Queries that are padding (``attention_mask`` 0), that ``query_mask`` leaves out, or that see
    no key get 0, never NaN, whatever their inputs hold. A selected query that sees a NaN
    (in its own vector or in a key it can see) gets NaN: never a value that could pass for a
    confident token. ``scale`` and ``softcap`` must be finite numbers > 0. ``query_mask``
    also saves the work: blocks of unselected queries are skipped. ``reduce_heads="mean"``
    averages over the query heads (``[B, T]`` / ``[total]``).

    Forward only; inputs that require grad are refused. Inputs fp32/bf16/fp16, computed in fp32.
    Backend: ``LOGITLESS_BACKEND`` (``triton`` | ``torch``) if set, else Triton on CUDA and the
    chunked torch path on CPU; both use O(T) memory beyond the inputs.
    """
    _check_inputs(q, k, scale=scale, window=window, softcap=softcap, reduce_heads=reduce_heads)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    # One graph node under torch.compile (the op defined at the end of this module).
    return torch.ops.logitless.attention_entropy(
        q, k, cu_seqlens, attention_mask, query_mask, bool(causal), scale, window, softcap,
        reduce_heads == "mean")


def _attention_entropy_impl(q, k, cu_seqlens, attention_mask, query_mask, causal: bool,
                            scale: float, window: int | None, softcap: float | None,
                            reduce_mean: bool) -> torch.Tensor:
    """`attention_entropy` after its argument checks: the layout checks, the segments of
    ``cu_seqlens`` (read on the host) and the kernel."""
    seg_start = seg_end = None
    if cu_seqlens is not None:
        if q.dim() != 3:
            raise ValueError(
                f"with cu_seqlens, q must be packed [total, Hq, d], got shape {list(q.shape)}"
            )
        if attention_mask is not None:
            raise ValueError(
                "attention_mask is for the padded layout; with cu_seqlens, sequences are "
                "delimited by cu_seqlens (no padding)"
            )
        total, hq, _ = q.shape
        if k.shape[0] != total:
            raise ValueError(f"k must have q's {total} tokens, got {k.shape[0]}")
        _check_mask("query_mask", query_mask, (total,), q.device)
        seg_start, seg_end = _segments(cu_seqlens, total, q.device)
        # [total, H, d] -> [1, H, total, d] as a view: the kernels take any strides.
        q4 = q.permute(1, 0, 2)[None]
        k4 = k.permute(1, 0, 2)[None]
        key_valid = None
        query_valid = None if query_mask is None else query_mask.bool()[None]
    else:
        if q.dim() != 4:
            raise ValueError(
                "q must be padded [B, Hq, T, d] (or packed [total, Hq, d] with cu_seqlens), "
                f"got shape {list(q.shape)}"
            )
        bsz, hq, t, _ = q.shape
        if k.shape[0] != bsz or k.shape[2] != t:
            raise ValueError(
                f"k must be [B, Hk, T, d] with q's B = {bsz} and T = {t}, got {list(k.shape)}"
            )
        _check_mask("attention_mask", attention_mask, (bsz, t), q.device)
        _check_mask("query_mask", query_mask, (bsz, t), q.device)
        q4, k4 = q, k
        key_valid = None if attention_mask is None else attention_mask.bool()
        query_valid = key_valid
        if query_mask is not None:
            qm = query_mask.bool()
            query_valid = qm if query_valid is None else query_valid & qm
    hk = k4.shape[1]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q's heads ({hq}) must be a positive multiple of k's heads ({hk})")

    kwargs = dict(
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        seg_start=seg_start,
        seg_end=seg_end,
    )
    if triton_selected(q.device, q.dtype):
        from logitless.kernels.attention_entropy import attention_entropy_triton

        # The kernel reads the masks as bytes; a bool tensor is reinterpreted, not copied.
        def as_bytes(x):
            return None if x is None else x.contiguous().view(torch.uint8)

        out = attention_entropy_triton(
            q4, k4, key_valid=as_bytes(key_valid), query_valid=as_bytes(query_valid), **kwargs
        )
    else:
        out = attention_entropy_chunked(
            q4, k4, key_valid=key_valid, query_valid=query_valid, **kwargs
        )
    if cu_seqlens is not None:
        out = out[0].transpose(0, 1)  # [total, Hq]
        return out.mean(1) if reduce_mean else out.contiguous()
    return out.mean(1) if reduce_mean else out


# --- attention_entropy (forward only) -------------------------------------------------------


def _ae_forward_fake(a):
    if a.cu_seqlens is not None:  # packed [total, Hq, d] -> [total, Hq]
        shape = a.q.shape[:2]
    else:  # padded [B, Hq, T, d] -> [B, Hq, T]
        shape = a.q.shape[:3]
    if a.reduce_mean:
        shape = (shape[0], *shape[2:])
    return a.q.new_empty(shape, dtype=torch.float32)


Op("attention_entropy",
   ("Tensor q", "Tensor k", "Tensor? cu_seqlens", "Tensor? attention_mask", "Tensor? query_mask",
    "bool causal", "float scale", "int? window", "float? softcap", "bool reduce_mean"),
   ("entropy",), lambda a: _attention_entropy_impl(**vars(a)), _ae_forward_fake)
