"""Sampler-matched logprobs: ``linear_logprobs`` with top-k, top-p, min-p or a per-token
temperature (see ``docs/sampler.md`` for the semantics, which follow vLLM 0.34.0).

``linear_logprobs`` checks the settings here (:func:`sampler_settings`) and, when any of them
truncates or varies per token, passes them as per-token tensors (:func:`per_token`) to the
custom op ``logitless::sampled_logprobs`` (defined at the end of this module), which checks
their values (:func:`check_values`), compacts the rows and runs :func:`rows_forward` (its
backward op :func:`rows_backward`); plain scalar settings never reach this module. With
``vocab_parallel`` the op takes the group by name, as the plain op does, and runs the torch
twin's passes with ``shards.GroupReduction`` (a distributed radix select).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from types import ModuleType

import torch

from logitless.fused_losses.backend import triton_selected
from logitless.fused_losses.head import shards
from logitless.fused_losses.oplib import (
    Op,
    check_temperature,
    compact_rows,
    distinct,
    grads_or_empty,
    is_number,
    put_rows,
    take_rows,
)
from logitless.kernels import sampler_torch
from logitless.kernels.linear_softmax_torch import acc_dtype
from logitless.kernels.sampler_torch import ENGINES, LOCAL, Reduction, RowParams

__all__ = ["SamplerSettings", "drop_outside_kept", "per_token", "sampler_settings"]


@dataclass(frozen=True)
class SamplerSettings:
    """Checked settings: each a Python number, a tensor of ``targets``' shape, or None (off).
    ``temperature`` is None when it is the scalar the plain path takes."""

    temperature: object = None
    top_k: object = None
    top_p: object = None
    min_p: object = None
    sampler: str = "vllm"


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


def check_values(temperature, top_k, top_p, min_p, dtype) -> None:
    """The checks that read the per-token settings' values as given, before any cast
    (``ValueError`` naming the argument); each a tensor or None, ``temperature`` in the range
    of `check_temperature` for the compute dtype ``dtype``. Run inside the custom op (under
    ``torch.compile`` too)."""
    check_temperature(temperature, dtype)
    for name, x in (("top_p", top_p), ("min_p", min_p)):
        if x is not None and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} must be finite, found a non-finite value")
    if top_k is not None and not bool((top_k >= 1).all()):
        raise ValueError("top_k must be >= 1 at every token (None turns it off; "
                         "vLLM's 0 and -1 are spelled None here)")
    if top_p is not None and not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError("top_p must lie in (0, 1] at every token")
    if min_p is not None and not bool(((min_p >= 0) & (min_p <= 1)).all()):
        raise ValueError("min_p must lie in [0, 1] at every token")


def check_sampler(sampler) -> None:
    """``sampler`` names an engine whose rules the kernels follow (``ValueError`` if not)."""
    if not isinstance(sampler, str) or sampler not in ENGINES:
        raise ValueError(f"sampler must be one of {ENGINES} (the rollout engine whose "
                         f"top-k / top-p / min-p rules to follow), got {sampler!r}")


def sampler_settings(targets, vocab: int | None, temperature, top_k, top_p, min_p,
                     sampler: str = "vllm") -> SamplerSettings | None:
    """Check the sampler arguments statically (``ValueError`` naming the argument; a tensor's
    values are checked by `check_values`, inside the op); None when they leave the plain
    path's numbers unchanged: scalar temperature, and ``top_k`` None or ``>= V``, ``top_p``
    None or 1, ``min_p`` None or 0 (every engine then samples from the full softmax).
    ``vocab`` None: not known here (a sharded vocabulary), a ``top_k`` is kept (the op keeps
    every token when it is ``>= V``)."""
    check_sampler(sampler)
    if isinstance(temperature, torch.Tensor):
        _check_tensor("temperature", temperature, targets, False)
    if top_k is not None:
        if isinstance(top_k, torch.Tensor):
            _check_tensor("top_k", top_k, targets, True)
        elif isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
            raise ValueError(f"top_k must be None (off) or an integer >= 1 (vLLM's 0 and -1 "
                             f"are spelled None here), got {top_k!r}")
        elif vocab is not None and top_k >= vocab:
            top_k = None
    for name, value, low_open in (("top_p", top_p, True), ("min_p", min_p, False)):
        rng = "(0, 1]" if low_open else "[0, 1]"
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            _check_tensor(name, value, targets, False)
        elif not (is_number(value) and math.isfinite(value)
                  and (value > 0 if low_open else value >= 0) and value <= 1):
            raise ValueError(f"{name} must be None (off) or a number in {rng}, got {value!r}")
    if is_number(top_p) and top_p == 1:
        top_p = None
    if is_number(min_p) and min_p == 0:
        min_p = None
    tensor_t = isinstance(temperature, torch.Tensor)
    if top_k is None and top_p is None and min_p is None and not tensor_t:
        return None
    return SamplerSettings(temperature if tensor_t else None, top_k, top_p, min_p, sampler)


def drop_outside_kept(logps, old, mask):
    """A response token the recomputed policy (or old policy) keeps out of the sampler's
    truncated set has logprob -inf under sampler matching: its ratio is undefined. Such
    tokens leave the loss mask, and every -inf reads 0 in both logprobs (no gradient reaches
    them). Returns the new ``(logprobs, old, mask)`` and the fraction of the masked tokens
    dropped."""
    infinite = torch.isneginf(logps.detach()) | torch.isneginf(old)
    outside = infinite & mask.bool()
    zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
    logps = torch.where(infinite, zero, logps)
    old = torch.where(infinite, zero.to(old.dtype), old)
    fraction = outside.sum() / mask.sum().clamp(min=1)
    return logps, old, mask * ~outside, fraction


def _backend_for(device: torch.device, dtype: torch.dtype, sharded: bool = False) -> ModuleType:
    """The kernel module for this call (see :func:`triton_selected`): ``kernels.sampler``
    (cuBLAS GEMMs and Triton passes) or its torch twin ``kernels.sampler_torch``; both take
    the same arguments and give the same kept sets. A sharded vocabulary takes the torch
    twin on every device: its passes carry the reduction hook (``shards.GroupReduction``)."""
    if sharded or not triton_selected(device, dtype):
        return sampler_torch
    from logitless.kernels import sampler

    return sampler


def per_token(settings: SamplerSettings, targets, temperature: float, dtype):
    """The settings as tensors of ``targets``' shape (the op's arguments): ``temperature``
    times the scalar ``temperature``, ``top_k`` int64, ``top_p`` fp64, ``min_p``; None where
    off. ``temperature`` and ``min_p`` are in the accumulation dtype of ``dtype`` or, given as
    wider tensors, in their own dtype: the op checks their values before it casts them
    (`check_values`)."""
    acc = acc_dtype(dtype)

    def full(x, tensor_dtype):
        if x is None:
            return None
        if isinstance(x, torch.Tensor):
            return x.to(torch.promote_types(x.dtype, tensor_dtype))
        return torch.full(targets.shape, x, dtype=tensor_dtype, device=targets.device)

    t = full(settings.temperature, acc)
    t = torch.full(targets.shape, temperature, dtype=acc, device=targets.device) if t is None \
        else t * temperature
    return t, full(settings.top_k, torch.int64), full(settings.top_p, torch.float64), \
        full(settings.min_p, acc)


def _kw(backend, softcap, logit_scale, tile_bytes):
    return dict(softcap=softcap, logit_scale=logit_scale,
                tile_bytes=tile_bytes or backend.DEFAULT_TILE_BYTES)


def rows_forward(hidden, weight, bias, targets, params: RowParams, softcap, logit_scale,
                 tile_bytes, dtype, reduce: Reduction = LOCAL):
    """``(logprobs, entropy, log_kept_mass, lse, m, log_kept, key, count)`` of compacted rows
    (targets in ``[0, V)``), no autograd; ``m`` and ``log_kept`` are the row maximum and the
    kept set's normaliser relative to it, the last two describe the kept set. ``reduce``: a
    sharded vocabulary's (targets then ids in this rank's slice, ``count`` the slice's own)."""
    backend = _backend_for(hidden.device, dtype, reduce.sharded)
    kw = _kw(backend, softcap, logit_scale, tile_bytes)
    if reduce.sharded:
        kw["reduce"] = reduce
    with torch.autocast(hidden.device.type, enabled=False):
        return backend.forward(hidden.to(dtype), weight, bias, targets, params, **kw)


