"""TRL's `GRPOConfig` read as logitless configs: the loss (`config_from_grpo`, TRL's loss for
every ``loss_type``) and the sampler's truncations (`sampler_from_grpo`, for
``match_sampler``)."""

from __future__ import annotations

import copy
import dataclasses
import numbers

import torch

from logitless.fused_losses.objectives.config import ConfigError, PolicyLossConfig
from logitless.integrations import objective_fields
from logitless.integrations.replay import SAMPLING_MASK_KEY
from logitless.integrations.sampler_config import (
    GREEDY_TEMPERATURE,
    SamplerTruncation,
    read_sampler_config,
)

# The PolicyLossConfig fields whose GRPOConfig argument TRL's loss reads in fp32: it builds
# them with ``torch.where`` on python floats, a tensor of the default dtype.
_TRL_FP32 = frozenset({"sapo_tau_pos", "sapo_tau_neg", "vespo_k_pos", "vespo_lambda_pos",
                       "vespo_k_neg", "vespo_lambda_neg"})


def _as_trl_reads(field_name: str, value):
    """``value`` of ``field_name`` at the precision TRL's loss reads it (fp32 for
    `_TRL_FP32`, as is for the others)."""
    if field_name not in _TRL_FP32 or isinstance(value, bool) or not isinstance(
            value, numbers.Real):
        return value
    return float(torch.tensor(value, dtype=torch.float32))


# Each PolicyLossConfig field config_from_grpo sets, and the GRPOConfig argument it comes from
# (an invalid value is reported under the argument's name).
_GRPO_ARGUMENTS = dict(
    objective="loss_type", ratio_level="importance_sampling_level", eps_low="epsilon",
    eps_high="epsilon_high", cispo_cap="epsilon_high", delta="delta", beta="beta",
    entropy_coef="entropy_coef", top_entropy_quantile="top_entropy_quantile",
    opsm_threshold="off_policy_mask_threshold", sapo_tau_pos="sapo_temperature_pos",
    sapo_tau_neg="sapo_temperature_neg", vespo_k_pos="vespo_k_pos",
    vespo_lambda_pos="vespo_lambda_pos", vespo_k_neg="vespo_k_neg",
    vespo_lambda_neg="vespo_lambda_neg", max_response_length="max_completion_length",
    grad_accum_steps="gradient_accumulation_steps", dp_size="world_size",
    rollout_is_min="vllm_importance_sampling_clip_min",
    rollout_is_max="vllm_importance_sampling_clip_max",
)
_VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def config_from_grpo(args, **overrides) -> PolicyLossConfig:
    """The `PolicyLossConfig` whose loss is TRL's ``GRPOTrainer`` loss for ``args`` (a
    ``GRPOConfig``); ``overrides`` replace any field (e.g. ``dual_clip_c=3.0``).

    ``loss_type`` -> ``objective`` (all eight of TRL 1.16), ``importance_sampling_level`` ->
    ``ratio_level``, ``epsilon`` / ``epsilon_high`` -> ``eps_low`` / ``eps_high`` (cispo:
    TRL's ``epsilon_high``, else ``epsilon``, is the ratio cap itself, ``min(r, epsilon_high)``
    for any value, below 1 included: ``cispo_cap``; TRL's cispo reads no other clip bound),
    ``delta``, ``beta`` with TRL's k3 estimator and ``use_bias_correction_kl`` (times ``r``
    with its gradient, as TRL's code does), ``top_entropy_quantile``, ``entropy_coef`` (a mean
    over the selected tokens: ``entropy_agg="bnpo"``), ``off_policy_mask_threshold`` ->
    ``opsm_threshold``, vLLM importance sampling (``use_vllm`` and
    ``vllm_importance_sampling_correction``: ``*_truncate`` / ``*_mask`` modes and clip bounds)
    -> ``rollout_is*``, sapo temperatures and vespo k/lambda (rounded to fp32: TRL builds them
    with ``torch.where`` on python floats), ``max_completion_length`` -> ``max_response_length``
    (dr_grpo's constant), ``gradient_accumulation_steps`` and the world size (the trainer sets
    both per call). TRL exponentiates the log-ratio unclamped (vespo clamps it to +-20), and so
    does this config.

    Raises ``ValueError`` naming the ``GRPOConfig`` argument (or the override) whose value
    `PolicyLossConfig` rejects. It accepts every value TRL's loss gives a meaning to; rejected
    although TRL runs with them: NaN anywhere; an infinite ``beta``, ``entropy_coef``,
    temperature or vespo parameter; ``epsilon`` / ``epsilon_high`` < 0 (a clip range not
    around 1), cispo's ``epsilon_high`` < 0 (a negative weight), ``beta`` < 0 (a reward for
    leaving the reference), ``delta`` <= 1 (caps the ratio below its on-policy value),
    sapo temperatures <= 0 (TRL divides by them), ``top_entropy_quantile`` > 1 (TRL ignores it,
    its documented range is [0, 1]), ``vllm_importance_sampling_clip_max`` <= 0 (every weight
    0).
    """
    return _build(args, _grpo_fields(args), overrides)


