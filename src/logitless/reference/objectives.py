"""Plain-loop reference of the objective library: one sequence, one token at a time, in fp64.

Written for obviousness, not speed: scans are running values in a loop, quantiles come from a
sorted Python list, aggregations sum sequence by sequence. Inputs are right-padded ``[B, T]``
with a 0/1 mask; per-token values are torch scalars so autograd gives the reference gradients.
"""

import math

import torch


def _valid(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def segment_sum_loop(x, mask):
    return torch.stack(
        [sum((x[i, t] for t in _valid(mask, i)), x.new_zeros(())) for i in range(x.shape[0])]
    )


def prefix_sum_loop(x, mask):
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        run = x.new_zeros(())
        for t in range(x.shape[1]):
            if mask[i, t]:
                run = run + x[i, t]
            out[i, t] = run
    return out


def suffix_sum_loop(x, mask):
    return prefix_sum_loop(x.flip(-1), mask.flip(-1)).flip(-1)


def prefix_min_loop(x, mask, exclusive=False):
    out = torch.full_like(x, math.inf)
    for i in range(x.shape[0]):
        run = math.inf
        for t in range(x.shape[1]):
            if exclusive:
                out[i, t] = run
            if mask[i, t]:
                run = min(run, float(x[i, t]))
            if not exclusive:
                out[i, t] = run
    return out


def quantile_loop(values, q):
    """Linear interpolation between order statistics of a Python list."""
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def ratio_loop(
    level, lp, old, adv, mask, eps_low, eps_high, *, growth="sqrt", minpro_prefix="inclusive"
):
    """Per-token ratio values (with gradient) and clip bounds ``(low, high)`` per token."""
    B, T = lp.shape
    rho = [[lp.new_ones(()) for _ in range(T)] for _ in range(B)]
    low = [[1 - eps_low] * T for _ in range(B)]
    high = [[1 + eps_high] * T for _ in range(B)]
    for i in range(B):
        valid = _valid(mask, i)
        n = max(len(valid), 1)
        d = {t: lp[i, t] - old[i, t] for t in valid}
        if level in ("sequence", "sequence_token", "geometric"):
            if level == "geometric":
                parts = []
                for t in valid:
                    s = float(torch.sign(adv[i, t]))
                    clipped = d[t].clamp(-eps_low, eps_high)
                    parts.append(s * torch.minimum(s * d[t], s * clipped))
                low[i], high[i] = [0.0] * T, [math.inf] * T
            else:
                parts = [d[t] for t in valid]
            log_s = sum(parts, lp.new_zeros(())) / n
        running, running_min = lp.new_zeros(()), math.inf
        for count, t in enumerate(valid, start=1):
            r = torch.exp(d[t])
            if level == "token":
                rho[i][t] = r
            elif level in ("sequence", "geometric"):
                rho[i][t] = torch.exp(log_s)
            elif level == "sequence_token":
                rho[i][t] = torch.exp(log_s.detach() + lp[i, t] - lp[i, t].detach())
            elif level == "prefix_cumulative":
                running = running + d[t]
                g = {"sqrt": math.sqrt(count), "linear": float(count), "constant": 1.0}[growth]
                rho[i][t] = torch.exp(running)
                low[i][t], high[i][t] = math.exp(-eps_low * g), math.exp(eps_high * g)
            elif level == "prefix_min":
                if minpro_prefix == "inclusive":
                    running_min = min(running_min, float(r))
                    mu = running_min
                else:
                    mu = float(r) * (1.0 if math.isinf(running_min) else running_min)
                    running_min = min(running_min, float(r))
                rho[i][t] = r * (mu / float(r))
    return rho, low, high


def clipped_token_loss(rho, a, low, high, *, delta=None, dual_clip_c=None):
    capped = rho if delta is None else torch.clamp(rho, max=delta)
    loss = torch.maximum(-a * capped, -a * torch.clamp(rho, low, high))
    if dual_clip_c is not None and a < 0:
        loss = torch.clamp(loss, max=-dual_clip_c * a)
    return loss


def aggregate_loop(loss, mask, adv, mode, *, max_len=None, length_power_alpha=0.5):
    """One scalar from ``loss [B, T]``; local normalisers, every sequence counted (TRL)."""
    B = loss.shape[0]
    sums, lens, seq_adv = [], [], []
    for i in range(B):
        valid = _valid(mask, i)
        sums.append(sum((loss[i, t] for t in valid), loss.new_zeros(())))
        lens.append(len(valid))
        seq_adv.append(sum(float(adv[i, t]) for t in valid) / max(len(valid), 1))
    total, n_tok = sum(sums), sum(lens)
    if mode in ("token-mean", "bnpo"):
        return total / max(n_tok, 1)
    if mode == "token-sum":
        return total
    if mode == "seq-mean-token-mean":
        return sum(s / max(n, 1) for s, n in zip(sums, lens)) / B
    if mode == "seq-mean-token-sum":
        return total / B
    if mode == "seq-mean-token-sum-norm":
        return total / (B * max_len)
    if mode == "balanced":
        pos = [(i, t) for i in range(B) for t in _valid(mask, i) if adv[i, t] > 0]
        neg = [(i, t) for i in range(B) for t in _valid(mask, i) if adv[i, t] < 0]
        n_pos = sum(1 for i in range(B) if lens[i] and seq_adv[i] > 0)
        n_neg = sum(1 for i in range(B) if lens[i] and seq_adv[i] < 0)
        out = loss.new_zeros(())
        if pos:
            out = out + n_pos / (n_pos + n_neg) * sum(loss[k] for k in pos) / len(pos)
        if neg:
            out = out + n_neg / (n_pos + n_neg) * sum(loss[k] for k in neg) / len(neg)
        return out
    if mode == "length-power":
        denom = sum(n ** (1 - length_power_alpha) for n in lens if n)
        return sum(s * n ** (-length_power_alpha) for s, n in zip(sums, lens) if n) / denom
    raise ValueError(mode)


def rollout_rejection_keep_loop(old, rollout, mask, options):
    """verl's rejection options (``(name, lower, upper)``) sequence by sequence; bool ``[B, T]``."""
    keep = mask.bool().clone()
    for i in range(old.shape[0]):
        valid = _valid(mask, i)
        stats = {}
        for t in valid:
            x = float(old[i, t] - rollout[i, t])
            x = 0.0 if math.isnan(x) else max(-20.0, min(20.0, x))
            stats[t] = {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}
        for name, lo, hi in options:
            k = name[-2:]
            if name.startswith("token"):
                for t in valid:
                    if not lo <= stats[t][k] <= hi:
                        keep[i, t] = False
                continue
            values = [stats[t][k] for t in valid]
            if name.startswith("seq_sum"):
                s = sum(values)
            elif name.startswith("seq_mean"):
                s = sum(values) / max(len(values), 1)
            else:
                s = max(values) if values else 0.0
            if not lo <= s <= hi:
                for t in valid:
                    keep[i, t] = False
    return keep


def token_loss_loop(objective, lp, old, adv, mask, rho, low, high, cfg, entropy=None):
    """Per-token losses ``[B, T]`` of one objective (options: delta, dual clip, cispo_clip)."""
    B, T = lp.shape
    out = [[lp.new_zeros(()) for _ in range(T)] for _ in range(B)]
    for i in range(B):
        valid = _valid(mask, i)
        n = max(len(valid), 1)
        h_max = (
            max((float(entropy[i, t].detach()) for t in valid), default=1.0)
            if entropy is not None
            else 1.0
        )
        s = torch.exp(sum((lp[i, t] - old[i, t] for t in valid), lp.new_zeros(())) / n)
        log_w = sum(float(lp[i, t] - old[i, t]) for t in valid)
        for t in valid:
            a, r_t, x = float(adv[i, t]), rho[i][t], lp[i, t]
            r = torch.exp(x - old[i, t])
            lo, hi = low[i][t], high[i][t]
            if objective in (
                "ppo",
                "grpo",
                "dapo",
                "bnpo",
                "dr_grpo",
                "luspo",
                "gspo",
                "ctpo",
                "minpro",
            ):
                loss = clipped_token_loss(
                    r_t, a, lo, hi, delta=cfg.delta, dual_clip_c=cfg.dual_clip_c
                )
            elif objective == "cispo":
                w = (
                    min(float(r_t), hi)
                    if cfg.cispo_clip == "upper"
                    else min(max(float(r_t), lo), hi)
                )
                loss = -w * a * x
            elif objective == "sapo":
                tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
                loss = -(4 / tau) * torch.sigmoid(tau * (r_t - 1)) * a
            elif objective == "gmpo":
                loss = -a * r_t
            elif objective == "vespo":
                lw = min(max(log_w, math.log(1e-8)), 20.0)
                k, lam = (
                    (cfg.vespo_k_pos, cfg.vespo_lambda_pos)
                    if a >= 0
                    else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
                )
                loss = -math.exp(lam + k * lw - lam * math.exp(lw)) * a * x
            elif objective in ("reinforce", "gpg"):
                loss = -a * x
            elif objective == "dro":
                loss = -(x * a - 0.5 * cfg.dro_beta * (x - old[i, t]) ** 2)
            elif objective in ("dppo_tv", "dppo_kl"):
                p, p_old = math.exp(float(x)), math.exp(float(old[i, t]))
                if objective == "dppo_tv":
                    ok = p - p_old <= cfg.eps_high if a > 0 else p - p_old >= -cfg.eps_low
                else:
                    bkl = p_old * (float(old[i, t]) - float(x)) + (1 - p_old) * math.log(
                        (1 - p_old + 1e-8) / (1 - p + 1e-8)
                    )
                    ok = (
                        (bkl <= cfg.eps_high or p <= p_old)
                        if a > 0
                        else (bkl <= cfg.eps_low or p >= p_old)
                    )
                loss = -a * min(float(r), cfg.dppo_ratio_cap) * x * float(ok)
            elif objective == "aspo":
                if a > 0:
                    flipped = torch.exp(x - x.detach()) / float(r)
                else:
                    flipped = r * (min(float(r), cfg.dual_clip_c) / float(r))
                loss = torch.maximum(-a * flipped, -a * torch.clamp(flipped, lo, hi))
            elif objective == "dhpo":
                mix = (
                    float(entropy[i, t].detach()) / h_max
                    if cfg.dhpo_mix == "entropy"
                    else cfg.dhpo_mix
                )
                s_lo, s_hi = 1 - cfg.eps_low, 1 + cfg.eps_high
                unclipped = mix * r + (1 - mix) * s
                clipped = mix * torch.clamp(r, lo, hi) + (1 - mix) * torch.clamp(s, s_lo, s_hi)
                loss = torch.maximum(-a * unclipped, -a * clipped)
            elif objective == "delight":
                gate = 1 / (1 + math.exp(-a * (-float(old[i, t])) / cfg.delight_eta))
                loss = -gate * a * x
            else:
                raise ValueError(objective)
            out[i][t] = loss
    return torch.stack([torch.stack(row) for row in out])


def kl_loop(lp, ref, estimator):
    """Per-token KL estimates by the textbook formulas (``+``: straight-through k2 gradient)."""
    base = estimator.rstrip("+")
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            x = ref[i, t] - lp[i, t]
            value = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - x - 1, "abs": torch.abs(x)}[
                base
            ]
            if estimator.endswith("+"):
                value = x * x / 2 - (x * x / 2).detach() + value.detach()
            out[i, t] = value
    return out


