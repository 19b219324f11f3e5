"""`PolicyLossConfig`: the objective and every knob of docs/objectives.md, checked when built."""

import dataclasses
import math
import numbers
import typing
from dataclasses import dataclass, field

import torch

RATIO_LEVELS = (
    "token",
    "sequence",
    "sequence_token",
    "geometric",
    "prefix_cumulative",
    "prefix_min",
)
LOSS_AGGS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "bnpo",
    "balanced",
    "length-power",
    "prompt-mean",
    "constant",
)
# Aggregations that need a config field: the field, and what it is.
_AGG_FIELDS = {"prompt-mean": "prompt_group_size", "constant": "loss_agg_divisor"}
# verl's names are accepted as aliases of the k-names.
KL_ESTIMATORS = (
    "k1",
    "k2",
    "k3",
    "abs",
    "k1+",
    "k3+",
    "abs+",
    "kl",
    "mse",
    "low_var_kl",
    "low_var_kl+",
)
# Not an estimator from the sampled token: the full-vocabulary KL(policy || reference) per
# token, given as a tensor (`policy_loss`'s ``kl=``) or computed from the reference head
# (`fused_policy_loss`'s ``ref_hidden=`` / ``ref_weight=``).
KL_EXACT = "exact"
ROLLOUT_IS_LEVELS = ("token", "sequence", "sequence_geometric")
ROLLOUT_RS_OPTIONS = tuple(
    [f"token_k{k}" for k in (1, 2, 3)]
    + [f"seq_{lvl}_k{k}" for lvl in ("sum", "mean") for k in (1, 2, 3)]
    + ["seq_max_k2", "seq_max_k3"]
)
ATTN_WEIGHTINGS = ("tanh", "softmax", "low_quantile", "high_quantile")

Scalar = float | torch.Tensor

# Fields whose infinite value is meaningful: a bound that is absent (no clip, cap, clamp or
# threshold). Every other float field must be finite, and no field may be NaN.
INF_ALLOWED = frozenset({
    "eps_low", "eps_high", "seq_eps_low", "seq_eps_high", "dual_clip_c", "delta",
    "log_ratio_clamp", "seq_log_ratio_max", "cispo_cap", "dppo_ratio_cap", "clip_cov_lb",
    "clip_cov_ub", "stapo_entropy_threshold", "rollout_is_min", "rollout_is_max",
    "rollout_rs_threshold", "opsm_threshold",
})


# Sizes and counts: integers >= 1 (max_response_length may also be None).
POSITIVE_INT_FIELDS = ("max_response_length", "dp_size", "grad_accum_steps", "prompt_group_size")


class ConfigError(ValueError):
    """A `PolicyLossConfig` field's value is invalid; ``field`` names it, ``reason`` says why."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"PolicyLossConfig.{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


def _fail(name: str, msg: str):
    raise ConfigError(name, msg)


def _check_number(name, value):
    """NaN is never a setting; inf only where it means an absent bound (`INF_ALLOWED`)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        nan, inf = bool(torch.isnan(value).any()), bool(torch.isinf(value).any())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        nan, inf = math.isnan(value), math.isinf(value)
    else:
        return
    if nan:
        _fail(name, f"must not be NaN, got {value}")
    if inf and name not in INF_ALLOWED:
        _fail(name, f"must be finite, got {value}")


def _check_type(name, value, annotation):
    """A field's value has a type its annotation names (numeric fields only): a real number
    (not a bool, nor a string of one) where ``float`` is expected, an integer where ``int``
    is; None, a string or a tensor only where the annotation allows them."""
    kinds = typing.get_args(annotation) or (annotation,)
    if float not in kinds and int not in kinds:
        return
    if value is None and type(None) in kinds:
        return
    if isinstance(value, str) and str in kinds:
        return
    if isinstance(value, torch.Tensor) and torch.Tensor in kinds:
        return
    if not isinstance(value, bool):
        if float in kinds and isinstance(value, numbers.Real):
            return
        if isinstance(value, numbers.Integral):
            return
    if float in kinds:
        _fail(name, f"must be a real number, got {value!r}")
    want = "a positive integer" if name in POSITIVE_INT_FIELDS else "an integer"
    _fail(name, f"must be {want}, got {value!r}")


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        _fail(name, f"must be a positive integer, got {value!r}")


def _check_nonneg(name, value):
    if value is None:
        return
    bad = (value < 0).any().item() if isinstance(value, torch.Tensor) else value < 0
    if bad:
        _fail(name, f"must be >= 0, got {value}")


