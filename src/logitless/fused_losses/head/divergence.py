"""Two-head divergences for distillation: ``linear_divergence``, ``linear_topk_distill`` and
the MTP draft loss ``mtp_draft_loss`` built on them.

Input checks, compaction of masked rows and result shaping live here; the tiled math in
``kernels/divergence.py`` (cuBLAS tiles and Triton epilogues, where ``triton_selected``) or its
chunked torch twin ``kernels/divergence_torch.py`` (CPU, fp64). The teacher's tensors are
detached before the autograd functions see them: no graph is built for the teacher and it
receives no gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType

import torch

from logitless.fused_losses.backend import triton_selected
from logitless.fused_losses.head import kept
from logitless.fused_losses.head.logprobs import check_byte_budget, linear_logprobs
from logitless.fused_losses.oplib import (
    DivergenceOutput,
    Op,
    check_devices,
    check_head,
    check_head_dtype,
    check_temperature,
    compute_dtype,
    distinct,
    grads_or_empty,
    head_precision,
    is_number,
    mask_rows,
    precision_gather,
    put_rows,
    take_rows,
)
from logitless.kernels import divergence_torch
from logitless.kernels.linear_softmax_torch import acc_dtype

__all__ = ["DivergenceOutput", "exact_kl_rows", "linear_divergence", "linear_topk_distill",
           "mtp_draft_loss", "reference_head"]

@dataclass(frozen=True)
class _Spec:
    beta: float
    temperature: float
    tile_bytes: int | None
    backend: ModuleType
    entropy: bool = False
    head_dtype: str | None = None  # the eager backward's GEMM precision (`head_precision`)

    def kw(self):
        return {} if self.tile_bytes is None else {"tile_bytes": self.tile_bytes}


def divergence_kernels(device: torch.device, *dtypes: torch.dtype) -> ModuleType:
    """The kernel module for tensors of this device and these dtypes: the Triton path when
    :func:`triton_selected` picks it for every one of them, else the torch twin."""
    if not all(triton_selected(device, dtype) for dtype in dtypes):
        return divergence_torch
    from logitless.kernels import divergence

    return divergence


def spec_for(beta, temperature, tile_bytes, hidden, t_hidden=None, entropy=False) -> _Spec:
    """The spec of a call on these tensors (the backend from their device and dtypes)."""
    dtypes = (hidden.dtype,) if t_hidden is None else (hidden.dtype, t_hidden.dtype)
    return _Spec(float(beta), float(temperature), tile_bytes,
                 divergence_kernels(hidden.device, *dtypes), bool(entropy))


class _Divergence(torch.autograd.Function):
    """Rows already compacted; the teacher's tensors arrive detached. Returns the divergence
    and the student's entropy (empty unless ``spec.entropy``; no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, spec: _Spec):
        ctx.set_materialize_grads(False)
        div, entropy, *saved = _divergence_rows(spec, hidden, weight, bias, t_hidden, t_weight,
                                                t_bias)
        ctx.spec = spec
        ctx.save_for_backward(hidden, weight, bias, t_hidden, t_weight, t_bias, *saved)
        ctx.mark_non_differentiable(entropy)
        return div, entropy

    @staticmethod
    def backward(ctx, grad, _):
        need = ctx.needs_input_grad[:3]
        if grad is None or not any(need):
            return (None,) * 7
        with head_precision(ctx.spec.head_dtype):
            grads = _divergence_rows_backward(ctx.spec, *ctx.saved_tensors, grad, need)
        return (*grads, None, None, None, None)


def _divergence_rows(spec: _Spec, hidden, weight, bias, t_hidden, t_weight, t_bias):
    """``(divergence, entropy, top_s, log_l_s, top_t, log_l_t, aux)`` of compacted rows, no
    autograd: the heads' normalisers as the backward reads them (never ``lse``, see
    ``divergence_torch.log_softmax_``). The entropy is empty unless ``spec.entropy``."""
    with torch.autocast(hidden.device.type, enabled=False):
        out = spec.backend.divergence_forward(
            hidden, weight, bias, t_hidden, t_weight, t_bias, beta=spec.beta,
            temperature=spec.temperature, entropy=spec.entropy, **spec.kw())
    div, saved, ent = out[0], out[1:6], out[6:]
    return div, ent[0] if ent else div.new_empty(0), *saved


