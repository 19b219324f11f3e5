"""Rollout correction (docs/objectives.md, section 6): IS weights, rejection masks, OPSM.

All on right-padded ``[B, T]`` tensors, all detached. A NaN rollout logprob means "not
available": its token gets a zero log-ratio (weight 1, no rejection evidence), as TRL does.
"""

import torch

from logitless.fused_losses.objectives import context_parallel as cp
from logitless.fused_losses.objectives import segments
from logitless.fused_losses.oplib import is_compiling

SAFETY_BOUND = 20.0  # exp(20) ~ 5e8: the largest log-weight exponentiated (verl's bound)


def rollout_log_ratio(old_lp, rollout_lp, m):
    """``log(pi_old / pi_rollout)`` per token, 0 where masked or where the rollout value is NaN."""
    diff = (old_lp - rollout_lp).detach()
    return torch.where(m & ~torch.isnan(diff), diff, torch.zeros_like(diff))


def rollout_is_weight(log_ratio, m, cfg, group=None) -> torch.Tensor:
    """TIS (``truncate``) or MIS/IcePop (``mask``) weight at token or sequence level ``[B, T]``.

    ``sequence``: exp of the summed log-ratio; ``sequence_geometric``: exp of its mean.
    """
    if cfg.rollout_is == "token":
        log_w = log_ratio
    elif cfg.rollout_is == "sequence":
        log_w = segments.segment_sum(log_ratio, m, group=group)[:, None].expand_as(log_ratio)
    else:
        log_w = segments.segment_mean(log_ratio, m, group=group)[:, None].expand_as(log_ratio)
    w = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    if cfg.rollout_is_mode == "truncate":
        if cfg.rollout_is_min is None and cfg.rollout_is_max is None:
            return w  # no bound: the plain weight (torch.clamp needs at least one)
        return w.clamp(min=cfg.rollout_is_min, max=cfg.rollout_is_max)
    lo = -torch.inf if cfg.rollout_is_min is None else cfg.rollout_is_min
    hi = torch.inf if cfg.rollout_is_max is None else cfg.rollout_is_max
    return torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))


def rollout_is_batch_mean(weight, m, level, group=None) -> float:
    """Mean of the IS weights over the batch: over valid tokens (``token``), or over non-empty
    sequences, one weight each (sequence levels). 1 when it is not positive (verl's guard).
    A float; a 0-d tensor under ``torch.compile``. With a context-parallel ``group``, over
    every rank's tokens (one ``all_reduce``; a sequence-level weight is the same at every
    column of every rank, so each rank reads its first column, and needs one)."""
    if level == "token":
        total, n = cp.reduced(torch.stack([torch.where(m, weight, torch.zeros_like(weight)).sum(),
                                           m.sum().to(weight.dtype)]), group).unbind()
        mean = total / n.clamp(min=1)
    else:
        nonempty = cp.reduced(m.sum(-1), group) > 0
        first = weight[:, :1].squeeze(-1) if weight.shape[1] else weight.new_zeros(len(m))
        mean = torch.where(nonempty, first, 0.0).sum() / nonempty.sum().clamp(min=1)
    if is_compiling():  # a 0-d tensor: reading it on the host would break the graph
        return torch.where(mean > 1e-8, mean, torch.ones_like(mean))
    mean = float(mean)
    return mean if mean > 1e-8 else 1.0


def rollout_rejection_keep(log_ratio, m, options, group=None) -> torch.Tensor:
    """verl ``rollout_rs``: bool ``[B, T]``, False where any option rejects the token/sequence.

    Statistics of ``x = log(pi_old / pi_rollout)`` (clamped to +-20): ``k1 = -x``,
    ``k2 = x^2 / 2``, ``k3 = exp(x) - 1 - x``; at token level, or summed / averaged / maxed over
    the sequence. ``options`` come from `parse_rollout_rs` as ``(name, lower, upper)``.
    """
    x = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -x, "k2": 0.5 * x.square(), "k3": torch.exp(x) - 1 - x}
    keep = torch.ones_like(m)
    for name, lo, hi in options:
        stat = stats[name[-2:]]
        if name.startswith("seq_sum"):
            stat = segments.segment_sum(stat, m, group=group)[:, None]
        elif name.startswith("seq_mean"):
            stat = segments.segment_mean(stat, m, group=group)[:, None]
        elif name.startswith("seq_max"):
            stat = segments.segment_max(stat, m, group=group)[:, None]
        keep = keep & (stat >= lo) & (stat <= hi)
    return keep


def off_policy_sequence_keep(lp, sampling_lp, adv, m, threshold, group=None) -> torch.Tensor:
    """DeepSeek-V3.2 OPSM: drop tokens of A < 0 in sequences whose mean ``lp_roll - lp`` exceeds
    ``threshold``. NaN sampling logprobs count as zero divergence. Bool ``[B, T]``."""
    div = (sampling_lp - lp).detach()
    div = torch.where(torch.isnan(div), torch.zeros_like(div), div)
    avg = (segments.segment_sum(div, m, group=group)
           / segments.segment_count(m, group=group).clamp(min=1).to(div.dtype))
    return (adv >= 0) | (avg[:, None] <= threshold)
