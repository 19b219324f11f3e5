"""Plain-loop reference of the objective library: one sequence, one token at a time, in fp64.

Written for obviousness, not speed: scans are running values in a loop, quantiles come from a
sorted Python list, aggregations sum sequence by sequence. Inputs are right-padded ``[B, T]``
with a 0/1 mask; per-token values are torch scalars so autograd gives the reference gradients.
What an objective is (its family and flags) is read from the registry, the one source of that
metadata; the formulas here are the reference's own.
"""

import math

import torch

from logitless.fused_losses.objectives.catalog import get_objective
from logitless.reference.segments import valid_tokens as _valid
from logitless.reference.token_losses import token_loss_loop, value_at


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
    """Per-token ratio values (with gradient) and clip bounds ``(low, high)`` per token.
    ``eps_low``/``eps_high`` are scalars or per-token ``[B, T]`` tensors."""
    B, T = lp.shape
    rho = [[lp.new_ones(()) for _ in range(T)] for _ in range(B)]
    low = [[1 - value_at(eps_low, i, t) for t in range(T)] for i in range(B)]
    high = [[1 + value_at(eps_high, i, t) for t in range(T)] for i in range(B)]
    for i in range(B):
        valid = _valid(mask, i)
        n = max(len(valid), 1)
        d = {t: lp[i, t] - old[i, t] for t in valid}
        if level in ("sequence", "sequence_token", "geometric"):
            if level == "geometric":
                parts = []
                for t in valid:
                    s = float(torch.sign(adv[i, t]))
                    clipped = d[t].clamp(-value_at(eps_low, i, t), value_at(eps_high, i, t))
                    parts.append(s * torch.minimum(s * d[t], s * clipped))
                low[i], high[i] = [0.0] * T, [math.inf] * T
            else:
                parts = [d[t] for t in valid]
            log_s = sum(parts, lp.new_zeros(())) / n
            if level != "sequence_token":  # one value per sequence, at every position
                rho[i] = [torch.exp(log_s)] * T
                continue
        running, running_min = lp.new_zeros(()), math.inf
        for count, t in enumerate(valid, start=1):
            r = torch.exp(d[t])
            if level == "token":
                rho[i][t] = r
            elif level == "sequence_token":
                rho[i][t] = torch.exp(log_s.detach() + lp[i, t] - lp[i, t].detach())
            elif level == "prefix_cumulative":
                running = running + d[t]
                g = {"sqrt": math.sqrt(count), "linear": float(count), "constant": 1.0}[growth]
                rho[i][t] = torch.exp(running)
                low[i][t] = math.exp(-value_at(eps_low, i, t) * g)
                high[i][t] = math.exp(value_at(eps_high, i, t) * g)
            elif level == "prefix_min":
                if minpro_prefix == "inclusive":
                    running_min = min(running_min, float(r.detach()))
                    mu = running_min
                else:
                    mu = float(r.detach()) * (1.0 if math.isinf(running_min) else running_min)
                    running_min = min(running_min, float(r.detach()))
                rho[i][t] = r * (mu / float(r.detach()))
    return rho, low, high


def aggregate_loop(loss, mask, adv, mode, *, max_len=None, length_power_alpha=0.5,
                   group_size=None, divisor=None):
    """One scalar from ``loss [B, T]``; local normalisers, every sequence counted (TRL);
    ``group_size`` the prompt groups of ``prompt-mean``, ``divisor`` that of ``constant``."""
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
    if mode == "constant":
        return total / (B * divisor)
    if mode == "prompt-mean":
        groups = [range(g, g + group_size) for g in range(0, B, group_size)]
        return sum(sum(sums[i] for i in g) / max(sum(lens[i] for i in g), 1)
                   for g in groups) / len(groups)
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
        if not denom:  # no sequence with a token: nothing to weight
            return loss.new_zeros(())
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


KL_NAMES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's names of the estimators


