"""`policy_loss`: the objective library on per-token logprobs, padded or packed.

The pipeline, on right-padded ``[B, T]`` tensors (a packed batch is scattered into that grid
first, see `segments`): rollout rejection and STAPO narrow the mask; FRPO and probability
reweighting adjust the advantages; the ratio of the configured level feeds the objective; the
per-token policy loss is multiplied by the token selections, weights and rollout IS weight; the
KL term is added; the sum is aggregated; the entropy bonus is subtracted.

Chunked use (the contract `fused_policy_loss` relies on): everything that depends on the whole
batch is in `BatchGlobals`, computed by `policy_loss_globals` from the masks, advantages and
(where the config needs them) old/rollout logprobs and entropies of the whole batch. Calling
`policy_loss` on a subset of whole sequences with ``batch_globals`` of the full batch returns
that subset's exact share: the losses of a partition of the sequences sum to the full loss,
and so do their gradients. Exceptions: ``clip_cov`` and ``kl_cov`` select tokens from batch
statistics of the current logprobs (verl's definition) and need the whole batch in one call.
"""

from dataclasses import dataclass

import torch

from logitless.fused_losses import segments
from logitless.fused_losses.aggregation import (
    BatchGlobals,
    agg_counts,
    aggregate,
    check_global_counts,
)
from logitless.fused_losses.config import PolicyLossConfig
from logitless.fused_losses.kl import kl_estimate
from logitless.fused_losses.objectives import ObjectiveInputs, get_objective
from logitless.fused_losses.ratios import compute_ratio
from logitless.fused_losses.rollout_correction import (
    off_policy_sequence_keep,
    rollout_is_batch_mean,
    rollout_is_weight,
    rollout_log_ratio,
    rollout_rejection_keep,
)
from logitless.fused_losses.token_selection import (
    attention_entropy_stats,
    attention_entropy_weights,
    future_kl_advantages,
    probability_reweighted_advantages,
    quantile,
    stapo_keep,
    top_fraction_threshold,
)


@dataclass
class _Grid:
    """Inputs on the ``[B, T]`` grid; ``m`` the bool mask as given."""

    m: torch.Tensor
    adv: torch.Tensor
    width: int
    packed: bool
    tensors: dict


def _check_cu_seqlens(cu_seqlens, n):
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens: expected a 1-D integer tensor [B + 1]")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != n:
        raise ValueError(
            f"cu_seqlens: must start at 0 and end at N={n}, got "
            f"{int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
        )
    if (cu_seqlens[1:] < cu_seqlens[:-1]).any():
        raise ValueError("cu_seqlens: must be non-decreasing")


def _to_grid(mask, advantages, cu_seqlens, dtype, validate=True, **tensors) -> _Grid:
    """Validate shapes and NaNs, cast to ``dtype`` and scatter packed inputs into ``[B, T]``.

    ``validate=False`` skips the value checks (NaN, ``cu_seqlens`` order), which synchronise
    with the device; shapes are always checked (free)."""
    shape = mask.shape
    if cu_seqlens is None:
        if mask.dim() != 2:
            raise ValueError(f"mask: expected [B, T] (or [N] with cu_seqlens), got {tuple(shape)}")
        num_seqs = shape[0]
    else:
        if mask.dim() != 1:
            raise ValueError(f"mask: expected packed [N] with cu_seqlens, got {tuple(shape)}")
        if validate:
            _check_cu_seqlens(cu_seqlens, shape[0])
        num_seqs = cu_seqlens.numel() - 1
    for name, t in tensors.items():
        if t is None:
            continue
        if t.shape != shape:
            raise ValueError(
                f"{name}: expected shape {tuple(shape)} like mask, got {tuple(t.shape)}"
            )
        if validate and name != "rollout_logprobs" and torch.isnan(t).any():
            raise ValueError(f"{name}: contains NaN")
    if validate and torch.isnan(advantages).any():
        raise ValueError("advantages: contains NaN")
    if advantages.shape in ((num_seqs,), (num_seqs, 1)):
        per_sequence = True
    elif advantages.shape == shape:
        per_sequence = False
    else:
        raise ValueError(
            f"advantages: expected [{num_seqs}] per sequence or {tuple(shape)} per "
            f"token, got {tuple(advantages.shape)}"
        )
    adv = advantages.detach().to(dtype)
    m = mask != 0
    out = {name: None if t is None else t.to(dtype) for name, t in tensors.items()}
    if cu_seqlens is not None:
        m = segments.to_padded(m, cu_seqlens, False)
        out = {k: None if t is None else segments.to_padded(t, cu_seqlens) for k, t in out.items()}
        if not per_sequence:
            adv = segments.to_padded(adv, cu_seqlens)
    if per_sequence:
        adv = adv.reshape(num_seqs, 1).expand(num_seqs, m.shape[1])
    return _Grid(m, adv, m.shape[1], cu_seqlens is not None, out)


