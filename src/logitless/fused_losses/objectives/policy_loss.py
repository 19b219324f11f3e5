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

import dataclasses
from dataclasses import dataclass

import torch

from logitless.fused_losses.objectives import context_parallel as cp
from logitless.fused_losses.objectives.aggregation import (
    BatchGlobals,
    agg_counts,
    aggregate,
    check_global_counts,
    host_value,
    prompt_weights,
)
from logitless.fused_losses.objectives.catalog import (
    ObjectiveInputs,
    ObjectiveOutput,
    get_objective,
)
from logitless.fused_losses.objectives.config import KL_EXACT, PolicyLossConfig
from logitless.fused_losses.objectives.kl import kl_estimate
from logitless.fused_losses.objectives.policy_inputs import Batch, promoted_dtype, to_batch
from logitless.fused_losses.objectives.ratios import Ratio, compute_ratio
from logitless.fused_losses.objectives.rollout_correction import (
    off_policy_sequence_keep,
    rollout_is_batch_mean,
    rollout_is_weight,
    rollout_log_ratio,
    rollout_rejection_keep,
)
from logitless.fused_losses.objectives.token_selection import (
    attention_entropy_stats,
    attention_entropy_weights,
    future_kl_advantages,
    masked_quantile,
    probability_reweighted_advantages,
    stapo_keep,
    top_fraction_threshold,
)
from logitless.fused_losses.oplib import is_compiling


def _kept_mask(batch: Batch, cfg: PolicyLossConfig) -> torch.Tensor:
    """The mask after rollout rejection and STAPO (both renormalise over what remains)."""
    m, old_lp, rollout_lp = batch.m, batch["old_logprobs"], batch["rollout_logprobs"]
    entropy = batch["entropy"]
    if cfg.rollout_rs is not None:
        if rollout_lp is None or old_lp is None:
            raise ValueError("rollout_logprobs: rollout_rs needs rollout_logprobs and old_logprobs")
        m = m & rollout_rejection_keep(
            rollout_log_ratio(old_lp, rollout_lp, m), m, cfg.rollout_rs_parsed, batch.cp_group
        )
    if cfg.stapo_prob_threshold is not None:
        if entropy is None or old_lp is None:
            raise ValueError("entropy: STAPO needs entropy and old_logprobs")
        m = stapo_keep(
            batch.adv, old_lp, entropy, m, cfg.stapo_prob_threshold, cfg.stapo_entropy_threshold
        )
    return m


@dataclass
class Masks:
    """The masks of one call: ``given`` as passed; ``kept`` after rejection and STAPO (what the
    normalisers count); ``entropy`` ``kept`` narrowed by the entropy-quantile selection (where
    the entropy bonus acts); ``select`` further narrowed by the |A| H selection (where the
    policy term acts). Selections zero a token's policy term without changing the normalisers
    (TRL's entropy mask)."""

    given: torch.Tensor
    kept: torch.Tensor
    entropy: torch.Tensor
    select: torch.Tensor
    # prompt-mean's per-token weights over ``kept`` and over ``entropy`` (`prompt_weights`),
    # None unless the loss / entropy aggregation is prompt-mean
    loss_weight: torch.Tensor | None = None
    entropy_weight: torch.Tensor | None = None

    def rows(self, s0: int, s1: int, width: int) -> "Masks":
        """Sequences ``s0:s1``, positions ``:width`` (as `Batch.rows`)."""
        return Masks(*(None if t is None else t[s0:s1, :width]
                        for t in (self.given, self.kept, self.entropy, self.select,
                                  self.loss_weight, self.entropy_weight)))


def globals_read_old_logprobs(cfg: PolicyLossConfig) -> bool:
    """Whether the batch's globals read the old logprobs (`_kept_mask`'s rollout rejection and
    STAPO, `_is_weight_mean`): an on-policy chunked caller computes them before its chunks."""
    return (cfg.rollout_rs is not None or cfg.stapo_prob_threshold is not None
            or (cfg.rollout_is is not None and cfg.rollout_is_batch_normalize))


