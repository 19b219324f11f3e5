"""verl adapter: logitless objectives as verl policy losses, and the fused head.

Importing this module (the ``verl.plugins`` entry point does it on ``import verl`` in every
process, Ray workers included) registers ``logitless_<objective>`` for every registered
logitless objective in verl's policy-loss registry. Select one with::

    actor_rollout_ref.actor.policy_loss.loss_mode=logitless_grpo

Hyperparameters verl already has come from the actor config (``clip_ratio_low/high`` are
``eps_low/eps_high``, ``clip_ratio_c`` the dual clip and DPPO's ratio cap, ``tau_pos/tau_neg``
SAPO's temperatures, ``loss_agg_mode`` the aggregation, ``policy_loss.clip_cov_*``,
``kl_cov_ratio``, ``ppo_kl_coef`` and ``dro_beta`` the covariance and DRO knobs), the
normalisers from verl's ``global_batch_info`` (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, ``loss_scale_factor``) and the rollout IS weights from verl's trainer.
The other logitless knobs are fields of :class:`LogitlessPolicyLossConfig`, selected with
``policy_loss._target_=logitless.integrations.verl.LogitlessPolicyLossConfig``.

verl calls a policy loss without reference logprobs or entropies: its own ``use_kl_loss`` and
``entropy_coeff`` terms apply as usual, and the logitless knobs that need those inputs (KL,
entropy selections, rollout logprobs) are not offered here.

It also registers ``logitless_forward_kl_topk`` in verl's distillation-loss registry (see
:mod:`logitless.integrations.verl_distill`).

The fused head (:func:`enable_fused_head`) lives in :mod:`logitless.integrations.verl_head`;
``LOGITLESS_VERL_FUSED_HEAD=1`` in a worker's environment enables it when this module loads.

Sampler matching: ``policy_loss.match_sampler`` set to the rollout config
(``+actor_rollout_ref.actor.policy_loss.match_sampler='${actor_rollout_ref.rollout}'``) makes
the fused head compute the logprobs of the distribution the rollout engine (vLLM or SGLang,
from ``rollout.name``) samples from (see
:func:`sampler_from_rollout` for what is read and refused).

Replay: ``policy_loss.match_sampler=replay`` renormalises over the kept sets the rollout engine
recorded, which the batch carries under ``"kept_ids"`` (int64 ``[batch, response_length, K]``,
-1 padded, aligned with ``responses``; a key present without ``replay`` is not read). verl's
rollouts do not fill it: a custom agent loop or rollout does, from vLLM's
``return_sampling_mask`` or SGLang's (``logitless.integrations.replay``). Supported on verl's
FSDP engine (``FSDPEngineWithLMHead``; remove-padding or not, static packing pad, Ulysses).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_policy_loss
from verl.workers.config import PolicyLossConfig as VerlPolicyLossConfig

from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss
from logitless.fused_losses.head.dtensor import is_dtensor
from logitless.fused_losses.head.sampled import drop_outside_kept
from logitless.fused_losses.objectives.catalog import OBJECTIVES, get_objective
from logitless.fused_losses.objectives.config import PolicyLossConfig
from logitless.fused_losses.objectives.mismatch import logged_mismatch
from logitless.fused_losses.objectives.policy_loss import check_cp_config, policy_loss
from logitless.integrations import objective_fields
from logitless.integrations.sampler_config import (
    SamplerTruncation,
    read_sampler_config,
)
from logitless.integrations.verl_distill import register_verl_distillation_loss
from logitless.integrations.verl_head import (
    disable_fused_head,
    enable_fused_head,
    fused_head_enabled,
    head_dtype,
    head_replays,
    head_sampler,
    linear_cross_entropy,
    sampler_head_calls,
    set_head_deferral,
    set_head_dtype,
    set_head_replay,
    set_head_sampler,
)

# ``policy_loss.match_sampler``'s value for renormalising over the recorded kept sets
REPLAY = "replay"

__all__ = [
    "LOSS_PREFIX",
    "REPLAY",
    "LogitlessPolicyLossConfig",
    "disable_fused_head",
    "enable_fused_head",
    "fused_head_enabled",
    "linear_cross_entropy",
    "register_verl_distillation_loss",
    "register_verl_losses",
    "sampler_from_rollout",
    "to_logitless_config",
    "ulysses_cp_seqlens",
]

LOSS_PREFIX = "logitless_"

# PolicyLossConfig fields that verl supplies (actor config, verl's own PolicyLossConfig, the
# loss mode, global_batch_info) ...
_FROM_VERL = frozenset({
    "objective", "eps_low", "eps_high", "loss_agg", "dual_clip_c", "sapo_tau_pos",
    "sapo_tau_neg", "dppo_ratio_cap", "clip_cov_lb", "clip_cov_ub", "cov_fraction",
    "kl_cov_coef", "dro_beta", "dp_size", "max_response_length",
})
# ... and those that need inputs a verl policy-loss function never receives (reference and
# rollout logprobs, entropies, attention entropies).
_NEEDS_OTHER_INPUTS = frozenset({
    "beta", "kl_estimator", "kl_bias_correction", "kl_bias_correction_grad", "kl_clamp",
    "future_kl_coef", "entropy_coef", "entropy_agg", "top_entropy_quantile",
    "stapo_prob_threshold", "stapo_entropy_threshold", "adv_entropy_top_fraction",
    "rollout_is", "rollout_is_mode", "rollout_is_min", "rollout_is_max",
    "rollout_is_batch_normalize", "rollout_rs",
    "rollout_rs_threshold", "opsm_threshold",
})
# verl counts only non-empty sequences in seq-mean normalisers.
_VERL_DEFAULTS = {"seq_count": "nonempty"}

PASSTHROUGH_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(PolicyLossConfig)
    if f.init
    and f.name not in _FROM_VERL
    and f.name not in _NEEDS_OTHER_INPUTS
    and not f.name.startswith("attn_entropy")
)


def ulysses_cp_seqlens(cu_seqlens: torch.Tensor, sp_rank: int, sp_size: int):
    """The ``cu_seqlens`` of Ulysses rank ``sp_rank`` for ``cp_group=`` (docs/scale.md): verl
    pads the packed stream of ``cu_seqlens[-1]`` tokens to a multiple of ``sp_size`` and gives
    rank ``r`` positions ``[r n, (r + 1) n)`` (``ulysses_pad_and_slice_inputs``). Returns
    ``(local_cu_seqlens [B + 1], num_tokens)``: the rank's piece of every sequence (zero-length
    where it holds none), and how many of its ``n`` positions are tokens (the rest is verl's
    tail padding, to drop before the call)."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size: expected an int >= 1, got {sp_size!r}")
    if isinstance(sp_rank, bool) or not isinstance(sp_rank, int) or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank: expected an int in [0, {sp_size}), got {sp_rank!r}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens: expected a 1-D integer tensor [B + 1]")
    total = int(cu_seqlens[-1])
    n = -(-total // sp_size)  # the padded stream's share per rank
    local = (cu_seqlens - sp_rank * n).clamp(0, n)
    return local, int(local[-1])


def _passthrough_default(name: str):
    if name in _VERL_DEFAULTS:
        return _VERL_DEFAULTS[name]
    return next(f.default for f in dataclasses.fields(PolicyLossConfig) if f.name == name)


# verl's rollout.name -> the engine whose sampling rules logitless follows
_ROLLOUT_ENGINES = {"vllm": "vllm", "sglang": "sglang"}


def sampler_from_rollout(rollout) -> SamplerTruncation:
    """The truncations verl's rollout samples with, from its rollout config (``RolloutConfig``,
    its ``DictConfig`` or a mapping with the same keys; absent keys take verl's defaults).

    Reads ``temperature``, ``top_k`` (-1 or 0: off), ``top_p`` (1: off) and ``min_p`` (None or
    0: off; verl's rollout config has no such field, a mapping may carry one). Raises
    ``ValueError`` naming the ``rollout.<field>`` the head cannot reproduce:
    ``repetition_penalty`` != 1; ``name`` other than ``vllm`` or ``sglang`` when a truncation
    is on (each engine's rules are followed: ``sampler="vllm"`` or ``"sglang"``, see
    docs/sampler.md); with vLLM, ``logprobs_mode`` other than ``processed_logprobs`` (the
    rollout logprobs the correction terms compare with would be those of another
    distribution); ``do_sample`` False or a temperature below 1e-5 (greedy
    decoding); a value no sampler accepts (``top_k`` < -1, ``top_p`` outside (0, 1], ``min_p``
    outside [0, 1]).
    """
    names = {k: f"rollout.{k}" for k in ("temperature", "top_k", "top_p", "min_p")}
    penalty = _get(rollout, "repetition_penalty", 1.0)
    if penalty != 1:
        raise ValueError(
            f"rollout.repetition_penalty: sampler matching reproduces temperature, top-k, top-p "
            f"and min-p only; a repetition penalty depends on the tokens generated so far "
            f"(expected 1.0, got {penalty!r})")
    if not _get(rollout, "do_sample", True):
        raise ValueError("rollout.do_sample: sampler matching needs sampling, got False")
    name = _get(rollout, "name")
    mode = _get(rollout, "logprobs_mode", "processed_logprobs")
    if name != "sglang" and mode != "processed_logprobs":  # verl passes it to vLLM only
        raise ValueError(
            f"rollout.logprobs_mode: expected 'processed_logprobs' (the logprobs of the "
            f"distribution vLLM samples from), got {mode!r}")
    settings = read_sampler_config(
        temperature=_get(rollout, "temperature", 1.0), top_k=_get(rollout, "top_k", -1),
        top_p=_get(rollout, "top_p", 1.0), min_p=_get(rollout, "min_p"), names=names,
        top_k_off=(-1, 0), sampler=_ROLLOUT_ENGINES.get(name, "vllm"))
    if settings.truncates and name not in _ROLLOUT_ENGINES:
        raise ValueError(
            f"rollout.name: sampler matching follows the top-k / top-p / min-p rules of "
            f"{sorted(_ROLLOUT_ENGINES)}, got {name!r}")
    return settings


def _post_init(self):
    parent = getattr(VerlPolicyLossConfig, "__post_init__", None)
    if parent is not None:
        parent(self)
    _check_fields(self)
    _apply_match_sampler(self)
    _apply_head_dtype(self)
    _hook_engine()


_PREFIX = "logitless_"


def _check_fields(self):
    """The logitless fields checked when verl builds the config (hydra instantiation in the
    driver), not at the first loss call on the workers: a ``PolicyLossConfig`` of the
    ``loss_mode``'s objective with the given fields must build. The clip bounds and the other
    fields that come from the actor config are checked with it at the first call."""
    mode = getattr(self, "loss_mode", None)
    if self.sequence_is_weight not in (None, "geometric"):
        raise ValueError(f"policy_loss.sequence_is_weight: expected None or 'geometric', got "
                         f"{self.sequence_is_weight!r}")
    if not isinstance(self.fused, bool):
        raise ValueError(f"policy_loss.fused: expected True or False, got {self.fused!r}")
    if not (isinstance(mode, str) and mode.startswith(_PREFIX)):
        if self.fused:
            raise ValueError(f"policy_loss.fused: the fused loss is a logitless loss mode's "
                             f"(logitless_<objective>), got loss_mode={mode!r}")
        return  # one of verl's own losses: these fields are not read
    fields = {name: getattr(self, name) for name in PASSTHROUGH_FIELDS}
    if self.loss_agg is not None:
        _refuse_prompt_mean(self.loss_agg, "policy_loss.loss_agg")
        fields["loss_agg"] = self.loss_agg
    try:
        get_objective(mode[len(_PREFIX):])
        PolicyLossConfig(objective=mode[len(_PREFIX):], **fields)
    except ValueError as err:
        raise ValueError(f"policy_loss (loss_mode={mode!r}): {err}") from err


def _refuse_prompt_mean(loss_agg, name: str) -> None:
    """``prompt-mean`` groups ``prompt_group_size`` consecutive sequences of the loss's batch,
    which verl's batch does not keep together: refused, naming the setting."""
    if loss_agg == "prompt-mean":
        raise ValueError(
            f"{name}: prompt-mean groups prompt_group_size consecutive sequences as one "
            f"prompt's responses, but verl reorders the batch before the actor's loss: "
            f"trainer.balance_batch (on by default) sorts each data-parallel rank's sequences "
            f"by length, actor.use_dynamic_bsz regroups micro-batches by token count and "
            f"actor.shuffle shuffles the mini-batches, and each micro-batch's loss sees only "
            f"its own groups; choose another aggregation (e.g. seq-mean-token-mean)")


def _setstate(self, state):
    # Ray ships a built config to its workers by pickling it: the worker's head is set too.
    self.__dict__.update(state)
    _apply_match_sampler(self)
    _apply_head_dtype(self)
    _hook_engine()


def _apply_match_sampler(self):
    source = self.match_sampler
    if source is None or source is False:
        return
    if source == REPLAY:
        set_head_replay(True)
        return
    if not hasattr(source, "get") and not hasattr(source, "top_k"):
        raise ValueError(
            f"policy_loss.match_sampler: expected the rollout config (a mapping, e.g. "
            f"'${{actor_rollout_ref.rollout}}'), {REPLAY!r} or None, got {source!r}")
    # The head runs in the model forward, before any loss call: every process that builds
    # this config (the actor worker among them) truncates its fused head from now on.
    set_head_sampler(sampler_from_rollout(source))


def _apply_head_dtype(self):
    # as match_sampler: the head runs in the model forward, so every process that builds the
    # config (the actor worker among them) sets its head's precision from now on
    try:
        set_head_dtype(self.head_dtype)
    except ValueError as err:
        raise ValueError(f"policy_loss.{err}") from err


LogitlessPolicyLossConfig = dataclasses.make_dataclass(
    "LogitlessPolicyLossConfig",
    [
        ("match_sampler", Any, dataclasses.field(default=None)),
        ("fused", bool, dataclasses.field(default=False)),
        ("loss_agg", Any, dataclasses.field(default=None)),
        ("dual_clip", Any, dataclasses.field(default=None)),
        ("use_global_batch_info", bool, dataclasses.field(default=True)),
        ("sequence_is_weight", Any, dataclasses.field(default=None)),
        ("head_dtype", Any, dataclasses.field(default=None)),
        *((name, Any, dataclasses.field(default=_passthrough_default(name)))
          for name in PASSTHROUGH_FIELDS),
    ],
    bases=(VerlPolicyLossConfig,),
    namespace={"__post_init__": _post_init, "__setstate__": _setstate},
)
# Ray pickles configs to its workers and hydra resolves ``_target_`` by module path.
LogitlessPolicyLossConfig.__module__ = __name__
LogitlessPolicyLossConfig.__doc__ = f"""verl's ``PolicyLossConfig`` plus the logitless knobs.

Select it with ``policy_loss._target_=logitless.integrations.verl.LogitlessPolicyLossConfig``
and ``policy_loss.loss_mode=logitless_<objective>``. Its own fields:

- ``match_sampler``: the rollout config (``'${{actor_rollout_ref.rollout}}'``) to compute the
  fused head's logprobs and entropies under the distribution the rollout engine samples from
  (its temperature, top-k, top-p, min-p, under vLLM's or SGLang's rules as ``rollout.name``
  says; see ``sampler_from_rollout``); ``replay`` to renormalise over the kept sets the
  engine recorded, from the batch's ``kept_ids``; or None (off). Needs
  logitless's fused head (``use_fused_kernels`` with the ``triton`` backend and
  ``LOGITLESS_VERL_FUSED_HEAD=1``) and no reference KL (``use_kl_loss``): the reference
  model's head in the same process would be truncated too. Checked at the first loss call.
- ``fused``: compute the policy loss from the head's inputs with
  :func:`logitless.fused_policy_loss` (three GEMM passes over the response rows, the
  gradients formed in the forward) instead of from the head's logprobs; needs
  ``use_fused_kernels`` (``triton`` backend) with ``LOGITLESS_VERL_FUSED_HEAD=1`` and verl's
  FSDP or Megatron engine (its tensor-parallel head with ``vocab_parallel=``). verl's
  entropy and KL terms (``calculate_entropy`` / ``entropy_coeff``,
  ``use_kl_loss``) join the fused call, and under Ulysses it runs with ``cp_group=`` the
  Ulysses group; ``match_sampler`` (and replay) passes the truncation (the recorded sets) to
  the fused call. A micro-batch that cannot run fused (``match_sampler`` with verl's entropy
  term, a tensor-parallel head or Ulysses, an FSDP2 DTensor head, verl's terms aggregated
  otherwise than the policy term, an objective ``cp_group`` refuses under Ulysses, ...) runs
  the composed path, with one warning naming the reason (docs/verl.md).
- ``loss_agg``: overrides the actor's ``loss_agg_mode`` for this loss (any logitless
  aggregation, e.g. ``balanced`` or ``length-power``); None keeps verl's.
- ``dual_clip``: apply ``clip_ratio_c`` as a dual clip; None does what verl's matching loss
  does (on for the ppo family, as ``vanilla``; off otherwise).
- ``use_global_batch_info``: normalise by verl's global batch information (default); False
  normalises over the micro-batch, as verl's ``geo_mean`` does.
- ``sequence_is_weight``: None weights each token by its rollout IS weight; ``geometric``
  weights every token of a sequence by the geometric mean of the sequence's weights, as verl's
  ``geo_mean`` does.
- ``head_dtype``: the precision of the fused head's GEMMs (``linear_logprobs``'s):
  None (the compute dtype), ``float32`` (an fp32 head from bf16 hidden states, NeMo-RL's
  ``fp32_lm_head``, TRL's ``cast_lm_head_to_fp32``) or ``tf32``; the fused loss's too.
  Needs logitless's fused head, as ``match_sampler`` does.
- the logitless knobs a verl policy loss can honour, defaults as in
  ``logitless.PolicyLossConfig`` (``seq_count`` defaults to verl's ``nonempty``):
  {", ".join(PASSTHROUGH_FIELDS)}.
"""


def _raw(config, key, default=None):
    """``key`` of a dataclass, verl ``BaseConfig`` or ``DictConfig`` (default when absent)."""
    if config is None:
        return default
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


def _get(config, key, default=None):
    """Like `_raw`, with None read as "not set" (verl's convention for its own fields)."""
    value = _raw(config, key, default)
    return default if value is None else value


def to_logitless_config(objective: str, actor_config, loss_agg_mode: str | None = None):
    """The logitless config and normaliser arguments for one verl policy-loss call.

    Args:
        objective: a registered logitless objective name.
        actor_config: verl's ``ActorConfig`` (or its ``DictConfig``) as passed to the loss.
        loss_agg_mode: the ``loss_agg_mode`` verl passed (default: the actor's).

    Returns:
        ``(PolicyLossConfig, kwargs)`` with ``kwargs`` the ``num_items_in_batch`` and
        ``global_batch_size`` arguments of :func:`logitless.policy_loss`.
    """
    pl = _get(actor_config, "policy_loss")
    clip = _get(actor_config, "clip_ratio", 0.2)
    clip_c = _get(actor_config, "clip_ratio_c", 3.0)
    get_objective(objective)  # an unknown name fails here, naming the registered ones
    dual = _get(pl, "dual_clip")
    if dual is None:
        dual = objective_fields.verl_dual_clip(objective)
    cov_key = objective_fields.verl_keys(objective).get("cov_fraction", "clip_cov_ratio")
    loss_agg = _get(pl, "loss_agg") or loss_agg_mode or _get(actor_config, "loss_agg_mode")
    _refuse_prompt_mean(loss_agg, "policy_loss.loss_agg" if _get(pl, "loss_agg")
                        else "actor.loss_agg_mode")
    fields = dict(
        objective=objective,
        eps_low=_get(actor_config, "clip_ratio_low", clip),
        eps_high=_get(actor_config, "clip_ratio_high", clip),
        loss_agg=loss_agg,
        dual_clip_c=clip_c if dual else None,
        dppo_ratio_cap=clip_c,
        sapo_tau_pos=_get(actor_config, "tau_pos", 1.0),
        sapo_tau_neg=_get(actor_config, "tau_neg", 1.05),
        clip_cov_lb=_get(pl, "clip_cov_lb", 1.0),
        clip_cov_ub=_get(pl, "clip_cov_ub", 5.0),
        cov_fraction=_get(pl, cov_key, 2e-4),
        kl_cov_coef=_get(pl, "ppo_kl_coef", 0.1),
    )
    if _get(pl, "dro_beta") is not None:
        fields["dro_beta"] = _get(pl, "dro_beta")
    for name in PASSTHROUGH_FIELDS:
        # None is a value here (log_ratio_clamp=None: no clamp); absent keys (verl's own
        # PolicyLossConfig) take the logitless default.
        fields[name] = _raw(pl, name, _passthrough_default(name))
    kwargs = {}
    if _get(pl, "use_global_batch_info", True):
        info = _get(actor_config, "global_batch_info", {})
        fields["dp_size"] = int(_get(info, "dp_size", 1))
        fields["max_response_length"] = _get(info, "loss_scale_factor")
        kwargs = dict(num_items_in_batch=_get(info, "batch_num_tokens"),
                      global_batch_size=_get(info, "global_batch_size"))
    return PolicyLossConfig(**fields), kwargs


def _verl_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """verl's metric names (same meaning where verl has one) plus every logitless metric under
    ``actor/logitless/``; one device sync for all of them."""
    names = list(metrics)
    values = torch.stack([metrics[k].to(torch.float64) for k in names]).tolist()
    ours = dict(zip(names, values))
    out = {"actor/ppo_kl": ours["approx_kl"]}
    if "clip_ratio/region" in ours:
        out["actor/pg_clipfrac"] = ours["clip_ratio/region"]
        out["actor/pg_clipfrac_lower"] = ours["clip_ratio/low"]
    # verl passes no reference logprobs or entropies: policy_loss leaves their metrics out.
    out.update({f"actor/logitless/{k}": v for k, v in ours.items()})
    return out


def _geometric_sequence_weights(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` weights -> each sequence's geometric mean over its valid tokens, broadcast.
    The ``1e-10`` floor inside the log is verl's, so a zeroed (IcePop) token weight shrinks
    its sequence's weight as it does in verl rather than zeroing it."""
    m = mask.bool()
    log_w = torch.where(m, torch.log(weights + 1e-10), torch.zeros_like(weights))
    mean = log_w.sum(-1) / m.sum(-1).clamp(min=1).to(weights.dtype)
    return torch.exp(mean)[:, None].expand_as(weights)


def _verl_policy_loss(objective: str):
    def compute_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if config is None:
            raise ValueError(f"config: {LOSS_PREFIX}{objective} needs verl's actor config")
        cfg, normalisers = to_logitless_config(objective, config, loss_agg_mode)
        outside = None
        step = _step_of(config)
        matching = _get(_get(config, "policy_loss"), "match_sampler") is not None
        fused = step is not None and step.rows is not None
        if matching:
            _check_sampler_matching(config)
            if not fused:  # the fused loss drops them itself (`_fused_loss`)
                log_prob, old_log_prob, response_mask, outside = drop_outside_kept(
                    log_prob, old_log_prob, response_mask)
        mode = _get(_get(config, "policy_loss"), "sequence_is_weight")
        if mode not in (None, "geometric"):
            raise ValueError(
                f"policy_loss.sequence_is_weight: expected None or 'geometric', got {mode!r}"
            )
        if rollout_is_weights is not None and mode == "geometric":
            rollout_is_weights = _geometric_sequence_weights(rollout_is_weights, response_mask)
        if step is None and _get(_get(config, "policy_loss"), "fused", False):
            _warn_composed("the loss was not called by verl's FSDP or Megatron engine from its "
                           "ppo_loss (partial(ppo_loss, config=...), as verl's actor worker "
                           "binds it)")
        if fused:
            loss, metrics, current = _fused_loss(step, log_prob, old_log_prob, advantages,
                                                 response_mask, cfg, rollout_is_weights,
                                                 normalisers, config)
            if matching:  # the composed path's tokens out of the loss, for its metrics
                _, old_log_prob, response_mask, outside = drop_outside_kept(
                    current, old_log_prob, response_mask)
        else:
            loss, metrics = policy_loss(log_prob, old_log_prob, advantages, response_mask, cfg,
                                        token_weights=rollout_is_weights, **normalisers)
        if outside is not None:
            metrics["sampler/outside_kept"] = outside
        if rollout_log_probs is None and step is not None \
                and step.rollout_log_probs is not None:
            rollout_log_probs = step.rollout_log_probs.to(old_log_prob.device)
        if rollout_log_probs is not None:
            # old_log_prob: the trainer's logprobs at the weights the rollout sampled with
            metrics.update(logged_mismatch(old_log_prob, rollout_log_probs, response_mask))
        return loss, _verl_metrics(metrics)

    compute_policy_loss.__name__ = f"compute_policy_loss_{LOSS_PREFIX}{objective}"
    compute_policy_loss.__qualname__ = compute_policy_loss.__name__
    compute_policy_loss.__doc__ = (
        f"verl policy loss over logitless's ``{objective}`` objective "
        "(see logitless.integrations.verl)."
    )
    return compute_policy_loss


# -- verl's training step: the fused loss and the rollout logprobs ---------------------------
#
# verl 0.9.1 trains the actor through its engine (``FSDPEngineWithLMHead.forward_step``: the
# model forward, whose fused head is our ``linear_cross_entropy``, then ``ppo_loss``, which
# calls the registered policy loss). ``_hook_engine`` wraps ``forward_step`` so that, for a
# micro-batch that trains with verl's ``ppo_loss``, this module knows the step's actor config
# and its ``rollout_log_probs``; with ``policy_loss.fused`` the head call then hands its
# inputs over (``set_head_deferral``) and the policy loss runs ``fused_policy_loss`` on them,
# with ``ppo_loss``'s own entropy and KL terms folded in (``_fused_ppo_loss``), and under
# Ulysses with ``cp_group=`` the Ulysses group (``_ulysses_loss``).
# verl's Megatron engine is wrapped the same way around its whole ``forward_backward_batch``;
# its head is tensor-parallel: the fused loss runs with ``vocab_parallel=`` its group.

_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
_ENGINE_CLASS = "FSDPEngineWithLMHead"
# verl's Megatron engine (importable where megatron-core is): its forward_step runs inside
# Megatron's schedule, so its whole forward_backward_batch is wrapped (one head call, then its
# loss, per micro-batch)
_MEGATRON_MODULE = "verl.workers.engine.megatron.transformer_impl"
_MEGATRON_CLASS = "MegatronEngineWithLMHead"
_original_forward_step = None
_original_megatron_step = None
_step = None  # the _TrainStep of the micro-batch being trained, or None
_warned: set[str] = set()


@dataclasses.dataclass
class _HeadRows:
    """A deferred head call's inputs: ``[N, D]`` hidden rows, the head, ``[N]`` labels."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    temperature: float
    group: Any = None  # the tensor-parallel group the weight's vocabulary is sharded over
    # Ulysses: the rows are positions [offset, offset + N) of the packed stream, sp_group's
    sp_group: Any = None
    offset: int = 0
    kept: torch.Tensor | None = None  # replay: the rows' recorded sets [N, K]


@dataclasses.dataclass
class _TrainStep:
    """One micro-batch's training step as the engine hook sees it."""

    config: Any  # the actor config verl's ppo_loss was bound to
    fused: str | None  # None: run fused; else why the composed path runs
    rollout_log_probs: torch.Tensor | None  # [B, response_length], as ppo_loss pads its fields
    rows: _HeadRows | None = None
    entropy: bool = False  # the batch's calculate_entropy: verl's loss has its entropy term
    kl: bool = False  # actor.use_kl_loss, fused: verl's KL term joins the fused call
    sp_group: Any = None  # verl's Ulysses group, with ulysses_sequence_parallel_size > 1
    # the micro-batch's ref_log_prob [B, response_length] (`_fused_ppo_loss`)
    ref_log_prob: torch.Tensor | None = None
    # verl's metrics of the terms the fused loss folded in (`_fused_loss`, `_fused_ppo_loss`)
    logged: dict | None = None

    def take_rows(self) -> _HeadRows:
        rows, self.rows = self.rows, None
        return rows


def _step_of(config) -> _TrainStep | None:
    """The engine step of this loss call (None outside verl's hooked engines)."""
    return _step if _step is not None and _step.config is config else None


def _hook_engine() -> None:
    """Wrap verl's FSDP engine's ``forward_step`` and, where megatron-core is importable, its
    Megatron engine's ``forward_backward_batch`` (once per process; idempotent)."""
    global _original_forward_step, _original_megatron_step
    import importlib

    if _original_forward_step is None:
        engine = getattr(importlib.import_module(_ENGINE_MODULE), _ENGINE_CLASS)
        _original_forward_step = engine.forward_step
        engine.forward_step = _forward_step
        set_head_deferral(_defer_head)
    if _original_megatron_step is None:
        try:
            engine = getattr(importlib.import_module(_MEGATRON_MODULE), _MEGATRON_CLASS)
        except ImportError:  # no megatron-core here: verl's Megatron engine cannot run either
            return
        _original_megatron_step = engine.forward_backward_batch
        engine.forward_backward_batch = _megatron_step


def _ppo_loss_config(loss_function):
    """The actor config of verl's ``partial(ppo_loss, config=...)`` (what verl's actor worker
    trains with), else None."""
    from verl.workers.utils.losses import ppo_loss

    if isinstance(loss_function, functools.partial) and loss_function.func is ppo_loss:
        return loss_function.keywords.get("config")
    return None


def _train_step(engine, batch, config, fused_kernels: bool, rollout) -> _TrainStep:
    """The `_TrainStep` of a batch that trains with verl's ``ppo_loss`` bound to ``config``."""
    from verl.utils import tensordict_utils as tu

    fused, sp_group = "off", None
    entropy = bool(tu.get_non_tensor_data(data=batch, key="calculate_entropy", default=False))
    if _get(_get(config, "policy_loss"), "fused", False):
        if not fused_kernels:
            raise ValueError(
                "policy_loss.fused: needs actor_rollout_ref.model.use_fused_kernels=True (with "
                "fused_kernel_options.impl_backend=triton and LOGITLESS_VERL_FUSED_HEAD=1): the "
                "fused loss takes its inputs from the fused head")
        fused = _composed_reason(config, entropy)
        if fused is None and getattr(engine, "use_ulysses_sp", False):
            from verl.utils.ulysses import get_ulysses_sequence_parallel_group

            sp_group = get_ulysses_sequence_parallel_group()
            fused = _ulysses_reason(config, sp_group)
        if fused is None and _get(config, "use_kl_loss", False) \
                and "ref_log_prob" not in batch:  # verl's own loss raises for it
            fused = "actor.use_kl_loss: the batch has no ref_log_prob"
    kl = fused is None and bool(_get(config, "use_kl_loss", False))
    return _TrainStep(config=config, fused=fused, rollout_log_probs=rollout, entropy=entropy,
                      kl=kl, sp_group=None if fused is not None else sp_group)


def _forward_step(self, micro_batch, loss_function, forward_only):
    """verl's ``forward_step``, with the micro-batch's training step known to the head and the
    policy loss (see `_TrainStep`)."""
    global _step
    config = None if forward_only else _ppo_loss_config(loss_function)
    if config is None:
        return _original_forward_step(self, micro_batch, loss_function=loss_function,
                                      forward_only=forward_only)
    from verl.utils import tensordict_utils as tu

    rollout = None
    if "rollout_log_probs" in micro_batch:
        rollout = micro_batch.select("rollout_log_probs").to_padded_tensor()["rollout_log_probs"]
    fused_kernels = tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels",
                                           default=False)
    _step = _train_step(self, micro_batch, config, fused_kernels, rollout)
    if _step.fused is None:
        loss_function = functools.partial(_fused_ppo_loss, loss_function)
    try:
        return _original_forward_step(self, micro_batch, loss_function=loss_function,
                                      forward_only=forward_only)
    finally:
        _step = None


def _megatron_step(self, data, loss_function, forward_only=False):
    """verl's Megatron ``forward_backward_batch``, with the batch's training step known to the
    head and the policy loss (see `_TrainStep`); the rollout logprobs are not passed on (the
    batch is split into micro-batches inside)."""
    global _step
    config = None if forward_only else _ppo_loss_config(loss_function)
    if config is None:
        return _original_megatron_step(self, data, loss_function, forward_only=forward_only)
    _step = _train_step(self, data, config, bool(self.engine_config.use_fused_kernels), None)
    if _step.fused is None:
        loss_function = functools.partial(_fused_ppo_loss, loss_function)
    try:
        return _original_megatron_step(self, data, loss_function, forward_only=forward_only)
    finally:
        _step = None


def _composed_reason(config, calculate_entropy: bool) -> str | None:
    """Why this micro-batch cannot run the fused loss (None: it can; Ulysses: see
    `_ulysses_reason`)."""
    kl = _get(config, "use_kl_loss", False)
    pl = _get(config, "policy_loss")
    if kl or calculate_entropy:
        # verl aggregates its entropy and KL terms with agg_loss(loss_agg_mode, the global
        # batch info): the fused loss's aggregation of them must be that one
        if not _get(pl, "use_global_batch_info", True):
            return ("policy_loss.use_global_batch_info=False: verl normalises its entropy and "
                    "KL terms by the global batch")
        if _raw(pl, "seq_count", _passthrough_default("seq_count")) != "nonempty":
            return ("policy_loss.seq_count: verl's entropy and KL terms count non-empty "
                    "sequences")
    if kl:
        if _kl_estimator(_get(config, "kl_loss_type")) is None:
            return (f"actor.kl_loss_type={_get(config, 'kl_loss_type')!r}: not an estimator "
                    f"from the sampled token's logprobs")
        if _get(pl, "loss_agg") not in (None, _get(config, "loss_agg_mode")):
            return ("policy_loss.loss_agg: verl aggregates its KL term with "
                    "actor.loss_agg_mode, the fused loss with the policy term's aggregation")
        if not dataclasses.is_dataclass(config):
            return "actor.use_kl_loss: the actor config is not verl's ActorConfig dataclass"
    if _get(pl, "match_sampler") is not None:
        if _get(pl, "sequence_is_weight") is not None:
            return ("policy_loss.match_sampler with sequence_is_weight: the sequence weights "
                    "read the mask before the tokens outside the kept set leave it")
        if calculate_entropy:
            return ("policy_loss.match_sampler with calculate_entropy: verl's entropy term "
                    "and metric cover the tokens outside the kept set, which leave the policy "
                    "term")
    return None


def _ulysses_reason(config, sp_group) -> str | None:
    """Why a Ulysses micro-batch cannot run the fused loss: what ``cp_group=`` refuses
    (`check_cp_config`: objectives and selections over whole-batch statistics), for the
    logitless config of the loss mode. ``max_response_length`` is left out of the check: the
    loss sets it to the grid's width, verl's horizon, where verl's config leaves it open."""
    objective = _get(_get(config, "policy_loss"), "loss_mode")[len(LOSS_PREFIX):]
    cfg, _ = to_logitless_config(objective, config)
    try:
        check_cp_config(dataclasses.replace(cfg, max_response_length=1), sp_group)
    except ValueError as err:
        return f"ulysses_sequence_parallel_size > 1 (the loss runs with cp_group): {err}"
    return None


# verl's kl_loss_type (kl_penalty's names, each with an optional ``+``) -> logitless's estimator
_KL_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2",
             "low_var_kl": "k3", "k3": "k3"}


def _kl_estimator(kl_loss_type) -> str | None:
    """verl's ``kl_loss_type`` as ``PolicyLossConfig.kl_estimator`` (with ``kl_clamp``, verl's
    guard of k3), or None for one verl computes otherwise (``full``) or refuses. A ``+`` is
    k2's gradient under the estimate's value, which for k2 itself is k2."""
    if not isinstance(kl_loss_type, str):
        return None
    plus = kl_loss_type.endswith("+")
    base = _KL_TYPES.get(kl_loss_type[:-1] if plus else kl_loss_type)
    if base is None:
        return None
    return f"{base}+" if plus and base != "k2" else base


def _defer_head(hidden, weight, labels, temperature, reduction, dist_process_group,
                entropy_grad=True, kept=None):
    """The head hook (`set_head_deferral`): in a fused training step, keep the head's inputs
    for the policy loss and return placeholders: the logprobs are the rows' numbers (1-based,
    0 nowhere), so verl's own layout code (unpad, nested, ``no_padding_2_padding``) tells the
    loss which row each response token is; the entropy is 0 (verl's loss reads none here)."""
    step = _step
    if step is None or step.fused == "off":
        return None
    reason = step.fused
    if reason is None:
        if is_dtensor(weight):
            reason = "a sharded head (an FSDP2 DTensor weight)"
        elif (head_sampler() is not None or head_replays()) \
                and (dist_process_group is not None or step.sp_group is not None):
            reason = ("policy_loss.match_sampler with a tensor-parallel head or Ulysses: the "
                      "fused loss takes the truncation with one process's whole vocabulary "
                      "and sequences")
        elif reduction.lower() != "none" or step.rows is not None:
            reason = "a head call that is not one per-token call per micro-batch"
        elif step.entropy and _get(step.config, "entropy_coeff", 0.0) != 0 \
                and not entropy_grad:
            reason = ("enable_fused_head(entropy_grad=False): verl's entropy term has no "
                      "gradient there")
    if reason is not None:
        step.fused = "off"
        _warn_composed(reason)
        return None
    n = labels.numel()
    # Ulysses: the rank's n rows are positions [rank n, (rank + 1) n) of the padded stream
    # (ulysses_pad_and_slice_inputs), numbered so, and verl's gather gives every rank them all
    offset = 0 if step.sp_group is None else \
        torch.distributed.get_rank(group=step.sp_group) * n
    # verl's Megatron fused forward: whole hidden rows (verl gathers the sequence-parallel
    # ones first), this rank's vocabulary slice of the weight, the tensor-parallel group
    step.rows = _HeadRows(hidden.reshape(n, hidden.shape[-1]), weight, labels.reshape(n),
                          float(temperature), dist_process_group, step.sp_group, offset, kept)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    ids = torch.arange(offset + 1, offset + n + 1, dtype=dtype, device=hidden.device)
    return ids, torch.zeros_like(ids)


def _warn_composed(reason: str) -> None:
    """One warning per reason and process that ``policy_loss.fused`` runs the composed path."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"policy_loss.fused: this micro-batch runs the composed loss (the "
                      f"head's logprobs, then the policy loss): {reason}", stacklevel=3)


def _fused_loss(step: _TrainStep, ids, old_log_prob, advantages, response_mask, cfg,
                token_weights, normalisers, config):
    """``fused_policy_loss`` over the response tokens, their hidden rows picked by the row
    numbers verl laid out in ``log_prob``'s place (`_defer_head`), with verl's entropy and KL
    terms (`_verl_terms`) in the same call."""
    rows = step.take_rows()
    ids = ids.detach().round().long()
    mask = response_mask.bool()
    n = rows.labels.numel()
    stream = n if rows.sp_group is None else n * torch.distributed.get_world_size(rows.sp_group)
    if bool(((ids < 1) | (ids > stream))[mask].any()):
        raise ValueError("policy_loss.fused: a response token in the loss has no head row "
                         "(the micro-batch's head call and its loss do not match)")
    if rows.sp_group is not None:
        # (match_sampler runs composed under Ulysses: `_defer_head`)
        return (*_ulysses_loss(step, rows, ids, old_log_prob, advantages, response_mask, cfg,
                               token_weights, normalisers, config), None)
    pick = torch.where(mask, ids - 1, torch.zeros_like(ids))
    # a tensor-parallel head: each rank's share of the hidden gradient, as the head drop-in
    # returns it (verl's sequence-parallel gather sums it)
    parallel = {} if rows.group is None else dict(vocab_parallel=rows.group,
                                                  hidden_grad="partial")
    cfg, terms = _verl_terms(step, cfg, config, old_log_prob)
    current = terms.setdefault("out_logprobs", torch.zeros_like(old_log_prob))
    # match_sampler: the head's truncation (replay: the rows' recorded sets)
    truncation = dict(kept_ids=rows.kept[pick]) if rows.kept is not None else \
        ({} if head_sampler() is None else head_sampler().kwargs())
    loss, metrics = fused_policy_loss(rows.hidden[pick], rows.weight, rows.labels[pick],
                                      old_log_prob, advantages, response_mask, cfg,
                                      token_weights=token_weights, head_dtype=head_dtype(),
                                      temperature=rows.temperature, **parallel, **normalisers,
                                      **truncation, **terms)
    if "ref_logprobs" in terms or "out_entropy" in terms:
        step.logged = _logged_terms(loss, terms, response_mask, config)
    # the composed path's metrics: verl passes a policy loss no entropies or reference
    return loss, {k: v for k, v in metrics.items()
                  if not k.startswith("entropy/") and k != "kl"}, current


def _ulysses_loss(step: _TrainStep, rows: _HeadRows, ids, old_log_prob, advantages,
                  response_mask, cfg, token_weights, normalisers, config):
    """`_fused_loss` under Ulysses: ``fused_policy_loss(cp_group=)`` over this rank's piece of
    every response (docs/scale.md). The rank's rows are stream positions
    ``[offset, offset + n)``; a response's positions are consecutive in the stream, so its
    tokens on this rank are one run of the ``[B, T]`` grid, in rank order: they become the
    rank's ``[B, T_r]`` grid. The loss is the whole sequences' on every rank; its gradient is
    scaled by the Ulysses size, as verl's gather scales the composed path's (FSDP's average
    over the ranks takes it back). The metrics are the composed path's: ``policy_loss`` on
    the whole grid of logprobs, each rank's ``out_logprobs`` summed over the group."""
    group = rows.sp_group
    local = ids - rows.offset  # 1-based row numbers on this rank
    mine = (local >= 1) & (local <= rows.labels.numel())
    count = mine.sum(-1)
    start = torch.where(count > 0, mine.int().argmax(-1), torch.zeros_like(count))
    # at least one column: a rank with no response token still joins the group's reductions
    j = torch.arange(max(int(count.max()), 1), device=ids.device)
    inside = j < count[:, None]
    pos = torch.where(inside, start[:, None] + j, torch.zeros_like(j))

    def take(x):
        return None if x is None else torch.gather(x, 1, pos)

    def whole(x):  # the rank's [B, T_r] values summed into the [B, T] grid over the group
        grid = torch.zeros_like(old_log_prob)
        grid.scatter_add_(1, pos, torch.where(inside, x, torch.zeros_like(x)))
        torch.distributed.all_reduce(grid, group=group)
        return grid

    pick = torch.where(inside, take(local) - 1, torch.zeros_like(pos))
    cfg_cp = cfg
    if cfg.max_response_length is None:  # verl's horizon: the grid's width, not the rank's
        cfg_cp = dataclasses.replace(cfg, max_response_length=response_mask.shape[-1])
    cfg_cp, terms = _verl_terms(step, cfg_cp, config, take(old_log_prob))
    local_terms = {k: take(v) if k == "ref_logprobs" else v for k, v in terms.items()}
    local_terms.setdefault("out_logprobs", torch.zeros_like(take(old_log_prob)))
    loss, _ = fused_policy_loss(rows.hidden[pick], rows.weight, rows.labels[pick],
                                take(old_log_prob), take(advantages),
                                take(response_mask).bool() & inside, cfg_cp,
                                token_weights=take(token_weights), head_dtype=head_dtype(),
                                temperature=rows.temperature, cp_group=group, **normalisers,
                                **local_terms)
    with torch.no_grad():
        log_prob = whole(local_terms["out_logprobs"])
        _, metrics = policy_loss(log_prob, old_log_prob, advantages, response_mask, cfg,
                                 token_weights=token_weights, **normalisers)
        if terms:
            whole_terms = dict(out_logprobs=log_prob, ref_logprobs=terms.get("ref_logprobs"))
            if "out_entropy" in terms:
                whole_terms["out_entropy"] = whole(local_terms["out_entropy"])
            step.logged = _logged_terms(loss, {k: v for k, v in whole_terms.items()
                                               if k in terms}, response_mask, config)
    sp = torch.distributed.get_world_size(group)
    return loss + (sp - 1) * (loss - loss.detach()), metrics


def _verl_terms(step: _TrainStep, cfg: PolicyLossConfig, config, like: torch.Tensor):
    """The config and ``fused_policy_loss`` arguments of the terms verl's ``ppo_loss`` adds to
    the policy loss: ``- entropy_coeff * agg_loss(entropy)`` when the batch calculates
    entropies, ``+ kl_loss_coef * agg_loss(kl_penalty(log_prob, ref_log_prob))`` with
    ``use_kl_loss``, both aggregated with the actor's ``loss_agg_mode`` and the global batch
    information, as the policy term (`_composed_reason` sends the rest to the composed path).
    The KL joins each token's policy term before the aggregation, which is linear. The
    per-token entropies and logprobs come back in ``out_`` buffers for verl's metrics."""
    changes, terms = {}, {}
    if step.entropy:
        changes.update(entropy_coef=float(_get(config, "entropy_coeff", 0.0)),
                       entropy_agg=_get(config, "loss_agg_mode"))
        terms["out_entropy"] = torch.zeros_like(like)
    if step.kl:
        changes.update(beta=float(_get(config, "kl_loss_coef")), kl_clamp=True,
                       kl_estimator=_kl_estimator(_get(config, "kl_loss_type")))
        terms.update(ref_logprobs=step.ref_log_prob.to(like.device),
                     out_logprobs=torch.zeros_like(like))
    return (dataclasses.replace(cfg, **changes) if changes else cfg), terms


def _logged_terms(loss, terms, response_mask, config) -> dict:
    """verl's ``actor/pg_loss``, ``actor/entropy_loss`` and ``kl_loss`` of a fused loss that
    holds the entropy and KL terms: the terms from the per-token values by verl's own
    ``agg_loss`` and ``kl_penalty``, the policy term the rest of the loss."""
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

    def agg(mat):
        return agg_loss(loss_mat=mat, loss_mask=response_mask,
                        loss_agg_mode=config.loss_agg_mode, **config.global_batch_info)

    pg = loss.detach()
    logged = {}
    if "out_entropy" in terms:
        logged["actor/entropy_loss"] = agg(terms["out_entropy"])
        pg = pg + config.entropy_coeff * logged["actor/entropy_loss"]
    if "ref_logprobs" in terms:
        kld = kl_penalty(logprob=terms["out_logprobs"], ref_logprob=terms["ref_logprobs"],
                         kl_penalty=config.kl_loss_type)
        logged["kl_loss"] = agg(kld)
        pg = pg - config.kl_loss_coef * logged["kl_loss"]
    logged["actor/pg_loss"] = pg
    return logged


def _fused_ppo_loss(loss_function, model_output, data, dp_group=None):
    """verl's ``ppo_loss`` (``loss_function``, ``partial(ppo_loss, config=...)``) in a fused
    step: the fused loss holds verl's entropy and KL terms, so ppo_loss runs without them (the
    model output without its placeholder entropies, ``use_kl_loss`` off in a copy of the actor
    config), and their metrics are put back as verl logs them. A step whose head fell back to
    the composed path runs ``loss_function`` as it is."""
    from verl.utils.metric import Metric

    step = _step
    if step is None or step.rows is None:
        return loss_function(model_output=model_output, data=data, dp_group=dp_group)
    config = loss_function.keywords["config"]
    if step.kl:  # the micro-batch's reference logprobs, padded as ppo_loss pads its fields
        step.ref_log_prob = data.select("ref_log_prob").to_padded_tensor()["ref_log_prob"]
        step.config = dataclasses.replace(config, use_kl_loss=False)
    output = {k: v for k, v in model_output.items() if k != "entropy"}
    loss, metrics = loss_function.func(*loss_function.args,
                                       **{**loss_function.keywords, "config": step.config},
                                       model_output=output, data=data, dp_group=dp_group)
    if step.logged is not None:
        aggregation = metrics["actor/pg_loss"].aggregation
        metrics.update({k: Metric(value=v, aggregation=aggregation)
                        for k, v in step.logged.items()})
        if step.kl:
            metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics


def _check_sampler_matching(actor_config) -> None:
    """``match_sampler``'s conditions that only the loss call can see."""
    if _get(actor_config, "use_kl_loss", False):
        raise ValueError(
            "actor.use_kl_loss: with policy_loss.match_sampler the reference model's fused head "
            "in this process is truncated too, so its KL term is not the reference's; turn "
            "one of them off")
    if (head_sampler() is None and not head_replays()) or sampler_head_calls() == 0:
        raise ValueError(
            "policy_loss.match_sampler: the logprobs did not come through logitless's "
            "sampler-matched head in this process; set actor_rollout_ref.model."
            "use_fused_kernels=True with fused_kernel_options.impl_backend=triton and "
            "LOGITLESS_VERL_FUSED_HEAD=1 in the workers' environment")


def register_verl_losses(objectives=None) -> list[str]:
    """Register ``logitless_<name>`` in verl's policy-loss registry for the given objective
    names (default: every registered logitless objective; call it again after registering
    your own with ``logitless.register_objective``). Returns the loss-mode names."""
    names = sorted(OBJECTIVES) if objectives is None else list(objectives)
    for name in names:
        if name not in OBJECTIVES:
            raise ValueError(f"objectives: {name!r} is not a registered logitless objective")
        register_policy_loss(LOSS_PREFIX + name)(_verl_policy_loss(name))
    return [LOSS_PREFIX + name for name in names]


register_verl_losses()
register_verl_distillation_loss()

if os.environ.get("LOGITLESS_VERL_FUSED_HEAD", "").strip().lower() in ("1", "true", "yes"):
    enable_fused_head(
        entropy_grad=os.environ.get("LOGITLESS_VERL_ENTROPY_GRAD", "1").strip().lower()
        not in ("0", "false", "no"),
        sum_pi_squared=os.environ.get("LOGITLESS_VERL_SUM_PI_SQUARED", "").strip().lower()
        in ("1", "true", "yes"),
    )
