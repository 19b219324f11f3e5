"""Reference for the two-head divergences: both heads' full logits, then the formulas.

``generalized_jsd`` follows the definition TRL 1.16 uses for on-policy distillation (GKD):
``beta = 0`` is the forward KL(teacher || student), ``beta = 1`` the reverse KL(student ||
teacher), anything between the mixture divergence
``beta KL(teacher || m) + (1 - beta) KL(student || m)`` with ``m = beta p_t + (1 - beta) p_s``.
``topk_forward_kl`` is verl 0.9.1's top-k forward KL, with its clamps; ``topk_reverse_kl`` the
student-top-k renormalised reverse KL (verl #6676), with the same clamps; ``mtp_draft_loss``
the soft cross-entropy of a draft head against the detached main head (SkyRL's
``draft_soft_ce``), optionally against the main head's top-k renormalised.
"""

from __future__ import annotations

import math

import torch

from logitless.fused_losses.oplib import DivergenceOutput
from logitless.reference.linear_softmax import head_inputs, linear_logits

__all__ = ["generalized_jsd", "linear_divergence", "linear_topk_distill", "mtp_draft_loss",
           "topk_forward_kl", "topk_reverse_kl"]


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-token generalized JSD of ``softmax(student / T)`` and ``softmax(teacher / T)``.

    Logits ``[..., V]`` -> ``[...]`` in their dtype; differentiable in both.
    """
    log_s = torch.log_softmax(student_logits / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    kl_t = (log_t.exp() * (log_t - log_m)).sum(-1)
    kl_s = (log_s.exp() * (log_s - log_m)).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


def _masked(out: torch.Tensor, mask) -> torch.Tensor:
    """``out`` with 0 where ``mask`` (bool, or 0/1) drops the row."""
    return out if mask is None else torch.where(mask != 0, out, 0.0)


def linear_divergence(hidden, weight, teacher_hidden, teacher_weight, mask=None, *, beta=0.5,
                      temperature=1.0, bias=None, teacher_bias=None,
                      return_entropy=False, head_dtype=None) -> DivergenceOutput:
    """``generalized_jsd`` of the two heads' logits, 0 where ``mask`` drops the row; with
    ``return_entropy`` the student's entropy of ``softmax(logits / T)`` too, detached.
    ``head_dtype``: both heads upcast to fp32 first (`head_inputs`)."""
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias = head_inputs(
        head_dtype, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias)
    student = linear_logits(hidden, weight, bias)
    out = generalized_jsd(student, linear_logits(teacher_hidden, teacher_weight, teacher_bias),
                          beta, temperature)
    entropy = None
    if return_entropy:
        log_p = torch.log_softmax(student.detach() / temperature, dim=-1)
        entropy = _masked(-(log_p.exp() * log_p).sum(-1), mask)
    return DivergenceOutput(_masked(out, mask), entropy)


def topk_forward_kl(student_topk_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                    log_prob_min_clamp: float | None = -10.0,
                    loss_max_clamp: float | None = 10.0) -> torch.Tensor:
    """verl's top-k forward KL per token: ``sum_k p_t,k (log p_t,k - log q_k)`` over the
    teacher's top-k ids only (no tail term), both log-probs clamped below at
    ``log_prob_min_clamp``, the result clamped to ``[0, loss_max_clamp]``."""
    s, t = student_topk_logprobs, teacher_logprobs
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    loss = (t.exp() * (t - s)).sum(-1).clamp_min(0.0)
    return loss if loss_max_clamp is None else loss.clamp(max=loss_max_clamp)


def topk_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int,
                    log_prob_min_clamp: float | None = -10.0,
                    loss_max_clamp: float | None = 10.0) -> torch.Tensor:
    """The student-top-k renormalised reverse KL per token on full logits ``[..., V]``: ``S``
    the student's ``k`` largest logits (no gradient through the choice), both distributions
    renormalised over ``S``, ``sum_{i in S} s_i (log s_i - log t_i)``; the log-probs floored
    at ``log_prob_min_clamp``, the result clamped to ``[0, loss_max_clamp]`` (as verl clamps
    its top-k losses)."""
    ids = student_logits.detach().topk(k, dim=-1).indices
    log_s = torch.log_softmax(student_logits.gather(-1, ids), dim=-1)
    log_t = torch.log_softmax(teacher_logits.gather(-1, ids), dim=-1)
    if log_prob_min_clamp is not None:
        log_s, log_t = log_s.clamp_min(log_prob_min_clamp), log_t.clamp_min(log_prob_min_clamp)
    loss = (log_s.exp() * (log_s - log_t)).sum(-1).clamp_min(0.0)
    return loss if loss_max_clamp is None else loss.clamp(max=loss_max_clamp)


def linear_topk_distill(hidden, weight, teacher_ids=None, teacher_logprobs=None, mask=None, *,
                        temperature=1.0, bias=None, log_prob_min_clamp=-10.0,
                        loss_max_clamp=10.0, direction="forward", k=None, teacher_hidden=None,
                        teacher_weight=None, teacher_bias=None,
                        head_dtype=None) -> torch.Tensor:
    """``topk_forward_kl`` of the student's tempered log-softmax at ``teacher_ids``, or with
    ``direction="reverse"`` ``topk_reverse_kl`` of the two heads' tempered logits.
    ``head_dtype``: the heads upcast to fp32 first (`head_inputs`)."""
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias = head_inputs(
        head_dtype, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias)
    if direction == "reverse":
        out = topk_reverse_kl(
            linear_logits(hidden, weight, bias, temperature=temperature),
            linear_logits(teacher_hidden, teacher_weight, teacher_bias,
                          temperature=temperature).detach(),
            k, log_prob_min_clamp, loss_max_clamp)
        return _masked(out, mask)
    log_q = torch.log_softmax(linear_logits(hidden, weight, bias, temperature=temperature), -1)
    out = topk_forward_kl(log_q.gather(-1, teacher_ids.long()), teacher_logprobs.to(log_q.dtype),
                          log_prob_min_clamp, loss_max_clamp)
    return _masked(out, mask)


def mtp_draft_loss(hidden, weight, main_hidden, mask=None, *, bias=None, main_weight=None,
                   main_bias=None, top_k=None, temperature=1.0) -> torch.Tensor:
    """``-sum_v p_main(v) log_softmax(draft logits / T)(v)`` per token on the materialised
    logits, the main head detached (``weight``/``bias`` when ``main_weight`` is None);
    with ``top_k``, ``p_main`` truncated to its ``top_k`` largest logits and renormalised."""
    if main_weight is None:
        main_weight, main_bias = weight, bias
    z_main = linear_logits(main_hidden, main_weight, main_bias,
                           temperature=temperature).detach()
    p = torch.softmax(z_main, dim=-1)
    if top_k is not None:
        ids = z_main.topk(top_k, dim=-1).indices
        p = torch.zeros_like(p).scatter(-1, ids, torch.softmax(z_main.gather(-1, ids), -1))
    log_s = torch.log_softmax(linear_logits(hidden, weight, bias, temperature=temperature), -1)
    out = -(p * log_s).sum(-1)
    return _masked(out, mask)