def _selection_masks(batch, cfg, kept, entropy_threshold, adv_entropy_threshold) -> Masks:
    ent = batch["entropy"]
    entropy_mask = kept
    if cfg.top_entropy_quantile < 1:
        thr = entropy_threshold
        entropy_mask = kept & (ent.detach() >= thr) if thr is not None else kept & False
    select = entropy_mask
    if cfg.adv_entropy_top_fraction < 1:
        thr = adv_entropy_threshold
        keep = (batch.adv.abs() * ent.detach() >= thr) if thr is not None else kept & False
        select = select & keep
    return Masks(batch.m, kept, entropy_mask, select)


def _max_response_length(batch: Batch, cfg: PolicyLossConfig) -> float:
    if cfg.max_response_length is not None:
        return float(cfg.max_response_length)
    if batch.packed and cfg.loss_agg == "seq-mean-token-sum-norm":
        raise ValueError(
            "max_response_length: seq-mean-token-sum-norm on a packed batch needs "
            "PolicyLossConfig.max_response_length (the padded width is not known)"
        )
    return float(batch.width)


def _attention_globals(batch, cfg, kept):
    hatt = batch["attention_entropy"]
    if hatt is None:
        raise ValueError("attention_entropy: attn_entropy_weighting needs attention_entropy")
    q = cfg.attn_entropy_quantile
    low, n = masked_quantile(hatt, kept, q)
    high = masked_quantile(hatt, kept, 1 - q)[0]
    thresholds = (host_value(low), host_value(high))
    if not is_compiling() and int(n) == 0:
        thresholds = None  # no valid token (under compile: every comparison is masked)
    return attention_entropy_stats(hatt, kept), thresholds


def _is_weight_mean(batch, cfg):
    old_lp, roll_lp = batch["old_logprobs"], batch["rollout_logprobs"]
    if old_lp is None or roll_lp is None:
        raise ValueError("rollout_logprobs: rollout_is_batch_normalize needs "
                         "rollout_logprobs and old_logprobs of the whole batch")
    weight = rollout_is_weight(rollout_log_ratio(old_lp, roll_lp, batch.m), batch.m, cfg,
                               batch.cp_group)
    return rollout_is_batch_mean(weight, batch.m, cfg.rollout_is, batch.cp_group)


