"""Sampler-matched logprobs: ``linear_logprobs`` with top-k, top-p, min-p or a per-token
temperature (see ``docs/sampler.md`` for the semantics, which follow vLLM 0.34.0).

``linear_logprobs`` checks the settings here (:func:`sampler_settings`) and, when any of them
truncates or varies per token, hands its compacted rows to :func:`sampled_logprobs`; plain
scalar settings never reach this module.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from types import ModuleType

import torch

from logitless.fused_losses.backend import triton_selected
from logitless.kernels import sampler_torch
from logitless.kernels.linear_softmax_torch import acc_dtype
from logitless.kernels.sampler_torch import RowParams

__all__ = ["SamplerSettings", "sampled_logprobs", "sampler_settings"]


@dataclass(frozen=True)
class SamplerSettings:
    """Checked settings: each a Python number, a tensor of ``targets``' shape, or None (off).
    ``temperature`` is None when it is the scalar the plain path takes."""

    temperature: object = None
    top_k: object = None
    top_p: object = None
    min_p: object = None

    def rows(self, rows, n: int, dtype, device) -> RowParams:
        """Per-row tensors for the kernels, restricted to ``rows`` (None: all ``n`` rows)."""
        def per_row(x, tensor_dtype):
            if x is None:
                return None
            if isinstance(x, torch.Tensor):
                x = x.reshape(-1)
                x = x if rows is None else x.index_select(0, rows)
                return x.to(tensor_dtype)
            return torch.full((n,), x, dtype=tensor_dtype, device=device)
        temperature = per_row(self.temperature, dtype)
        if temperature is None:
            temperature = torch.ones(n, dtype=dtype, device=device)
        return RowParams(temperature, per_row(self.top_k, torch.int64),
                         per_row(self.top_p, torch.float64), per_row(self.min_p, dtype))


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_tensor(name, x, targets, integer: bool):
    if tuple(x.shape) != tuple(targets.shape):
        raise ValueError(f"{name} as a tensor must have targets' shape {tuple(targets.shape)} "
                         f"(one value per token), got {tuple(x.shape)}")
    if x.device != targets.device:
        raise ValueError(f"{name} is on {x.device} but targets are on {targets.device}")
    if integer and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
        raise ValueError(f"{name} as a tensor must have an integer dtype, got {x.dtype}")
    if not integer and not x.dtype.is_floating_point:
        raise ValueError(f"{name} as a tensor must be floating point, got {x.dtype}")
    if not integer and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite, found a non-finite value")


def sampler_settings(targets, vocab: int, temperature, top_k, top_p, min_p,
                     vocab_parallel) -> SamplerSettings | None:
    """Check the sampler arguments (``ValueError`` naming the argument); None when they leave
    the plain path's numbers unchanged: scalar temperature, and ``top_k`` None or ``>= V``,
    ``top_p`` None or 1, ``min_p`` None or 0."""
    if isinstance(temperature, torch.Tensor):
        _check_tensor("temperature", temperature, targets, False)
        if not bool((temperature > 0).all()):
            raise ValueError("temperature must be > 0 at every token")
    if top_k is not None:
        if isinstance(top_k, torch.Tensor):
            _check_tensor("top_k", top_k, targets, True)
            if not bool((top_k >= 1).all()):
                raise ValueError("top_k must be >= 1 at every token (None turns it off; "
                                 "vLLM's 0 and -1 are spelled None here)")
        elif isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
            raise ValueError(f"top_k must be None (off) or an integer >= 1 (vLLM's 0 and -1 "
                             f"are spelled None here), got {top_k!r}")
        elif top_k >= vocab:
            top_k = None
    for name, value, low_open in (("top_p", top_p, True), ("min_p", min_p, False)):
        rng = "(0, 1]" if low_open else "[0, 1]"
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            _check_tensor(name, value, targets, False)
            low_ok = (value > 0) if low_open else (value >= 0)
            if not bool((low_ok & (value <= 1)).all()):
                raise ValueError(f"{name} must lie in {rng} at every token")
        elif not (_is_number(value) and math.isfinite(value)
                  and (value > 0 if low_open else value >= 0) and value <= 1):
            raise ValueError(f"{name} must be None (off) or a number in {rng}, got {value!r}")
    if _is_number(top_p) and top_p == 1:
        top_p = None
    if _is_number(min_p) and min_p == 0:
        min_p = None
    tensor_t = isinstance(temperature, torch.Tensor)
    if top_k is None and top_p is None and min_p is None and not tensor_t:
        return None
    if vocab_parallel is not None:
        raise ValueError("vocab_parallel is unsupported with top_k/top_p/min_p or a per-token "
                         "temperature")
    return SamplerSettings(temperature if tensor_t else None, top_k, top_p, min_p)


def _backend_for(device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The kernel module for this call (see :func:`triton_selected`): ``kernels.sampler``
    (cuBLAS GEMMs and Triton passes) or its torch twin ``kernels.sampler_torch``; both take
    the same arguments and give the same kept sets."""
    if not triton_selected(device, dtype):
        return sampler_torch
    from logitless.kernels import sampler

    return sampler


