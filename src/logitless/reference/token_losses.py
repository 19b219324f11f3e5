"""Plain-loop reference of the objectives' per-token losses: one formula per objective on one
valid token at a time (`token_loss_loop`), with the sequence values (ratio, log-weight, largest
entropy) the sequence-level objectives read."""

import math
from dataclasses import dataclass

import torch

from logitless.fused_losses.objectives.catalog import CLIPPED_SURROGATE, get_objective
from logitless.reference.segments import valid_tokens as _valid


def _log(x):
    """``log x``, ``-inf`` at 0 (a masked-out rollout IS weight)."""
    return math.log(x) if x > 0 else -math.inf


def value_at(x, i, t):
    """A scalar knob or the value of a per-token ``[B, T]`` tensor at ``(i, t)``, as a float."""
    return float(x[i, t]) if isinstance(x, torch.Tensor) and x.dim() == 2 else float(x)


def clipped_token_loss(rho, a, low, high, *, delta=None, dual_clip_c=None):
    capped = rho if delta is None else torch.clamp(rho, max=delta)
    loss = torch.maximum(-a * capped, -a * torch.clamp(rho, low, high))
    if dual_clip_c is not None and a < 0:
        loss = torch.clamp(loss, max=-dual_clip_c * a)
    return loss


@dataclass
class _Token:
    """One valid token as the objectives' formulas see it."""

    a: float  # advantage
    rho: torch.Tensor  # the ratio of the configured level, with gradient
    x: torch.Tensor  # lp, with gradient
    old: float
    r: torch.Tensor  # the token ratio exp(lp - old), with gradient
    lo: float  # clip bounds of the ratio level
    hi: float
    s: torch.Tensor  # the sequence ratio exp(mean d), with gradient
    log_w: float  # vespo's sequence log-weight (rollout IS folded in)
    h_rel: float | None  # entropy over the sequence's largest entropy (DHPO's mix)
    i: int  # where the token sits: per-token eps tensors are read there
    t: int


def _clipped(k: _Token, cfg):
    loss = clipped_token_loss(k.rho, k.a, k.lo, k.hi, delta=cfg.delta, dual_clip_c=cfg.dual_clip_c)
    if cfg.hard_trust_region and not k.lo <= float(k.rho.detach()) <= k.hi:
        loss = loss.detach()
    return loss


def _cispo(k: _Token, cfg):
    hi = k.hi if cfg.cispo_cap is None else cfg.cispo_cap
    rho = float(k.rho.detach())
    w = min(rho, hi) if cfg.cispo_clip == "upper" else min(max(rho, k.lo), hi)
    return -w * k.a * k.x


def _sapo(k: _Token, cfg):
    tau = cfg.sapo_tau_pos if k.a > 0 else cfg.sapo_tau_neg
    return -(4 / tau) * torch.sigmoid(tau * (k.rho - 1)) * k.a


def _gmpo(k: _Token, cfg):
    return -k.a * k.rho


def _vespo(k: _Token, cfg):
    lw = min(max(k.log_w, math.log(1e-8)), 20.0)
    pos = k.a >= 0
    kk = cfg.vespo_k_pos if pos else cfg.vespo_k_neg
    lam = cfg.vespo_lambda_pos if pos else cfg.vespo_lambda_neg
    return -math.exp(lam + kk * lw - lam * math.exp(lw)) * k.a * k.x


def _reinforce(k: _Token, cfg):
    return -k.a * k.x


def _dro(k: _Token, cfg):
    return -(k.x * k.a - 0.5 * cfg.dro_beta * (k.x - k.old) ** 2)


def _dppo(k: _Token, cfg, ok: bool):
    return -k.a * min(float(k.r.detach()), cfg.dppo_ratio_cap) * k.x * float(ok)


def _dppo_tv(k: _Token, cfg):
    change = math.exp(float(k.x.detach())) - math.exp(k.old)
    e_lo, e_hi = value_at(cfg.eps_low, k.i, k.t), value_at(cfg.eps_high, k.i, k.t)
    return _dppo(k, cfg, change <= e_hi if k.a > 0 else change >= -e_lo)


def _dppo_kl(k: _Token, cfg):
    p, p_old = math.exp(float(k.x.detach())), math.exp(k.old)
    bkl = p_old * (k.old - float(k.x.detach())) + (1 - p_old) * math.log(
        (1 - p_old + 1e-8) / (1 - p + 1e-8)
    )
    e_lo, e_hi = value_at(cfg.eps_low, k.i, k.t), value_at(cfg.eps_high, k.i, k.t)
    if k.a > 0:
        return _dppo(k, cfg, bkl <= e_hi or p <= p_old)
    return _dppo(k, cfg, bkl <= e_lo or p >= p_old)