def _globals(batch: Batch, cfg: PolicyLossConfig, kept) -> tuple[BatchGlobals, Masks]:
    """The batch's `BatchGlobals`, and its masks (computed on the way, so a caller that runs the
    loss on the same batch need not compute them again)."""
    entropy = batch["entropy"]
    needs_entropy = cfg.top_entropy_quantile < 1 or cfg.adv_entropy_top_fraction < 1
    if needs_entropy and entropy is None:
        raise ValueError("entropy: top_entropy_quantile / adv_entropy_top_fraction need entropy")
    entropy_threshold = adv_entropy_threshold = None
    if cfg.top_entropy_quantile < 1:
        thr = top_fraction_threshold(entropy, kept, cfg.top_entropy_quantile)
        entropy_threshold = host_value(thr)
    if cfg.adv_entropy_top_fraction < 1:
        thr = top_fraction_threshold(batch.adv.abs() * entropy, kept, cfg.adv_entropy_top_fraction)
        adv_entropy_threshold = host_value(thr)
    masks = _selection_masks(batch, cfg, kept, entropy_threshold, adv_entropy_threshold)
    masks = _with_prompt_weights(masks, cfg, batch.adv.dtype)
    attn_stats = attn_thresholds = None
    if cfg.attn_entropy_weighting is not None:
        attn_stats, attn_thresholds = _attention_globals(batch, cfg, kept)
    max_len = _max_response_length(batch, cfg)
    loss_counts = agg_counts(kept, batch.adv, cfg.seq_count, cfg.length_power_alpha,
                             batch.cp_group)
    is_weight_mean = None
    if cfg.rollout_is is not None and cfg.rollout_is_batch_normalize:
        is_weight_mean = _is_weight_mean(batch, cfg)
    glob = BatchGlobals(
        loss=loss_counts,
        entropy=loss_counts if masks.entropy is kept else agg_counts(
            masks.entropy, batch.adv, cfg.seq_count, cfg.length_power_alpha, batch.cp_group),
        max_response_length=max_len,
        entropy_threshold=entropy_threshold,
        adv_entropy_threshold=adv_entropy_threshold,
        attn_stats=attn_stats,
        attn_thresholds=attn_thresholds,
        is_weight_mean=is_weight_mean,
        num_prompts=float(batch.m.shape[0] // cfg.prompt_group_size)
        if cfg.prompt_group_size else None,
    )
    return glob, masks


def _with_prompt_weights(masks: Masks, cfg: PolicyLossConfig, dtype,
                         num_prompts=None) -> Masks:
    """The masks with prompt-mean's weights, where an aggregation is prompt-mean: over the
    call's groups, ``num_prompts`` of them in the whole batch (`BatchGlobals`; None: this
    batch is the whole batch)."""
    def weights(mode, m):
        if mode != "prompt-mean":
            return None
        return prompt_weights(m, cfg.prompt_group_size, num_prompts).to(dtype)

    return dataclasses.replace(
        masks, loss_weight=weights(cfg.loss_agg, masks.kept),
        entropy_weight=weights(cfg.entropy_agg or cfg.loss_agg, masks.entropy))


def globals_and_masks(batch: Batch, cfg: PolicyLossConfig,
                      glob: BatchGlobals | None = None) -> tuple[BatchGlobals, Masks]:
    """`BatchGlobals` and masks of a whole batch, without a graph: a chunked caller slices the
    masks (`Masks.rows`), so that every chunk keeps exactly the tokens the thresholds were
    taken over (comparing values it recomputed could differ by an ulp at a threshold). With
    ``glob`` (the caller's globals, e.g. thresholds over several processes) the batch's masks
    under its thresholds."""
    with torch.no_grad():
        if glob is not None:
            return glob, _call_masks(batch, cfg, glob)
        return _globals(batch, cfg, _kept_mask(batch, cfg))


def _batch_globals(batch: Batch, cfg: PolicyLossConfig) -> BatchGlobals:
    return globals_and_masks(batch, cfg)[0]


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
    max_seqlen=None,
) -> BatchGlobals:
    """`BatchGlobals` of a whole batch (same layouts and arguments as `policy_loss`).

    Needs ``old_logprobs``/``rollout_logprobs`` when the config rejects by rollout divergence,
    ``entropy`` for entropy selections and STAPO, ``attention_entropy`` for attention weighting.
    For the fused path the entropies may come from the old-policy pass.
    """
    dtype = promoted_dtype(old_logprobs if old_logprobs is not None else advantages)
    with torch.no_grad():
        batch = to_batch(
            mask,
            advantages,
            cu_seqlens,
            dtype,
            max_seqlen=max_seqlen,
            old_logprobs=old_logprobs,
            rollout_logprobs=rollout_logprobs,
            entropy=entropy,
            attention_entropy=attention_entropy,
        )
    return _batch_globals(batch, config)


def _masked_mean(x, m):
    n = m.sum()
    return torch.where(m, x, torch.zeros_like(x)).sum() / n.clamp(min=1)


