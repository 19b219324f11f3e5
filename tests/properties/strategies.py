"""Hypothesis strategies of the property tests: head problems, batch layouts, policy-loss configs
and batches, and the backend switch.

Hypothesis draws the sizes, dtypes and options (and shrinks them when a property fails); the
tensors themselves come from a drawn seed through a ``torch.Generator``, so their values stay
random, non-zero and cheap to make. Profiles (example counts) live in ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from logitless.fused_losses.head.logprobs import STATS
from logitless.fused_losses.objectives.catalog import OBJECTIVES
from logitless.fused_losses.objectives.config import (
    ATTN_WEIGHTINGS,
    KL_ESTIMATORS,
    LOSS_AGGS,
    RATIO_LEVELS,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_OPTIONS,
)

LOW_PRECISION = (torch.bfloat16, torch.float16)
# Objectives the plain-loop reference covers (clip_cov / kl_cov draw tokens at random).
# clip_cov, kl_cov: whole-batch selections; the DPPO top-k objectives read top-k inputs
# (tests/fused_losses/test_dppo.py)
REFERENCE_OBJECTIVES = sorted(o for o, spec in OBJECTIVES.items()
                              if o not in ("clip_cov", "kl_cov") and not spec.needs_topk)
seeds = st.integers(0, 2**31 - 1)


@contextlib.contextmanager
def backend(name: str):
    """``LOGITLESS_BACKEND=name`` for the body (read at each call). Not monkeypatch: its fixture
    is function-scoped and would be shared by every example hypothesis draws."""
    old = os.environ.get("LOGITLESS_BACKEND")
    os.environ["LOGITLESS_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["LOGITLESS_BACKEND"]
        else:
            os.environ["LOGITLESS_BACKEND"] = old


def finite(lo, hi):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


@st.composite
def head_transforms(draw):
    """The logit transform: temperature, optional softcap, logit scale."""
    return dict(
        temperature=draw(st.just(1.0) | finite(0.3, 2.0)),
        softcap=draw(st.none() | finite(1.0, 30.0)),
        logit_scale=draw(st.just(1.0) | finite(0.5, 1.5) | finite(-1.5, -0.5)),
    )


@dataclass
class HeadProblem:
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor
    transform: dict
    ignore_index: int
    return_entropy: bool
    stats: tuple[str, ...]
    max_tile_bytes: int | None

    def kwargs(self, bias=None):
        """The keyword arguments of the call, with ``bias`` (e.g. a leaf copy) for the bias."""
        return dict(bias=bias, ignore_index=self.ignore_index, stats=self.stats,
                    return_entropy=self.return_entropy, max_tile_bytes=self.max_tile_bytes,
                    **self.transform)


@st.composite
def head_problems(draw, *, max_n=12, max_d=40, max_v=90, dtypes=(torch.float32,)):
    """A `linear_logprobs` call: ``[N, D]`` or ``[B, n, D]`` hidden states of a drawn dtype, an
    optional bias, targets partly ignored and partly at the argmax (``is_top1`` both ways)."""
    n, d, v = draw(st.integers(1, max_n)), draw(st.integers(1, max_d)), draw(st.integers(2, max_v))
    lead = draw(st.sampled_from([(n,), (2, n)]))
    dtype = draw(st.sampled_from(dtypes))
    transform = draw(head_transforms())
    ignore_index = draw(st.sampled_from([-100, -1, 0, v + 3]))
    ignored = draw(st.sampled_from([0.0, 0.3, 1.0]))
    gen = torch.Generator().manual_seed(draw(seeds))
    hidden = torch.randn(*lead, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * (2 / d**0.5)
    bias = torch.randn(v, generator=gen, dtype=torch.float64) if draw(st.booleans()) else None
    targets = torch.randint(0, v, lead, generator=gen)
    top = (hidden @ weight.t() + (0 if bias is None else bias)).argmax(-1)
    targets = torch.where(torch.rand(lead, generator=gen) < 0.3, top, targets)
    targets = torch.where(torch.rand(lead, generator=gen) < ignored, ignore_index, targets)
    if ignore_index == 0:  # id 0 is ignored: scored targets must avoid it
        targets = torch.where(targets == 0, torch.ones_like(targets) * min(1, v - 1), targets)
        targets[torch.rand(lead, generator=gen) < ignored] = 0
    cast = lambda x: None if x is None else x.to(dtype)
    return HeadProblem(
        hidden=cast(hidden), weight=cast(weight), bias=cast(bias), targets=targets,
        transform=transform, ignore_index=ignore_index, return_entropy=draw(st.booleans()),
        stats=tuple(draw(st.lists(st.sampled_from(STATS), unique=True))),
        max_tile_bytes=draw(st.none() | st.integers(1, 8 * 4 * v)),
    )


@dataclass
class Layout:
    """Sequence lengths (zeros included), the padded width, holes inside responses, packed?"""

    lengths: list[int]
    width: int
    holes: float
    packed: bool

    @property
    def mask(self) -> torch.Tensor:
        """The ``[B, width]`` grid mask: right-padded, before holes."""
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        return torch.arange(self.width)[None, :] < lengths[:, None]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.long)


@st.composite
def layouts(draw, *, max_b=4, max_t=7, packed=None, min_b=1):
    lengths = draw(st.lists(st.integers(0, max_t), min_size=min_b, max_size=max_b))
    width = max(lengths, default=0) + draw(st.integers(0, 2))
    return Layout(lengths, max(width, 1), draw(st.sampled_from([0.0, 0.25])),
                  draw(st.booleans()) if packed is None else packed)


@dataclass
class PolicyBatch:
    """fp64 ``[B, T]`` grids of a policy-loss call (the packed view is taken from them)."""

    layout: Layout
    mask: torch.Tensor  # bool [B, T], holes included
    lp: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    rollout: torch.Tensor
    entropy: torch.Tensor
    adv: torch.Tensor  # [B] or [B, T]
    token_weights: torch.Tensor | None
    attention_entropy: torch.Tensor
    eps: tuple[torch.Tensor, torch.Tensor] | None  # per-token clip bounds

    def pack(self, x):
        """A grid tensor in the call's layout: as is (padded) or its valid tokens (packed).
        Per-sequence ``[B]`` values stay ``[B]``, except in a packed batch of ``B`` tokens,
        where ``[B]`` would read per token: there they go as ``[B, 1]`` (the documented rule)."""
        if x is None or not self.layout.packed:
            return x
        if x.dim() == 1:
            return x[:, None] if x.shape[0] == sum(self.layout.lengths) else x
        return x[self.layout.mask]


@st.composite
def policy_batches(draw, layout, *, per_token_adv=None):
    """A batch on ``layout`` (a `Layout`, or a strategy of them)."""
    if isinstance(layout, st.SearchStrategy):
        layout = draw(layout)
    gen = torch.Generator().manual_seed(draw(seeds))
    shape = (len(layout.lengths), layout.width)
    rand = lambda: torch.rand(shape, generator=gen, dtype=torch.float64)
    randn = lambda: torch.randn(shape, generator=gen, dtype=torch.float64)
    grid = layout.mask
    mask = grid & (rand() >= layout.holes)
    old = -rand() * 2.5 - 0.05
    lp = (old + 0.3 * randn()).clamp(max=-1e-3)
    rollout = old + 0.2 * randn()
    rollout = torch.where(rand() < 0.1, float("nan"), rollout)  # engine gave no value
    per_token = draw(st.booleans()) if per_token_adv is None else per_token_adv
    adv = randn() if per_token else torch.randn(shape[0], generator=gen, dtype=torch.float64)
    eps = None
    if draw(st.booleans()):
        eps = (0.05 + 0.3 * rand(), 0.05 + 0.3 * rand())
    return PolicyBatch(
        layout=layout, mask=mask, lp=lp, old=old, ref=old + 0.2 * randn(), rollout=rollout,
        entropy=rand() * 2, adv=adv,
        token_weights=rand() * 2 if draw(st.booleans()) else None,
        attention_entropy=rand() * 3, eps=eps,
    )


@st.composite
def policy_configs(draw, *, objectives=REFERENCE_OBJECTIVES):
    """`PolicyLossConfig` keyword arguments within what the plain-loop reference covers."""
    name = draw(st.sampled_from(objectives))
    spec = OBJECTIVES[name]
    kw = dict(objective=name)
    kw["ratio_level"] = draw(st.none() | st.sampled_from(spec.ratio_levels or RATIO_LEVELS))
    kw["loss_agg"] = draw(st.none() | st.sampled_from(LOSS_AGGS))
    kw["max_response_length"] = draw(st.none() | st.integers(7, 12))
    kw["loss_agg_divisor"] = draw(finite(1.0, 20.0))  # read by "constant" only
    kw["prompt_group_size"] = 1  # "prompt-mean": one group per sequence, whatever B
    kw["length_power_alpha"] = draw(finite(0.0, 1.0))
    if draw(st.booleans()):
        kw["eps_low"], kw["eps_high"] = draw(finite(0.05, 0.4)), draw(finite(0.05, 0.4))
    if draw(st.booleans()):
        kw["beta"] = draw(finite(0.01, 0.5))
        kw["kl_estimator"] = draw(st.sampled_from(KL_ESTIMATORS))
        kw["kl_clamp"] = draw(st.booleans())
        kw["kl_bias_correction"] = draw(st.booleans())
        kw["kl_bias_correction_grad"] = draw(st.booleans())
    if draw(st.booleans()):
        kw["entropy_coef"] = draw(finite(0.001, 0.1))
        kw["entropy_agg"] = draw(st.none() | st.sampled_from(LOSS_AGGS))
    kw["top_entropy_quantile"] = draw(st.just(1.0) | finite(0.0, 1.0))
    kw["adv_entropy_top_fraction"] = draw(st.just(1.0) | finite(0.05, 1.0))
    if draw(st.booleans()):
        kw["stapo_prob_threshold"] = draw(finite(0.05, 0.9))
        kw["stapo_entropy_threshold"] = draw(finite(0.2, 1.8))
    kw["future_kl_coef"] = draw(st.just(0.0) | finite(0.0, 0.5))
    kw["prob_reweight_alpha"] = draw(st.just(0.0) | finite(0.0, 1.0))
    if draw(st.booleans()):
        kw["attn_entropy_weighting"] = draw(st.sampled_from(ATTN_WEIGHTINGS))
        kw["attn_entropy_alpha"] = draw(finite(0.0, 1.0))
        kw["attn_entropy_alpha_final"] = draw(st.none() | finite(0.0, 1.0))
        kw["attn_entropy_standardize"] = draw(st.sampled_from(["sequence", "batch"]))
        kw["attn_entropy_quantile"] = draw(finite(0.05, 0.5))
    if draw(st.booleans()):
        kw["rollout_is"] = draw(st.sampled_from(ROLLOUT_IS_LEVELS))
        kw["rollout_is_mode"] = draw(st.sampled_from(["truncate", "mask"]))
        kw["rollout_is_min"] = draw(st.none() | finite(0.0, 0.9))
        kw["rollout_is_max"] = draw(st.none() | finite(1.1, 3.0))
    if draw(st.booleans()):
        options = draw(st.lists(st.sampled_from(ROLLOUT_RS_OPTIONS), min_size=1, max_size=2,
                                unique=True))
        kw["rollout_rs"] = ",".join(options)
        kw["rollout_rs_threshold"] = ",".join(
            f"{draw(finite(0.5, 0.95)):.3f}_{draw(finite(1.05, 2.0)):.3f}" if o.endswith("k1")
            else f"{draw(finite(0.01, 0.5)):.3f}" for o in options)
    kw["opsm_threshold"] = draw(st.none() | finite(0.0, 0.5))
    kw["dual_clip_c"] = draw(st.none() | finite(1.5, 4.0))
    kw["delta"] = draw(st.none() | finite(1.1, 3.0))
    kw["hard_trust_region"] = draw(st.booleans())
    if name == "cispo":
        kw["cispo_cap"] = draw(st.none() | finite(0.5, 2.0))
        if kw["cispo_cap"] is None:
            kw["cispo_clip"] = draw(st.sampled_from(["two_sided", "upper"]))
    if name == "dhpo":
        kw["dhpo_mix"] = draw(st.just("entropy") | finite(0.0, 1.0))
        if draw(st.booleans()):
            kw["seq_eps_low"], kw["seq_eps_high"] = draw(finite(0.05, 0.3)), draw(finite(0.05, 0.3))
    if name == "ctpo":
        kw["prefix_bound_growth"] = draw(st.sampled_from(["sqrt", "linear", "constant"]))
    if name == "minpro":
        kw["minpro_prefix"] = draw(st.sampled_from(["inclusive", "preceding"]))
    return kw