def check_policy_inputs(mask, advantages, *, cu_seqlens=None, **tensors) -> None:
    """Raise ``ValueError`` where `policy_loss` would (shapes, NaN, ``cu_seqlens``), without
    computing anything: lets a chunked caller validate the batch once."""
    with torch.no_grad():
        _to_grid(mask, advantages, cu_seqlens, torch.float32, True, **tensors)


def _dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def _kept_mask(grid: _Grid, cfg: PolicyLossConfig, old_lp, rollout_lp, entropy):
    """The mask after rollout rejection and STAPO (both renormalise over what remains)."""
    m = grid.m
    if cfg.rollout_rs is not None:
        if rollout_lp is None or old_lp is None:
            raise ValueError("rollout_logprobs: rollout_rs needs rollout_logprobs and old_logprobs")
        m = m & rollout_rejection_keep(
            rollout_log_ratio(old_lp, rollout_lp, m), m, cfg.rollout_rs_parsed
        )
    if cfg.stapo_prob_threshold is not None:
        if entropy is None or old_lp is None:
            raise ValueError("entropy: STAPO needs entropy and old_logprobs")
        m = stapo_keep(
            grid.adv, old_lp, entropy, m, cfg.stapo_prob_threshold, cfg.stapo_entropy_threshold
        )
    return m


def _globals_from_grid(grid: _Grid, cfg: PolicyLossConfig) -> BatchGlobals:
    t = grid.tensors
    entropy, hatt = t.get("entropy"), t.get("attention_entropy")
    m = _kept_mask(grid, cfg, t.get("old_logprobs"), t.get("rollout_logprobs"), entropy)
    needs_entropy = cfg.top_entropy_quantile < 1 or cfg.adv_entropy_top_fraction < 1
    if needs_entropy and entropy is None:
        raise ValueError("entropy: top_entropy_quantile / adv_entropy_top_fraction need entropy")
    entropy_threshold = adv_entropy_threshold = attn_stats = attn_thresholds = None
    entropy_mask = m
    if cfg.top_entropy_quantile < 1:
        entropy_threshold = top_fraction_threshold(entropy, m, cfg.top_entropy_quantile)
        entropy_mask = (
            m & (entropy >= entropy_threshold) if entropy_threshold is not None else m & False
        )
    if cfg.adv_entropy_top_fraction < 1:
        adv_entropy_threshold = top_fraction_threshold(
            grid.adv.abs() * entropy, m, cfg.adv_entropy_top_fraction
        )
    if cfg.attn_entropy_weighting is not None:
        if hatt is None:
            raise ValueError("attention_entropy: attn_entropy_weighting needs attention_entropy")
        attn_stats = attention_entropy_stats(hatt, m)
        valid = hatt.detach()[m]
        if valid.numel():
            q = cfg.attn_entropy_quantile
            attn_thresholds = (float(quantile(valid, q)), float(quantile(valid, 1 - q)))
    if cfg.max_response_length is not None:
        max_len = float(cfg.max_response_length)
    elif grid.packed and cfg.loss_agg == "seq-mean-token-sum-norm":
        raise ValueError(
            "max_response_length: seq-mean-token-sum-norm on a packed batch needs "
            "PolicyLossConfig.max_response_length (the padded width is not known)"
        )
    else:
        max_len = float(grid.width)
    is_weight_mean = None
    if cfg.rollout_is is not None and cfg.rollout_is_batch_normalize:
        old_lp, roll_lp = t.get("old_logprobs"), t.get("rollout_logprobs")
        if old_lp is None or roll_lp is None:
            raise ValueError("rollout_logprobs: rollout_is_batch_normalize needs "
                             "rollout_logprobs and old_logprobs of the whole batch")
        weight = rollout_is_weight(rollout_log_ratio(old_lp, roll_lp, grid.m), grid.m, cfg)
        is_weight_mean = rollout_is_batch_mean(weight, grid.m, cfg.rollout_is)
    return BatchGlobals(
        loss=agg_counts(m, grid.adv, cfg.seq_count, cfg.length_power_alpha),
        entropy=agg_counts(entropy_mask, grid.adv, cfg.seq_count, cfg.length_power_alpha),
        max_response_length=max_len,
        entropy_threshold=None if entropy_threshold is None else float(entropy_threshold),
        adv_entropy_threshold=None
        if adv_entropy_threshold is None
        else float(adv_entropy_threshold),
        attn_stats=attn_stats,
        attn_thresholds=attn_thresholds,
        is_weight_mean=is_weight_mean,
    )