def _masked_min_max(x, m):
    """Min and max of ``x`` over ``m`` (0 and 0 when ``m`` is empty), without a host read."""
    some = m.any()
    pad = x.new_full((1,), torch.inf)  # a sentinel: amin/amax refuse an empty tensor
    lo = torch.cat([torch.where(m, x, torch.inf).reshape(-1), pad]).amin()
    hi = torch.cat([torch.where(m, x, -torch.inf).reshape(-1), -pad]).amax()
    return torch.where(some, lo, 0.0), torch.where(some, hi, 0.0)


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
    max_seqlen: int | None = None,
    num_items_in_batch=None,
    global_batch_size=None,
    batch_globals: BatchGlobals | None = None,
    training_progress: float | None = None,
    entropy_coef: float | None = None,
    validate: bool = True,
    compute_metrics: bool = True,
    kl=None,
    cp_group=None,
    topk_logprobs=None,
    old_topk_logprobs=None,
):
    """Policy loss and metrics from per-token logprobs.

    Args:
        logprobs: ``[B, T]`` right-padded or ``[N]`` packed (with ``cu_seqlens [B + 1]``),
            log pi_theta of the sampled tokens, with gradient.
        old_logprobs, ref_logprobs, rollout_logprobs: like ``logprobs``, no gradient;
            ``rollout_logprobs`` may hold NaN where the engine gave no value.
        advantages: per token like ``logprobs``, or ``[B]`` (or ``[B, 1]``) per sequence; a
            tensor shaped like ``logprobs`` is read per token, so packed per-sequence
            advantages of a batch with as many tokens as sequences must be ``[B, 1]``.
        mask: like ``logprobs``, nonzero for tokens in the loss.
        config: `PolicyLossConfig`.
        entropy: like ``logprobs``, token entropies; the entropy bonus differentiates it.
        token_weights: like ``logprobs``, external per-token weights of the policy term.
        attention_entropy: like ``logprobs``, per-token attention entropies (weighting input).
        max_seqlen: packed only, an int at least the longest sequence (flash-attention's
            ``max_seqlen``): the width of the grid the batch is laid out on. Without it the
            width is read from ``cu_seqlens`` (a device read), or under ``torch.compile`` is
            ``N`` (no read, a ``[B, N]`` grid).
        num_items_in_batch: tokens of the whole optimizer step over all ranks and micro-batches
            (global token-mean normaliser); global_batch_size: its sequences (seq-mean-*).
            Numbers (or one-element tensors) > 0; 0 only for a batch without loss tokens.
        batch_globals: `BatchGlobals` of the full batch for chunked use (module docstring).
        training_progress: in [0, 1], drives the attention-entropy alpha schedule.
        entropy_coef: overrides ``config.entropy_coef`` (for `AdaptiveEntropyCoef`).
        validate: ``False`` skips the NaN, ``cu_seqlens``, ``max_seqlen`` and global-count
            checks, which synchronise with the device: for callers that validated the whole
            batch once.
            Under ``torch.compile`` they are skipped whatever ``validate`` says (run
            `check_policy_inputs` eagerly on the batch instead).
        compute_metrics: ``False`` returns an empty metrics dict (no metric work).
        kl: like ``logprobs``, the exact per-token KL(policy || reference) with its graph, for
            ``kl_estimator="exact"`` only (e.g. ``linear_divergence(hidden, weight, ref_hidden,
            ref_weight, mask, beta=1, temperature=T).divergence``); needed there when
            ``beta != 0``. It takes the place of the estimate; ``beta``, ``kl_bias_correction``
            and the aggregation apply to it as to an estimate, ``kl_clamp`` (a guard of k3)
            does not.
        cp_group: a ``torch.distributed`` process group over which every sequence is split
            (context parallelism, docs/scale.md): each rank passes the same ``B`` sequences in
            the same order, rank ``r`` the ``r``-th contiguous piece of each (padded
            ``[B, T_r]``, or packed with ``cu_seqlens`` local to the rank, zero-length
            segments where it holds none of a sequence). Every sequence-level sum, count,
            max and scan runs over the group (`context_parallel`), so the returned loss is
            the whole sequences' loss on every rank and each rank's gradient with respect to
            its tokens is the whole loss's; the metrics are the rank's own tokens'. Options
            that cannot be made exact cheaply raise ``ValueError`` (`check_cp_config`).
        topk_logprobs, old_topk_logprobs: ``[*logprobs.shape, K]``, for the DPPO top-k
            objectives only (``dppo_topk_tv``, ``dppo_topk_kl``): the trainer's logprobs at
            the rollout's top-k token ids and the rollout's own logprobs there (tempered like
            ``logprobs``). Both are read without gradient (they only select tokens); the
            caller computes the first, e.g. with ``linear_logprobs`` at the given ids.

    Returns:
        ``(loss, metrics)``: a scalar (dtype of the logprobs, at least fp32) and a dict of
        detached scalars: ``clip_ratio/low|high|region``, ``kl`` (only given
        ``ref_logprobs`` or the exact ``kl``), ``approx_kl``, ``ratio/min|mean|max``,
        ``entropy/mean`` (only given ``entropy``), ``is_weight/min|mean|max``,
        ``entropy/bonus_sum|bonus_tokens`` (over the tokens the entropy bonus acts on),
        ``masked_fraction``.
    """
    cfg = config
    if logprobs.dim() == 1 and cu_seqlens is None:
        raise ValueError("cu_seqlens: a packed [N] batch needs cu_seqlens")
    if old_logprobs is None:
        raise ValueError("old_logprobs: required (pass logprobs.detach() when on-policy)")
    check_exact_kl(cfg, kl is not None, "kl", "kl (the per-token exact KL, e.g. from "
                   "linear_divergence(..., beta=1).divergence)")
    if cp_group is not None:
        check_cp_config(cfg, cp_group, batch_globals)
    batch = to_batch(
        mask, advantages, cu_seqlens, promoted_dtype(logprobs), validate, cfg, max_seqlen,
        cp_group=cp_group,
        logprobs=logprobs, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs, entropy=entropy, token_weights=token_weights,
        attention_entropy=attention_entropy, kl=kl, **check_topk_inputs(
            cfg, topk_logprobs=topk_logprobs, old_topk_logprobs=old_topk_logprobs),
    )
    loss, metrics = loss_of_batch(
        batch, cfg, batch_globals, validate=validate,
        num_items_in_batch=num_items_in_batch, global_batch_size=global_batch_size,
        training_progress=training_progress, entropy_coef=entropy_coef,
        compute_metrics=compute_metrics,
    )
    return cp_loss_value(loss, cp_group), metrics