def _grpo_fields(args) -> dict:
    """`config_from_grpo`'s fields for ``args``, before any override."""
    loss_type = args.loss_type
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    fields = dict(
        objective=loss_type,
        ratio_level=args.importance_sampling_level,
        eps_low=args.epsilon,
        eps_high=eps_high,
        delta=args.delta,
        beta=args.beta,
        kl_estimator="k3",
        kl_bias_correction=args.use_bias_correction_kl,
        kl_bias_correction_grad=True,
        log_ratio_clamp=None,
        entropy_coef=args.entropy_coef,
        entropy_agg="bnpo",
        top_entropy_quantile=args.top_entropy_quantile,
        opsm_threshold=args.off_policy_mask_threshold,
        sapo_tau_pos=args.sapo_temperature_pos,
        sapo_tau_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos,
        vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg,
        max_response_length=args.max_completion_length,
        grad_accum_steps=args.gradient_accumulation_steps,
        dp_size=getattr(args, "world_size", 1),
        seq_count="all",
    )
    fields = {k: _as_trl_reads(k, v) for k, v in fields.items()}
    # an unknown name fixes nothing (PolicyLossConfig reports it); vespo's token level and
    # log-ratio clamp
    fields.update(objective_fields.trl_fields(loss_type))
    if loss_type == "cispo":
        del fields["eps_low"], fields["eps_high"]
        fields.update(cispo_clip="upper", cispo_cap=eps_high)
    if args.use_vllm and args.vllm_importance_sampling_correction:
        mode = args.vllm_importance_sampling_mode
        if mode not in _VLLM_IS_MODES:
            raise ValueError(f"GRPOConfig.vllm_importance_sampling_mode: expected one of "
                             f"{list(_VLLM_IS_MODES)}, got {mode!r}")
        level, how = mode.split("_")
        fields.update(
            rollout_is=level,
            rollout_is_mode="mask" if how == "mask" else "truncate",
            rollout_is_min=args.vllm_importance_sampling_clip_min,
            rollout_is_max=args.vllm_importance_sampling_clip_max,
        )
    return fields


def _build(args, fields: dict, overrides: dict) -> PolicyLossConfig:
    """``PolicyLossConfig(**fields, **overrides)``; an invalid value is reported under the
    ``GRPOConfig`` argument it comes from (an override: under its own field)."""
    fields = {**fields, **overrides}
    try:
        return PolicyLossConfig(**fields)
    except ConfigError as e:
        argument = None if e.field in overrides else _GRPO_ARGUMENTS.get(e.field)
        if argument == "epsilon_high" and args.epsilon_high is None:
            argument = "epsilon"  # TRL's epsilon_high defaults to epsilon
        if argument is None:
            raise
        raise ValueError(f"GRPOConfig.{argument}: {e.reason} (as PolicyLossConfig.{e.field})"
                         ) from e