def _check_fraction(name, value):
    if not 0.0 < value <= 1.0:
        _fail(name, f"must be in (0, 1], got {value}")


def _check_choice(name, value, choices):
    if value not in choices:
        _fail(name, f"unknown value {value!r}; expected one of {list(choices)}")


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf  # a bound of 1/inf is 0: no lower bound


def parse_rollout_rs(options: str, threshold) -> tuple[tuple[str, float, float], ...]:
    """verl `rollout_rs` syntax: comma separated options, thresholds one shared or one each.

    k1 options take ratio bounds ``"lo_hi"`` (a single ``hi`` means ``1/hi_hi``) and compare
    the log-ratio to their logs; k2/k3 options take an upper bound. Returns
    ``(option, lower, upper)`` in the space the statistic lives in (``lower = -inf`` for k2/k3).
    """
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    if not names:
        _fail("rollout_rs", "must name at least one option")
    for name in names:
        _check_choice("rollout_rs", name, ROLLOUT_RS_OPTIONS)
    if threshold is None:
        _fail("rollout_rs_threshold", "is required when rollout_rs is set")
    specs = [threshold] if isinstance(threshold, int | float) else str(threshold).split(",")
    specs = [str(s).strip() for s in specs]
    if len(specs) not in (1, len(names)):
        _fail("rollout_rs_threshold", f"expects 1 or {len(names)} values, got {len(specs)}")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, spec in zip(names, specs):
        try:
            parts = [float(p) for p in spec.split("_")]
        except ValueError:
            _fail("rollout_rs_threshold", f"cannot parse {spec!r}")
        if any(not p > 0 for p in parts) or len(parts) > 2:  # `not p > 0`: NaN too
            _fail(
                "rollout_rs_threshold", f"{spec!r}: thresholds must be one or two positive numbers"
            )
        if name.endswith("k1"):
            lo, hi = (1.0 / parts[0], parts[0]) if len(parts) == 1 else parts
            if lo > hi:
                _fail("rollout_rs_threshold", f"{spec!r}: lower bound above upper bound")
            out.append((name, _log(lo), _log(hi)))
        else:
            if len(parts) != 1:
                _fail("rollout_rs_threshold", f"{name} takes a single upper bound, got {spec!r}")
            out.append((name, -math.inf, parts[0]))
    return tuple(out)