# What a cp_group cannot make exact without gathering every rank's tokens: (field, test, why).
_CP_REFUSED = (
    ("top_entropy_quantile", lambda c: c.top_entropy_quantile < 1,
     "an entropy quantile over the batch (a sort of every rank's tokens)"),
    ("adv_entropy_top_fraction", lambda c: c.adv_entropy_top_fraction < 1,
     "a |A| H quantile over the batch (a sort of every rank's tokens)"),
    ("attn_entropy_weighting", lambda c: c.attn_entropy_weighting is not None,
     "batch quantiles and per-sequence softmaxes of attention entropies"),
    ("loss_agg", lambda c: "prompt-mean" in (c.loss_agg, c.entropy_agg),
     "prompt-mean: token counts of prompt groups over every rank"),
)


def check_cp_config(cfg: PolicyLossConfig, cp_group, batch_globals=None) -> None:
    """``ValueError`` naming the option for what ``cp_group`` refuses (docs/scale.md): the
    objectives that select tokens from whole-batch statistics of the current logprobs
    (``clip_cov``, ``kl_cov``), entropy and attention-entropy quantiles, attention-entropy
    weighting, ``seq-mean-token-sum-norm`` without ``max_response_length`` (a rank's width is
    not the sequences'), and ``batch_globals`` (computed by one rank, they are not the
    group's)."""
    cp.check_group(cp_group)
    if get_objective(cfg.objective).needs_whole_batch:
        raise ValueError(f"objective: {cfg.objective} selects tokens from statistics of the "
                         "whole batch's current logprobs and is not supported with cp_group")
    for name, refused, why in _CP_REFUSED:
        if refused(cfg):
            raise ValueError(f"{name}: not supported with cp_group ({why})")
    norm = "seq-mean-token-sum-norm"
    if cfg.max_response_length is None and norm in (cfg.loss_agg, cfg.entropy_agg):
        raise ValueError(f"max_response_length: {norm} with cp_group needs "
                         "PolicyLossConfig.max_response_length (a rank's padded width is not "
                         "the sequences')")
    if batch_globals is not None:
        raise ValueError("batch_globals: not supported with cp_group (the call computes them "
                         "over the group)")


def cp_sequence_terms(cfg: PolicyLossConfig) -> str | None:
    """Under ``cp_group``: the option whose term reads the current (or old) logprobs of a
    whole sequence inside the loss (a sequence-level ratio, an objective that reduces per
    sequence, the future-KL suffix sums, OPSM, a sequence-level rollout IS weight), or None
    when every token's gradient comes from the rank's own values and `BatchGlobals` reduced
    over the group before (the counts and lengths of the mask, rejection, thresholds): then
    `fused_policy_loss` runs one rank's tokens in chunks of its own (docs/scale.md)."""
    if cfg.ratio_level != "token":
        return f"ratio_level={cfg.ratio_level!r}"
    if get_objective(cfg.objective).reads_sequences:
        return f"objective={cfg.objective!r}"
    if cfg.future_kl_coef:
        return "future_kl_coef"
    if cfg.opsm_threshold is not None:
        return "opsm_threshold"
    if cfg.rollout_is not in (None, "token"):
        return f"rollout_is={cfg.rollout_is!r}"
    return None