def kl_loop(lp, ref, estimator, clamp=False):
    """Per-token KL estimates by the textbook formulas (``+``: straight-through k2 gradient;
    ``clamp``: verl's k3 guard, before the ``+`` form like any other value)."""
    base = estimator.rstrip("+")
    base = KL_NAMES.get(base, base)
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            x = ref[i, t] - lp[i, t]
            if clamp and base == "k3":
                xc = x.clamp(-20.0, 20.0)
                value = (torch.exp(xc) - xc - 1).clamp(-10.0, 10.0)
            else:
                value = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - x - 1,
                         "abs": torch.abs(x)}[base]
            if estimator.endswith("+"):
                value = x * x / 2 - (x * x / 2).detach() + value.detach()
            out[i, t] = value
    return out


def rollout_is_weight_loop(old, rollout, mask, level, mode, lo, hi):
    """TIS / MIS weights per token as nested lists; NaN rollout values give a zero log-ratio."""
    B, T = old.shape
    out = [[1.0] * T for _ in range(B)]
    for i in range(B):
        valid = _valid(mask, i)
        diffs = {t: float(old[i, t] - rollout[i, t]) for t in valid}
        diffs = {t: 0.0 if math.isnan(v) else v for t, v in diffs.items()}
        seq = sum(diffs.values())
        if level == "sequence_geometric":
            seq = seq / max(len(valid), 1)
        for t in valid:
            w = math.exp(max(-20.0, min(20.0, diffs[t] if level == "token" else seq)))
            if mode == "truncate":
                w = min(w, hi) if hi is not None else w
                w = max(w, lo) if lo is not None else w
            elif not ((lo is None or w >= lo) and (hi is None or w <= hi)):
                w = 0.0
            out[i][t] = w
    return out


def attention_weight_loop(hatt, mask, cfg, batch_stats, thresholds, alpha):
    """Attention-entropy weights per token as nested lists (see `attention_entropy_weights`)."""
    B, T = hatt.shape
    out = [[1.0] * T for _ in range(B)]
    for i in range(B):
        valid = _valid(mask, i)
        h = {t: float(hatt[i, t]) for t in valid}
        if cfg.attn_entropy_weighting in ("low_quantile", "high_quantile"):
            for t in valid:
                keep = (
                    (h[t] <= thresholds[0])
                    if cfg.attn_entropy_weighting == "low_quantile"
                    else (h[t] >= thresholds[1])
                )
                out[i][t] = float(keep)
            continue
        if cfg.attn_entropy_standardize == "batch":
            mean, std = batch_stats
        else:
            mean = sum(h.values()) / max(len(valid), 1)
            std = math.sqrt(sum((v - mean) ** 2 for v in h.values()) / max(len(valid), 1))
        z = {t: (h[t] - mean) / (std + 1e-8) for t in valid}
        if cfg.attn_entropy_weighting == "tanh":
            for t in valid:
                out[i][t] = 1 + alpha * math.tanh(z[t])
        else:
            top = max((alpha * v for v in z.values()), default=0.0)
            norm = sum(math.exp(alpha * v - top) for v in z.values())
            for t in valid:
                out[i][t] = len(valid) * math.exp(alpha * z[t] - top) / norm
    return out


def _kept_mask_loop(old, adv, mask, h, cfg, rollout):
    """The mask after rollout rejection and STAPO."""
    kept = mask.clone()
    if cfg.rollout_rs is not None:
        kept &= rollout_rejection_keep_loop(old, rollout, mask, cfg.rollout_rs_parsed)
    if cfg.stapo_prob_threshold is not None:
        for i in range(kept.shape[0]):
            for t in _valid(kept, i):
                if (
                    adv[i, t] > 0
                    and math.exp(float(old[i, t])) < cfg.stapo_prob_threshold
                    and float(h[i, t]) < cfg.stapo_entropy_threshold
                ):
                    kept[i, t] = False
    return kept


