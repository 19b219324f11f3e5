"""Validation of `PolicyLossConfig` and of the global counts of `policy_loss`: every invalid
value is a ``ValueError`` naming the argument; every value with a meaning is accepted.

The numeric fields are read from the dataclass, so a new field is checked without being listed:
NaN must be refused, and inf too unless the field is listed below as a bound whose absence inf
means (then the loss with it must stay finite).
"""

import dataclasses
import math
import types
import typing

import pytest
import torch

from logitless import PolicyLossConfig, policy_loss
from logitless.fused_losses.objectives import config as config_module

B, T = 4, 7

# Each field where inf means "no bound", the infinite value that does, and a config using it.
INF_MEANINGFUL = {
    "eps_low": (math.inf, {}),
    "eps_high": (math.inf, {}),
    "seq_eps_low": (math.inf, dict(objective="dhpo")),
    "seq_eps_high": (math.inf, dict(objective="dhpo")),
    "dual_clip_c": (math.inf, dict(objective="ppo")),
    "delta": (math.inf, dict(objective="ppo")),
    "log_ratio_clamp": (math.inf, {}),
    "seq_log_ratio_max": (math.inf, dict(objective="gspo")),
    "cispo_cap": (math.inf, dict(objective="cispo")),
    "dppo_ratio_cap": (math.inf, dict(objective="dppo_tv")),
    "clip_cov_lb": (-math.inf, dict(objective="clip_cov", cov_fraction=0.5, cov_seed=1)),
    "clip_cov_ub": (math.inf, dict(objective="clip_cov", cov_fraction=0.5, cov_seed=1)),
    "stapo_entropy_threshold": (math.inf, dict(stapo_prob_threshold=0.9)),
    "rollout_is_min": (-math.inf, dict(rollout_is="token")),
    "rollout_is_max": (math.inf, dict(rollout_is="token", rollout_is_mode="mask")),
    "rollout_rs_threshold": (math.inf, dict(rollout_rs="token_k1,seq_mean_k3")),
    "opsm_threshold": (math.inf, {}),
}


def _numeric(tp) -> bool:
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    return any(a in (float, int) for a in args)


NUMERIC_FIELDS = [f.name for f in dataclasses.fields(PolicyLossConfig)
                  if f.init and _numeric(f.type)]


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None] < torch.tensor([7, 3, 0, 5])[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    lp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    return dict(
        lp=lp, old=old, mask=mask,
        ref=old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64),
        roll=old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        ent=torch.rand(B, T, generator=g, dtype=torch.float64) * 2,
        adv=torch.randn(B, generator=g, dtype=torch.float64),
    )


def run(cfg, d, **kw):
    lp = d["lp"].clone().requires_grad_()
    loss, _ = policy_loss(lp, d["old"], d["adv"], d["mask"], cfg, ref_logprobs=d["ref"],
                          rollout_logprobs=d["roll"], entropy=d["ent"], **kw)
    loss.backward()
    return loss.detach(), lp.grad


def test_every_numeric_field_is_found():
    assert {"eps_low", "eps_high", "beta", "entropy_coef", "delta", "log_ratio_clamp",
            "cispo_cap", "grad_accum_steps", "rollout_rs_threshold"} <= set(NUMERIC_FIELDS)
    assert set(INF_MEANINGFUL) == config_module.INF_ALLOWED
    assert set(INF_MEANINGFUL) <= set(NUMERIC_FIELDS)


@pytest.mark.parametrize("name", NUMERIC_FIELDS)
def test_nan_is_refused_naming_the_field(name):
    with pytest.raises(ValueError, match=rf"PolicyLossConfig\.{name}: must not be NaN"):
        PolicyLossConfig(**{name: math.nan})


# Numeric fields that take no string (dhpo_mix and rollout_rs_threshold take some).
STRINGLESS_FIELDS = [f.name for f in dataclasses.fields(PolicyLossConfig)
                     if f.name in NUMERIC_FIELDS and str not in typing.get_args(f.type)]


@pytest.mark.parametrize(("name", "value"), [(n, "1") for n in STRINGLESS_FIELDS]
                         + [(n, True) for n in NUMERIC_FIELDS])
def test_a_string_or_bool_is_refused_where_a_number_is_expected(name, value):
    """The type is checked before any range (a string compared with a number was a TypeError,
    or was accepted where nothing compared it; a bool was read as 0 or 1)."""
    want = "(a real number|an integer|a positive integer)"
    with pytest.raises(ValueError, match=rf"PolicyLossConfig\.{name}: must be {want}"):
        PolicyLossConfig(**{name: value})


