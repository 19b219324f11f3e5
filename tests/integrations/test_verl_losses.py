"""logitless loss modes inside verl's policy-loss registry, against verl's built-in losses.

Every call goes through ``verl.trainer.ppo.core_algos.get_policy_loss_fn`` with a real verl
``ActorConfig`` carrying ``global_batch_info``, as verl's actor does; the logitless side is
configured only through verl configuration (``LogitlessPolicyLossConfig``).
"""

import math
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl", reason="verl is installed by `make test`")
import torch
import verl.trainer.ppo.core_algos as core_algos
import verl.workers.config as verl_config
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

import logitless
from logitless.fused_losses.objectives.catalog import OBJECTIVES
from logitless.integrations.verl import (
    LOSS_PREFIX,
    LogitlessPolicyLossConfig,
    register_verl_losses,
)

RTOL, ATOL = 1e-12, 1e-14
VERL_AGGS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm")
BATCH_INFOS = {
    "local": dict(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None),
    "global": dict(dp_size=4, batch_num_tokens=97, global_batch_size=19, loss_scale_factor=23),
}
# verl's policy_loss block for both sides; the logitless side adds its options to it.
VERL_POLICY_LOSS = dict(dro_beta=0.4, clip_cov_ratio=0.3, clip_cov_lb=0.05, clip_cov_ub=5.0,
                        kl_cov_ratio=0.2, ppo_kl_coef=0.6)

# verl loss -> (logitless loss mode, LogitlessPolicyLossConfig options giving verl's behaviour,
# actor overrides for both sides).
CASES = {
    "vanilla": ("logitless_ppo", {}, {}),
    "vanilla-no-dual-clip": ("logitless_ppo", dict(dual_clip=False), dict(clip_ratio_c=1e12)),
    "gspo": ("logitless_gspo", dict(ratio_level="sequence_token", seq_log_ratio_max=10.0,
                                    log_ratio_clamp=None), {}),
    "sapo": ("logitless_sapo", dict(loss_agg="seq-mean-token-mean"), {}),
    "gpg": ("logitless_gpg", {}, {}),
    "clip_cov": ("logitless_clip_cov", {}, {}),
    "kl_cov": ("logitless_kl_cov", {}, {}),
    "geo_mean": ("logitless_gmpo", dict(loss_agg="seq-mean-token-mean", seq_count="all",
                                        use_global_batch_info=False,
                                        sequence_is_weight="geometric"), {}),
    "dro": ("logitless_dro", {}, {}),
    "cispo": ("logitless_cispo", {}, {}),
    "dppo_tv": ("logitless_dppo_tv", {}, {}),
    "dppo_kl": ("logitless_dppo_kl", {}, {}),
}
SHARED_METRICS = {
    "vanilla-no-dual-clip": ("actor/ppo_kl", "actor/pg_clipfrac"),
    "gspo": ("actor/ppo_kl", "actor/pg_clipfrac"),
    "sapo": ("actor/ppo_kl",),
    "geo_mean": ("actor/ppo_kl",),
    "dro": ("actor/ppo_kl",),
    "cispo": ("actor/ppo_kl",),
    "dppo_tv": ("actor/ppo_kl", "actor/pg_clipfrac"),
    "dppo_kl": ("actor/ppo_kl", "actor/pg_clipfrac"),
}