def policy_loss_reference(lp, old, adv, mask, cfg, *, ref=None, entropy=None):
    """The whole loss for one resolved `PolicyLossConfig` (no selections, no rollout
    correction): ratio, per-token objective, KL, aggregation (local normalisers), entropy bonus."""
    adv = adv.reshape(adv.shape[0], -1).expand_as(lp) if adv.dim() == 1 else adv
    rho, low, high = ratio_loop(
        cfg.ratio_level,
        lp,
        old,
        adv,
        mask,
        cfg.eps_low,
        cfg.eps_high,
        growth=cfg.prefix_bound_growth,
        minpro_prefix=cfg.minpro_prefix,
    )
    loss = token_loss_loop(cfg.objective, lp, old, adv, mask, rho, low, high, cfg, entropy)
    if cfg.beta:
        loss = loss + cfg.beta * kl_loop(lp, ref, cfg.kl_estimator)
    max_len = cfg.max_response_length or lp.shape[1]
    total = aggregate_loop(
        loss, mask, adv, cfg.loss_agg, max_len=max_len, length_power_alpha=cfg.length_power_alpha
    )
    if cfg.entropy_coef:
        total = total - cfg.entropy_coef * aggregate_loop(
            entropy,
            mask,
            adv,
            cfg.entropy_agg or cfg.loss_agg,
            max_len=max_len,
            length_power_alpha=cfg.length_power_alpha,
        )
    return total