def policy_loss_globals(
    mask,
    advantages,
    config: PolicyLossConfig,
    *,
    old_logprobs=None,
    rollout_logprobs=None,
    entropy=None,
    attention_entropy=None,
    cu_seqlens=None,
) -> BatchGlobals:
    """`BatchGlobals` of a whole batch (same layouts and arguments as `policy_loss`).

    Needs ``old_logprobs``/``rollout_logprobs`` when the config rejects by rollout divergence,
    ``entropy`` for entropy selections and STAPO, ``attention_entropy`` for attention weighting.
    For the fused path the entropies may come from the old-policy pass.
    """
    dtype = _dtype(old_logprobs if old_logprobs is not None else advantages)
    with torch.no_grad():
        grid = _to_grid(
            mask,
            advantages,
            cu_seqlens,
            dtype,
            old_logprobs=old_logprobs,
            rollout_logprobs=rollout_logprobs,
            entropy=entropy,
            attention_entropy=attention_entropy,
        )
        return _globals_from_grid(grid, config)


def _as_tensor(value, grid_like, cu_seqlens, name):
    """A scalar or per-token tensor knob, on the grid (knobs never receive gradients)."""
    if not isinstance(value, torch.Tensor):
        return torch.tensor(float(value), dtype=grid_like.dtype, device=grid_like.device)
    value = value.detach().to(grid_like)
    if value.dim() == 0:
        return value
    expected = grid_like.shape if cu_seqlens is None else (int(cu_seqlens[-1]),)
    if tuple(value.shape) != tuple(expected):
        raise ValueError(
            f"{name}: per-token tensor must be laid out like logprobs {tuple(expected)}"
        )
    return value if cu_seqlens is None else segments.to_padded(value, cu_seqlens)


def _masked_mean(x, m):
    n = m.sum()
    return torch.where(m, x, torch.zeros_like(x)).sum() / n.clamp(min=1)