def _actor(policy_loss, info, **overrides):
    kw = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
              clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0,
              tau_neg=1.05)
    kw.update(overrides)
    actor = verl_config.ActorConfig(policy_loss=policy_loss, **kw)
    actor.global_batch_info.update(info)
    return actor


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 7, 11
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[1] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    lp = -3 * torch.rand(b, t, generator=g, dtype=torch.float64) - 0.05
    old = (lp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    old[:, :2] = lp[:, :2] - 1.5  # ratios above clip_ratio_c: the dual clip binds for A < 0
    adv = 2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    return lp, old, adv, mask


def _call(mode, lp, old, adv, mask, agg, actor, weights):
    lp = lp.clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(mode)(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg,
        config=actor, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, metrics


def _seed(case):
    if case == "clip_cov":  # both sides draw the dropped tokens from torch's global generator
        torch.manual_seed(99)


@pytest.mark.parametrize("info", sorted(BATCH_INFOS))
@pytest.mark.parametrize("agg", VERL_AGGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_logitless_loss_mode_equals_verl_builtin(case, agg, info):
    mode, options, overrides = CASES[case]
    verl_mode = case.split("-")[0]
    lp, old, adv, mask = _batch(seed=len(case))
    weights = 2 * torch.rand(lp.shape, dtype=torch.float64)
    weights[0, 3] = 0.0  # a token zeroed by IcePop

    theirs_cfg = _actor(verl_config.PolicyLossConfig(loss_mode=verl_mode, **VERL_POLICY_LOSS),
                        BATCH_INFOS[info], **overrides)
    ours_cfg = _actor(LogitlessPolicyLossConfig(loss_mode=mode, **VERL_POLICY_LOSS, **options),
                      BATCH_INFOS[info], **overrides)
    _seed(case)
    v_loss, v_grad, v_metrics = _call(verl_mode, lp, old, adv, mask, agg, theirs_cfg, weights)
    _seed(case)
    o_loss, o_grad, o_metrics = _call(mode, lp, old, adv, mask, agg, ours_cfg, weights)

    torch.testing.assert_close(o_loss, v_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(o_grad, v_grad, rtol=RTOL, atol=ATOL)
    for name in SHARED_METRICS.get(case, ()):
        assert o_metrics[name] == pytest.approx(v_metrics[name], abs=1e-6), name
    assert all(isinstance(v, float) for v in o_metrics.values())
    assert {"actor/ppo_kl", "actor/logitless/approx_kl",
            "actor/logitless/masked_fraction"} <= set(o_metrics)


@pytest.mark.parametrize("mode", ["logitless_ppo", "logitless_cispo"])
def test_mismatch_metrics_with_rollout_log_probs(mode):
    """Given the rollout engine's logprobs (``rollout_log_probs``, the argument verl's
    ``PolicyLossFn`` names), the loss returns ``actor/logitless/mismatch/*`` from verl's
    ``old_log_prob`` (the trainer's, at the weights the rollout sampled with) against them,
    over the response mask less a token whose engine logprob is not finite; the k1 and k3 KLs
    are verl's own ``rollout_corr/kl`` and ``rollout_corr/k3_kl`` over the same tokens."""
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    lp, old, adv, mask = _batch(seed=21)
    g = torch.Generator().manual_seed(22)
    rollout = old + 0.07 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    assert mask[0, 0]
    measured = mask.clone()
    measured[0, 0] = False  # a token without a finite engine logprob is left out
    scored = rollout.clone()
    rollout[0, 0] = float("-inf")
    actor = _actor(LogitlessPolicyLossConfig(loss_mode=mode), BATCH_INFOS["local"])
    fn = core_algos.get_policy_loss_fn(mode)
    kwargs = dict(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                  loss_agg_mode="token-mean", config=actor)
    loss, metrics = fn(**kwargs, rollout_log_probs=rollout)
    plain_loss, plain = fn(**kwargs)
    assert loss == plain_loss
    assert not any("mismatch" in k for k in plain)

    theirs = compute_offpolicy_metrics(old, scored, measured)
    ds = (old - rollout)[measured].tolist()
    want = {
        "abs_diff/mean": sum(abs(d) for d in ds) / len(ds),
        "abs_diff/max": max(abs(d) for d in ds),
        "kl_k1": theirs["kl"],
        "kl_k3": theirs["k3_kl"],
        "ratio_outside": sum(not 0.9 <= math.exp(d) <= 1.1 for d in ds) / len(ds),
    }
    assert 0 < want["ratio_outside"] < 1
    assert {k for k in metrics if "mismatch" in k} == {f"actor/logitless/mismatch/{k}"
                                                        for k in want}
    for name, value in want.items():
        assert metrics[f"actor/logitless/mismatch/{name}"] == pytest.approx(value, rel=1e-7), name


def test_defaults_follow_the_paper_where_verl_differs():
    """Without the verl-behaviour options the deviating modes differ from verl's built-ins."""
    lp, old, adv, mask = _batch(seed=3)
    info = BATCH_INFOS["global"]
    for case in ("sapo", "geo_mean", "gspo"):
        mode, _, _ = CASES[case]
        theirs = _actor(verl_config.PolicyLossConfig(loss_mode=case), info)
        ours = _actor(LogitlessPolicyLossConfig(loss_mode=mode), info)
        v_loss, v_grad, _ = _call(case, lp, old, adv, mask, "token-mean", theirs, None)
        o_loss, o_grad, _ = _call(mode, lp, old, adv, mask, "token-mean", ours, None)
        assert not (torch.allclose(o_loss, v_loss) and torch.allclose(o_grad, v_grad)), case


def test_plain_verl_policy_loss_config_works_with_logitless_modes():
    """``loss_mode=logitless_x`` alone (verl's own PolicyLossConfig): logitless defaults, and
    verl's dual clip for the ppo family (as verl's ``vanilla``)."""
    lp, old, adv, mask = _batch(seed=5)
    info = BATCH_INFOS["global"]
    actor = _actor(verl_config.PolicyLossConfig(loss_mode="logitless_dapo"), info)
    o_loss, o_grad, _ = _call("logitless_dapo", lp, old, adv, mask, "token-mean", actor, None)
    cfg = logitless.PolicyLossConfig(objective="dapo", eps_low=0.2, eps_high=0.28,
                                     dual_clip_c=3.0, loss_agg="token-mean", dp_size=4,
                                     max_response_length=23, seq_count="nonempty")
    lp_ = lp.clone().requires_grad_(True)
    e_loss, _ = logitless.policy_loss(lp_, old, adv, mask, cfg, num_items_in_batch=97,
                                      global_batch_size=19)
    (e_grad,) = torch.autograd.grad(e_loss, lp_)
    torch.testing.assert_close(o_loss, e_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(o_grad, e_grad, rtol=RTOL, atol=ATOL)


def test_target_selects_the_config_through_verls_instantiation():
    """``policy_loss._target_`` in a verl actor config instantiates LogitlessPolicyLossConfig
    (verl's own omega_conf_to_dataclass, hydra underneath), and its knobs reach the loss."""
    yaml = textwrap.dedent("""
        _target_: verl.workers.config.ActorConfig
        strategy: fsdp
        rollout_n: 1
        ppo_micro_batch_size_per_gpu: 1
        clip_ratio_low: 0.2
        clip_ratio_high: 0.3
        loss_agg_mode: seq-mean-token-mean
        policy_loss:
          _target_: logitless.integrations.verl.LogitlessPolicyLossConfig
          loss_mode: logitless_grpo
          delta: 1.5
          loss_agg: balanced
    """)
    actor = omega_conf_to_dataclass(OmegaConf.create(yaml))
    assert isinstance(actor.policy_loss, LogitlessPolicyLossConfig)
    assert pickle.loads(pickle.dumps(actor.policy_loss)) == actor.policy_loss  # Ray ships it
    assert actor.policy_loss.delta == 1.5 and actor.policy_loss.loss_agg == "balanced"
    lp, old, adv, mask = _batch(seed=9)
    o_loss, o_grad, _ = _call(actor.policy_loss.loss_mode, lp, old, adv, mask,
                              actor.loss_agg_mode, actor, None)
    cfg = logitless.PolicyLossConfig(objective="grpo", eps_low=0.2, eps_high=0.3, delta=1.5,
                                     dual_clip_c=3.0, loss_agg="balanced",
                                     seq_count="nonempty")
    lp_ = lp.clone().requires_grad_(True)
    e_loss, _ = logitless.policy_loss(lp_, old, adv, mask, cfg)
    (e_grad,) = torch.autograd.grad(e_loss, lp_)
    torch.testing.assert_close(o_loss, e_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(o_grad, e_grad, rtol=RTOL, atol=ATOL)
    without_delta = logitless.PolicyLossConfig(objective="grpo", eps_low=0.2, eps_high=0.3,
                                               dual_clip_c=3.0, loss_agg="balanced",
                                               seq_count="nonempty")
    assert not torch.isclose(logitless.policy_loss(lp, old, adv, mask, without_delta)[0], e_loss)


# Every objective of docs/objectives.md, section 2.
DOCUMENTED_OBJECTIVES = ("ppo", "grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo",
                         "gspo", "gmpo", "vespo", "reinforce", "gpg", "dro", "dppo_tv",
                         "dppo_kl", "clip_cov", "kl_cov", "ctpo", "minpro", "aspo", "dhpo",
                         "delight")


def test_every_objective_is_registered_and_custom_ones_can_be():
    registry = set(core_algos.POLICY_LOSS_REGISTRY)
    assert {LOSS_PREFIX + name for name in DOCUMENTED_OBJECTIVES} <= registry

    @logitless.register_objective("verl_test_pg")
    def _pg(x):
        from logitless.fused_losses.objectives.catalog import ObjectiveOutput

        return ObjectiveOutput(-x.adv * x.lp * 2)

    try:
        assert register_verl_losses(["verl_test_pg"]) == ["logitless_verl_test_pg"]
        lp, old, adv, mask = _batch(seed=1)
        actor = _actor(verl_config.PolicyLossConfig(), BATCH_INFOS["local"])
        mine, _, _ = _call("logitless_verl_test_pg", lp, old, adv, mask, "token-mean", actor,
                           None)
        gpg, _, _ = _call("gpg", lp, old, adv, mask, "token-mean", actor, None)
        torch.testing.assert_close(mine, 2 * gpg, rtol=RTOL, atol=ATOL)
    finally:
        OBJECTIVES.pop("verl_test_pg", None)
        core_algos.POLICY_LOSS_REGISTRY.pop("logitless_verl_test_pg", None)
    with pytest.raises(ValueError, match="not a registered"):
        register_verl_losses(["no_such_objective"])


def test_none_valued_knobs_reach_logitless():
    """A knob set to None in the verl config (``log_ratio_clamp: null``: no clamp) is passed as
    None, not replaced by the default; knobs absent from verl's own config take defaults."""
    from logitless.integrations.verl import to_logitless_config

    actor = _actor(LogitlessPolicyLossConfig(loss_mode="logitless_gspo", log_ratio_clamp=None,
                                             ratio_level="sequence_token"), BATCH_INFOS["local"])
    cfg, _ = to_logitless_config("gspo", actor)
    assert cfg.log_ratio_clamp is None and cfg.ratio_level == "sequence_token"
    plain = _actor(verl_config.PolicyLossConfig(loss_mode="logitless_gspo"), BATCH_INFOS["local"])
    cfg, _ = to_logitless_config("gspo", plain)
    assert cfg.log_ratio_clamp == 20.0 and cfg.ratio_level == "sequence"
    assert cfg.seq_count == "nonempty"


def test_bad_configuration_raises():
    lp, old, adv, mask = _batch(seed=2)
    with pytest.raises(ValueError, match="config"):
        core_algos.get_policy_loss_fn("logitless_ppo")(old, lp, adv, mask, "token-mean", None)
    # the logitless fields are checked when the config is built, before any loss call
    with pytest.raises(ValueError, match="sequence_is_weight"):
        LogitlessPolicyLossConfig(loss_mode="logitless_gmpo", sequence_is_weight="harmonic")
    with pytest.raises(ValueError, match="delta"):  # logitless's own validation
        LogitlessPolicyLossConfig(loss_mode="logitless_ppo", delta=0.5)


def test_prompt_mean_is_refused_naming_verls_reordering():
    """verl's trainer.balance_batch (on by default) sorts each rank's sequences by length and
    dynamic batching regroups them, so consecutive sequences are not one prompt's group:
    prompt-mean is refused when the config is built and at the loss call."""
    with pytest.raises(ValueError, match=r"^policy_loss\.loss_agg: prompt-mean .*balance_batch"):
        LogitlessPolicyLossConfig(loss_mode="logitless_grpo", loss_agg="prompt-mean",
                                  prompt_group_size=2)
    lp, old, adv, mask = _batch(seed=4)
    actor = _actor(verl_config.PolicyLossConfig(loss_mode="logitless_grpo"),
                   BATCH_INFOS["local"])
    with pytest.raises(ValueError, match=r"^actor\.loss_agg_mode: prompt-mean .*use_dynamic"):
        _call("logitless_grpo", lp, old, adv, mask, "prompt-mean", actor, None)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("delta", 0.5, "delta"),
    ("loss_agg", "balancd", "loss_agg"),
    ("loss_mode", "logitless_nosuch", "objective"),
])
def test_bad_logitless_fields_raise_when_verl_builds_the_config(field, value, match):
    """Issue 24: a typo in the logitless fields fails in the driver, where hydra instantiates
    the actor config (verl's omega_conf_to_dataclass), not at the first loss call on a worker."""
    policy_loss = {"_target_": "logitless.integrations.verl.LogitlessPolicyLossConfig",
                   "loss_mode": "logitless_grpo", field: value}
    yaml = OmegaConf.create({
        "_target_": "verl.workers.config.ActorConfig", "strategy": "fsdp", "rollout_n": 1,
        "ppo_micro_batch_size_per_gpu": 1, "policy_loss": policy_loss})
    with pytest.raises(Exception, match=match) as info:
        omega_conf_to_dataclass(yaml)
    chain, err = [], info.value
    while err is not None:  # hydra wraps the config's ValueError in its own error
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(e, ValueError) and match in str(e) for e in chain)


def test_entry_point_registers_in_a_fresh_interpreter_that_only_imports_verl():
    """What each Ray worker does: ``import verl`` loads the ``verl.plugins`` entry point of the
    installed logitless (``pip install -e .``), which registers the losses and, with
    LOGITLESS_VERL_FUSED_HEAD=1, routes verl's fused head to logitless; the top-k distillation
    loss lands in verl's distillation-loss registry."""
    script = textwrap.dedent("""
        import sys
        import verl
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
        import verl.utils.kernel.linear_cross_entropy as kernel
        from logitless.fused_losses.objectives.catalog import OBJECTIVES
        modes = sorted(k for k in POLICY_LOSS_REGISTRY if k.startswith("logitless_"))
        print(",".join(modes))
        print(",".join(sorted(OBJECTIVES)))
        print(kernel.linear_cross_entropy.__module__)
        from verl.trainer.distillation.losses import DISTILLATION_LOSS_REGISTRY
        print(",".join(sorted(k for k in DISTILLATION_LOSS_REGISTRY if k.startswith("logitless_"))))
    """)
    env = {**os.environ, "LOGITLESS_VERL_FUSED_HEAD": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    modes, objectives, head_module, distillation = out.stdout.strip().splitlines()[-4:]
    assert distillation == "logitless_forward_kl_topk"
    assert set(modes.split(",")) == {LOSS_PREFIX + name for name in objectives.split(",")}
    assert {"logitless_grpo", "logitless_gspo", "logitless_dppo_kl"} <= set(modes.split(","))
    assert head_module == "logitless.integrations.verl_head"


def _verl_actor_batch(seed):
    """A batch as verl's actor hands it to ``ppo_loss``: unpadded per-token model outputs over
    prompt + response, and padded response tensors with the global batch information."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    b, p, t = 5, 3, 7
    prompt_lens = torch.tensor([3, 1, 2, 3, 2])
    response_lens = torch.tensor([7, 4, 0, 5, 6])
    attention_mask = torch.zeros(b, p + t, dtype=torch.long)
    for i in range(b):
        attention_mask[i, p - prompt_lens[i]:p] = 1
        attention_mask[i, p:p + response_lens[i]] = 1
    total = int((prompt_lens + response_lens).sum())
    data = TensorDict({
        "prompts": torch.zeros(b, p, dtype=torch.long),
        "responses": torch.zeros(b, t, dtype=torch.long),
        "attention_mask": attention_mask,
        "response_mask": torch.arange(t)[None] < response_lens[:, None],
        "old_log_probs": -3 * torch.rand(b, t, generator=g, dtype=torch.float64),
        "advantages": torch.randn(b, t, generator=g, dtype=torch.float64),
        "ref_log_prob": -3 * torch.rand(b, t, generator=g, dtype=torch.float64),
        "rollout_is_weights": 2 * torch.rand(b, t, generator=g, dtype=torch.float64),
    }, batch_size=[b])
    tu.assign_non_tensor(data, dp_size=2, batch_num_tokens=41, global_batch_size=9)
    log_probs = -3 * torch.rand(total, generator=g, dtype=torch.float64)
    entropy = torch.rand(total, generator=g, dtype=torch.float64)
    return data, log_probs, entropy


@pytest.mark.parametrize("case", ["vanilla", "gspo", "cispo", "dppo_kl"])
def test_inside_verls_actor_loss_with_kl_and_entropy(case):
    """verl's own ``ppo_loss`` (the actor's loss function: unpadding, rollout IS weights,
    entropy bonus, KL loss, global batch information) with a logitless loss mode equals it with
    the built-in, values and gradients with respect to the logprobs and the entropies."""
    from verl.workers.utils.losses import ppo_loss

    mode, options, _ = CASES[case]
    data, log_probs, entropy = _verl_actor_batch(seed=4)

    def run(policy_loss):
        actor = verl_config.ActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28,
            policy_loss=policy_loss, entropy_coeff=0.01, use_kl_loss=True,
            kl_loss_type="k3+", loss_agg_mode="seq-mean-token-mean")
        lp = log_probs.clone().requires_grad_(True)
        ent = entropy.clone().requires_grad_(True)
        loss, metrics = ppo_loss(actor, {"log_probs": lp, "entropy": ent}, data)
        return loss, torch.autograd.grad(loss, (lp, ent)), metrics

    v_loss, v_grads, _ = run(verl_config.PolicyLossConfig(loss_mode=case))
    o_loss, o_grads, o_metrics = run(LogitlessPolicyLossConfig(loss_mode=mode, **options))
    torch.testing.assert_close(o_loss, v_loss, rtol=RTOL, atol=ATOL)
    for ours, theirs in zip(o_grads, v_grads):
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    assert {"actor/ppo_kl", "actor/pg_loss", "actor/logitless/clip_ratio/region"} <= set(o_metrics)
    assert "actor/logitless/kl" not in o_metrics  # verl's kl_loss is the KL metric here