def _advantages_loop(lp, ref, adv, mask, cfg):
    """FRPO's future-KL correction, then probability reweighting."""
    a = adv.clone()
    if cfg.future_kl_coef:
        for i in range(a.shape[0]):
            ts = _valid(mask, i)
            for t in ts:
                a[i, t] = a[i, t] - cfg.future_kl_coef * sum(
                    float(lp[i, j].detach() - ref[i, j]) for j in ts if j >= t
                )
    if cfg.prob_reweight_alpha:
        for i in range(a.shape[0]):
            for t in _valid(mask, i):
                p = math.exp(float(lp[i, t].detach()))
                a[i, t] = (cfg.prob_reweight_alpha * p + 1 - cfg.prob_reweight_alpha) * a[i, t]
    return a


def _selections_loop(h, adv, mask, cfg):
    """``(select, entropy_select)``: the tokens the policy term and the entropy bonus act on."""
    valid = [(i, t) for i in range(mask.shape[0]) for t in _valid(mask, i)]
    select = mask.clone()
    if cfg.top_entropy_quantile < 1 and valid:
        thr = quantile_loop([float(h[k]) for k in valid], 1 - cfg.top_entropy_quantile)
        for k in valid:
            select[k] = float(h[k]) >= thr
    entropy_select = select.clone()
    if cfg.adv_entropy_top_fraction < 1 and valid:
        scores = {k: abs(float(adv[k])) * float(h[k]) for k in valid}
        thr = quantile_loop(list(scores.values()), 1 - cfg.adv_entropy_top_fraction)
        for k in valid:
            select[k] = select[k] and scores[k] >= thr
    return select, entropy_select


def _opsm_loop(lp, sampling, adv, mask, cfg, factor):
    """OPSM: zero the negative-advantage tokens of sequences that drifted off-policy."""
    for i in range(mask.shape[0]):
        ts = _valid(mask, i)
        divs = [float(sampling[i, t] - lp[i, t].detach()) for t in ts]
        avg = sum(0.0 if math.isnan(v) else v for v in divs) / max(len(ts), 1)
        for t in ts:
            if adv[i, t] < 0 and avg > cfg.opsm_threshold:
                factor[i, t] = 0.0


def _attention_factor_loop(attention_entropy, mask, cfg, training_progress):
    """Attention-entropy weights with their batch statistics, quantiles and alpha schedule."""
    valid = [(i, t) for i in range(mask.shape[0]) for t in _valid(mask, i)]
    hv = [float(attention_entropy[k]) for k in valid]
    n = len(hv)
    mean = sum(hv) / max(n, 1)
    # unbiased spread; one token has none (z = 0, weight 1, as a sequence of one token)
    std = math.sqrt(sum((v - mean) ** 2 for v in hv) / (n - 1)) if n > 1 else 0.0
    stats = (mean, std)
    q = cfg.attn_entropy_quantile
    thresholds = (quantile_loop(hv, q), quantile_loop(hv, 1 - q)) if hv else None
    alpha = cfg.attn_entropy_alpha
    if cfg.attn_entropy_alpha_final is not None and training_progress is not None:
        alpha += (cfg.attn_entropy_alpha_final - alpha) * training_progress
    return attention_weight_loop(attention_entropy, mask, cfg, stats, thresholds, alpha)


def _factor_loop(lp, old, adv, mask, cfg, rollout, token_weights, attention_entropy, progress):
    """The per-token factor of the policy term: OPSM, attention weights, token weights."""
    factor = torch.ones(lp.shape, dtype=lp.dtype)
    if cfg.opsm_threshold is not None:
        _opsm_loop(lp, rollout if rollout is not None else old, adv, mask, cfg, factor)
    if cfg.attn_entropy_weighting is not None:
        weights = _attention_factor_loop(attention_entropy, mask, cfg, progress)
        factor = factor * torch.tensor(weights, dtype=lp.dtype)
    if token_weights is not None:
        factor = factor * token_weights
    return factor