@dataclass
class PolicyLossConfig:
    """The objective and its knobs. Fields left at ``None`` take the objective's default.

    Every invalid value raises `ConfigError` (a ``ValueError``) naming the field. No float
    field may be NaN, and only the bounds listed in `INF_ALLOWED` may be infinite, where
    ``inf`` means the bound is absent: ``eps_low``, ``eps_high``, ``seq_eps_low``,
    ``seq_eps_high`` (no clip on that side), ``dual_clip_c``, ``delta``, ``cispo_cap``,
    ``dppo_ratio_cap`` (no cap), ``log_ratio_clamp``, ``seq_log_ratio_max`` (no clamp),
    ``clip_cov_lb`` / ``clip_cov_ub``, ``stapo_entropy_threshold``, ``opsm_threshold``,
    ``rollout_is_min`` / ``rollout_is_max``, ``rollout_rs_threshold`` (no threshold).

    Objective and ratio:
        objective: a registered objective name (see ``logitless.fused_losses.objectives.catalog``).
        ratio_level: ``token | sequence | sequence_token | geometric | prefix_cumulative |
            prefix_min``; ``None``: the objective's default (``gspo``/``luspo`` sequence, ``gmpo``
            geometric, ``ctpo`` prefix_cumulative, ``minpro`` prefix_min, else token).
        eps_low, eps_high: clip bounds ``[1 - eps_low, 1 + eps_high]`` (log-space for
            ``geometric`` and ``prefix_cumulative``), scalars or per-token tensors laid out like
                the logprobs. ``None``: the objective's default (eps_low 0.2, 0.4 for ``gmpo``;
            eps_high 0.28 for ``dapo``, else eps_low).
        dual_clip_c: dual clip for A < 0, ``min(l, -c A)``, c > 1 (verl ``clip_ratio_c``).
        delta: two-sided cap of the unclipped ratio, ``rho <- min(rho, delta)`` (TRL ``delta``).
        hard_trust_region: tokens whose ratio leaves the clip range get no gradient (SAO).
        log_ratio_clamp: ``d = lp - lp_old`` is clamped to ``[-c, c]`` before any exp.
        seq_log_ratio_max: cap of the log sequence ratio of ``sequence`` and ``sequence_token``
            (value and gradient), verl's GSPO guard (10, with ``log_ratio_clamp=None``).
        cispo_clip: ``two_sided`` (paper, verl) ``clip(r, 1-eps_low, 1+eps_high)`` or ``upper``
            ``min(r, cap)`` (ScaleRL, TRL); ``None``: ``upper`` when ``cispo_cap`` is set,
            else ``two_sided``.
        cispo_cap: the cap of ``upper``, a number >= 0 (TRL's ``epsilon_high`` of
            ``loss_type="cispo"``, any value, below 1 included); ``None``: ``1 + eps_high``.
        sapo_tau_pos, sapo_tau_neg; vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
            vespo_lambda_neg; dro_beta; dppo_ratio_cap (verl ``clip_ratio_c`` of DPPO);
            sq_log_ratio_coef (``prime_rl``'s squared log-ratio term, prime-rl ``kl_tau``);
            cov_fraction, clip_cov_lb, clip_cov_ub, kl_cov_coef, cov_seed (``clip_cov``,
            ``kl_cov``; ``cov_seed=None`` draws from torch's global generator like verl);
            dhpo_mix (float in [0, 1] or ``"entropy"``), seq_eps_low, seq_eps_high (DHPO's
            sequence bounds, default eps_low/eps_high); delight_eta;
            prefix_bound_growth (``sqrt | linear | constant``, CTPO's g(t));
            minpro_prefix (``inclusive``: min over j <= t; ``preceding``: r_t * min over j < t).
    KL to the reference:
        beta (scalar or per-token tensor), kl_estimator (``k1 k2 k3 abs``, ``+`` variants:
        straight-through k2 gradient; verl aliases ``kl mse low_var_kl``; ``exact``: the
        full-vocabulary KL(policy || reference) per token, see docs/objectives.md),
        kl_bias_correction (multiply by ``sg(r)``, TRL's ``use_bias_correction_kl``;
        ``kl_bias_correction_grad``: by ``r`` with its gradient, as TRL's code does), kl_clamp
        (verl's clamp of k3: x to [-20, 20], result to [-10, 10]), future_kl_coef (FRPO).
    Entropy:
        entropy_coef, entropy_agg (``None``: the loss aggregation, as verl; TRL: ``bnpo``),
        top_entropy_quantile (in [0, 1]: keep the tokens at or above the ``1 - q`` quantile of
        the entropies, 0 keeping the highest only, as TRL), stapo_prob_threshold and
        stapo_entropy_threshold (STAPO, both needed), adv_entropy_top_fraction (D3S),
        attn_entropy_weighting (``tanh | softmax | low_quantile | high_quantile``),
        attn_entropy_alpha, attn_entropy_alpha_final,
        attn_entropy_standardize (``sequence | batch``), attn_entropy_quantile,
        prob_reweight_alpha (Lopti).
    Rollout correction:
        rollout_is (``token | sequence | sequence_geometric``), rollout_is_mode (``truncate``:
        TIS, ``mask``: MIS/IcePop), rollout_is_min (a bound at or below 0 bounds nothing, as
        TRL's ``vllm_importance_sampling_clip_min``), rollout_is_max,
        rollout_is_batch_normalize (divide the weights by their batch mean: over tokens, or
        over non-empty sequences for sequence levels; verl's option), rollout_rs and
        rollout_rs_threshold (verl syntax), opsm_threshold (DeepSeek-V3.2, TRL
        ``off_policy_mask_threshold``).
    Aggregation:
        loss_agg, max_response_length (``L_max`` of seq-mean-token-sum-norm; default: the padded
        width), length_power_alpha, dp_size and grad_accum_steps (positive integers),
        seq_count (``all``: every sequence counts in seq-mean denominators, as TRL;
        ``nonempty``: as verl); prompt_group_size (``prompt-mean``: the batch is groups of
        this many consecutive sequences, one prompt's responses); loss_agg_divisor
        (``constant``: the fixed divisor of each sequence's token sum, > 0).
    """

    objective: str = "grpo"
    ratio_level: str | None = None
    eps_low: Scalar | None = None
    eps_high: Scalar | None = None
    loss_agg: str | None = None
    beta: Scalar = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    dual_clip_c: float | None = None
    delta: float | None = None
    hard_trust_region: bool = False
    log_ratio_clamp: float | None = 20.0
    seq_log_ratio_max: float | None = None
    cispo_clip: str | None = None
    cispo_cap: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    dro_beta: float = 1.0
    dppo_ratio_cap: float = 20.0
    sq_log_ratio_coef: float = 1e-3
    cov_fraction: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    cov_seed: int | None = None
    dhpo_mix: float | str = 0.5
    seq_eps_low: float | None = None
    seq_eps_high: float | None = None
    delight_eta: float = 1.0
    prefix_bound_growth: str = "sqrt"
    minpro_prefix: str = "inclusive"

    kl_bias_correction: bool = False
    kl_bias_correction_grad: bool = False
    kl_clamp: bool = False
    future_kl_coef: float = 0.0

    entropy_agg: str | None = None
    top_entropy_quantile: float = 1.0
    stapo_prob_threshold: float | None = None
    stapo_entropy_threshold: float | None = None
    adv_entropy_top_fraction: float = 1.0
    attn_entropy_weighting: str | None = None
    attn_entropy_alpha: float = 0.5
    attn_entropy_alpha_final: float | None = None
    attn_entropy_standardize: str = "sequence"
    attn_entropy_quantile: float = 0.2
    prob_reweight_alpha: float = 0.0

    rollout_is: str | None = None
    rollout_is_mode: str = "truncate"
    rollout_is_min: float | None = None
    rollout_is_max: float | None = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    opsm_threshold: float | None = None

    max_response_length: int | None = None
    length_power_alpha: float = 0.5
    dp_size: int = 1
    grad_accum_steps: int = 1
    seq_count: str = "all"
    prompt_group_size: int | None = None
    loss_agg_divisor: float | None = None

    rollout_rs_parsed: tuple = field(init=False, repr=False, compare=False, default=())

    def __new__(cls, *args, **kwargs):
        # The fields passed to the constructor (`given_fields`), for adapters that lay this
        # config over another (TRL's GRPOTrainer over its GRPOConfig).
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        self._given = frozenset(names[:len(args)]) | frozenset(kwargs)
        return self

    def given_fields(self) -> frozenset:
        """The names of the fields passed to the constructor (``dataclasses.replace`` passes
        them all); the others hold their defaults."""
        return getattr(self, "_given", frozenset(f.name for f in dataclasses.fields(self)))

    def __post_init__(self):
        self._take_objective_defaults()
        for f in dataclasses.fields(self):
            if f.init:
                _check_number(f.name, getattr(self, f.name))
                _check_type(f.name, getattr(self, f.name), f.type)
        self._check_choices()
        self._check_ranges()
        self._check_bounds()
        self._check_rollout()
        self._check_aggregation()
        if self.rollout_rs is not None:
            self.rollout_rs_parsed = parse_rollout_rs(self.rollout_rs, self.rollout_rs_threshold)

    def _take_objective_defaults(self):
        """Fields left at None take the registered objective's defaults."""
        from logitless.fused_losses.objectives.catalog import get_objective

        spec = get_objective(self.objective)  # raises ValueError naming `objective`
        if self.ratio_level is None:
            self.ratio_level = spec.ratio_level
        if self.loss_agg is None:
            self.loss_agg = spec.loss_agg
        if self.eps_low is None:
            self.eps_low = spec.eps_low
        if self.eps_high is None:
            self.eps_high = spec.eps_high if spec.eps_high is not None else self.eps_low
        if spec.dual_clip_c is not None and self.dual_clip_c is None:
            self.dual_clip_c = spec.dual_clip_c
        if self.cispo_clip is None:
            self.cispo_clip = "two_sided" if self.cispo_cap is None else "upper"
        if spec.ratio_levels is not None and self.ratio_level not in spec.ratio_levels:
            _fail("ratio_level", f"{self.objective} supports {list(spec.ratio_levels)}")

    def _check_choices(self):
        """Fields that name one of a fixed set of options."""
        _check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        if self.entropy_agg is not None:
            _check_choice("entropy_agg", self.entropy_agg, LOSS_AGGS)
        _check_choice("kl_estimator", self.kl_estimator, (*KL_ESTIMATORS, KL_EXACT))
        _check_choice("cispo_clip", self.cispo_clip, ("two_sided", "upper"))
        _check_choice(
            "prefix_bound_growth", self.prefix_bound_growth, ("sqrt", "linear", "constant")
        )
        _check_choice("minpro_prefix", self.minpro_prefix, ("inclusive", "preceding"))
        _check_choice("seq_count", self.seq_count, ("all", "nonempty"))
        _check_choice("rollout_is_mode", self.rollout_is_mode, ("truncate", "mask"))
        _check_choice(
            "attn_entropy_standardize", self.attn_entropy_standardize, ("sequence", "batch")
        )
        if self.rollout_is is not None:
            _check_choice("rollout_is", self.rollout_is, ROLLOUT_IS_LEVELS)
        if self.attn_entropy_weighting is not None:
            _check_choice("attn_entropy_weighting", self.attn_entropy_weighting, ATTN_WEIGHTINGS)
        if isinstance(self.dhpo_mix, str):
            _check_choice("dhpo_mix", self.dhpo_mix, ("entropy",))
        elif not 0.0 <= self.dhpo_mix <= 1.0:
            _fail("dhpo_mix", f"must be in [0, 1] or 'entropy', got {self.dhpo_mix}")

    def _check_ranges(self):
        """Signs and ranges of the numeric knobs."""
        for name in (
            "eps_low",
            "eps_high",
            "beta",
            "seq_eps_low",
            "seq_eps_high",
            "future_kl_coef",
            "dro_beta",
            "kl_cov_coef",
            "prob_reweight_alpha",
            "length_power_alpha",
            "log_ratio_clamp",
            "delight_eta",
            "sq_log_ratio_coef",
        ):
            _check_nonneg(name, getattr(self, name))
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            _fail("top_entropy_quantile", f"must be in [0, 1], got {self.top_entropy_quantile}")
        for name in (
            "adv_entropy_top_fraction",
            "attn_entropy_quantile",
            "cov_fraction",
        ):
            _check_fraction(name, getattr(self, name))
        for name in ("sapo_tau_pos", "sapo_tau_neg", "dppo_ratio_cap", "delight_eta"):
            if getattr(self, name) <= 0:
                _fail(name, f"must be > 0, got {getattr(self, name)}")
        if self.prob_reweight_alpha > 1:
            _fail("prob_reweight_alpha", f"must be in [0, 1], got {self.prob_reweight_alpha}")

    def _check_bounds(self):
        """Caps and clips of the ratio, and the covariance window."""
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            _fail("dual_clip_c", f"must be > 1, got {self.dual_clip_c}")
        if self.delta is not None and self.delta <= 1.0:
            _fail("delta", f"must be > 1, got {self.delta}")
        self._check_cispo_cap()
        if self.clip_cov_lb >= self.clip_cov_ub:
            _fail("clip_cov_lb", "must be below clip_cov_ub")

    def _check_rollout(self):
        """Rollout IS bounds and STAPO's thresholds."""
        if self.rollout_is_max is not None and self.rollout_is_max <= 0:
            _fail("rollout_is_max", f"must be > 0, got {self.rollout_is_max}")
        if (
            self.rollout_is_min is not None
            and self.rollout_is_max is not None
            and self.rollout_is_min > self.rollout_is_max
        ):
            _fail("rollout_is_min", "must not exceed rollout_is_max")
        if (self.stapo_prob_threshold is None) != (self.stapo_entropy_threshold is None):
            _fail(
                "stapo_prob_threshold",
                "STAPO needs both stapo_prob_threshold and stapo_entropy_threshold",
            )
        if self.stapo_prob_threshold is not None and not 0 < self.stapo_prob_threshold <= 1:
            _fail("stapo_prob_threshold", f"must be in (0, 1], got {self.stapo_prob_threshold}")

    def _check_aggregation(self):
        """Aggregation sizes, and the fields ``prompt-mean`` and ``constant`` need."""
        for name in POSITIVE_INT_FIELDS:
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.loss_agg_divisor is not None and not self.loss_agg_divisor > 0:
            _fail("loss_agg_divisor", f"must be > 0, got {self.loss_agg_divisor}")
        for mode in {self.loss_agg, self.entropy_agg} & set(_AGG_FIELDS):
            if getattr(self, _AGG_FIELDS[mode]) is None:
                _fail(_AGG_FIELDS[mode], f"loss_agg / entropy_agg {mode!r} needs it")

    def _check_cispo_cap(self):
        if self.cispo_cap is None:
            return
        if isinstance(self.cispo_cap, bool) or not isinstance(self.cispo_cap, numbers.Real):
            _fail("cispo_cap", f"must be a number, got {self.cispo_cap!r}")
        if self.cispo_cap < 0:
            _fail("cispo_cap", f"must be >= 0 (a cap of the ratio), got {self.cispo_cap}")
        if self.cispo_clip != "upper":
            _fail("cispo_cap", "is the cap of cispo_clip='upper'; cispo_clip is "
                  f"{self.cispo_clip!r}")
