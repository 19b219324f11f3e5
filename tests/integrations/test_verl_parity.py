"""`logitless.policy_loss` against verl 0.9.1's own functions, on the same random fp64 tensors.

Each test calls verl's code (``verl.trainer.ppo.core_algos`` and the rollout-correction helper)
and logitless on identical inputs and compares the loss, its gradient with respect to the
logprobs, and the metrics whose meaning the two share. The logitless config that reproduces a
verl loss is spelled out in ``VERL_EQUIVALENTS``: where logitless follows the paper rather than
verl, the verl behaviour is an option, and that option is what is tested here.

Tolerances: values and gradients agree to rounding (``rtol=1e-12``); metrics to 1e-6, as verl
computes them in fp32. The one exception is named where it occurs.
"""

import dataclasses

import pytest

pytest.importorskip("verl", reason="verl is installed by `make test`")
import torch
import verl.trainer.ppo.core_algos as core_algos
import verl.trainer.ppo.rollout_corr_helper as rollout_corr
import verl.workers.config as verl_config

from logitless import PolicyLossConfig, policy_loss
from logitless.fused_losses.objectives.kl import kl_estimate

RTOL, ATOL = 1e-12, 1e-14
METRIC_TOL = 1e-6

VERL_AGGS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
# verl's global batch information (ActorConfig.global_batch_info), local and global.
BATCH_INFOS = {
    "local": dict(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None),
    "global": dict(dp_size=2, batch_num_tokens=83, global_batch_size=13, loss_scale_factor=17),
}
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0

# verl loss mode -> (logitless objective, config fields that give verl's behaviour).
VERL_EQUIVALENTS = {
    "vanilla": ("ppo", dict(dual_clip_c=CLIP_C)),
    # verl's GSPO is the GSPO-token form (value s_i, gradient through lp_t only), with the log
    # sequence ratio capped at 10 instead of each token's log-ratio clamped.
    "gspo": ("gspo", dict(ratio_level="sequence_token", seq_log_ratio_max=10.0,
                          log_ratio_clamp=None)),
    "sapo": ("sapo", dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05)),
    "gpg": ("gpg", {}),
    "dro": ("dro", dict(dro_beta=0.3)),
    "cispo": ("cispo", dict(cispo_clip="two_sided")),
    "dppo_tv": ("dppo_tv", dict(dppo_ratio_cap=CLIP_C)),
    "dppo_kl": ("dppo_kl", dict(dppo_ratio_cap=CLIP_C)),
    "clip_cov": ("clip_cov", dict(cov_fraction=0.3, clip_cov_lb=0.05, clip_cov_ub=5.0)),
    "kl_cov": ("kl_cov", dict(cov_fraction=0.2, kl_cov_coef=0.7)),
}


def _verl_actor(info, **kw):
    policy_loss_cfg = verl_config.PolicyLossConfig(
        loss_mode="vanilla", dro_beta=0.3, clip_cov_ratio=0.3, clip_cov_lb=0.05,
        clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.7,
    )
    kw.setdefault("clip_ratio_c", CLIP_C)
    actor = verl_config.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=CLIP_LOW,
        clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, tau_pos=1.0, tau_neg=1.05,
        policy_loss=policy_loss_cfg, **kw,
    )
    actor.global_batch_info.update(info)
    return actor


def _ours_config(objective, agg, info, **kw):
    """The logitless config for verl's aggregation and global batch information."""
    kw.setdefault("eps_low", CLIP_LOW)
    kw.setdefault("eps_high", CLIP_HIGH)
    return PolicyLossConfig(
        objective=objective, loss_agg=agg, dp_size=info["dp_size"],
        max_response_length=info["loss_scale_factor"], seq_count="nonempty", **kw,
    )