# The GRPOConfig arguments each PolicyLossConfig field is read from (beyond `_GRPO_ARGUMENTS`'
# one-to-one names): a field set in both configs is compared against them.
_SOURCES = {**{k: (v,) for k, v in _GRPO_ARGUMENTS.items()},
            "loss_agg": ("loss_type",), "kl_bias_correction": ("use_bias_correction_kl",),
            "rollout_is": ("use_vllm", "vllm_importance_sampling_correction",
                           "vllm_importance_sampling_mode"),
            "rollout_is_mode": ("vllm_importance_sampling_mode",)}
# Taken from the GRPOConfig whatever the objective: the trainer's settings, TRL's counting and
# the rollout correction its generation needs.
_ALWAYS = frozenset({"max_response_length", "grad_accum_steps", "dp_size", "seq_count",
                     "rollout_is", "rollout_is_mode", "rollout_is_min", "rollout_is_max"})
# ... and taken along with a field: TRL's KL estimate comes with its beta, its entropy
# aggregation with its entropy_coef.
_COMPANIONS = {"beta": ("kl_estimator", "kl_bias_correction", "kl_bias_correction_grad"),
               "entropy_coef": ("entropy_agg",)}


def _sources(field_name: str, args) -> tuple[str, ...]:
    if field_name in ("eps_low", "eps_high") and args.loss_type == "cispo":
        return ()  # TRL's cispo reads epsilon_high as its cap, no clip bounds
    if field_name == "cispo_cap" and args.loss_type != "cispo":
        return ()
    if field_name in ("eps_high", "cispo_cap") and args.epsilon_high is None:
        return ("epsilon",)  # TRL's epsilon_high defaults to epsilon
    return _SOURCES.get(field_name, ())


def _set_in(args) -> frozenset:
    """The ``GRPOConfig`` arguments whose value is not TRL's default (what the user set)."""
    out = set()
    for f in dataclasses.fields(type(args)):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        if getattr(args, f.name, default) != default:
            out.add(f.name)
    return frozenset(out)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a == b


def loss_config_over_grpo(args, loss_config: PolicyLossConfig) -> PolicyLossConfig:
    """``loss_config`` laid over ``config_from_grpo(args)``: the fields passed to its
    constructor (`PolicyLossConfig.given_fields`) override, the others come from ``args``.

    With ``loss_config``'s objective TRL's ``loss_type`` (or not given), the result is
    ``config_from_grpo(args, **given)``. With another objective (``loss_type`` then left at
    TRL's default), it is that objective's defaults with, from ``args``: the arguments set
    there (``beta`` with TRL's KL estimate, ``epsilon`` / ``epsilon_high``, ``delta``,
    ``entropy_coef`` with TRL's entropy aggregation, ``top_entropy_quantile``,
    ``importance_sampling_level``, ``off_policy_mask_threshold``, ...) and always
    ``max_completion_length``, vLLM's importance-sampling correction and the trainer's
    accumulation and world size.

    Raises ``ValueError`` naming both fields when one set in both (``GRPOConfig`` not at
    TRL's default, ``loss_config`` given) disagrees, e.g. "GRPOConfig.beta=0.04 but
    loss_config.beta=0.0"; ``loss_type`` speaks for ``objective`` and ``loss_agg``.
    """
    given = {f: getattr(loss_config, f) for f in loss_config.given_fields()
             if f not in ("grad_accum_steps", "dp_size")}
    set_in_grpo = _set_in(args)
    base = config_from_grpo(args)
    for name, value in given.items():
        set_sources = [a for a in _sources(name, args) if a in set_in_grpo]
        theirs = getattr(base, name)
        if set_sources and not _same(theirs, _as_trl_reads(name, value)):
            arg = set_sources[0]
            shown = getattr(args, arg)
            note = "" if _same(shown, theirs) else f" (which makes {name}={theirs!r})"
            raise ValueError(f"GRPOConfig.{arg}={shown!r}{note} but loss_config.{name}="
                             f"{value!r}: set it in one of the two, or to the same value")
    if given.get("objective", args.loss_type) == args.loss_type:
        return _build(args, _grpo_fields(args), given)
    fields = _grpo_fields(args)
    carried = {k for k in fields
               if k in _ALWAYS or set_in_grpo.intersection(_sources(k, args))}
    carried |= {c for k, cs in _COMPANIONS.items() if k in carried for c in cs}
    return _build(args, {k: v for k, v in fields.items() if k in carried}, given)