def _masked_min_max(x, m):
    if not m.any():
        zero = x.new_zeros(())
        return zero, zero
    v = x[m]
    return v.min(), v.max()


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    config: PolicyLossConfig,
    *,
    ref_logprobs=None,
    rollout_logprobs=None,
    entropy=None,
    token_weights=None,
    attention_entropy=None,
    cu_seqlens=None,
    num_items_in_batch=None,
    global_batch_size=None,
    batch_globals: BatchGlobals | None = None,
    training_progress: float | None = None,
    entropy_coef: float | None = None,
    validate: bool = True,
    compute_metrics: bool = True,
):
    """Policy loss and metrics from per-token logprobs.

    Args:
        logprobs: ``[B, T]`` right-padded or ``[N]`` packed (with ``cu_seqlens [B + 1]``),
            log pi_theta of the sampled tokens, with gradient.
        old_logprobs, ref_logprobs, rollout_logprobs: like ``logprobs``, no gradient;
            ``rollout_logprobs`` may hold NaN where the engine gave no value.
        advantages: ``[B]`` (or ``[B, 1]``) per sequence, or per token like ``logprobs``.
        mask: like ``logprobs``, nonzero for tokens in the loss.
        config: `PolicyLossConfig`.
        entropy: like ``logprobs``, token entropies; the entropy bonus differentiates it.
        token_weights: like ``logprobs``, external per-token weights of the policy term.
        attention_entropy: like ``logprobs``, per-token attention entropies (weighting input).
        num_items_in_batch: tokens of the whole optimizer step over all ranks and micro-batches
            (global token-mean normaliser); global_batch_size: its sequences (seq-mean-*).
            Numbers (or one-element tensors) > 0; 0 only for a batch without loss tokens.
        batch_globals: `BatchGlobals` of the full batch for chunked use (module docstring).
        training_progress: in [0, 1], drives the attention-entropy alpha schedule.
        entropy_coef: overrides ``config.entropy_coef`` (for `AdaptiveEntropyCoef`).
        validate: ``False`` skips the NaN, ``cu_seqlens`` and global-count checks, which
            synchronise with the device: for callers that validated the whole batch once and
            now run chunks of it (``fused_policy_loss``).
        compute_metrics: ``False`` returns an empty metrics dict (no metric work).

    Returns:
        ``(loss, metrics)``: a scalar (dtype of the logprobs, at least fp32) and a dict of
        detached scalars: ``clip_ratio/low|high|region``, ``kl``, ``approx_kl``,
        ``ratio/min|mean|max``, ``entropy/mean``, ``is_weight/min|mean|max``,
        ``entropy/bonus_sum|bonus_tokens`` (over the tokens the entropy bonus acts on),
        ``masked_fraction``.
    """
    cfg = config
    spec = get_objective(cfg.objective)
    if logprobs.dim() == 1 and cu_seqlens is None:
        raise ValueError("cu_seqlens: a packed [N] batch needs cu_seqlens")
    if old_logprobs is None:
        raise ValueError("old_logprobs: required (pass logprobs.detach() when on-policy)")
    dtype = _dtype(logprobs)
    grid = _to_grid(
        mask,
        advantages,
        cu_seqlens,
        dtype,
        validate,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        entropy=entropy,
        token_weights=token_weights,
        attention_entropy=attention_entropy,
    )
    t = grid.tensors
    lp, old_lp, ref_lp, roll_lp = (
        t["logprobs"],
        t["old_logprobs"].detach(),
        t["ref_logprobs"],
        t["rollout_logprobs"],
    )
    ent = t["entropy"]
    if ref_lp is not None:
        ref_lp = ref_lp.detach()
    if spec.needs_whole_batch and batch_globals is not None:
        raise ValueError(
            f"batch_globals: {cfg.objective} selects tokens from statistics of the "
            "whole batch and cannot run on a chunk"
        )
    glob = batch_globals if batch_globals is not None else _globals_from_grid(grid, cfg)
    if validate:
        check_global_counts(num_items_in_batch, global_batch_size, glob.loss)

    m_in = grid.m
    m = _kept_mask(grid, cfg, old_lp, roll_lp, ent)
    adv = grid.adv
    beta = _as_tensor(cfg.beta, lp, cu_seqlens, "beta")
    eps_low = _as_tensor(cfg.eps_low, lp, cu_seqlens, "eps_low")
    eps_high = _as_tensor(cfg.eps_high, lp, cu_seqlens, "eps_high")
    uses_kl = isinstance(cfg.beta, torch.Tensor) or cfg.beta != 0
    if (uses_kl or cfg.future_kl_coef) and ref_lp is None:
        raise ValueError("ref_logprobs: beta != 0 and future_kl_coef need ref_logprobs")
    if cfg.future_kl_coef:
        adv = future_kl_advantages(adv, lp, ref_lp, m, cfg.future_kl_coef)
    if cfg.prob_reweight_alpha:
        adv = probability_reweighted_advantages(adv, lp, cfg.prob_reweight_alpha)

    # Selections zero the policy term of a token without changing the normalisers (TRL's
    # entropy mask); weights scale it. All are detached.
    select = m
    if cfg.top_entropy_quantile < 1:
        thr = glob.entropy_threshold
        select = select & (ent.detach() >= thr) if thr is not None else select & False
    entropy_mask = select
    if cfg.adv_entropy_top_fraction < 1:
        thr = glob.adv_entropy_threshold
        keep = (grid.adv.abs() * ent.detach() >= thr) if thr is not None else torch.zeros_like(m)
        select = select & keep
    factor = torch.ones_like(lp).detach()
    if cfg.opsm_threshold is not None:
        sampling = roll_lp if roll_lp is not None else old_lp
        factor = factor * off_policy_sequence_keep(lp, sampling, grid.adv, m, cfg.opsm_threshold)
    if cfg.attn_entropy_weighting is not None:
        factor = factor * attention_entropy_weights(
            t["attention_entropy"],
            m,
            cfg,
            stats=glob.attn_stats,
            thresholds=glob.attn_thresholds,
            progress=training_progress,
        )
    if t["token_weights"] is not None:
        factor = factor * t["token_weights"].detach()
    is_weight = None
    if cfg.rollout_is is not None:
        if roll_lp is None:
            raise ValueError("rollout_logprobs: rollout_is needs rollout_logprobs")
        # Over the mask as given: a sequence's IS weight is its likelihood ratio, rejected
        # tokens included (as verl's rollout-correction helper computes it).
        is_weight = rollout_is_weight(rollout_log_ratio(old_lp, roll_lp, m_in), m_in, cfg)
        if cfg.rollout_is_batch_normalize:
            if glob.is_weight_mean is None:
                raise ValueError("batch_globals: computed without rollout_is_batch_normalize")
            is_weight = is_weight / glob.is_weight_mean

    d = lp - old_lp
    if cfg.log_ratio_clamp is not None:
        d = d.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio_mask = select if spec.selects_in_ratio else m
    ratio = compute_ratio(cfg.ratio_level, d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask)
    out = spec.fn(
        ObjectiveInputs(
            lp,
            old_lp,
            d,
            adv,
            m,
            ratio,
            cfg,
            eps_low,
            eps_high,
            ent,
            is_weight if spec.folds_rollout_is else None,
        )
    )
    pg = out.loss * factor
    if not spec.selects_in_ratio:
        pg = pg * select
    if is_weight is not None and not spec.folds_rollout_is:
        pg = pg * is_weight
    per_token = pg
    kl = None
    if ref_lp is not None:
        kl = kl_estimate(lp, ref_lp, cfg.kl_estimator, clamp=cfg.kl_clamp)
        if cfg.kl_bias_correction:
            kl = kl * (ratio.value if cfg.kl_bias_correction_grad else ratio.value.detach())
        if uses_kl:
            per_token = per_token + beta * kl

    agg_args = dict(
        max_response_length=glob.max_response_length,
        num_items_in_batch=num_items_in_batch,
        global_batch_size=global_batch_size,
    )
    loss = aggregate(per_token, m, grid.adv, cfg.loss_agg, glob.loss, cfg, **agg_args)
    coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
    if coef:
        if ent is None:
            raise ValueError("entropy: entropy_coef != 0 needs entropy")
        mode = cfg.entropy_agg or cfg.loss_agg
        loss = loss - coef * aggregate(
            ent, entropy_mask, grid.adv, mode, glob.entropy, cfg, **agg_args
        )

    if not compute_metrics:
        return loss, {}
    with torch.no_grad():
        metrics = _metrics(out, ratio, d, kl, ent, is_weight, m_in, m, select, factor, cfg)
        if ent is not None:  # what an adaptive entropy coefficient accumulates
            metrics["entropy/bonus_sum"] = torch.where(entropy_mask, ent, 0.0).sum().detach()
            metrics["entropy/bonus_tokens"] = entropy_mask.sum().to(d.dtype)
    return loss, metrics