def _batch(b=6, t=10, seed=0):
    """Right-padded fp64 batch with an empty row and per-token advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[2] = 0
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    lp = -3 * torch.rand(b, t, generator=g, dtype=torch.float64) - 0.05
    old = (lp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    return lp, old, adv, mask


def _grad(loss, lp):
    (g,) = torch.autograd.grad(loss, lp)
    return g


def _close(ours, theirs, name):
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _run_verl(mode, lp, old, adv, mask, agg, actor, rollout_is_weights=None):
    lp = lp.clone().requires_grad_(True)
    fn = core_algos.get_policy_loss_fn(mode)
    loss, metrics = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                       loss_agg_mode=agg, config=actor, rollout_is_weights=rollout_is_weights)
    return loss, _grad(loss, lp), metrics


def _run_ours(cfg, lp, old, adv, mask, info, **kw):
    lp = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old, adv, mask, cfg,
                                num_items_in_batch=info["batch_num_tokens"],
                                global_batch_size=info["global_batch_size"], **kw)
    return loss, _grad(loss, lp), metrics


# verl metric -> logitless metric, for the losses where the two mean the same thing.
SHARED_METRICS = {
    "vanilla": {"actor/ppo_kl": "approx_kl", "actor/pg_clipfrac": "clip_ratio/region"},
    "gspo": {"actor/ppo_kl": "approx_kl", "actor/pg_clipfrac": "clip_ratio/region"},
    "sapo": {"actor/ppo_kl": "approx_kl"},
    "dro": {"actor/ppo_kl": "approx_kl"},
    "cispo": {"actor/ppo_kl": "approx_kl"},
    "dppo_tv": {"actor/ppo_kl": "approx_kl", "actor/pg_clipfrac": "clip_ratio/region"},
    "dppo_kl": {"actor/ppo_kl": "approx_kl", "actor/pg_clipfrac": "clip_ratio/region"},
}


def _seed_both(mode):
    # clip_cov draws its dropped tokens from torch's global generator (verl's definition).
    if mode == "clip_cov":
        torch.manual_seed(1234)


@pytest.mark.parametrize("info", sorted(BATCH_INFOS))
@pytest.mark.parametrize("agg", VERL_AGGS)
@pytest.mark.parametrize("mode", sorted(VERL_EQUIVALENTS))
def test_policy_loss_equals_verl(mode, agg, info):
    objective, options = VERL_EQUIVALENTS[mode]
    batch_info = BATCH_INFOS[info]
    lp, old, adv, mask = _batch()
    if mode == "sapo":
        # verl's sapo always aggregates seq-mean-token-mean whatever loss_agg_mode says;
        # logitless honours loss_agg, so verl's behaviour is loss_agg="seq-mean-token-mean".
        cfg = _ours_config(objective, "seq-mean-token-mean", batch_info, **options)
    else:
        cfg = _ours_config(objective, agg, batch_info, **options)
    _seed_both(mode)
    v_loss, v_grad, v_metrics = _run_verl(mode, lp, old, adv, mask, agg, _verl_actor(batch_info))
    _seed_both(mode)
    o_loss, o_grad, o_metrics = _run_ours(cfg, lp, old, adv, mask, batch_info)
    _close(o_loss, v_loss, "loss")
    _close(o_grad, v_grad, "grad")
    for verl_name, ours_name in SHARED_METRICS.get(mode, {}).items():
        assert float(o_metrics[ours_name]) == pytest.approx(v_metrics[verl_name],
                                                            abs=METRIC_TOL), verl_name
    if mode == "clip_cov":
        # The selection is not vacuous: some token was dropped by the covariance rule.
        assert v_metrics["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("info", sorted(BATCH_INFOS))
def test_vanilla_without_dual_clip(info):
    """verl always dual-clips (clip_ratio_c); logitless's ppo does only with dual_clip_c set.
    With a c that never binds verl's vanilla is the plain clipped surrogate."""
    batch_info = BATCH_INFOS[info]
    lp, old, adv, mask = _batch(seed=3)
    old[:, :3] = lp[:, :3] - 1.5  # ratio e^1.5 > 3: a dual clip at c = 3 would bind for A < 0
    actor = _verl_actor(batch_info, clip_ratio_c=1e12)
    v_loss, v_grad, _ = _run_verl("vanilla", lp, old, adv, mask, "token-mean", actor)
    cfg = _ours_config("ppo", "token-mean", batch_info)
    o_loss, o_grad, _ = _run_ours(cfg, lp, old, adv, mask, batch_info)
    _close(o_loss, v_loss, "loss")
    _close(o_grad, v_grad, "grad")
    # ... and the dual clip at 3 does change the loss on these tensors.
    d_loss, _, _ = _run_ours(_ours_config("ppo", "token-mean", batch_info, dual_clip_c=CLIP_C),
                             lp, old, adv, mask, batch_info)
    assert not torch.isclose(d_loss, o_loss)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_log_ratio_cap_is_verls_option(agg):
    """Far off-policy sequences (mean log-ratio 12): verl caps the log sequence ratio at 10,
    value and gradient; logitless does with seq_log_ratio_max=10 and differs without it."""
    batch_info = BATCH_INFOS["global"]
    lp, old, adv, mask = _batch(seed=29)
    old[:3] = lp[:3] - 12.0
    adv[:3] = -adv[:3].abs()  # A < 0: the unclipped side is taken, the cap is what binds
    # A long sequence below the cap with one token log-ratio of 25: verl does not clamp it.
    row = int(torch.nonzero(mask.sum(-1) >= 6).flatten()[-1])
    assert row >= 3
    old[row, 0] = lp[row, 0] - 25.0
    v_loss, v_grad, _ = _run_verl("gspo", lp, old, adv, mask, agg, _verl_actor(batch_info))
    objective, options = VERL_EQUIVALENTS["gspo"]
    cfg = _ours_config(objective, agg, batch_info, **options)
    o_loss, o_grad, _ = _run_ours(cfg, lp, old, adv, mask, batch_info)
    _close(o_loss, v_loss, "loss")
    _close(o_grad, v_grad, "grad")
    for differs in (dict(seq_log_ratio_max=10.0), dict(log_ratio_clamp=None)):
        other = _ours_config(objective, agg, batch_info, ratio_level="sequence_token", **differs)
        _, o_grad, _ = _run_ours(other, lp, old, adv, mask, batch_info)
        assert not torch.allclose(o_grad, v_grad), differs


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo", "dppo_tv", "gpg", "dro"])
def test_rollout_is_weights_multiply_the_token_loss(mode):
    """verl multiplies the per-token loss by the trainer's rollout IS weights; logitless takes
    them as ``token_weights``."""
    objective, options = VERL_EQUIVALENTS[mode]
    batch_info = BATCH_INFOS["global"]
    lp, old, adv, mask = _batch(seed=5)
    weights = torch.rand(lp.shape, dtype=torch.float64) * 2
    v_loss, v_grad, _ = _run_verl(mode, lp, old, adv, mask, "token-mean", _verl_actor(batch_info),
                                  rollout_is_weights=weights)
    cfg = _ours_config(objective, "token-mean", batch_info, **options)
    o_loss, o_grad, _ = _run_ours(cfg, lp, old, adv, mask, batch_info, token_weights=weights)
    _close(o_loss, v_loss, "loss")
    _close(o_grad, v_grad, "grad")


