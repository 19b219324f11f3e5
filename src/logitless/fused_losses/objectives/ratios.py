"""Importance ratios by level (docs/objectives.md, section 1), on right-padded ``[B, T]`` tensors.

Each level returns a `Ratio`: a per-token value ``rho`` (with its gradient path) and the clip
bounds in ratio space that the clipped surrogate uses with it. Values at masked positions are
1 and carry no gradient.
"""

from dataclasses import dataclass

import torch

from logitless.fused_losses.objectives import segments


@dataclass
class Ratio:
    value: torch.Tensor  # [B, T]
    low: torch.Tensor | float  # lower clip bound (ratio space)
    high: torch.Tensor | float  # upper clip bound (ratio space)
    per_sequence: bool  # one value per sequence (metrics count sequences, as TRL)


def _seq(values, like):
    return values[:, None].expand_as(like)


def _token(d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask, group):
    return Ratio(torch.exp(d), 1 - eps_low, 1 + eps_high, False)


def _capped(log_s, cfg):
    # verl's GSPO caps the log sequence ratio (at 10): past it, value and gradient stop.
    return log_s if cfg.seq_log_ratio_max is None else log_s.clamp(max=cfg.seq_log_ratio_max)


def _sequence(d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask, group):
    # GSPO: s_i = exp(mean_t d), the gradient reaches every token of the sequence.
    log_s = _capped(_seq(segments.segment_mean(d, ratio_mask, group=group), d), cfg)
    return Ratio(torch.exp(log_s), 1 - eps_low, 1 + eps_high, True)


def _sequence_token(d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask, group):
    # GSPO-token: value s_i, gradient through lp_t only.
    log_s = _seq(segments.segment_mean(d, ratio_mask, group=group), d).detach()
    return Ratio(torch.exp(_capped(log_s + lp - lp.detach(), cfg)), 1 - eps_low, 1 + eps_high,
                 False)


def _geometric(d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask, group):
    # GMPO: sign-aware log-space clip per token, then the geometric mean over the sequence.
    # The clip is already inside the value, so the surrogate gets no further bounds.
    sign = torch.sign(adv)
    dc = sign * torch.minimum(sign * d, sign * torch.clamp(d, -eps_low, eps_high))
    log_s = _seq(segments.segment_mean(dc, ratio_mask, group=group), d)
    return Ratio(torch.exp(log_s), 0.0, torch.inf, True)


def prefix_bound_scale(m: torch.Tensor, growth: str, group=None) -> torch.Tensor:
    """CTPO's g(t) with t the 1-based index of the token among the valid tokens of its sequence."""
    # a segment scan, so that under cp_group t counts the earlier ranks' tokens too
    t = segments.prefix_sum(m.to(torch.float64), m, group=group).clamp(min=1)
    if growth == "sqrt":
        return t.sqrt()
    if growth == "linear":
        return t
    return torch.ones_like(t)


def _prefix_cumulative(d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask, group):
    # CTPO: C_t = sum_{j<=t} d_j, log-space bounds growing with g(t).
    c = segments.prefix_sum(d, m, group=group)
    g = prefix_bound_scale(m, cfg.prefix_bound_growth, group).to(d.dtype)
    return Ratio(torch.exp(c), torch.exp(-eps_low * g), torch.exp(eps_high * g), False)


def _prefix_min(d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask, group):
    # MinPRO: the minimum token ratio of the prefix stands in for the prefix product; the value
    # is mu_t, the gradient reaches lp_t only (r_t * sg(mu_t / r_t)).
    r = torch.exp(d)
    if cfg.minpro_prefix == "inclusive":
        mu = segments.prefix_min(r.detach(), m, group=group)
    else:
        prev = segments.prefix_min(r.detach(), m, exclusive=True, group=group)
        mu = r.detach() * torch.where(torch.isinf(prev), torch.ones_like(prev), prev)
    mu = torch.where(m, mu, r.detach())
    return Ratio(r * (mu / r.detach()), 1 - eps_low, 1 + eps_high, False)


RATIO_FUNCTIONS = {
    "token": _token,
    "sequence": _sequence,
    "sequence_token": _sequence_token,
    "geometric": _geometric,
    "prefix_cumulative": _prefix_cumulative,
    "prefix_min": _prefix_min,
}


def compute_ratio(level, d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask,
                  group=None) -> Ratio:
    """Ratio of ``level`` from the clamped log-ratio ``d = lp - lp_old`` ``[B, T]``.

    ``m`` is the bool token mask, ``ratio_mask`` the tokens averaged by sequence-level ratios
    (``m``, narrowed by entropy selections for GMPO as TRL does); ``group`` the
    context-parallel group of the sequence-level reductions (None: local).
    """
    ratio = RATIO_FUNCTIONS[level](d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask, group)
    ratio.value = torch.where(m, ratio.value, torch.ones_like(ratio.value))
    return ratio