def rows_backward(hidden, weight, bias, targets, params: RowParams, key, count, m, log_kept,
                  log_kept_mass, ent, lp, grads, need, softcap, logit_scale, tile_bytes, dtype,
                  sharded: bool = False):
    """Gradients of compacted rows (None where ``need`` says not wanted), in input dtypes,
    from the upstream ``grads`` of (logprobs, entropy, log_kept_mass, lse) (None: none).
    ``sharded``: this rank's slice of a sharded vocabulary (no communication here: the
    hidden gradient is the slice's share)."""
    backend = _backend_for(hidden.device, dtype, sharded)
    g_lp, *rest = grads
    if g_lp is not None:  # a target outside the kept set has logprob -inf: no gradient
        g_lp = torch.where(torch.isfinite(lp), g_lp, 0.0)
    acc = m.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        d_h, d_w, d_b = backend.backward(
            hidden.to(dtype), weight, bias, targets, params, key, count, m, log_kept,
            log_kept_mass, ent,
            *(None if g is None else g.to(acc) for g in (g_lp, *rest)),
            need_hidden=need[0], need_weight=need[1], need_bias=need[2],
            **_kw(backend, softcap, logit_scale, tile_bytes))
    return tuple(None if g is None else g.to(t.dtype)
                 for g, t in zip((d_h, d_w, d_b), (hidden, weight, bias)))