@pytest.mark.parametrize("agg", VERL_AGGS)
def test_geo_mean_equals_gmpo_per_local_sequence(agg):
    """verl's geo_mean ignores loss_agg_mode and the global batch information: the loss is the
    mean over the micro-batch's sequences (empty ones included) of ``-A_i rho_i``. logitless's
    gmpo gives that with seq-mean-token-mean over every sequence (seq_count="all") and no
    global normalisers; with them it scales by the global batch as every other loss does."""
    lp, old, _, mask = _batch(seed=7)
    seq_adv = torch.randn(lp.shape[0], 1, dtype=torch.float64).expand_as(lp)
    local = BATCH_INFOS["local"]
    v_loss, v_grad, v_metrics = _run_verl("geo_mean", lp, old, seq_adv, mask, agg,
                                          _verl_actor(BATCH_INFOS["global"]))
    cfg = PolicyLossConfig(objective="gmpo", eps_low=CLIP_LOW, eps_high=CLIP_HIGH,
                           loss_agg="seq-mean-token-mean", seq_count="all")
    o_loss, o_grad, o_metrics = _run_ours(cfg, lp, old, seq_adv, mask, local)
    _close(o_loss, v_loss, "loss")
    _close(o_grad, v_grad, "grad")
    assert float(o_metrics["approx_kl"]) == pytest.approx(v_metrics["actor/ppo_kl"],
                                                          abs=METRIC_TOL)
    # sequence-constant rollout IS weights: verl's per-sequence geometric mean is the weight.
    w = (torch.rand(lp.shape[0], 1, dtype=torch.float64) + 0.5).expand_as(lp)
    v_loss, v_grad, _ = _run_verl("geo_mean", lp, old, seq_adv, mask, agg,
                                  _verl_actor(local), rollout_is_weights=w)
    o_loss, o_grad, _ = _run_ours(cfg, lp, old, seq_adv, mask, local, token_weights=w)
    # verl takes exp(mean log(w + 1e-10)): a relative shift of at most 1e-10 / min(w) = 2e-10.
    for ours, theirs, name in ((o_loss, v_loss, "loss"), (o_grad, v_grad, "grad")):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=ATOL, msg=name)


KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "kl", "mse", "low_var_kl",
                 "low_var_kl+")


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_kl_and_entropy_terms_equal_verls_actor_loss(estimator, agg):
    """verl's actor loss: ``pg - entropy_coeff * agg(H) + kl_loss_coef * agg(kl_penalty)``,
    each aggregated with the same mode and global batch info. logitless adds ``beta * kl`` per
    token and subtracts ``entropy_coef * agg(H)``; k3 takes verl's clamps with kl_clamp."""
    batch_info = BATCH_INFOS["global"]
    lp, old, adv, mask = _batch(seed=11)
    ref = lp.detach() + 0.5 * torch.randn(lp.shape, dtype=torch.float64)
    entropy = torch.rand(lp.shape, dtype=torch.float64) * 2
    beta, coef = 0.05, 0.01
    actor = _verl_actor(batch_info)

    lp_v = lp.clone().requires_grad_(True)
    ent_v = entropy.clone().requires_grad_(True)
    pg, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old, log_prob=lp_v, advantages=adv, response_mask=mask, loss_agg_mode=agg,
        config=actor, rollout_is_weights=None)
    kld = core_algos.kl_penalty(logprob=lp_v, ref_logprob=ref, kl_penalty=estimator)
    kl_loss = core_algos.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=agg,
                                  **actor.global_batch_info)
    ent_loss = core_algos.agg_loss(loss_mat=ent_v, loss_mask=mask, loss_agg_mode=agg,
                                   **actor.global_batch_info)
    v_loss = pg - coef * ent_loss + beta * kl_loss
    v_grad_lp, v_grad_ent = torch.autograd.grad(v_loss, (lp_v, ent_v))

    cfg = _ours_config("ppo", agg, batch_info, dual_clip_c=CLIP_C, beta=beta,
                       kl_estimator=estimator, kl_clamp=True, entropy_coef=coef)
    lp_o = lp.clone().requires_grad_(True)
    ent_o = entropy.clone().requires_grad_(True)
    o_loss, _ = policy_loss(lp_o, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent_o,
                            num_items_in_batch=batch_info["batch_num_tokens"],
                            global_batch_size=batch_info["global_batch_size"])
    o_grad_lp, o_grad_ent = torch.autograd.grad(o_loss, (lp_o, ent_o))
    _close(o_loss, v_loss, "loss")
    _close(o_grad_lp, v_grad_lp, "grad logprobs")
    _close(o_grad_ent, v_grad_ent, "grad entropy")


def test_k3_clamp_is_verls_option():
    """verl clamps k3's log-ratio to +-20 and the estimate to +-10; logitless does so only with
    kl_clamp=True (the default is the unclamped estimator)."""
    lp = torch.full((2, 3), -0.5, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.5, -30.0, 25.0], [-3.0, -0.1, -14.0]], dtype=torch.float64)
    theirs = core_algos.kl_penalty(lp, ref, "k3")
    torch.testing.assert_close(kl_estimate(lp, ref, "k3", clamp=True), theirs, rtol=1e-15,
                               atol=0)
    assert not torch.allclose(kl_estimate(lp, ref, "k3"), theirs)


ROLLOUT_CASES = [
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="sequence", rollout_is_threshold=3.0),
    dict(rollout_is="token", rollout_is_threshold="0.5_1.5"),  # IcePop
    dict(rollout_is="sequence", rollout_is_threshold="0.2_5.0"),
    dict(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
    dict(rollout_rs="token_k2,seq_mean_k3", rollout_rs_threshold="0.05,0.02"),
    dict(rollout_rs="seq_sum_k1,seq_max_k2", rollout_rs_threshold="0.7_1.4,0.1"),
    dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="seq_mean_k1",
         rollout_rs_threshold=1.05),
    dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="token_k1",
         rollout_rs_threshold="0.8_1.25"),
    dict(rollout_is="token", rollout_is_threshold=1.2, rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True,
         rollout_rs="seq_max_k2", rollout_rs_threshold=0.03),
]