# generation_kwargs keys that leave the per-token sampling distribution alone (lengths, stop
# rules, ids, seeds, caching, detokenisation); any other key is refused under match_sampler.
_NEUTRAL_GENERATION_KWARGS = frozenset({
    "max_tokens", "max_new_tokens", "max_length", "n", "num_return_sequences", "stop",
    "stop_token_ids", "stop_strings", "include_stop_str_in_output", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "seed",
    "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "use_cache",
    "disable_compile", "output_kind",
})
# ... and those whose value must be the one that keeps plain multinomial sampling.
_REQUIRED_GENERATION_KWARGS = {"do_sample": True, "num_beams": 1}
_SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _check_distribution_settings(args, read_fields) -> None:
    """What neither sampler matching nor replay reproduces: a repetition penalty, and
    ``generation_kwargs`` keys that override ``read_fields`` or change the distribution
    otherwise (``do_sample`` must stay True and ``num_beams`` 1)."""
    if args.repetition_penalty != 1:
        raise ValueError(
            f"GRPOConfig.repetition_penalty: sampler matching reproduces temperature, top-k, "
            f"top-p and min-p only; a repetition penalty depends on the tokens generated so far "
            f"(expected 1.0, got {args.repetition_penalty!r})")
    extra = args.generation_kwargs or {}
    for key, value in extra.items():
        if key in read_fields:
            raise ValueError(
                f"GRPOConfig.generation_kwargs[{key!r}]: overrides GRPOConfig.{key}, which "
                f"match_sampler reads; set GRPOConfig.{key} instead")
        if key in _REQUIRED_GENERATION_KWARGS:
            if value != _REQUIRED_GENERATION_KWARGS[key]:
                raise ValueError(
                    f"GRPOConfig.generation_kwargs[{key!r}]: match_sampler needs plain sampling "
                    f"({key}={_REQUIRED_GENERATION_KWARGS[key]!r}), got {value!r}")
        elif key not in _NEUTRAL_GENERATION_KWARGS and key not in _SAMPLER_FIELDS:
            raise ValueError(
                f"GRPOConfig.generation_kwargs[{key!r}]: may change the sampling distribution, "
                f"which match_sampler cannot reproduce (accepted keys: "
                f"{sorted(_NEUTRAL_GENERATION_KWARGS | set(_REQUIRED_GENERATION_KWARGS))})")


def head_dtype_from_grpo(args) -> str | None:
    """The ``head_dtype`` of TRL's head for ``args`` (a ``GRPOConfig``):
    ``cast_lm_head_to_fp32=True`` -> ``"float32"`` (TRL's fused head then computes the
    logits in fp32 from the hidden states upcast, autocast off, with the head's weight cast
    to fp32), else None. Patched into TRL's forward, logitless's head receives those fp32
    tensors already; a caller that feeds the backbone's hidden states to `linear_logprobs` or
    `fused_policy_loss` itself passes this value to compute as TRL does."""
    flag = getattr(args, "cast_lm_head_to_fp32", False)
    if not isinstance(flag, bool):
        raise ValueError(f"cast_lm_head_to_fp32 must be a bool, got {flag!r}")
    return "float32" if flag else None