def _policy_term_loop(lp, old, a, mask, select, factor, is_weight, cfg, entropy):
    """The objective's per-token loss times the selections, factors and IS weight; and the
    ratio (the KL bias correction reads it)."""
    spec = get_objective(cfg.objective)
    rho, low, high = ratio_loop(
        cfg.ratio_level,
        lp,
        old,
        a,
        select if spec.selects_in_ratio else mask,
        cfg.eps_low,
        cfg.eps_high,
        growth=cfg.prefix_bound_growth,
        minpro_prefix=cfg.minpro_prefix,
    )
    folds = spec.folds_rollout_is
    loss = token_loss_loop(
        cfg.objective, lp, old, a, mask, rho, low, high, cfg, entropy, is_weight if folds else None
    )
    loss = loss * factor
    if not spec.selects_in_ratio:
        loss = loss * select
    if is_weight is not None and not folds:
        loss = loss * torch.tensor(is_weight, dtype=lp.dtype)
    return loss, torch.stack([torch.stack(row) for row in rho])


def _kl_term_loop(lp, ref, ratio, cfg, exact_kl=None):
    """``beta`` times the per-token KL: the estimate, or the exact KL given (``"exact"``)."""
    if cfg.kl_estimator == "exact":
        kl = exact_kl
    else:
        kl = kl_loop(lp, ref, cfg.kl_estimator, clamp=cfg.kl_clamp)
    if cfg.kl_bias_correction:
        kl = kl * (ratio if cfg.kl_bias_correction_grad else ratio.detach())
    return cfg.beta * kl


def policy_loss_reference(
    lp,
    old,
    adv,
    mask,
    cfg,
    *,
    ref=None,
    entropy=None,
    rollout=None,
    token_weights=None,
    attention_entropy=None,
    training_progress=None,
    kl=None,
):
    """The whole loss of one resolved `PolicyLossConfig`, token by token (``kl``: the exact
    per-token KL for ``kl_estimator="exact"``): rollout rejection and
    STAPO narrow the mask; FRPO and probability reweighting adjust A; entropy / |A| H top
    fractions select tokens; OPSM, attention weights, token weights and rollout IS weights scale
    the policy term; KL is added; local normalisers; the entropy bonus is subtracted."""
    B, T = lp.shape
    adv = adv.reshape(B, 1).expand(B, T) if adv.dim() == 1 else adv
    m_in = mask.bool().clone()
    h = None if entropy is None else entropy.detach()  # selections read values only
    mask = _kept_mask_loop(old, adv, m_in, h, cfg, rollout)
    a = _advantages_loop(lp, ref, adv, mask, cfg)
    select, entropy_select = _selections_loop(h, adv, mask, cfg)
    factor = _factor_loop(
        lp, old, adv, mask, cfg, rollout, token_weights, attention_entropy, training_progress
    )
    is_weight = None
    if cfg.rollout_is is not None:
        is_weight = rollout_is_weight_loop(
            old,
            rollout,
            m_in,  # the mask as given: rejected tokens stay in a sequence's likelihood ratio
            cfg.rollout_is,
            cfg.rollout_is_mode,
            cfg.rollout_is_min,
            cfg.rollout_is_max,
        )
    loss, ratio = _policy_term_loop(lp, old, a, mask, select, factor, is_weight, cfg, entropy)
    if (ref is not None or kl is not None) and (isinstance(cfg.beta, torch.Tensor) or cfg.beta):
        loss = loss + _kl_term_loop(lp, ref, ratio, cfg, kl)
    max_len = cfg.max_response_length or T
    total = aggregate_loop(
        loss, mask, adv, cfg.loss_agg, max_len=max_len, length_power_alpha=cfg.length_power_alpha,
        group_size=cfg.prompt_group_size, divisor=cfg.loss_agg_divisor
    )
    if cfg.entropy_coef:
        total = total - cfg.entropy_coef * aggregate_loop(
            entropy,
            mask & entropy_select,
            adv,
            cfg.entropy_agg or cfg.loss_agg,
            max_len=max_len,
            length_power_alpha=cfg.length_power_alpha,
            group_size=cfg.prompt_group_size,
            divisor=cfg.loss_agg_divisor,
        )
    return total
