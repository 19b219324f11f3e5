"""The objective library: per-token losses (docs/objectives.md, section 2) as registered functions.

An objective maps `ObjectiveInputs` (right-padded ``[B, T]`` tensors and the chosen `Ratio`) to
a per-token loss; `policy_loss` does the rest (rollout correction, selections, KL, entropy,
aggregation). Register your own::

    @register_objective("my_pg", loss_agg="token-mean")
    def my_pg(x: ObjectiveInputs) -> ObjectiveOutput:
        return ObjectiveOutput(-x.adv * x.ratio.value)

and select it with ``PolicyLossConfig(objective="my_pg")``.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from logitless.fused_losses.objectives import segments
from logitless.fused_losses.objectives.ratios import Ratio
from logitless.fused_losses.objectives.token_selection import cov_drop_mask, cov_top_mask


@dataclass
class ObjectiveInputs:
    """What an objective sees; every tensor ``[B, T]`` right-padded, ``m`` the bool mask."""

    lp: torch.Tensor  # logprobs, with gradient
    old_lp: torch.Tensor
    d: torch.Tensor  # lp - old_lp, clamped to +-log_ratio_clamp, with gradient
    adv: torch.Tensor  # advantages after FRPO / probability reweighting, broadcast per token
    m: torch.Tensor
    ratio: Ratio
    cfg: object  # PolicyLossConfig
    eps_low: torch.Tensor
    eps_high: torch.Tensor
    entropy: torch.Tensor | None
    rollout_is_weight: torch.Tensor | None  # only for objectives that fold it in (vespo)
    # ``[B, T, K]`` each: the trainer's logprobs at the rollout's top-k ids and the rollout's
    # own (no gradient); only for objectives registered with ``needs_topk``
    topk_logprobs: torch.Tensor | None = None
    old_topk_logprobs: torch.Tensor | None = None
    # the context-parallel group of ``cp_group=`` (None: whole sequences here): pass it to the
    # segment ops (``segments.segment_mean(v, x.m, group=x.cp_group)``) so that a sequence's
    # statistics cover every rank's tokens; an objective doing so registers with
    # ``reads_sequences=True`` (on fused_policy_loss's chunks of one rank's tokens the group is
    # a `context_parallel.ChunkedGroup`, which the collectives refuse)
    cp_group: object = None


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # [B, T]
    clip_low: torch.Tensor | None = None  # bool [B, T]: clipped on the low side (A < 0)
    clip_high: torch.Tensor | None = None  # bool [B, T]: clipped on the high side (A > 0)
    flags_per_sequence: bool | None = None  # clip metrics per sequence; None: as the ratio


CLIPPED_SURROGATE = "clipped_surrogate"


@dataclass(frozen=True)
class ObjectiveSpec:
    """A registered objective: its function, the defaults a `PolicyLossConfig` naming it takes,
    and the flags the rest of the library reads instead of lists of names (docs/objectives.md,
    "Registry flags")."""

    name: str
    fn: Callable[[ObjectiveInputs], ObjectiveOutput]
    loss_agg: str
    ratio_level: str
    ratio_levels: tuple[str, ...] | None  # allowed levels; None: any
    eps_low: float
    eps_high: float | None
    dual_clip_c: float | None
    # CLIPPED_SURROGATE: the loss is `clipped_surrogate` on the ratio (TRL's per-sequence clip
    # metrics are defined for it); None: a formula of its own.
    family: str | None = None
    folds_rollout_is: bool = False  # the objective uses the rollout IS weight itself
    selects_in_ratio: bool = False  # entropy selections narrow the ratio's tokens, not the loss
    # Selects tokens from statistics of the whole batch's current logprobs: one call over the
    # whole batch (no chunks, no batch_globals).
    needs_whole_batch: bool = False
    # Reads the rollout's top-k logprobs and the trainer's at the same ids (`ObjectiveInputs`).
    needs_topk: bool = False
    # Reduces per-sequence statistics (segment ops over ``x.cp_group``): under ``cp_group`` a
    # token's term needs the other ranks' tokens of its sequence, so no chunks of one rank's.
    reads_sequences: bool = False


OBJECTIVES: dict[str, ObjectiveSpec] = {}

# Keywords of `register_objective` that another room defines, for one release (the TRL and
# verl field maps, now in logitless.integrations.objective_fields): keyword -> the function
# called with the objective's name and the value. That room adds them when it is imported
# (``import logitless`` imports it).
_FORWARDED: dict[str, Callable[[str, object], None]] = {}


def forward_keyword(keyword: str, handler: Callable[[str, object], None]) -> None:
    """Let ``register_objective(name, keyword=value)`` call ``handler(name, value)``: a
    deprecated keyword whose meaning now lives outside the registry."""
    _FORWARDED[keyword] = handler


def register_objective(
    name,
    *,
    loss_agg="token-mean",
    ratio_level="token",
    ratio_levels=None,
    eps_low=0.2,
    eps_high=None,
    dual_clip_c=None,
    family=None,
    folds_rollout_is=False,
    selects_in_ratio=False,
    needs_whole_batch=False,
    needs_topk=False,
    reads_sequences=False,
    **forwarded,
):
    """Decorator registering ``fn(ObjectiveInputs) -> ObjectiveOutput`` under ``name`` with the
    defaults a `PolicyLossConfig` naming it takes (aggregation, ratio level, clip bounds) and
    its flags (`ObjectiveSpec`).

    ``verl_dual_clip``, ``verl_keys`` and ``trl_fields`` are deprecated (one release): they warn
    and forward to ``logitless.integrations.objective_fields.register_objective_fields``."""
    unknown = sorted(set(forwarded) - set(_FORWARDED))
    if unknown:
        raise TypeError(f"register_objective() got unexpected keyword arguments {unknown}")

    def decorate(fn):
        OBJECTIVES[name] = ObjectiveSpec(
            name=name,
            fn=fn,
            loss_agg=loss_agg,
            ratio_level=ratio_level,
            ratio_levels=None if ratio_levels is None else tuple(ratio_levels),
            eps_low=eps_low,
            eps_high=eps_high,
            dual_clip_c=dual_clip_c,
            family=family,
            folds_rollout_is=folds_rollout_is,
            selects_in_ratio=selects_in_ratio,
            needs_whole_batch=needs_whole_batch,
            needs_topk=needs_topk,
            reads_sequences=reads_sequences,
        )
        for keyword, value in forwarded.items():
            _FORWARDED[keyword](name, value)
        return fn

    return decorate


def get_objective(name: str) -> ObjectiveSpec:
    if name not in OBJECTIVES:
        raise ValueError(
            f"PolicyLossConfig.objective: unknown objective {name!r}; registered: "
            f"{sorted(OBJECTIVES)}"
        )
    return OBJECTIVES[name]


def needs_whole_batch(name: str) -> bool:
    """Whether objective ``name`` must see the whole batch in one call (`ObjectiveSpec`)."""
    return get_objective(name).needs_whole_batch


def clip_flags(rho, adv, low, high):
    return (rho < low) & (adv < 0), (rho > high) & (adv > 0)


def clipped_surrogate(rho, adv, low, high, cfg) -> ObjectiveOutput:
    """``max(-A min(rho, delta), -A clip(rho, low, high))``, dual clip and hard trust region."""
    capped = rho if cfg.delta is None else torch.clamp(rho, max=cfg.delta)
    loss = torch.maximum(-adv * capped, -adv * torch.clamp(rho, low, high))
    if cfg.dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip_c * adv), loss)
    if cfg.hard_trust_region:
        loss = torch.where((rho >= low) & (rho <= high), loss, loss.detach())
    # flagged where the clip binds: a delta below 1 + eps_high binds first (TRL's metric too)
    return ObjectiveOutput(loss, *clip_flags(capped.detach(), adv, low, high))


def _clipped(x: ObjectiveInputs) -> ObjectiveOutput:
    return clipped_surrogate(x.ratio.value, x.adv, x.ratio.low, x.ratio.high, x.cfg)


def _register_clipped(name, **defaults):
    register_objective(name, family=CLIPPED_SURROGATE, **defaults)(_clipped)


_register_clipped("ppo")
_register_clipped("grpo", loss_agg="seq-mean-token-mean")
_register_clipped("dapo", eps_high=0.28)
_register_clipped("bnpo", loss_agg="bnpo")
_register_clipped("dr_grpo", loss_agg="seq-mean-token-sum-norm")
_register_clipped("luspo", loss_agg="seq-mean-token-sum", ratio_level="sequence")
_register_clipped(
    "gspo",
    loss_agg="seq-mean-token-mean",
    ratio_level="sequence",
    ratio_levels=("sequence", "sequence_token"),
)
_register_clipped("ctpo", ratio_level="prefix_cumulative", ratio_levels=("prefix_cumulative",))
_register_clipped("minpro", ratio_level="prefix_min", ratio_levels=("prefix_min",))


@register_objective("cispo")
def cispo(x: ObjectiveInputs) -> ObjectiveOutput:
    """CISPO: ``-sg(clip(rho, 1-eps_low, 1+eps_high)) A lp``.

    ``cispo_clip="upper"``: ``min(rho, cap)`` (ScaleRL, TRL), ``cap`` the config's ``cispo_cap``
    (TRL's ``epsilon_high``) or ``1+eps_high``."""
    rho, low, high = x.ratio.value, x.ratio.low, x.ratio.high
    if x.cfg.cispo_clip == "upper":
        high = high if x.cfg.cispo_cap is None else x.cfg.cispo_cap
        weight = torch.clamp(rho, max=high)
        low = torch.zeros_like(rho)
    else:
        weight = torch.clamp(rho, low, high)
    return ObjectiveOutput(
        -weight.detach() * x.adv * x.lp, *clip_flags(rho.detach(), x.adv, low, high)
    )


@register_objective("sapo", loss_agg="seq-mean-token-mean")
def sapo(x: ObjectiveInputs) -> ObjectiveOutput:
    """``-(4 / tau) sigmoid(tau (rho - 1)) A``, tau by the sign of A (a soft gate, no clip)."""
    # new_tensor: python floats in torch.where would become fp32 and round tau (1.05).
    new = x.lp.new_tensor
    tau = torch.where(x.adv > 0, new(x.cfg.sapo_tau_pos), new(x.cfg.sapo_tau_neg))
    return ObjectiveOutput(-torch.sigmoid(tau * (x.ratio.value - 1)) * 4 / tau * x.adv)


@register_objective(
    "gmpo",
    loss_agg="seq-mean-token-mean",
    ratio_level="geometric",
    ratio_levels=("geometric",),
    eps_low=0.4,
    selects_in_ratio=True,
)
def gmpo(x: ObjectiveInputs) -> ObjectiveOutput:
    """``-A rho_i`` on the geometric ratio; with seq-mean-token-mean one term per sequence."""
    low, high = clip_flags(x.d.detach(), x.adv, -x.eps_low, x.eps_high)
    return ObjectiveOutput(-x.adv * x.ratio.value, low, high, flags_per_sequence=False)


_LOG_1E8 = math.log(1e-8)


@register_objective("vespo", ratio_levels=("token",), folds_rollout_is=True,
                    reads_sequences=True)
def vespo(x: ObjectiveInputs) -> ObjectiveOutput:
    """``-sg(phi(w)) A lp``, ``phi(w) = exp(lambda + k log w - lambda w)`` on the sequence ratio
    ``w`` (sum of log-ratios, times the rollout IS weights), (k, lambda) by the sign of A. The
    log clamps at ``log 1e-8`` are those of the original implementation (via TRL)."""
    cfg = x.cfg
    log_w = segments.segment_sum(x.d.detach(), x.m, group=x.cp_group)
    if x.rollout_is_weight is not None:
        log_is = torch.log(x.rollout_is_weight).clamp(_LOG_1E8, 20.0)
        log_w = log_w + segments.segment_sum(log_is, x.m, group=x.cp_group)
    log_w = log_w.clamp(_LOG_1E8, 20.0)[:, None]
    nonneg = x.adv >= 0
    new = x.lp.new_tensor  # not python floats in torch.where: they would round to fp32
    k = torch.where(nonneg, new(cfg.vespo_k_pos), new(cfg.vespo_k_neg))
    lam = torch.where(nonneg, new(cfg.vespo_lambda_pos), new(cfg.vespo_lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)
    return ObjectiveOutput(-phi * x.adv * x.lp)


def _reinforce(x: ObjectiveInputs) -> ObjectiveOutput:
    return ObjectiveOutput(-x.adv * x.lp)


register_objective("reinforce")(_reinforce)
register_objective("gpg")(_reinforce)


@register_objective("dro")
def dro(x: ObjectiveInputs) -> ObjectiveOutput:
    """verl ``dro``: ``-(lp A - beta/2 (lp - lp_old)^2)`` with ``beta = dro_beta``."""
    return ObjectiveOutput(-(x.lp * x.adv - 0.5 * x.cfg.dro_beta * x.d.square()))


def _dppo(x: ObjectiveInputs, divergence: torch.Tensor) -> ObjectiveOutput:
    """DPPO's loss ``-A sg(min(r, dppo_ratio_cap)) lp`` on the tokens inside the trust region:
    a token is out when its ``divergence`` (detached) exceeds ``eps_high`` while the sampled
    token's probability rose (A > 0), or ``eps_low`` while it fell (A <= 0)."""
    valid = _inside_trust_region(x, divergence)
    r = torch.exp(x.d.detach())
    loss = -x.adv * torch.clamp(r, max=x.cfg.dppo_ratio_cap) * x.lp * valid.to(x.lp.dtype)
    return ObjectiveOutput(loss, ~valid & (x.adv <= 0), ~valid & (x.adv > 0))


def _inside_trust_region(x: ObjectiveInputs, divergence: torch.Tensor) -> torch.Tensor:
    """DPPO's trust region (bool ``[B, T]``): out where ``divergence`` exceeds ``eps_high``
    and the sampled token's probability rose (A > 0), or ``eps_low`` and it fell (A <= 0)."""
    p, p_old = torch.exp(x.lp.detach()), torch.exp(x.old_lp)
    divergence = divergence.detach()
    return torch.where(x.adv > 0, (divergence <= x.eps_high) | (p <= p_old),
                       (divergence <= x.eps_low) | (p >= p_old))


def tv_trust_region(lp, old_lp) -> torch.Tensor:
    """DPPO-Binary-TV's divergence: ``|p - p_old|`` of the sampled token."""
    return (torch.exp(lp) - torch.exp(old_lp)).abs()


def binary_kl_trust_region(lp, old_lp) -> torch.Tensor:
    """DPPO-Binary-KL's divergence: the KL of the Bernoulli(sampled token or not) of the old
    policy to the current one, ``p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))``,
    the second log guarded by 1e-8 as verl's (TRL clamps both probabilities at ``1 - 1e-7``)."""
    p, p_old = torch.exp(lp), torch.exp(old_lp)
    return p_old * (old_lp - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))


def topk_trust_region(topk_lp, old_topk_lp, kind: str) -> torch.Tensor:
    """DPPO top-k's divergence over the rollout's top-k ids plus one bucket for the rest of
    the vocabulary (``1 - sum_k p_k``, at least 1e-12), as TRL's experimental DPPO trainer:
    ``kind="tv"``: half the L1 distance of the two ``K + 1``-bucket distributions;
    ``kind="kl"``: ``KL(old || current)`` over them. ``[..., K]`` in, ``[...]`` out."""
    p, p_old = torch.exp(topk_lp), torch.exp(old_topk_lp)
    rest = (1.0 - p.sum(-1)).clamp(min=1e-12)
    rest_old = (1.0 - p_old.sum(-1)).clamp(min=1e-12)
    if kind == "tv":
        return ((p - p_old).abs().sum(-1) + (rest - rest_old).abs()) / 2
    return (p_old * (old_topk_lp - topk_lp)).sum(-1) + rest_old * (rest_old.log() - rest.log())


@register_objective("dppo_tv", ratio_levels=("token",))
def dppo_tv(x: ObjectiveInputs) -> ObjectiveOutput:
    """DPPO-Binary-TV (verl ``dppo_tv``, TRL ``binary_tv``): the trust region bounds how far
    the sampled token's probability moved."""
    return _dppo(x, tv_trust_region(x.lp.detach(), x.old_lp))


@register_objective("dppo_kl", ratio_levels=("token",))
def dppo_kl(x: ObjectiveInputs) -> ObjectiveOutput:
    """DPPO-Binary-KL (verl ``dppo_kl``, TRL ``binary_kl``): the trust region is the binary KL
    of the sampled token's probability."""
    return _dppo(x, binary_kl_trust_region(x.lp.detach(), x.old_lp))


@register_objective("prime_rl", ratio_levels=("token",))
def prime_rl(x: ObjectiveInputs) -> ObjectiveOutput:
    """prime-rl's default loss: ``-A r`` (the ratio with its gradient, uncapped) on the tokens
    inside DPPO-Binary-TV's trust region, plus ``sq_log_ratio_coef d^2`` (Kimi K2.5's
    squared log-ratio) on every token."""
    valid = _inside_trust_region(x, tv_trust_region(x.lp.detach(), x.old_lp))
    pg = -x.adv * torch.exp(x.d) * valid.to(x.lp.dtype)
    loss = pg + x.cfg.sq_log_ratio_coef * x.d.square()
    return ObjectiveOutput(loss, ~valid & (x.adv < 0), ~valid & (x.adv > 0))


def _dppo_topk(kind):
    def objective(x: ObjectiveInputs) -> ObjectiveOutput:
        if x.topk_logprobs is None or x.old_topk_logprobs is None:
            raise ValueError(f"topk_logprobs: {x.cfg.objective} needs topk_logprobs and "
                             "old_topk_logprobs")
        return _dppo(x, topk_trust_region(x.topk_logprobs.detach(), x.old_topk_logprobs, kind))

    objective.__doc__ = (f"DPPO-TopK-{kind.upper()} (TRL ``topk_{kind}``): the trust region on "
                         "the rollout's top-k distribution (`topk_trust_region`).")
    return objective


for _kind in ("tv", "kl"):
    register_objective(f"dppo_topk_{_kind}", ratio_levels=("token",), needs_topk=True)(
        _dppo_topk(_kind))


def _covariance(x: ObjectiveInputs) -> torch.Tensor:
    """``(A - mean A)(lp - mean lp)`` with batch means over valid tokens (detached)."""
    n = x.m.sum().clamp(min=1)
    adv, lp = x.adv.detach(), x.lp.detach()
    mean_a = torch.where(x.m, adv, 0.0).sum() / n
    mean_lp = torch.where(x.m, lp, 0.0).sum() / n
    return (adv - mean_a) * (lp - mean_lp)


@register_objective(
    "clip_cov",
    ratio_levels=("token",),
    needs_whole_batch=True,
)
def clip_cov(x: ObjectiveInputs) -> ObjectiveOutput:
    """verl ``clip_cov``: the clipped surrogate, with a random ``cov_fraction`` of the tokens
    whose covariance lies in ``(clip_cov_lb, clip_cov_ub)`` (and that PPO did not clip) dropped."""
    out = clipped_surrogate(x.ratio.value, x.adv, x.ratio.low, x.ratio.high, x.cfg)
    rho = x.ratio.value.detach()
    unclipped = -x.adv * rho
    clipped = -x.adv * torch.clamp(rho, x.ratio.low, x.ratio.high)
    cov = _covariance(x)
    candidates = (
        x.m & ~(clipped > unclipped) & (cov > x.cfg.clip_cov_lb) & (cov < x.cfg.clip_cov_ub)
    )
    # one op (token_selection.py): the count and the draw (torch's global generator without
    # cov_seed, as verl) read values
    dropped = cov_drop_mask(candidates, x.m, float(x.cfg.cov_fraction),
                                       x.cfg.cov_seed)
    return ObjectiveOutput(
        torch.where(dropped, torch.zeros_like(out.loss), out.loss),
        out.clip_low | (dropped & (x.adv < 0)),
        out.clip_high | (dropped & (x.adv > 0)),
    )


@register_objective(
    "kl_cov",
    ratio_levels=("token",),
    needs_whole_batch=True,
)
def kl_cov(x: ObjectiveInputs) -> ObjectiveOutput:
    """verl ``kl_cov``: ``-A r``, plus ``kl_cov_coef |d|`` on the top ``cov_fraction`` tokens by
    covariance."""
    loss = -x.adv * x.ratio.value
    # one op (token_selection.py): the count of valid tokens is read on the host
    chosen = cov_top_mask(_covariance(x), x.m, float(x.cfg.cov_fraction))
    penalty = x.cfg.kl_cov_coef * x.d.abs()
    return ObjectiveOutput(torch.where(chosen, loss + penalty, loss))


@register_objective("aspo", dual_clip_c=3.0)
def aspo(x: ObjectiveInputs) -> ObjectiveOutput:
    """ASPO: for A > 0 the ratio is flipped, value ``1/r`` with gradient ``(1/r) grad lp``; for
    A < 0 a soft dual clip bounds the value at ``c`` with gradient ``min(r, c) grad lp``; then
    the clipped surrogate."""
    r = torch.exp(x.d)
    r_detached = r.detach()
    unit = torch.exp(x.lp - x.lp.detach())  # value 1, gradient grad lp
    flipped = unit / r_detached
    soft = r * (torch.clamp(r_detached, max=x.cfg.dual_clip_c) / r_detached)
    rho = torch.where(x.adv > 0, flipped, soft)
    low, high = x.ratio.low, x.ratio.high
    loss = torch.maximum(-x.adv * rho, -x.adv * torch.clamp(rho, low, high))
    return ObjectiveOutput(loss, *clip_flags(rho.detach(), x.adv, low, high))


@register_objective("dhpo", ratio_levels=("token",), reads_sequences=True)
def dhpo(x: ObjectiveInputs) -> ObjectiveOutput:
    """DHPO: ``rho = a clip(r, token bounds) + (1 - a) clip(s, sequence bounds)`` inside the
    clipped surrogate; ``a`` constant or, with ``dhpo_mix="entropy"``, ``H_t / max_seq H``."""
    cfg = x.cfg
    if cfg.dhpo_mix == "entropy":
        if x.entropy is None:
            raise ValueError("entropy: dhpo_mix='entropy' needs the per-token entropy")
        h = x.entropy.detach()
        a = h / segments.segment_max(h, x.m, group=x.cp_group)[:, None].clamp(min=1e-12)
    else:
        a = torch.full_like(x.lp, cfg.dhpo_mix)
    r = x.ratio.value
    s = torch.exp(segments.segment_mean(x.d, x.m, group=x.cp_group))[:, None].expand_as(r)
    s_low = 1 - (cfg.seq_eps_low if cfg.seq_eps_low is not None else x.eps_low)
    s_high = 1 + (cfg.seq_eps_high if cfg.seq_eps_high is not None else x.eps_high)
    s_low = torch.as_tensor(s_low, dtype=r.dtype)
    s_high = torch.as_tensor(s_high, dtype=r.dtype)
    mixed = a * r + (1 - a) * s
    mixed_clipped = a * torch.clamp(r, x.ratio.low, x.ratio.high) + (1 - a) * torch.clamp(
        s, s_low, s_high
    )
    loss = torch.maximum(-x.adv * mixed, -x.adv * mixed_clipped)
    return ObjectiveOutput(loss, *clip_flags(r.detach(), x.adv, x.ratio.low, x.ratio.high))


@register_objective("delight")
def delight(x: ObjectiveInputs) -> ObjectiveOutput:
    """Delightful PG: ``-sg(sigmoid(A (-lp_old) / eta)) A lp`` (a gate, no ratio)."""
    gate = torch.sigmoid(x.adv * (-x.old_lp) / x.cfg.delight_eta)
    return ObjectiveOutput(-gate.detach() * x.adv * x.lp)