def _ours_rollout_fields(case):
    out = {}
    if "rollout_is" in case:
        spec = str(case["rollout_is_threshold"])
        out["rollout_is"] = case["rollout_is"]
        if "_" in spec:
            lo, hi = (float(x) for x in spec.split("_"))
            out.update(rollout_is_mode="mask", rollout_is_min=lo, rollout_is_max=hi)
        else:
            out.update(rollout_is_mode="truncate", rollout_is_max=float(spec))
        out["rollout_is_batch_normalize"] = case.get("rollout_is_batch_normalize", False)
    if "rollout_rs" in case:
        out.update(rollout_rs=case["rollout_rs"], rollout_rs_threshold=case["rollout_rs_threshold"])
    return out


@pytest.mark.parametrize("case", ROLLOUT_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_rollout_correction_equals_verl_helper(case):
    """verl's trainer turns old vs rollout logprobs into IS weights and a rejection mask
    (``compute_rollout_correction_and_rejection_mask``), then calls the policy loss with them;
    logitless does both inside policy_loss from ``rollout_logprobs``."""
    batch_info = BATCH_INFOS["global"]
    lp, old, adv, mask = _batch(seed=13)
    g = torch.Generator().manual_seed(17)
    rollout = old + 0.25 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    weights_proto, kept, _ = rollout_corr.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, **case)
    weights = None if weights_proto is None else weights_proto.batch["rollout_is_weights"]
    if "rollout_rs" in case:
        assert 0 < kept.sum() < mask.sum()  # the rejection is exercised
    v_loss, v_grad, _ = _run_verl("vanilla", lp, old, adv, kept, "token-mean",
                                  _verl_actor(batch_info), rollout_is_weights=weights)
    cfg = _ours_config("ppo", "token-mean", batch_info, dual_clip_c=CLIP_C,
                       **_ours_rollout_fields(case))
    o_loss, o_grad, _ = _run_ours(cfg, lp, old, adv, mask, batch_info, rollout_logprobs=rollout)
    _close(o_loss, v_loss, "loss")
    _close(o_grad, v_grad, "grad")
    if case.get("rollout_is_batch_normalize"):  # the normalisation is not a no-op here
        plain = dataclasses.replace(cfg, rollout_is_batch_normalize=False)
        p_loss, _, _ = _run_ours(plain, lp, old, adv, mask, batch_info, rollout_logprobs=rollout)
        assert not torch.isclose(p_loss, v_loss)


BYPASS_CASES = [
    dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5),
    dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.5,
         rollout_rs="token_k2", rollout_rs_threshold=0.02),
    dict(loss_type="ppo_clip", rollout_is=None),
]


@pytest.mark.parametrize("case", BYPASS_CASES, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_bypass_mode_equals_verl(case, agg):
    """verl's ``bypass_mode`` trains on rollout logprobs as the old policy. ``reinforce``:
    ``-A w lp`` with IS weights and rejection from the current vs rollout logprobs, which is
    logitless's reinforce with ``old_logprobs = logprobs.detach()`` and ``rollout_logprobs``.
    ``ppo_clip``: vanilla with ``old = rollout`` (verl computes IS weights only as metrics)."""
    batch_info = BATCH_INFOS["global"]
    lp, _, adv, mask = _batch(seed=19)
    g = torch.Generator().manual_seed(23)
    rollout = lp + 0.25 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
    actor = _verl_actor(batch_info)
    corr = verl_config.PolicyLossConfig(
        loss_mode="bypass_mode",
        rollout_correction=rollout_corr.RolloutCorrectionConfig(bypass_mode=True, **case),
    )
    actor = verl_config.ActorConfig(**{**dict(actor), "policy_loss": corr})
    actor.global_batch_info.update(batch_info)
    v_loss, v_grad, _ = _run_verl("bypass_mode", lp, rollout, adv, mask, agg, actor)

    fields = {k: v for k, v in case.items() if k != "loss_type"}
    if case["loss_type"] == "reinforce":
        cfg = _ours_config("reinforce", agg, batch_info,
                           **_ours_rollout_fields({k: v for k, v in fields.items() if v}))
        o_loss, o_grad, _ = _run_ours(cfg, lp, lp.detach(), adv, mask, batch_info,
                                      rollout_logprobs=rollout)
    else:
        cfg = _ours_config("ppo", agg, batch_info, dual_clip_c=CLIP_C)
        o_loss, o_grad, _ = _run_ours(cfg, lp, rollout, adv, mask, batch_info)
    _close(o_loss, v_loss, "loss")
    _close(o_grad, v_grad, "grad")