# --- linear_logprobs with the sampler's settings (py) --------------------------------

# The op's arguments, declared once (`oplib.Op`); vocab parallelism as the plain op's: the
# group by name (None: the vocabulary is whole).
_SP_ARGS = ("Tensor hidden", "Tensor weight", "Tensor? bias", "Tensor targets",
            "Tensor temperature", "Tensor? top_k", "Tensor? top_p", "Tensor? min_p",
            "float? softcap", "float logit_scale", "int ignore_index", "int? tile_bytes",
            "ScalarType dtype", "str sampler", "str? group_name=None", 'str hidden_grad="sum"',
            "str? head_dtype=None")


def _shards(group_name, weight, device):
    """``(offset, reduction)`` of a call: the first global id of this rank's slice and the
    passes' reduction hook (0 and ``LOCAL`` when the vocabulary is whole)."""
    if group_name is None:
        return 0, LOCAL
    group = shards.resolve(group_name)
    offset, v_total = shards.vocab_offset(weight.shape[0], group, device)
    return offset, shards.GroupReduction(group, v_total)


def _in_acc(temperature, min_p, dtype):
    """``temperature`` and ``min_p`` in the accumulation dtype of ``dtype`` (the kernels'; a
    temperature checked by `check_values` stays a normal number there)."""
    acc = acc_dtype(dtype)
    return temperature.to(acc), None if min_p is None else min_p.to(acc)


def _sp_rows(a, offset, reduce):
    """``(targets of the rows, rows, RowParams of the rows)``: ids validated against the whole
    vocabulary, then made ids in this rank's slice (``offset``), the settings' rows."""
    check_sampler(a.sampler)
    flat_t, rows = compact_rows(a.targets, a.ignore_index, reduce.vocab(a.weight.shape[0]))
    temperature, min_p = _in_acc(a.temperature, a.min_p, a.dtype)
    params = RowParams(*(take_rows(x, rows) for x in (temperature, a.top_k, a.top_p, min_p)),
                       engine=a.sampler)
    return take_rows(flat_t, rows) - offset, rows, params