def _divergence_rows_backward(spec: _Spec, hidden, weight, bias, t_hidden, t_weight, t_bias,
                              top_s, log_l_s, top_t, log_l_t, aux, grad, need):
    """Gradients of compacted rows (None where ``need`` says not wanted), in input dtypes."""
    with torch.autocast(hidden.device.type, enabled=False):
        grads = spec.backend.divergence_backward(
            hidden, weight, bias, t_hidden, t_weight, t_bias, top_s, log_l_s, top_t, log_l_t, aux,
            grad.contiguous(), beta=spec.beta, temperature=spec.temperature,
            need_hidden=need[0], need_weight=need[1], need_bias=need[2], **spec.kw())
    return _cast(grads, (hidden, weight, bias))


def _topk_rows(spec: _Spec, hidden, weight, bias, ids):
    """``(logprobs [n, k], top [n], log_l [n])`` of compacted rows, no autograd (the
    normaliser as the backward reads it)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return spec.backend.topk_forward(hidden, weight, bias, ids,
                                         temperature=spec.temperature, **spec.kw())


def _topk_rows_backward(spec: _Spec, hidden, weight, bias, ids, top, log_l, grad, need):
    with torch.autocast(hidden.device.type, enabled=False):
        grads = spec.backend.topk_backward(
            hidden, weight, bias, ids, top, log_l, grad.contiguous(), temperature=spec.temperature,
            need_hidden=need[0], need_weight=need[1], need_bias=need[2], **spec.kw())
    return _cast(grads, (hidden, weight, bias))


def _topk_ids(teacher_ids, rows, v):
    """The kept rows' teacher ids as int64 ``[n, k]``; reads them: ``ValueError`` outside
    ``[0, v)``."""
    ids = take_rows(teacher_ids, rows, teacher_ids.shape[-1]).long()
    bad = (ids < 0) | (ids >= v)
    if bool(bad.any()):
        raise ValueError(f"teacher_ids must lie in [0, {v}) (the vocabulary of weight); found "
                         f"{ids[bad][:5].tolist()}")
    return ids


def _cast(grads, like):
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, like))


def _check_head(prefix: str, hidden, weight, bias, lead=None, head_dtype=None):
    """`check_head` on one head's ``hidden [..., D]``, ``weight [V, D]`` and ``bias [V]``
    (``lead``: the token shape ``hidden`` must have), a vocabulary of ``V >= 1``; returns them
    in their compute dtype (of ``head_dtype``: `compute_dtype`)."""
    check_head(hidden, weight, bias, prefix, lead)
    if weight.shape[0] == 0:
        raise ValueError(f"{prefix}weight must have a vocabulary of V >= 1 rows, got "
                         f"{tuple(weight.shape)}")
    # The head's dtype rule (TRL's): autocast's dtype under autocast, else hidden's; the
    # weight and bias are cast to it.
    dtype = compute_dtype(hidden, head_dtype)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _check_common(hidden, tensors, mask, temperature):
    """Devices, the temperature (`check_temperature`, for hidden's compute dtype) and the
    mask's type, shape and device; its values are read inside the ops (`mask_rows`)."""
    check_devices(hidden, tensors)
    check_temperature(temperature, hidden.dtype)
    lead = tuple(hidden.shape[:-1])
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype.is_complex \
            or tuple(mask.shape) != lead:
        raise ValueError(f"mask must be None or a bool or real tensor of hidden's token shape "
                         f"{lead} (1: kept, 0: dropped), got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    if mask.device != hidden.device:
        raise ValueError(f"mask is on {mask.device} but hidden is on {hidden.device}")


def linear_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    max_tile_bytes: int | None = None,
    return_entropy: bool = False,
    head_dtype: str | None = None,
) -> DivergenceOutput:
    """Per-token generalized Jensen-Shannon divergence between a student and a teacher head.

    With ``p_s = softmax((hidden @ weight^T + bias) / T)`` and ``p_t`` likewise from the
    teacher: ``beta = 0`` gives KL(p_t || p_s) (forward KL), ``beta = 1`` KL(p_s || p_t)
    (reverse KL), and ``0 < beta < 1`` gives ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``
    with ``m = beta p_t + (1 - beta) p_s`` (TRL's GKD definition). Neither head's
    ``[N, V]`` logits are stored: both are streamed through tiles of at most
    ``max_tile_bytes`` (default 64 MB for the torch path's tile buffers; on CUDA the head's
    256 MiB for both heads' tiles together).

    Args:
        hidden: ``[..., D]`` the student's hidden states.
        weight: ``[V, D]`` the student's head.
        teacher_hidden: ``[..., D_t]`` with the student's token shape; ``D_t`` may differ.
        teacher_weight: ``[V, D_t]``, the same vocabulary as the student's.
        mask: optional tensor of the token shape, bool, or real holding 0 and 1 only (1:
            kept; other values raise ``ValueError``); the other rows are skipped and hold 0.
        beta: in ``[0, 1]``.
        temperature: a normal number of the accumulation dtype (fp32, fp64 for fp64
            inputs), as ``linear_logprobs`` takes; divides both heads' logits.
        bias, teacher_bias: optional ``[V]`` biases.
        return_entropy: also return the student's per-token entropy of ``p_s`` (folded into
            the first pass; no gradient, 0 where ``mask`` is False).
        head_dtype: the precision of both heads' GEMMs, as in :func:`linear_logprobs`: None
            (the compute dtype), ``"float32"`` (16-bit inputs upcast, fp32 logits, gradients
            in the inputs' dtypes) or ``"tf32"`` (as ``"float32"``, the GEMMs under torch's
            fp32 matmul precision ``"high"``: TF32 on CUDA, fp32 on a CPU).

    Returns:
        :class:`DivergenceOutput`: ``divergence``, fp32 (fp64 for fp64 inputs) of the token
        shape, and ``entropy`` (None unless ``return_entropy``). Gradients reach ``hidden``,
        ``weight`` and ``bias``; the teacher's tensors are detached (no gradient, no graph).
        Until the next release the result also stands in for the old return value (the
        tensor, or ``(divergence, entropy)``), with a ``DeprecationWarning``.
    """
    check_head_dtype(head_dtype)
    hidden, weight, bias = _check_head("", hidden, weight, bias, head_dtype=head_dtype)
    lead = tuple(hidden.shape[:-1])
    teacher_hidden, teacher_weight, teacher_bias = _check_head(
        "teacher_", teacher_hidden, teacher_weight, teacher_bias, lead, head_dtype)
    _check_common(hidden, (("weight", weight), ("bias", bias),
                           ("teacher_hidden", teacher_hidden),
                           ("teacher_weight", teacher_weight),
                           ("teacher_bias", teacher_bias)), mask, temperature)
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"teacher_weight must have the student's vocabulary size "
                         f"{weight.shape[0]} rows, got {teacher_weight.shape[0]}")
    if not is_number(beta) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
    check_byte_budget("max_tile_bytes", max_tile_bytes)
    t_bias = None if teacher_bias is None else teacher_bias.detach()
    teacher = (teacher_hidden.detach(), teacher_weight.detach(), t_bias)
    # One graph node under torch.compile (the op defined at the end of this module).
    out, entropy, *_ = torch.ops.logitless.linear_divergence(
        hidden, weight, bias, *teacher, mask, float(beta), float(temperature), max_tile_bytes,
        bool(return_entropy), head_dtype)
    # the entropy gets no gradient, as documented
    return DivergenceOutput(out, entropy.detach() if return_entropy else None)