@pytest.mark.parametrize("name", ["eps_low", "eps_high", "beta"])
def test_nan_in_a_per_token_tensor_is_refused(name):
    value = torch.full((B, T), 0.1, dtype=torch.float64)
    value[1, 2] = math.nan
    with pytest.raises(ValueError, match=rf"PolicyLossConfig\.{name}: must not be NaN"):
        PolicyLossConfig(**{name: value})


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("name", [n for n in NUMERIC_FIELDS if n not in INF_MEANINGFUL])
def test_inf_is_refused_where_it_means_nothing(name, sign):
    with pytest.raises(ValueError, match=rf"PolicyLossConfig\.{name}: must be finite"):
        PolicyLossConfig(**{name: sign * math.inf})


@pytest.mark.parametrize("name", sorted(INF_MEANINGFUL))
def test_inf_is_accepted_where_it_means_no_bound(name):
    value, extra = INF_MEANINGFUL[name]
    cfg = PolicyLossConfig(**{name: value}, **extra)
    loss, grad = run(cfg, make_batch())
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_nan_rollout_rs_threshold_string_is_refused():
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        PolicyLossConfig(rollout_rs="token_k2", rollout_rs_threshold="nan")


@pytest.mark.parametrize("name", ["grad_accum_steps", "dp_size"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "2"])
def test_counts_must_be_positive_integers(name, value):
    with pytest.raises(ValueError, match=rf"PolicyLossConfig\.{name}: must be a positive integer"):
        PolicyLossConfig(**{name: value})


def test_cispo_cap():
    assert PolicyLossConfig(objective="cispo", cispo_cap=0.5).cispo_clip == "upper"
    assert PolicyLossConfig(objective="cispo").cispo_clip == "two_sided"
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.cispo_cap: must be >= 0"):
        PolicyLossConfig(objective="cispo", cispo_cap=-0.5)
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.cispo_cap: is the cap of"):
        PolicyLossConfig(objective="cispo", cispo_clip="two_sided", cispo_cap=5.0)
    # the cap below 1 weights on-policy tokens by the cap itself
    d = make_batch(1)
    d["lp"] = d["old"].clone()
    loss_cap, grad_cap = run(PolicyLossConfig(objective="cispo", cispo_cap=0.5), d)
    loss_one, grad_one = run(PolicyLossConfig(objective="cispo", cispo_cap=1.0), d)
    torch.testing.assert_close(loss_cap, 0.5 * loss_one, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_cap, 0.5 * grad_one, rtol=1e-12, atol=0)


def test_top_entropy_quantile_zero_keeps_the_highest_entropy_token():
    d = make_batch(2)
    cfg = PolicyLossConfig(top_entropy_quantile=0.0, loss_agg="token-sum")
    _, grad = run(cfg, d)
    top = torch.where(d["mask"], d["ent"], -1.0).argmax()
    assert grad.flatten().nonzero().flatten().tolist() == [int(top)]
    with pytest.raises(ValueError, match=r"top_entropy_quantile: must be in \[0, 1\]"):
        PolicyLossConfig(top_entropy_quantile=1.5)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_negative_rollout_is_min_bounds_nothing(mode):
    d = make_batch(3)
    runs = [run(PolicyLossConfig(rollout_is="token", rollout_is_mode=mode, rollout_is_min=lo),
                d) for lo in (-0.5, None)]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


# -- global counts (num_items_in_batch, global_batch_size) ---------------------------------------

@pytest.mark.parametrize("name,loss_agg", [("num_items_in_batch", "token-mean"),
                                           ("global_batch_size", "seq-mean-token-mean")])
@pytest.mark.parametrize("value", [0, 0.0, -1, -3.5, math.nan, math.inf, torch.tensor(0),
                                   torch.tensor([1.0, 2.0]), "12", True])
def test_global_counts_refused(name, loss_agg, value):
    cfg = PolicyLossConfig(loss_agg=loss_agg)
    with pytest.raises(ValueError, match=name):
        run(cfg, make_batch(), **{name: value})


@pytest.mark.parametrize("name,loss_agg", [("num_items_in_batch", "token-mean"),
                                           ("global_batch_size", "seq-mean-token-mean")])
def test_global_counts_zero_without_loss_tokens_gives_zero(name, loss_agg):
    d = make_batch()
    d["mask"] = torch.zeros_like(d["mask"])
    loss, grad = run(PolicyLossConfig(loss_agg=loss_agg), d, **{name: torch.tensor(0)})
    assert float(loss) == 0.0 and not grad.any()


def test_fractional_num_items_is_used_as_given():
    """A count rescaled to one accumulation window may be below 1 (TRL's normaliser): it
    divides as it is, where a clamp at 1 would shrink the loss."""
    d = make_batch(4)
    cfg = PolicyLossConfig(loss_agg="token-mean")
    half, _ = run(cfg, d, num_items_in_batch=0.5)
    one, _ = run(cfg, d, num_items_in_batch=1.0)
    torch.testing.assert_close(half, 2 * one, rtol=1e-14, atol=0)