def _metrics(out, ratio, d, kl, ent, is_weight, m_in, m, select, factor, cfg):
    zero = d.new_zeros(())
    metrics = {}
    per_seq = ratio.per_sequence if out.flags_per_sequence is None else out.flags_per_sequence
    if out.clip_low is not None:
        low, high = out.clip_low & m_in, out.clip_high & m_in
        region = low | high
        for name, flag in (("low", low), ("high", high), ("region", region)):
            if per_seq:
                # one flag per sequence, averaged over every sequence (TRL's convention)
                value = flag.any(-1).to(d.dtype).sum() / max(flag.shape[0], 1)
            else:
                value = _masked_mean(flag.to(d.dtype), m_in)
            metrics[f"clip_ratio/{name}"] = value
    metrics["kl"] = _masked_mean(kl, m_in) if kl is not None else zero
    metrics["approx_kl"] = _masked_mean(-d, m_in)
    rmin, rmax = _masked_min_max(ratio.value, m_in)
    metrics.update(
        {"ratio/min": rmin, "ratio/mean": _masked_mean(ratio.value, m_in), "ratio/max": rmax}
    )
    metrics["entropy/mean"] = _masked_mean(ent, m_in) if ent is not None else zero
    if is_weight is not None:
        if cfg.rollout_is == "token":
            w, wm = is_weight, m_in
        else:  # one weight per sequence, over every sequence (TRL's convention)
            w = (
                is_weight[:, :1]
                if is_weight.shape[1]
                else is_weight.new_ones(is_weight.shape[0], 1)
            )
            wm = torch.ones_like(w, dtype=torch.bool)
        wmin, wmax = _masked_min_max(w, wm)
        metrics.update(
            {"is_weight/min": wmin, "is_weight/mean": _masked_mean(w, wm), "is_weight/max": wmax}
        )
    live = m & select & (factor != 0)
    if is_weight is not None:
        live = live & (is_weight != 0)
    n_in = m_in.sum()
    metrics["masked_fraction"] = (m_in & ~live).sum().to(d.dtype) / n_in.clamp(min=1)
    return {k: v.detach() for k, v in metrics.items()}