def _divergence_impl(spec: _Spec, hidden, weight, bias, t_hidden, t_weight, t_bias, mask):
    """The op's forward: compact the rows ``mask`` keeps, `_divergence_rows` on them, and
    scatter each result back to the token shape (0 at dropped rows; an empty entropy, when not
    wanted, becomes zeros)."""
    lead = tuple(hidden.shape[:-1])
    rows = mask_rows(mask)
    outs = _divergence_rows(spec, take_rows(hidden, rows, hidden.shape[-1]), weight, bias,
                            take_rows(t_hidden, rows, t_hidden.shape[-1]), t_weight, t_bias)
    return tuple(put_rows(x if x.shape == outs[0].shape else x.new_zeros(outs[0].shape), rows,
                          lead) for x in outs)


def reference_head(hidden, weight, ref_hidden, ref_weight, ref_bias, head_dtype=None):
    """The reference head of the policy loss's exact KL checked against the policy head
    (``hidden [..., D]``, ``weight [V, D]``): both of ``ref_hidden`` and ``ref_weight`` given,
    ``ref_hidden [..., D_ref]`` of hidden's token shape, ``ref_weight [V, D_ref]`` of the same
    vocabulary, ``ref_bias`` None or ``[V]``, all on hidden's device. Returns them in their
    compute dtype (of ``head_dtype``, the policy's)."""
    for name, t in (("ref_hidden", ref_hidden), ("ref_weight", ref_weight)):
        if t is None:
            raise ValueError(f"{name}: the exact KL needs both ref_hidden and ref_weight "
                             "(the reference model's hidden states and head)")
    h, w, b = _check_head("ref_", ref_hidden, ref_weight, ref_bias, tuple(hidden.shape[:-1]),
                          head_dtype)
    check_devices(hidden, (("ref_hidden", h), ("ref_weight", w), ("ref_bias", b)))
    if w.shape[0] != weight.shape[0]:
        raise ValueError(f"ref_weight must have the policy's vocabulary size {weight.shape[0]} "
                         f"rows, got {w.shape[0]}")
    return h, w, b