def cp_loss_value(share: torch.Tensor, group) -> torch.Tensor:
    """With a context-parallel ``group``: the rank's share of the loss with the whole loss's
    value (one ``all_reduce`` of the shares) and the share's gradient, which is the whole
    loss's with respect to the rank's tokens (the sequence-level reductions carry the other
    ranks' terms). Without (None): ``share``."""
    if group is None:
        return share
    total = cp.all_reduce(share.detach(), group)
    return share + (total - share.detach())


def check_topk_inputs(cfg: PolicyLossConfig, **topk) -> dict:
    """The top-k tensors (``topk_logprobs``, ``old_topk_logprobs``) are given exactly when the
    objective reads them (``needs_topk``): ``ValueError`` naming them otherwise. Returns them,
    only when given (the batch carries no entry for them otherwise)."""
    given = [name for name, t in topk.items() if t is not None]
    if not isinstance(cfg, PolicyLossConfig):  # refused by the caller's own check
        return {name: topk[name] for name in given}
    if get_objective(cfg.objective).needs_topk:
        if len(given) != len(topk):
            raise ValueError(f"topk_logprobs: {cfg.objective} needs topk_logprobs and "
                             "old_topk_logprobs (the trainer's and the rollout's logprobs at the "
                             "rollout's top-k ids)")
    elif given:
        raise ValueError(f"{given[0]}: given, but {cfg.objective} does not read the top-k "
                         "logprobs (dppo_topk_tv and dppo_topk_kl do)")
    return {name: topk[name] for name in given}


def loss_of_batch(batch: Batch, cfg, batch_globals, *, validate=True, num_items_in_batch=None,
                   global_batch_size=None, **kw):
    """`policy_loss` of a batch on the grid: its `BatchGlobals` when not given (the kept mask
    and selections computed once for both), the global counts checked, then `batch_policy_loss`."""
    if get_objective(cfg.objective).needs_whole_batch and batch_globals is not None:
        raise ValueError(
            f"batch_globals: {cfg.objective} selects tokens from statistics of the "
            "whole batch and cannot run on a chunk"
        )
    kept = _kept_mask(batch, cfg)
    if batch_globals is None:
        batch_globals, masks = _globals(batch, cfg, kept)
    else:
        masks = _call_masks(batch, cfg, batch_globals, kept)
    if validate:
        check_global_counts(num_items_in_batch, global_batch_size, batch_globals.loss)
    return batch_policy_loss(batch, cfg, batch_globals, masks=masks,
                        num_items_in_batch=num_items_in_batch,
                        global_batch_size=global_batch_size, **kw)


def _call_masks(batch, cfg, glob: BatchGlobals, kept=None) -> Masks:
    """The masks of a call given the batch's `BatchGlobals` (their thresholds)."""
    kept = _kept_mask(batch, cfg) if kept is None else kept
    masks = _selection_masks(batch, cfg, kept, glob.entropy_threshold,
                             glob.adv_entropy_threshold)
    return _with_prompt_weights(masks, cfg, batch.adv.dtype, glob.num_prompts)