def sampler_from_grpo(args) -> SamplerTruncation:
    """The truncations TRL's generation backend samples with under ``args`` (a ``GRPOConfig``),
    for ``GRPOTrainer(match_sampler=True)``.

    Reads ``temperature``, ``top_k`` (0 or -1: off), ``top_p`` (1: off) and ``min_p`` (None or
    0: off), the values TRL passes to vLLM's ``SamplingParams`` and to transformers'
    ``GenerationConfig``. Raises ``ValueError`` naming the ``GRPOConfig`` argument for what the
    fused head cannot reproduce: ``repetition_penalty`` != 1 (it depends on the tokens already
    generated); a ``generation_kwargs`` key that overrides one of those settings or changes the
    distribution in another way (anything but lengths, stop rules, token ids, seeds and
    caching; ``do_sample`` must stay True and ``num_beams`` 1); ``vllm_structured_outputs_regex``
    (guided decoding masks tokens per step); a temperature below 1e-5 (vLLM samples greedily);
    with transformers' generation (``use_vllm=False``), any truncation under
    ``use_transformers_continuous_batching`` (its sampler is not the one checked).

    The rules follow the engine: vLLM's with ``use_vllm`` (either ``vllm_mode``), else
    transformers' ``generate`` (temperature, top-k keeping every tie at the k-th value, top-p,
    then min-p on the survivors; ``sampler="transformers"``). ``generate`` also takes what TRL
    leaves None from the model's own generation config: the trainer, once built, reads those
    merged settings instead (:func:`sampler_from_generate`).
    """
    names = {k: f"GRPOConfig.{k}" for k in ("temperature", "top_k", "top_p", "min_p")}
    _check_distribution_settings(args, _SAMPLER_FIELDS)
    if args.use_vllm and args.vllm_structured_outputs_regex is not None:
        raise ValueError(
            "GRPOConfig.vllm_structured_outputs_regex: guided decoding masks tokens at each "
            "step, which match_sampler cannot reproduce")
    # vLLM in either vllm_mode (server or colocate) runs the same sampler; without it, TRL
    # samples with transformers' generate and its logits processors
    settings = read_sampler_config(temperature=args.temperature, top_k=args.top_k,
                                   top_p=args.top_p, min_p=args.min_p, names=names,
                                   top_k_off=(0, -1),
                                   sampler="vllm" if args.use_vllm else "transformers")
    if not args.use_vllm and settings.truncates and args.use_transformers_continuous_batching:
        raise ValueError(
            "GRPOConfig.use_transformers_continuous_batching: match_sampler with top_k, "
            "top_p or min_p supports vLLM and transformers' generate, not continuous "
            "batching")
    return settings


# The logits processors of transformers' sampling that the head reproduces (the temperature
# and the truncations; LogitNormalization is a log-softmax, which leaves the distribution alone).
_GENERATE_REPRODUCED = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper",
                                  "TopPLogitsWarper", "MinPLogitsWarper", "LogitNormalization"})
# The generation-config setting behind each other processor transformers builds (5.17 - 5.25),
# for the error message; a processor not listed is named by its class.
_GENERATE_SETTINGS = {
    "TypicalLogitsWarper": "typical_p", "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff", "TopHLogitsWarper": "top_h",
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids", "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinLengthLogitsProcessor": "min_length", "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "WatermarkLogitsProcessor": "watermarking_config",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}
# The settings that choose generate's decoding mode (GenerationConfig.get_generation_mode).
_GENERATE_MODE_SETTINGS = ("num_beams", "num_beam_groups", "constraints",
                           "force_words_ids", "use_mtp", "prompt_lookup_num_tokens",
                           "assistant_early_exit")