def exact_kl_rows(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature,
                  head_dtype=None):
    """KL(policy || reference) per row of ``hidden [n, D]`` against ``ref_hidden [n, D_ref]``
    (rows already compacted, inputs checked): `linear_divergence`'s ``beta = 1`` passes, the
    gradient reaching the policy's tensors that require it, the reference's detached; the
    backward under `head_precision` of ``head_dtype`` (the caller runs the forward so)."""
    spec = dataclasses.replace(spec_for(1.0, temperature, None, hidden, ref_hidden),
                               head_dtype=head_dtype)
    kl, _ = _Divergence.apply(hidden, weight, bias, ref_hidden.detach(), ref_weight.detach(),
                              None if ref_bias is None else ref_bias.detach(), spec)
    return kl


def linear_topk_distill(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    log_prob_min_clamp: float | None = -10.0,
    loss_max_clamp: float | None = 10.0,
    max_tile_bytes: int | None = None,
    direction: str = "forward",
    k: int | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    head_dtype: str | None = None,
) -> torch.Tensor:
    """Per-token top-k KL to a teacher: forward over the teacher's top-k log-probabilities
    (``direction="forward"``), or reverse over the student's top-k, renormalised
    (``direction="reverse"``).

    verl 0.9.1's ``forward_kl_topk`` distillation loss, from hidden states and the head:
    with ``log q`` the student's log-softmax of ``(hidden @ weight^T + bias) / T`` at the
    teacher's ids, ``sum_k exp(t_k) (t_k - log q_k)`` over the k ids only. The tail beyond the
    top k is dropped, not lumped into an extra bucket, so the sum can dip below 0; as in verl
    both log-probs are first clamped below at ``log_prob_min_clamp`` and the result is clamped
    to ``[0, loss_max_clamp]`` (either None: no clamp). Gradients flow through the clamps as
    in verl (zero where a clamp is active) to ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``[..., D]``; weight ``[V, D]``; bias optional ``[V]``.
        teacher_ids: integer ``[..., k]`` in ``[0, V)``, the token shape then k.
        teacher_logprobs: float ``[..., k]``, the teacher's log-probabilities at those ids
            (no gradient).
        mask: optional tensor of the token shape, bool, or real holding 0 and 1 only (1:
            kept; other values raise ``ValueError``); the other rows are skipped and hold 0.
        direction: ``"forward"`` (the above; needs ``teacher_ids`` and ``teacher_logprobs``)
            or ``"reverse"``: verl's student-top-k renormalised reverse KL (issue #6676, PRs
            #7590 / #7806), ``sum_{i in S} s_i (log s_i - log t_i)`` with ``S`` the student's
            ``k`` largest logits, ``log s = log_softmax`` of the student's tempered logits
            over ``S`` and ``log t`` the teacher's, over the same ``S``. Needs ``k`` and the
            teacher head (``teacher_hidden [..., D_t]``, ``teacher_weight [V, D_t]``,
            optional ``teacher_bias``, detached, tempered by the same ``temperature``), whose
            logits at ``S`` are gathered; or, instead, a recorded set: ``teacher_ids`` the
            student's top-k as the rollout recorded it and ``teacher_logprobs`` the teacher's
            log-probs there (verl #7806's fixed-token scoring; taken as given, not tempered).
            The clamps apply as in the forward direction (to the renormalised log-probs,
            then to the loss). ``S`` is selected without gradient; the gradient reaches the
            student's ``hidden``, ``weight`` and ``bias`` only. See ``docs/distillation.md``.
        head_dtype: the precision of heads' GEMMs (the student's; the teacher head's too
            with direction="reverse"), as in :func:`linear_logprobs`: None
            (the compute dtype), ``"float32"`` (16-bit inputs upcast, fp32 logits, gradients
            in the inputs' dtypes) or ``"tf32"`` (as ``"float32"``, the GEMMs under torch's
            fp32 matmul precision ``"high"``: TF32 on CUDA, fp32 on a CPU).

    Returns:
        fp32 tensor (fp64 for fp64 inputs) of the token shape.
    """
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be 'forward' or 'reverse', got {direction!r}")
    check_head_dtype(head_dtype)
    hidden, weight, bias = _check_head("", hidden, weight, bias, head_dtype=head_dtype)
    _check_clamps(log_prob_min_clamp, loss_max_clamp)
    check_byte_budget("max_tile_bytes", max_tile_bytes)
    if direction == "reverse":
        with head_precision(head_dtype):
            return _reverse_topk(hidden, weight, bias, teacher_ids, teacher_logprobs, mask, k,
                                 teacher_hidden, teacher_weight, teacher_bias, temperature,
                                 log_prob_min_clamp, loss_max_clamp, max_tile_bytes,
                                 head_dtype)
    given = [n for n, v in (("k", k), ("teacher_hidden", teacher_hidden),
                            ("teacher_weight", teacher_weight),
                            ("teacher_bias", teacher_bias)) if v is not None]
    if given:
        raise ValueError(f"{given} belong to direction='reverse'; the forward direction takes "
                         f"teacher_ids and teacher_logprobs")
    _check_teacher_topk(hidden, weight, bias, teacher_ids, teacher_logprobs, mask, temperature)
    # One graph node under torch.compile (the op defined at the end of this module).
    log_q = torch.ops.logitless.linear_topk_logprobs(hidden, weight, bias, teacher_ids, mask,
                                                     float(temperature), max_tile_bytes,
                                                     head_dtype)[0]
    # Dropped rows: log q = log t = 0 below, so their loss is 0 (and gets no gradient).
    log_t = teacher_logprobs.detach().to(log_q.dtype)
    if mask is not None:
        log_t = torch.where(mask[..., None] != 0, log_t, 0.0)  # 0/1, checked by the op
    return _clamped_kl(log_t, log_q, log_prob_min_clamp, loss_max_clamp)