def batch_policy_loss(batch: Batch, cfg: PolicyLossConfig, glob: BatchGlobals, *,
                 masks: Masks | None = None, num_items_in_batch=None, global_batch_size=None,
                 training_progress=None, entropy_coef=None, compute_metrics=True):
    """`policy_loss` of a batch already validated and on the grid, with its `BatchGlobals`
    (the private entry point of chunked callers; nothing here synchronises with the device to
    check an input). The stages: masks; advantages and factors; the policy term; KL;
    aggregation; metrics."""
    spec = get_objective(cfg.objective)
    masks = _call_masks(batch, cfg, glob) if masks is None else masks
    adv = _advantages(batch, cfg, masks.kept)
    factor = _factor(batch, cfg, masks.kept, glob, training_progress)
    is_weight = _rollout_is_weight(batch, cfg, glob)
    term = _policy_term(batch, cfg, spec, adv, masks, factor, is_weight)
    kl = _kl(batch, cfg, term.ratio)
    per_token = term.loss
    if kl is not None and _uses_kl(cfg):
        per_token = per_token + batch.knobs["beta"] * kl
    counts = dict(num_items_in_batch=num_items_in_batch, global_batch_size=global_batch_size)
    loss = _aggregate(per_token, batch, cfg, glob, masks, entropy_coef, counts)
    if not compute_metrics:
        return loss, {}
    with torch.no_grad():
        metrics = _metrics(term.out, term.ratio, term.d, kl, batch["entropy"], is_weight,
                           masks.given, masks.kept, masks.select, factor, cfg)
        ent = batch["entropy"]
        if ent is not None:  # what an adaptive entropy coefficient accumulates
            metrics["entropy/bonus_sum"] = torch.where(masks.entropy, ent, 0.0).sum().detach()
            metrics["entropy/bonus_tokens"] = masks.entropy.sum().to(term.d.dtype)
    return loss, metrics


def _uses_kl(cfg) -> bool:
    return isinstance(cfg.beta, torch.Tensor) or cfg.beta != 0


def check_exact_kl(cfg: PolicyLossConfig, given: bool, names: str, wanted: str) -> None:
    """The exact KL's inputs (``names``) are given exactly when they can be used: refused
    without ``kl_estimator="exact"``, required with it when ``beta != 0``."""
    exact = cfg.kl_estimator == KL_EXACT
    if given and not exact:
        raise ValueError(f"{names}: given, but kl_estimator is {cfg.kl_estimator!r}; the exact "
                         "KL is used with kl_estimator='exact' only")
    if exact and not given and _uses_kl(cfg):
        raise ValueError(f"{names}: kl_estimator='exact' with beta != 0 needs {wanted}")


def _advantages(batch: Batch, cfg: PolicyLossConfig, kept) -> torch.Tensor:
    """FRPO's future-KL correction, then probability reweighting."""
    adv, lp, ref_lp = batch.adv, batch["logprobs"], batch["ref_logprobs"]
    estimated = _uses_kl(cfg) and cfg.kl_estimator != KL_EXACT
    if (estimated or cfg.future_kl_coef) and ref_lp is None:
        raise ValueError("ref_logprobs: beta != 0 (with an estimator) and future_kl_coef need "
                         "ref_logprobs")
    if cfg.future_kl_coef:
        adv = future_kl_advantages(adv, lp, ref_lp.detach(), kept, cfg.future_kl_coef,
                                   batch.cp_group)
    if cfg.prob_reweight_alpha:
        adv = probability_reweighted_advantages(adv, lp, cfg.prob_reweight_alpha)
    return adv


def _factor(batch: Batch, cfg: PolicyLossConfig, kept, glob, progress) -> torch.Tensor:
    """The detached per-token factor of the policy term: OPSM, attention weights, token
    weights."""
    lp = batch["logprobs"]
    factor = torch.ones_like(lp).detach()
    if cfg.opsm_threshold is not None:
        roll_lp = batch["rollout_logprobs"]
        sampling = roll_lp if roll_lp is not None else batch["old_logprobs"].detach()
        factor = factor * off_policy_sequence_keep(lp, sampling, batch.adv, kept,
                                                   cfg.opsm_threshold, batch.cp_group)
    if cfg.attn_entropy_weighting is not None:
        factor = factor * attention_entropy_weights(
            batch["attention_entropy"], kept, cfg, stats=glob.attn_stats,
            thresholds=glob.attn_thresholds, progress=progress,
        )
    if batch["token_weights"] is not None:
        factor = factor * batch["token_weights"].detach()
    return factor


def _rollout_is_weight(batch: Batch, cfg: PolicyLossConfig, glob):
    """The rollout IS weight, or None. Over the mask as given: a sequence's IS weight is its
    likelihood ratio, rejected tokens included (as verl's rollout-correction helper computes
    it)."""
    if cfg.rollout_is is None:
        return None
    roll_lp = batch["rollout_logprobs"]
    if roll_lp is None:
        raise ValueError("rollout_logprobs: rollout_is needs rollout_logprobs")
    old_lp = batch["old_logprobs"].detach()
    weight = rollout_is_weight(rollout_log_ratio(old_lp, roll_lp, batch.m), batch.m, cfg,
                               batch.cp_group)
    if cfg.rollout_is_batch_normalize:
        if glob.is_weight_mean is None:
            raise ValueError("batch_globals: computed without rollout_is_batch_normalize")
        weight = weight / glob.is_weight_mean
    return weight