class _Sampled(torch.autograd.Function):
    """Rows compacted, targets in ``[0, V)``; the kept set is a constant of the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, params, softcap, logit_scale, tile_bytes,
                dtype):
        ctx.set_materialize_grads(False)
        h = hidden.to(dtype)
        backend = _backend_for(hidden.device, dtype)
        kw = dict(softcap=softcap, logit_scale=logit_scale,
                  tile_bytes=tile_bytes or backend.DEFAULT_TILE_BYTES)
        with torch.autocast(hidden.device.type, enabled=False):
            lp, ent, kept_mass, lse, lse_kept, key, count = backend.forward(
                h, weight, bias, targets, params, **kw)
        ctx.params, ctx.kw, ctx.dtype, ctx.backend = params, kw, dtype, backend
        ctx.save_for_backward(hidden, weight, bias, targets, key, count, lse, lse_kept, ent,
                              lp)
        return lp, ent, kept_mass, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_kept, g_lse):
        hidden, weight, bias, targets, key, count, lse, lse_kept, ent, lp = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        nothing = (None,) * 6
        if all(g is None for g in (g_lp, g_ent, g_kept, g_lse)):
            return None, None, None, *nothing
        acc = lse.dtype
        if g_lp is not None:  # a target outside the kept set has logprob -inf: no gradient
            g_lp = torch.where(torch.isfinite(lp), g_lp, 0.0)
        with torch.autocast(hidden.device.type, enabled=False):
            d_h, d_w, d_b = ctx.backend.backward(
                hidden.to(ctx.dtype), weight, bias, targets, ctx.params, key, count, lse,
                lse_kept, ent, *(None if g is None else g.to(acc) for g in
                                 (g_lp, g_ent, g_kept, g_lse)),
                need_hidden=need_hidden, need_weight=need_weight, need_bias=need_bias,
                **ctx.kw)
        return (None if d_h is None else d_h.to(hidden.dtype),
                None if d_w is None else d_w.to(weight.dtype),
                None if d_b is None else d_b.to(bias.dtype), *nothing)


def sampled_logprobs(hidden, weight, bias, targets, settings: SamplerSettings, rows, *,
                     temperature: float, softcap, logit_scale, tile_bytes, dtype):
    """``(logprobs, entropy, log_kept_mass, lse)`` of the compacted rows (``hidden [N, D]``,
    ``targets [N]``; ``rows``: their positions in the flattened input, None for all), with
    gradients to hidden, weight and bias. ``temperature``: the scalar one (1 when the
    settings hold a per-token one)."""
    params = settings.rows(rows, hidden.shape[0], acc_dtype(dtype), hidden.device)
    params.temperature *= temperature
    return _Sampled.apply(hidden, weight, bias, targets, params, softcap, logit_scale,
                          tile_bytes, dtype)