def _check_teacher_topk(hidden, weight, bias, teacher_ids, teacher_logprobs, mask, temperature):
    """Devices, mask and temperature (`_check_common`), then ``teacher_ids`` integer
    ``[..., k]`` of hidden's token shape and ``teacher_logprobs`` a float tensor shaped like
    it (their values: `_topk_ids`, inside)."""
    lead = tuple(hidden.shape[:-1])
    _check_common(hidden, (("weight", weight), ("bias", bias), ("teacher_ids", teacher_ids),
                           ("teacher_logprobs", teacher_logprobs)), mask, temperature)
    if not isinstance(teacher_ids, torch.Tensor) or teacher_ids.dtype.is_floating_point \
            or teacher_ids.dtype.is_complex or teacher_ids.dtype == torch.bool \
            or teacher_ids.dim() != len(lead) + 1 or tuple(teacher_ids.shape[:-1]) != lead \
            or teacher_ids.shape[-1] < 1:
        raise ValueError(f"teacher_ids must be an integer tensor [{', '.join(map(str, lead))}"
                         f"{', ' if lead else ''}k] with k >= 1, got "
                         f"{getattr(teacher_ids, 'dtype', type(teacher_ids).__name__)} "
                         f"{tuple(getattr(teacher_ids, 'shape', ()))}")
    if not isinstance(teacher_logprobs, torch.Tensor) \
            or not teacher_logprobs.dtype.is_floating_point \
            or tuple(teacher_logprobs.shape) != tuple(teacher_ids.shape):
        raise ValueError(f"teacher_logprobs must be a float tensor shaped like teacher_ids "
                         f"{tuple(teacher_ids.shape)}, got "
                         f"{getattr(teacher_logprobs, 'dtype', type(teacher_logprobs).__name__)}"
                         f" {tuple(getattr(teacher_logprobs, 'shape', ()))}")


def _check_clamps(log_prob_min_clamp, loss_max_clamp):
    # a floor of log-probabilities is <= 0 (-inf: none); a cap of the loss is > 0 (inf: none)
    if log_prob_min_clamp is not None and not (is_number(log_prob_min_clamp)
                                               and log_prob_min_clamp <= 0):
        raise ValueError(f"log_prob_min_clamp must be None or a number <= 0, got "
                         f"{log_prob_min_clamp!r}")
    if loss_max_clamp is not None and not (is_number(loss_max_clamp) and loss_max_clamp > 0):
        raise ValueError(f"loss_max_clamp must be None or a number > 0, got {loss_max_clamp!r}")


def _clamped_kl(log_p, log_q, log_prob_min_clamp, loss_max_clamp):
    """verl's clamped ``KL(p || q)`` over the last dimension: both log-probs floored at
    ``log_prob_min_clamp``, ``sum exp(log p) (log p - log q)`` floored at 0 and capped at
    ``loss_max_clamp`` (None: no clamp)."""
    if log_prob_min_clamp is not None:
        log_p, log_q = log_p.clamp_min(log_prob_min_clamp), log_q.clamp_min(log_prob_min_clamp)
    loss = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    if loss_max_clamp is not None:
        loss = loss.clamp(max=loss_max_clamp)
    return loss