@dataclass
class _PolicyTerm:
    loss: torch.Tensor  # per token, times selections, factors and IS weight
    out: ObjectiveOutput
    ratio: Ratio
    d: torch.Tensor  # the clamped log-ratio


def _policy_term(batch, cfg, spec, adv, masks: Masks, factor, is_weight) -> _PolicyTerm:
    """The ratio of the configured level, the objective's per-token loss, and the selections,
    factors and IS weight applied to it."""
    lp, old_lp = batch["logprobs"], batch["old_logprobs"].detach()
    eps_low, eps_high = batch.knobs["eps_low"], batch.knobs["eps_high"]
    d = lp - old_lp
    if cfg.log_ratio_clamp is not None:
        d = d.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    m = masks.kept
    ratio_mask = masks.select if spec.selects_in_ratio else m
    ratio = compute_ratio(cfg.ratio_level, d, lp, m, adv, cfg, eps_low, eps_high, ratio_mask,
                          batch.cp_group)
    out = spec.fn(
        ObjectiveInputs(
            lp, old_lp, d, adv, m, ratio, cfg, eps_low, eps_high, batch["entropy"],
            is_weight if spec.folds_rollout_is else None,
            batch["topk_logprobs"], batch["old_topk_logprobs"], batch.cp_group,
        )
    )
    pg = out.loss * factor
    if not spec.selects_in_ratio:
        pg = pg * masks.select
    if is_weight is not None and not spec.folds_rollout_is:
        pg = pg * is_weight
    return _PolicyTerm(pg, out, ratio, d)


def _kl(batch: Batch, cfg: PolicyLossConfig, ratio) -> torch.Tensor | None:
    """Per-token KL to the reference (for the loss when beta != 0, for the metric always): the
    estimate from the sampled token's logprobs, or the exact KL given (``kl_estimator="exact"``,
    batch tensor ``kl``)."""
    ref_lp = batch["ref_logprobs"]
    if cfg.kl_estimator == KL_EXACT:
        kl = batch["kl"]
    elif ref_lp is None:
        return None
    else:
        kl = kl_estimate(batch["logprobs"], ref_lp.detach(), cfg.kl_estimator,
                         clamp=cfg.kl_clamp)
    if kl is None:
        return None
    if cfg.kl_bias_correction:
        kl = kl * (ratio.value if cfg.kl_bias_correction_grad else ratio.value.detach())
    return kl


def _aggregate(per_token, batch, cfg, glob, masks: Masks, entropy_coef, counts):
    """The aggregated loss minus the aggregated entropy bonus."""
    agg_args = dict(max_response_length=glob.max_response_length, **counts)
    loss = aggregate(per_token, masks.kept, batch.adv, cfg.loss_agg, glob.loss, cfg,
                     prompt_weight=masks.loss_weight, **agg_args)
    coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
    if coef:
        ent = batch["entropy"]
        if ent is None:
            raise ValueError("entropy: entropy_coef != 0 needs entropy")
        mode = cfg.entropy_agg or cfg.loss_agg
        loss = loss - coef * aggregate(
            ent, masks.entropy, batch.adv, mode, glob.entropy, cfg,
            prompt_weight=masks.entropy_weight, **agg_args
        )
    return loss


def _metrics(out, ratio, d, kl, ent, is_weight, m_in, m, select, factor, cfg):
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
    if kl is not None:  # left out without a reference (or a given exact KL)
        metrics["kl"] = _masked_mean(kl, m_in)
    metrics["approx_kl"] = _masked_mean(-d, m_in)
    rmin, rmax = _masked_min_max(ratio.value, m_in)
    metrics.update(
        {"ratio/min": rmin, "ratio/mean": _masked_mean(ratio.value, m_in), "ratio/max": rmax}
    )
    if ent is not None:  # left out without the entropies
        metrics["entropy/mean"] = _masked_mean(ent, m_in)
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