def sampler_from_generate(model, generation_config) -> SamplerTruncation:
    """The truncations transformers' ``generate`` really samples with when TRL calls it
    (``use_vllm=False``): ``generation_config`` (the trainer's, built from the ``GRPOConfig``)
    merged with the model's own ``model.generation_config`` (its generation_config.json) by
    transformers' ``_prepare_generation_config``, the merge ``generate`` makes. A setting TRL
    passes as None (``min_p`` when ``GRPOConfig.min_p`` is None) or not at all (``typical_p``,
    ``epsilon_cutoff``, ...) takes the model's value there.

    The logits processors ``generate`` builds from the merged config
    (``_get_logits_processor``) must be the temperature, top-k, top-p and min-p only, and its
    decoding mode plain sampling; anything else raises ``ValueError`` naming the setting
    (``model.generation_config.<name>`` when it comes from the model, ``GRPOConfig.<name>``
    when TRL passes it)."""
    from transformers.generation import GenerationMode

    if hasattr(model, "get_base_model"):  # PEFT: the model whose generate runs
        model = model.get_base_model()
    merged, _ = model._prepare_generation_config(generation_config)

    def where(name: str) -> str:
        ours = getattr(generation_config, name, None)
        return f"model.generation_config.{name}" if ours is None else f"GRPOConfig.{name}"

    mode = merged.get_generation_mode()
    if mode != GenerationMode.SAMPLE:
        default = type(merged)()
        moved = [n for n in _GENERATE_MODE_SETTINGS
                 if getattr(merged, n, None) not in (None, getattr(default, n, None), 1)]
        shown = ", ".join(f"{where(n)}={getattr(merged, n)!r}" for n in moved) or "its settings"
        raise ValueError(
            f"{shown}: transformers' generate then decodes by {mode.value!r}, not plain "
            f"sampling, which match_sampler cannot reproduce")
    merged = copy.deepcopy(merged)  # _prepare_special_tokens writes tensors into it
    model._prepare_special_tokens(merged, True, device=model.device)
    processors = model._get_logits_processor(merged, input_ids_seq_length=1,
                                             device=model.device)
    for processor in processors:
        kind = type(processor).__name__
        if kind in _GENERATE_REPRODUCED:
            continue
        name = _GENERATE_SETTINGS.get(kind)
        setting = (f"{where(name)}={getattr(merged, name, None)!r}" if name is not None
                   else f"the generation config's {kind}")
        raise ValueError(
            f"{setting}: transformers' generate applies it when sampling ({kind}), which "
            f"match_sampler cannot reproduce (it reproduces temperature, top_k, top_p and "
            f"min_p); unset it in the model's generation_config.json, or generate with vLLM")
    names = {k: where(k) for k in ("temperature", "top_k", "top_p", "min_p")}
    return read_sampler_config(temperature=merged.temperature, top_k=merged.top_k,
                               top_p=merged.top_p, min_p=merged.min_p, names=names,
                               top_k_off=(0,), sampler="transformers")


# Under replay the recorded set is the truncation: only the temperature (the head divides the
# logits by GRPOConfig.temperature) and the repetition penalty are read from the settings.
_REPLAY_FIELDS = ("temperature", "repetition_penalty")


def check_grpo_replay(args, rollout_func) -> None:
    """The conditions of ``GRPOTrainer(match_sampler="replay")`` that the ``GRPOConfig`` and
    the trainer's arguments show, checked at construction.

    Replay renormalises the policy's tempered logits over the set the engine recorded; that is
    the engine's distribution when, inside the set, the engine's processed logits are the
    model's logits over ``GRPOConfig.temperature``. The sets reach the trainer from a
    ``rollout_func`` (TRL's own vLLM paths do not return them: TRL builds the colocated
    ``LLM`` without ``return_sampling_mask`` and its server answers ids and logprobs only).
    Raises ``ValueError`` naming: ``rollout_func`` when there is none; ``GRPOConfig.temperature``
    below 1e-5 (greedy decoding; vLLM refuses replay there too);
    ``GRPOConfig.repetition_penalty`` != 1 (it moves the logits inside the set);
    ``GRPOConfig.generation_kwargs[...]`` for ``temperature`` or ``repetition_penalty`` (they
    override what the head reads) or a key that may change the distribution (``top_k``,
    ``top_p`` and ``min_p`` pass: the set records them); ``vllm_structured_outputs_regex``
    (not verified to enter vLLM's recorded set).
    """
    if rollout_func is None:
        raise ValueError(
            "rollout_func: match_sampler='replay' renormalises over the kept sets the engine "
            f"recorded, which reach the trainer from a rollout_func returning them under "
            f"{SAMPLING_MASK_KEY!r} (e.g. vLLM with return_sampling_mask=True, read by "
            "logitless.integrations.replay.masks_from_request_outputs); TRL's own generation "
            "does not return them")
    if args.temperature < GREEDY_TEMPERATURE:
        raise ValueError(
            f"GRPOConfig.temperature: replay needs a sampling temperature >= "
            f"{GREEDY_TEMPERATURE}, got {args.temperature!r}")
    _check_distribution_settings(args, _REPLAY_FIELDS)
    if args.use_vllm and args.vllm_structured_outputs_regex is not None:
        raise ValueError(
            "GRPOConfig.vllm_structured_outputs_regex: guided decoding with "
            "match_sampler='replay' is not supported (its token masks are not verified to "
            "enter the recorded set)")