def _reverse_topk(hidden, weight, bias, teacher_ids, teacher_logprobs, mask, k, t_hidden,
                  t_weight, t_bias, temperature, log_prob_min_clamp, loss_max_clamp,
                  max_tile_bytes, head_dtype=None):
    """``linear_topk_distill(direction="reverse")`` on checked student tensors: the student's
    top-k ids streamed through its tiles (no gradient) and the teacher head's logits gathered
    at them (`kept.gathered_logits`, detached), or a recorded set ``teacher_ids`` with the
    teacher's log-probs there; the student's logits gathered at the set, both renormalised
    over it, verl's clamped KL(student || teacher)."""
    lead = tuple(hidden.shape[:-1])
    head = [n for n, x in (("k", k), ("teacher_hidden", t_hidden), ("teacher_weight", t_weight),
                           ("teacher_bias", t_bias)) if x is not None]
    if teacher_ids is not None or teacher_logprobs is not None:
        if head:
            raise ValueError(f"direction='reverse' takes either a recorded set (teacher_ids, "
                             f"teacher_logprobs) or k and the teacher head, not both: drop "
                             f"{head}")
        _check_teacher_topk(hidden, weight, bias, teacher_ids, teacher_logprobs, mask,
                            temperature)
        rows = mask_rows(mask)
        ids = _topk_ids(teacher_ids, rows, weight.shape[0])
        z_t = take_rows(teacher_logprobs.detach(), rows, teacher_logprobs.shape[-1])
        return _reverse_rows(hidden, weight, bias, ids, z_t, rows, lead, temperature,
                             log_prob_min_clamp, loss_max_clamp, max_tile_bytes, head_dtype)
    if t_hidden is None or t_weight is None:
        raise ValueError("direction='reverse' needs the teacher head (teacher_hidden and "
                         "teacher_weight, teacher_bias optional) with k, or a recorded set "
                         "(teacher_ids and teacher_logprobs)")
    t_hidden, t_weight, t_bias = _check_head("teacher_", t_hidden, t_weight, t_bias, lead,
                                             head_dtype)
    if t_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"teacher_weight must have the student's vocabulary of "
                         f"{weight.shape[0]} rows, got {t_weight.shape[0]}")
    _check_common(hidden, (("weight", weight), ("bias", bias), ("teacher_hidden", t_hidden),
                           ("teacher_weight", t_weight), ("teacher_bias", t_bias)), mask,
                  temperature)
    v = weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= v:
        raise ValueError(f"k must be an integer in [1, V] = [1, {v}] with direction='reverse', "
                         f"got {k!r}")
    rows = mask_rows(mask)
    h = take_rows(hidden, rows, hidden.shape[-1])
    th = take_rows(t_hidden.detach(), rows, t_hidden.shape[-1])
    tile = {} if max_tile_bytes is None else {"tile_bytes": max_tile_bytes}
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        ids = divergence_torch.topk_ids(h.detach(), weight.detach(),
                                        None if bias is None else bias.detach(), k,
                                        temperature=float(temperature), **tile)
        z_t = kept.gathered_logits(th, t_weight.detach(),
                                   None if t_bias is None else t_bias.detach(), ids,
                                   temperature=float(temperature), dtype=t_hidden.dtype,
                                   max_tile_bytes=max_tile_bytes)
    return _reverse_rows(hidden, weight, bias, ids, z_t, rows, lead, temperature,
                         log_prob_min_clamp, loss_max_clamp, max_tile_bytes, head_dtype)


def _reverse_rows(hidden, weight, bias, ids, z_t, rows, lead, temperature,
                  log_prob_min_clamp, loss_max_clamp, max_tile_bytes, head_dtype=None):
    """The reverse KL of the kept ``rows`` over their sets ``ids [n_kept, k]``, the teacher's
    logits (or log-probs: the same once renormalised) ``z_t`` there, scattered to ``lead``."""
    h = take_rows(hidden, rows, hidden.shape[-1])
    z_s = kept.gathered_logits(h, weight, bias, ids, temperature=float(temperature),
                               dtype=hidden.dtype, max_tile_bytes=max_tile_bytes,
                               gather_weight=precision_gather(None, head_dtype))
    log_s = torch.log_softmax(z_s, dim=-1)
    log_t = torch.log_softmax(z_t.to(z_s.dtype), dim=-1)
    loss = _clamped_kl(log_s, log_t, log_prob_min_clamp, loss_max_clamp)
    return put_rows(loss, rows, lead)


# --- linear_divergence ----------------------------------------------------------------------

_WRT = ("hidden", "weight", "bias")  # the inputs the divergences' ops differentiate