def _sp_forward(a):
    # the values as given, before any cast
    check_values(a.temperature, a.top_k, a.top_p, a.min_p, a.dtype)
    offset, reduce = _shards(a.group_name, a.weight, a.hidden.device)
    t, rows, params = _sp_rows(a, offset, reduce)
    outs = rows_forward(take_rows(a.hidden, rows, a.hidden.shape[-1]), a.weight, a.bias, t,
                        params, a.softcap, a.logit_scale, a.tile_bytes, a.dtype, reduce)
    return distinct(put_rows(x, rows, a.targets.shape) for x in outs)


def _sp_forward_fake(a):
    acc = acc_dtype(a.dtype)
    floats = [a.hidden.new_empty(a.targets.shape, dtype=acc) for _ in range(6)]
    return (*floats, *(a.hidden.new_empty(a.targets.shape, dtype=torch.int64) for _ in range(2)))


def _sp_backward(a):
    offset, reduce = _shards(a.group_name, a.weight, a.hidden.device)
    t, rows, params = _sp_rows(a, offset, reduce)
    saved = [take_rows(x, rows) for x in (a.key, a.count, a.m, a.log_kept, a.log_kept_mass,
                                          a.entropy, a.logprobs)]
    grads = tuple(take_rows(g, rows) for g in (a.g_logprobs, a.g_entropy, a.g_log_kept_mass,
                                               a.g_lse))
    d_hidden, d_weight, d_bias = rows_backward(
        take_rows(a.hidden, rows, a.hidden.shape[-1]), a.weight, a.bias, t, params, *saved,
        grads, a.need, a.softcap, a.logit_scale, a.tile_bytes, a.dtype, reduce.sharded)
    if d_hidden is not None and reduce.sharded and a.hidden_grad == "sum":
        # each rank saw its slice only ("partial" leaves the sum to the caller)
        torch.distributed.all_reduce(d_hidden, group=reduce.group)
    return grads_or_empty(a.hidden, a.weight, rows, d_hidden, d_weight, d_bias)


SAMPLED_LOGPROBS = Op(
    "sampled_logprobs", _SP_ARGS,
    ("logprobs", "entropy", "log_kept_mass", "lse", "m", "log_kept", "key", "count"),
    _sp_forward, _sp_forward_fake, wrt=("hidden", "weight", "bias"),
    grads=("logprobs", "entropy", "log_kept_mass", "lse"),
    saved=("key", "count", "m", "log_kept", "log_kept_mass", "entropy", "logprobs"),
    backward=_sp_backward)


class _Gathered(torch.autograd.Function):
    """``sampled_logprobs`` with a ``gather_weight`` callable (the ZeRO-3 hook, which does not
    fit an op's schema; eager only): the op's forward and backward implementations, the
    backward inside the gather, as on the plain path (the caller runs the forward inside
    the same context)."""

    @staticmethod
    def forward(ctx, *inputs):
        inputs, ctx.gather = inputs[:-1], inputs[-1]
        outs = SAMPLED_LOGPROBS.run(*inputs)
        SAMPLED_LOGPROBS.setup_context(ctx, inputs, outs)
        ctx.mark_non_differentiable(*outs[4:])  # m, log_kept, key, count
        return outs

    @staticmethod
    def backward(ctx, *grads):
        with ctx.gather():
            return (*SAMPLED_LOGPROBS.backward(ctx, *grads), None)


def gathered(gather_weight):
    """``sampled_logprobs``'s arguments -> its outputs, with the backward inside
    ``gather_weight()`` (see `_Gathered`)."""
    return lambda *args: _Gathered.apply(*args, gather_weight)