def _prime_rl(k: _Token, cfg):
    change = math.exp(float(k.x.detach())) - math.exp(k.old)
    e_lo, e_hi = value_at(cfg.eps_low, k.i, k.t), value_at(cfg.eps_high, k.i, k.t)
    inside = change <= e_hi if k.a > 0 else change >= -e_lo
    return -k.a * k.r * float(inside) + cfg.sq_log_ratio_coef * (k.x - k.old) ** 2


def _aspo(k: _Token, cfg):
    r = float(k.r.detach())
    if k.a > 0:
        flipped = torch.exp(k.x - k.x.detach()) / r
    else:
        flipped = k.r * (min(r, cfg.dual_clip_c) / r)
    return torch.maximum(-k.a * flipped, -k.a * torch.clamp(flipped, k.lo, k.hi))


def _dhpo(k: _Token, cfg):
    mix = k.h_rel if cfg.dhpo_mix == "entropy" else cfg.dhpo_mix
    s_lo = 1 - value_at(cfg.eps_low if cfg.seq_eps_low is None else cfg.seq_eps_low, k.i, k.t)
    s_hi = 1 + value_at(cfg.eps_high if cfg.seq_eps_high is None else cfg.seq_eps_high, k.i, k.t)
    unclipped = mix * k.r + (1 - mix) * k.s
    clipped = mix * torch.clamp(k.r, k.lo, k.hi) + (1 - mix) * torch.clamp(k.s, s_lo, s_hi)
    return torch.maximum(-k.a * unclipped, -k.a * clipped)


def _delight(k: _Token, cfg):
    gate = 1 / (1 + math.exp(-k.a * (-k.old) / cfg.delight_eta))
    return -gate * k.a * k.x


# The reference's own formula of each objective outside the clipped-surrogate family.
_TOKEN_LOSSES = {
    "cispo": _cispo,
    "sapo": _sapo,
    "gmpo": _gmpo,
    "vespo": _vespo,
    "reinforce": _reinforce,
    "gpg": _reinforce,
    "dro": _dro,
    "dppo_tv": _dppo_tv,
    "dppo_kl": _dppo_kl,
    "prime_rl": _prime_rl,
    "aspo": _aspo,
    "dhpo": _dhpo,
    "delight": _delight,
}


def _token_formula(objective):
    if get_objective(objective).family == CLIPPED_SURROGATE:
        return _clipped
    if objective not in _TOKEN_LOSSES:
        raise ValueError(objective)
    return _TOKEN_LOSSES[objective]


def _sequence_values(lp, old, entropy, is_weight, i, valid):
    """Per sequence: its ratio ``exp(mean d)``, vespo's log-weight, its largest entropy."""
    n = max(len(valid), 1)
    s = torch.exp(sum((lp[i, t] - old[i, t] for t in valid), lp.new_zeros(())) / n)
    log_w = sum(float(lp[i, t].detach() - old[i, t]) for t in valid)
    if is_weight is not None:
        log_w += sum(min(max(_log(is_weight[i][t]), math.log(1e-8)), 20.0) for t in valid)
    h_max = 1.0
    if entropy is not None:
        h_max = max((float(entropy[i, t].detach()) for t in valid), default=1.0)
    return s, log_w, h_max


def token_loss_loop(
    objective, lp, old, adv, mask, rho, low, high, cfg, entropy=None, is_weight=None
):
    """Per-token losses ``[B, T]`` of one objective (options: delta, dual clip, hard trust
    region, cispo_clip; ``is_weight`` is folded into vespo's sequence weight)."""
    B, T = lp.shape
    formula = _token_formula(objective)
    out = [[lp.new_zeros(()) for _ in range(T)] for _ in range(B)]
    for i in range(B):
        valid = _valid(mask, i)
        s, log_w, h_max = _sequence_values(lp, old, entropy, is_weight, i, valid)
        for t in valid:
            token = _Token(
                a=float(adv[i, t]),
                rho=rho[i][t],
                x=lp[i, t],
                old=float(old[i, t]),
                r=torch.exp(lp[i, t] - old[i, t]),
                lo=low[i][t],
                hi=high[i][t],
                s=s,
                log_w=log_w,
                h_rel=None if entropy is None else float(entropy[i, t].detach()) / h_max,
                i=i,
                t=t,
            )
            out[i][t] = formula(token, cfg)
    return torch.stack([torch.stack(row) for row in out])