def _div_spec(a, entropy=False, beta=None):
    return spec_for(a.beta if beta is None else beta, a.temperature, a.tile_bytes, a.hidden,
                    getattr(a, "t_hidden", None), entropy)


def _div_forward(a):
    return distinct(_divergence_impl(_div_spec(a, a.entropy), a.hidden, a.weight, a.bias,
                                     a.t_hidden, a.t_weight, a.t_bias, a.mask))


def _div_forward_fake(a):
    acc = acc_dtype(a.hidden.dtype)
    return tuple(a.hidden.new_empty(a.hidden.shape[:-1], dtype=acc) for _ in range(7))


def _div_backward(a):
    rows = mask_rows(a.mask)
    per_row = [take_rows(x, rows) for x in (a.top_s, a.log_l_s, a.top_t, a.log_l_t, a.aux,
                                            a.g_divergence)]
    d_hidden, d_weight, d_bias = _divergence_rows_backward(
        _div_spec(a), take_rows(a.hidden, rows, a.hidden.shape[-1]), a.weight, a.bias,
        take_rows(a.t_hidden, rows, a.t_hidden.shape[-1]), a.t_weight, a.t_bias, *per_row,
        a.need)
    return grads_or_empty(a.hidden, a.weight, rows, d_hidden, d_weight, d_bias)


LINEAR_DIVERGENCE = Op(
    "linear_divergence",
    ("Tensor hidden", "Tensor weight", "Tensor? bias", "Tensor t_hidden", "Tensor t_weight",
     "Tensor? t_bias", "Tensor? mask", "float beta", "float temperature", "int? tile_bytes",
     "bool entropy", "str? head_dtype=None"),
    ("divergence", "entropy", "top_s", "log_l_s", "top_t", "log_l_t", "aux"),
    _div_forward, _div_forward_fake, wrt=_WRT, grads=("divergence",),
    saved=("top_s", "log_l_s", "top_t", "log_l_t", "aux"), backward=_div_backward,
    forward_only=("entropy",))


# --- linear_topk_distill's student logprobs at the teacher's ids ----------------------------


def _topk_forward(a):
    rows = mask_rows(a.mask)
    logprobs, *norm = _topk_rows(_div_spec(a, beta=0.0),
                                 take_rows(a.hidden, rows, a.hidden.shape[-1]), a.weight, a.bias,
                                 _topk_ids(a.ids, rows, a.weight.shape[0]))
    return put_rows(logprobs, rows, a.ids.shape), *(put_rows(x, rows, a.ids.shape[:-1])
                                                    for x in norm)


def _topk_forward_fake(a):
    acc = acc_dtype(a.hidden.dtype)
    return a.hidden.new_empty(a.ids.shape, dtype=acc), *(
        a.hidden.new_empty(a.ids.shape[:-1], dtype=acc) for _ in range(2))


def _topk_backward(a):
    rows = mask_rows(a.mask)
    grads = _topk_rows_backward(
        _div_spec(a, beta=0.0), take_rows(a.hidden, rows, a.hidden.shape[-1]), a.weight,
        a.bias, _topk_ids(a.ids, rows, a.weight.shape[0]), take_rows(a.top, rows),
        take_rows(a.log_l, rows), take_rows(a.g_logprobs, rows, a.ids.shape[-1]), a.need)
    return grads_or_empty(a.hidden, a.weight, rows, *grads)


LINEAR_TOPK_LOGPROBS = Op(
    "linear_topk_logprobs",
    ("Tensor hidden", "Tensor weight", "Tensor? bias", "Tensor ids", "Tensor? mask",
     "float temperature", "int? tile_bytes", "str? head_dtype=None"),
    ("logprobs", "top", "log_l"), _topk_forward, _topk_forward_fake, wrt=_WRT,
    grads=("logprobs",), saved=("top", "log_l"), backward=_topk_backward)


# --- the MTP draft loss ---------------------------------------------------------------------


def mtp_draft_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    main_hidden: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    main_weight: torch.Tensor | None = None,
    main_bias: torch.Tensor | None = None,
    top_k: int | None = None,
    temperature: float = 1.0,
    max_tile_bytes: int | None = None,
) -> torch.Tensor:
    """Per-token soft cross-entropy of a multi-token-prediction (draft) head against the
    detached main head's next-token distribution: the draft loss that keeps a speculative
    decoding head fresh during RL (SkyRL's ``draft_soft_ce``, Megatron-LM's
    ``mtp_isolated_loss``), from hidden states, never the logits.

    ``-sum_v p_main(v) log p_mtp(v)`` with ``p_mtp = softmax((hidden @ weight^T + bias) / T)``
    and ``p_main = softmax((main_hidden @ main_weight^T + main_bias) / T)`` at the same row:
    the caller aligns them (for MTP depth ``d``, the draft's row ``t`` with the main head's
    row ``t + d + 1``, e.g. ``hidden[:, :-(d + 1)]`` against ``main_hidden[:, d + 1:]``).
    It is ``linear_divergence(beta=0)``'s KL(p_main || p_mtp) plus the main head's entropy
    (one streamed pass of the main head more, no gradient); the gradient, ``p_mtp - p_main``
    per logit, is the KL's.

    With ``top_k``, the main distribution is truncated to its ``top_k`` largest logits and
    renormalised there, ``q``, and the loss is ``-sum_{i in top-k} q_i log p_mtp(i)`` with
    the draft's full-vocabulary log-probs (``linear_logprobs(ids=...)``): two gathers of
    ``top_k`` rows and the draft head's lse pass, after a streamed top-k of the main head.

    Args:
        hidden: ``[..., D]`` the draft head's hidden states (the MTP block's output).
        weight, bias: the draft head (``[V, D]``, optional ``[V]``); gradients reach them
            and ``hidden``. Pass ``weight.detach()`` for Megatron's isolated loss, which
            trains only the MTP block through ``hidden``.
        main_hidden: ``[..., D_main]`` with ``hidden``'s token shape; detached.
        main_weight, main_bias: the main head (detached); None: the draft head's own
            (``weight``, ``bias``: one shared output layer, as DeepSeek-V3's MTP).
            ``main_bias`` without ``main_weight`` is refused.
        mask: as ``linear_divergence``'s; dropped rows hold 0.
        top_k: None (the whole vocabulary) or an integer in ``[1, V]``.
        temperature: divides both heads' logits (1 for SkyRL's loss).

    Returns:
        fp32 tensor (fp64 for fp64 inputs) of the token shape; see docs/distillation.md.
    """
    if main_weight is None:
        if main_bias is not None:
            raise ValueError("main_bias needs main_weight (without it the main head is the "
                             "draft head itself, weight and bias)")
        main_weight, main_bias = weight, bias
    hidden, weight, bias = _check_head("", hidden, weight, bias)
    lead = tuple(hidden.shape[:-1])
    main_hidden, main_weight, main_bias = _check_head("main_", main_hidden, main_weight,
                                                      main_bias, lead)
    _check_common(hidden, (("weight", weight), ("bias", bias), ("main_hidden", main_hidden),
                           ("main_weight", main_weight), ("main_bias", main_bias)), mask,
                  temperature)
    v = weight.shape[0]
    if main_weight.shape[0] != v:
        raise ValueError(f"main_weight must have the draft head's vocabulary of {v} rows, got "
                         f"{main_weight.shape[0]}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or not 1 <= top_k <= v):
        raise ValueError(f"top_k must be None or an integer in [1, V] = [1, {v}], got "
                         f"{top_k!r}")
    check_byte_budget("max_tile_bytes", max_tile_bytes)
    main = (main_hidden.detach(), main_weight.detach(),
            None if main_bias is None else main_bias.detach())
    rows = mask_rows(mask)
    targets = torch.zeros(lead, dtype=torch.int64, device=hidden.device)
    if rows is not None:  # the dropped rows are ignored by linear_logprobs
        targets = targets.masked_fill(mask == 0, -100)
    if top_k is None:
        kl = linear_divergence(hidden, weight, *main[:2], mask, beta=0.0,
                               temperature=temperature, bias=bias, teacher_bias=main[2],
                               max_tile_bytes=max_tile_bytes).divergence
        with torch.no_grad():
            entropy = linear_logprobs(main[0], main[1], targets, bias=main[2],
                                      temperature=temperature, return_entropy=True,
                                      max_tile_bytes=max_tile_bytes).entropy
        return kl + entropy.to(kl.dtype)
    h_main = take_rows(main[0], rows, main[0].shape[-1])
    tile = {} if max_tile_bytes is None else {"tile_bytes": max_tile_bytes}
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        ids = divergence_torch.topk_ids(h_main, main[1], main[2], top_k,
                                        temperature=float(temperature), **tile)
        z_main = kept.gathered_logits(h_main, main[1], main[2], ids,
                                      temperature=float(temperature), dtype=main[0].dtype,
                                      max_tile_bytes=max_tile_bytes)
    lp = linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                         ids=put_rows(ids, rows, (*lead, top_k)),
                         max_tile_bytes=max_tile_bytes).id_logprobs
    q = torch.softmax(z_main, dim=-1).to(lp.dtype)
    return put_rows(-(q * take_rows(lp, rows, top_k)).sum(-1), rows, lead)
