"""policy_loss and its parts against the plain-loop reference, padded and packed, fp64."""

import pytest
import torch

from logitless import PolicyLossConfig, policy_loss, policy_loss_globals
from logitless import reference as ref
from logitless.fused_losses.objectives.catalog import OBJECTIVES
from logitless.fused_losses.objectives.config import LOSS_AGGS, parse_rollout_rs
from logitless.fused_losses.objectives.rollout_correction import (
    rollout_log_ratio,
    rollout_rejection_keep,
)
from logitless.fused_losses.objectives.token_selection import masked_quantile, quantile

B, T = 5, 11


def make(seed, per_token_adv=False, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[1] = 0
    mask = torch.arange(t)[None] < lengths[:, None]
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2.5 - 0.05
    lp = (old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    refl = old + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    roll = old + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ent = torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    adv = torch.randn((b, t) if per_token_adv else (b,), generator=g, dtype=torch.float64)
    return dict(lp=lp, old=old, ref=refl, roll=roll, ent=ent, adv=adv, mask=mask)


def packed(x, mask):
    return x[mask]


def cu_of(mask):
    return torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(-1).cumsum(0)])


def run(cfg, d, layout="padded", **kw):
    lp = d["lp"].clone().requires_grad_()
    ent = d["ent"].clone().requires_grad_()
    mask, adv = d["mask"], d["adv"]
    args = dict(ref_logprobs=d["ref"], rollout_logprobs=d["roll"], entropy=ent)
    if layout == "padded":
        loss, metrics = policy_loss(lp, d["old"], adv, mask, cfg, **args, **kw)
    else:
        m = mask
        p = {k: packed(v, m) for k, v in args.items()}
        p["entropy"] = packed(ent, m)
        a = adv if adv.dim() == 1 else packed(adv, m)
        loss, metrics = policy_loss(
            packed(lp, m), packed(d["old"], m), a, m[m], cfg, cu_seqlens=cu_of(m), **p, **kw
        )
    loss.backward()
    return (
        loss.detach(),
        lp.grad,
        ent.grad if ent.grad is not None else torch.zeros_like(ent),
        metrics,
    )


def close(a, b, tol=1e-10, name=""):
    scale = b.abs().max().clamp(min=1e-12)
    err = float((a - b).abs().max() / scale)
    assert err <= tol, f"{name}: relative error {err:.3e}"


def _objective_configs():
    out = []
    for name, spec in OBJECTIVES.items():
        if spec.needs_whole_batch:  # clip_cov, kl_cov: tested against their own loops below
            continue
        if spec.needs_topk:  # DPPO top-k: tests/fused_losses/test_dppo.py
            continue
        out.append((name, {}))
    out += [
        ("gspo", dict(ratio_level="sequence_token")),
        ("ctpo", dict(prefix_bound_growth="linear")),
        ("ctpo", dict(prefix_bound_growth="constant")),
        ("minpro", dict(minpro_prefix="preceding")),
        ("ppo", dict(dual_clip_c=2.0)),
        ("ppo", dict(delta=1.3)),
        ("cispo", dict(cispo_clip="upper")),
        ("cispo", dict(cispo_cap=0.9)),
        ("dhpo", dict(dhpo_mix="entropy")),
        # sequence bounds of their own, tighter than the token ones: they bind
        ("dhpo", dict(seq_eps_low=0.03, seq_eps_high=0.05)),
        ("grpo", dict(beta=0.1, entropy_coef=0.02)),
    ]
    return out


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize(
    ("objective", "extra"),
    _objective_configs(),
    ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())),
)
def test_objective_matches_reference(objective, extra, per_token_adv):
    d = make(len(objective) + 3 * per_token_adv, per_token_adv)
    cfg = PolicyLossConfig(objective=objective, max_response_length=T + 2, **extra)
    lp = d["lp"].clone().requires_grad_()
    ent = d["ent"].clone().requires_grad_()
    want = ref.policy_loss_reference(
        lp, d["old"], d["adv"], d["mask"], cfg, ref=d["ref"], entropy=ent
    )
    want.backward()
    for layout in ("padded", "packed"):
        loss, g, gh, _ = run(cfg, d, layout)
        close(loss, want.detach(), name=f"{layout} loss")
        close(g, lp.grad, name=f"{layout} grad")
        if cfg.entropy_coef:
            close(gh, ent.grad, name=f"{layout} entropy grad")


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_aggregations_match_reference(agg):
    d = make(21, per_token_adv=agg == "balanced")
    cfg = PolicyLossConfig(
        objective="grpo", loss_agg=agg, max_response_length=T + 4, length_power_alpha=0.7,
        prompt_group_size=1, loss_agg_divisor=T + 1.5,
    )
    lp = d["lp"].clone().requires_grad_()
    want = ref.policy_loss_reference(lp, d["old"], d["adv"], d["mask"], cfg)
    want.backward()
    for layout in ("padded", "packed"):
        loss, g, _, _ = run(cfg, d, layout)
        close(loss, want.detach(), name=layout)
        close(g, lp.grad, name=layout)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"])
def test_kl_estimators_match_reference(estimator):
    d = make(5)
    cfg = PolicyLossConfig(objective="dapo", beta=0.3, kl_estimator=estimator)
    lp = d["lp"].clone().requires_grad_()
    want = ref.policy_loss_reference(lp, d["old"], d["adv"], d["mask"], cfg, ref=d["ref"])
    want.backward()
    loss, g, _, metrics = run(cfg, d)
    close(loss, want.detach())
    close(g, lp.grad)
    kl = ref.kl_loop(d["lp"], d["ref"], estimator)
    close(metrics["kl"], kl[d["mask"]].mean())


def test_global_normalisers_and_scales():
    d = make(8)
    base = PolicyLossConfig(objective="dapo")
    loss, g, _, _ = run(base, d)
    n = int(d["mask"].sum())
    scaled = PolicyLossConfig(objective="dapo", dp_size=4, grad_accum_steps=3)
    loss_g, g_g, _, _ = run(scaled, d, num_items_in_batch=torch.tensor(5 * n))
    close(loss_g, loss * 4 / 5)
    close(g_g, g * 4 / 5)
    loss_l, _, _, _ = run(scaled, d)  # local normaliser: a micro-batch mean, averaged over 3
    close(loss_l, loss / 3)
    grpo = PolicyLossConfig(objective="grpo", dp_size=2)
    loss_s, _, _, _ = run(grpo, d)
    loss_b, _, _, _ = run(grpo, d, global_batch_size=4 * B)
    close(loss_b, loss_s * 2 / 4)
    nonempty = PolicyLossConfig(objective="grpo", seq_count="nonempty")
    loss_n, _, _, _ = run(nonempty, d)
    close(loss_n, loss_s * B / (B - 1))


def test_entropy_quantile_and_rejection_match_loops():
    d = make(13)
    m = d["mask"]
    valid = d["ent"][m].tolist()
    assert abs(float(quantile(d["ent"][m], 0.37)) - ref.quantile_loop(valid, 0.37)) < 1e-12
    opts = parse_rollout_rs("token_k1,seq_sum_k2,seq_mean_k3,seq_max_k2", "0.7_1.4,0.3,0.03,0.06")
    roll = d["roll"].clone()
    roll[0, 0] = float("nan")
    got = rollout_rejection_keep(rollout_log_ratio(d["old"], roll, m), m, opts) & m
    want = ref.rollout_rejection_keep_loop(d["old"], roll, m, opts)
    assert torch.equal(got, want)
    assert not got[m].all() and got[m].any()


CHUNK_CONFIGS = [
    dict(objective="grpo"),
    dict(objective="dapo", top_entropy_quantile=0.4, entropy_coef=0.01),
    dict(objective="dr_grpo", beta=0.05, kl_estimator="k3+"),
    dict(objective="grpo", loss_agg="balanced"),
    dict(objective="grpo", loss_agg="length-power"),
    dict(objective="gspo", stapo_prob_threshold=0.3, stapo_entropy_threshold=1.0),
    dict(
        objective="cispo",
        rollout_rs="seq_mean_k3,token_k1",
        rollout_rs_threshold="0.02,0.7_1.4",
        rollout_is="sequence",
        rollout_is_max=1.5,
    ),
    dict(objective="ctpo", adv_entropy_top_fraction=0.5, opsm_threshold=0.01),
    dict(objective="gmpo", top_entropy_quantile=0.5),
    dict(objective="sapo", attn_entropy_weighting="tanh", attn_entropy_standardize="batch"),
    dict(objective="dapo", attn_entropy_weighting="high_quantile"),
]


@pytest.mark.parametrize("cfg_kw", CHUNK_CONFIGS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_chunks_with_batch_globals_sum_to_full_loss(cfg_kw):
    d = make(17)
    cfg = PolicyLossConfig(**cfg_kw)
    hatt = torch.rand(B, T, dtype=torch.float64)
    full, g_full, _, _ = run(cfg, d, attention_entropy=hatt)
    glob = policy_loss_globals(
        d["mask"],
        d["adv"],
        cfg,
        old_logprobs=d["old"],
        rollout_logprobs=d["roll"],
        entropy=d["ent"],
        attention_entropy=hatt,
    )
    lp = d["lp"].clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, B)):
        loss, _ = policy_loss(
            lp[rows],
            d["old"][rows],
            d["adv"][rows],
            d["mask"][rows],
            cfg,
            ref_logprobs=d["ref"][rows],
            rollout_logprobs=d["roll"][rows],
            entropy=d["ent"][rows],
            attention_entropy=hatt[rows],
            batch_globals=glob,
        )
        total = total + loss
    total.backward()
    close(total.detach(), full)
    close(lp.grad, g_full)


def test_empty_sequence_and_empty_batch():
    d = make(2)
    for name in (n for n, spec in OBJECTIVES.items() if not spec.needs_topk):
        loss, g, _, metrics = run(PolicyLossConfig(objective=name, beta=0.1), d)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), name
        assert (g[1] == 0).all(), name  # sequence 1 has no valid token
        assert all(torch.isfinite(v) for v in metrics.values()), name
    lp = torch.zeros(0, requires_grad=True, dtype=torch.float64)
    for agg in ("token-mean", "seq-mean-token-mean", "balanced", "length-power"):
        cfg = PolicyLossConfig(objective="grpo", loss_agg=agg, max_response_length=8)
        loss, _ = policy_loss(
            lp,
            lp.detach(),
            torch.zeros(0, dtype=torch.float64),
            torch.zeros(0, dtype=torch.bool),
            cfg,
            cu_seqlens=torch.zeros(1, dtype=torch.long),
        )
        assert loss.item() == 0.0 and loss.requires_grad
        loss.backward()


def test_cov_objectives():
    d = make(9, b=8, t=40)
    for name in ("clip_cov", "kl_cov"):
        cfg = PolicyLossConfig(
            objective=name, cov_fraction=0.05, cov_seed=3, clip_cov_lb=-1.0, clip_cov_ub=1.0
        )
        a, ga, _, _ = run(cfg, d)
        b, gb, _, _ = run(cfg, d)
        assert torch.equal(a, b) and torch.equal(ga, gb), name  # deterministic given a seed
        plain, _, _, _ = run(
            PolicyLossConfig(objective="ppo" if name == "clip_cov" else "reinforce", eps_low=0.2), d
        )
        assert not torch.equal(a, plain)
    # kl_cov: -A r everywhere, + |d| on the top tokens by covariance (a plain loop here)
    m, lp, old = d["mask"], d["lp"], d["old"]
    adv = d["adv"][:, None].expand_as(lp)
    a_mean, lp_mean = adv[m].mean(), lp[m].mean()
    cov = [
        (float((adv[i, t] - a_mean) * (lp[i, t] - lp_mean)), i, t)
        for i in range(lp.shape[0])
        for t in range(lp.shape[1])
        if m[i, t]
    ]
    top = {(i, t) for _, i, t in sorted(cov, reverse=True)[: max(1, int(len(cov) * 0.05))]}
    total = sum(
        float(-adv[i, t] * torch.exp(lp[i, t] - old[i, t]))
        + ((abs(float(lp[i, t] - old[i, t]))) if (i, t) in top else 0.0)
        for _, i, t in cov
    )
    loss, _, _, _ = run(PolicyLossConfig(objective="kl_cov", cov_fraction=0.05), d)
    assert abs(float(loss) - total / len(cov)) < 1e-12


def test_registered_user_objective():
    from logitless import register_objective
    from logitless.fused_losses.objectives.catalog import ObjectiveOutput

    @register_objective("test_double_reinforce", loss_agg="token-sum")
    def _double(x):
        return ObjectiveOutput(-2 * x.adv * x.lp)

    d = make(4)
    loss, _, _, _ = run(PolicyLossConfig(objective="test_double_reinforce"), d)
    base, _, _, _ = run(PolicyLossConfig(objective="reinforce", loss_agg="token-sum"), d)
    close(loss, 2 * base)


def test_registry_flags_drive_the_reference_and_chunking():
    """The flags on a registered spec are what the reference and policy_loss read: a user
    objective in the clipped-surrogate family is the reference's clipped surrogate, and one
    that needs the whole batch refuses a chunk's batch_globals."""
    from logitless import register_objective
    from logitless.fused_losses.objectives.catalog import (
        CLIPPED_SURROGATE,
        OBJECTIVES,
        clipped_surrogate,
    )

    @register_objective("test_my_clip", family=CLIPPED_SURROGATE, eps_high=0.1)
    def _my_clip(x):
        return clipped_surrogate(x.ratio.value, x.adv, x.ratio.low, x.ratio.high, x.cfg)

    @register_objective("test_whole_batch", needs_whole_batch=True)
    def _whole(x):
        return OBJECTIVES["reinforce"].fn(x)

    try:
        d = make(6)
        cfg = PolicyLossConfig(objective="test_my_clip", dual_clip_c=2.5)
        lp = d["lp"].clone().requires_grad_()
        want = ref.policy_loss_reference(lp, d["old"], d["adv"], d["mask"], cfg)
        want.backward()
        loss, g, _, _ = run(cfg, d)
        close(loss, want.detach())
        close(g, lp.grad)

        cfg = PolicyLossConfig(objective="test_whole_batch")
        glob = policy_loss_globals(d["mask"], d["adv"], cfg)
        with pytest.raises(ValueError, match="batch_globals: test_whole_batch"):
            policy_loss(d["lp"], d["old"], d["adv"], d["mask"], cfg, batch_globals=glob)
    finally:
        OBJECTIVES.pop("test_my_clip", None)
        OBJECTIVES.pop("test_whole_batch", None)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(objective="nope"), "objective"),
        (dict(ratio_level="tokens"), "ratio_level"),
        (dict(loss_agg="mean"), "loss_agg"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_high=torch.tensor([0.1, -0.2])), "eps_high"),
        (dict(top_entropy_quantile=-0.1), "top_entropy_quantile"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
        (dict(objective="gmpo", ratio_level="token"), "ratio_level"),
        (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), "rollout_rs"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.2"), "rollout_rs_threshold"),
        (dict(stapo_prob_threshold=0.1), "stapo_prob_threshold"),
        (dict(rollout_is="tokens"), "rollout_is"),
    ],
)
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"PolicyLossConfig.{field}"):
        PolicyLossConfig(**kw)


def test_objective_defaults():
    assert PolicyLossConfig(objective="dapo").loss_agg == "token-mean"
    assert PolicyLossConfig(objective="dapo").eps_high == 0.28
    assert PolicyLossConfig(objective="dr_grpo").loss_agg == "seq-mean-token-sum-norm"
    assert PolicyLossConfig(objective="sapo").loss_agg == "seq-mean-token-mean"
    assert PolicyLossConfig(objective="gspo").ratio_level == "sequence"
    assert PolicyLossConfig(objective="dapo", loss_agg="token-sum").loss_agg == "token-sum"


def test_bad_inputs_name_the_argument():
    d = make(1)
    cfg = PolicyLossConfig()
    lp, old, adv, m = d["lp"], d["old"], d["adv"], d["mask"]
    cases = [
        (dict(old_logprobs=old[:, :-1]), "old_logprobs"),
        (dict(advantages=adv[:-1]), "advantages"),
        (dict(mask=m[:, :-1]), "logprobs"),
        (dict(ref_logprobs=old[:-1]), "ref_logprobs"),
        (dict(token_weights=old[:, 1:]), "token_weights"),
        (dict(old_logprobs=torch.where(m, old, float("nan"))), "old_logprobs"),
        (dict(advantages=adv.clone().fill_(float("nan"))), "advantages"),
    ]
    for change, name in cases:
        args = dict(logprobs=lp, old_logprobs=old, advantages=adv, mask=m, config=cfg)
        args.update(change)
        with pytest.raises(ValueError, match=name):
            policy_loss(**args)
    nan_roll = d["roll"].clone()
    nan_roll[0, 0] = float("nan")  # NaN rollout logprobs mean "not available": allowed
    policy_loss(lp, old, adv, m, PolicyLossConfig(rollout_is="token"), rollout_logprobs=nan_roll)
    cu = cu_of(m)
    for bad in (cu.flip(0), cu[:-1], cu.double()):
        with pytest.raises(ValueError, match="cu_seqlens"):
            policy_loss(lp[m], old[m], adv, m[m], cfg, cu_seqlens=bad)
    with pytest.raises(ValueError, match="cu_seqlens"):
        policy_loss(lp[m], old[m], adv, m[m], cfg)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, old, adv, m, PolicyLossConfig(beta=0.1))


def _pack_cfg(cfg, mask):
    """The same config with its per-token tensors laid out packed."""
    import dataclasses

    changes = {
        f.name: getattr(cfg, f.name)[mask]
        for f in dataclasses.fields(cfg)
        if f.init and isinstance(getattr(cfg, f.name), torch.Tensor)
    }
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _tensor_knobs(d):
    g = torch.Generator().manual_seed(99)
    return {
        "per_token_beta": dict(
            objective="dapo", beta=torch.rand(B, T, generator=g, dtype=torch.float64)
        ),
        "per_token_eps": dict(
            objective="grpo",
            eps_low=0.1 + 0.2 * torch.rand(B, T, generator=g, dtype=torch.float64),
            eps_high=0.1 + 0.3 * torch.rand(B, T, generator=g, dtype=torch.float64),
        ),
        "per_token_eps_ctpo": dict(
            objective="ctpo", eps_low=torch.full((B, T), 0.05, dtype=torch.float64)
        ),
    }


OPTION_CASES = {
    "hard_trust_region": dict(objective="grpo", hard_trust_region=True, eps_low=0.1, eps_high=0.1),
    "kl_clamp": dict(objective="dapo", beta=0.2, kl_estimator="k3", kl_clamp=True),
    "kl_bias_sg": dict(objective="dapo", beta=0.2, kl_bias_correction=True),
    "kl_bias_grad_gspo": dict(
        objective="gspo", beta=0.1, kl_bias_correction=True, kl_bias_correction_grad=True
    ),
    "future_kl": dict(objective="grpo", future_kl_coef=0.3),
    "prob_reweight": dict(objective="dapo", prob_reweight_alpha=0.6),
    "token_weights": dict(objective="sapo"),
    "rs": dict(
        objective="grpo", rollout_rs="token_k2,seq_mean_k1", rollout_rs_threshold="0.02,0.8_1.2"
    ),
    "stapo": dict(objective="dapo", stapo_prob_threshold=0.4, stapo_entropy_threshold=1.2),
    "opsm": dict(objective="cispo", opsm_threshold=0.0),
    "top_entropy": dict(objective="dapo", top_entropy_quantile=0.3, entropy_coef=0.05),
    "adv_entropy": dict(objective="grpo", adv_entropy_top_fraction=0.4),
    "gmpo_top_entropy": dict(objective="gmpo", top_entropy_quantile=0.6, beta=0.1),
    "attn_tanh_seq": dict(objective="dapo", attn_entropy_weighting="tanh", attn_entropy_alpha=0.7),
    "attn_tanh_batch_schedule": dict(
        objective="dapo",
        attn_entropy_weighting="tanh",
        attn_entropy_standardize="batch",
        attn_entropy_alpha=0.2,
        attn_entropy_alpha_final=1.0,
    ),
    "attn_softmax": dict(
        objective="grpo", attn_entropy_weighting="softmax", attn_entropy_alpha=1.5
    ),
    "attn_low": dict(objective="dapo", attn_entropy_weighting="low_quantile"),
    "attn_high": dict(
        objective="dapo", attn_entropy_weighting="high_quantile", attn_entropy_quantile=0.4
    ),
}
MASK_BOUNDS = {"token": (0.8, 1.25), "sequence": (0.7, 1.4), "sequence_geometric": (0.95, 1.05)}
for level, (lo, hi) in MASK_BOUNDS.items():
    for mode in ("truncate", "mask"):
        OPTION_CASES[f"is_{level}_{mode}"] = dict(
            objective="dapo",
            rollout_is=level,
            rollout_is_mode=mode,
            rollout_is_min=lo,
            rollout_is_max=hi,
        )
OPTION_CASES["vespo_is"] = dict(objective="vespo", rollout_is="token", rollout_is_max=1.1)


@pytest.mark.parametrize(
    "case", [*OPTION_CASES, "per_token_beta", "per_token_eps", "per_token_eps_ctpo"]
)
def test_options_match_reference(case):
    d = make(31 + len(case), per_token_adv=case in ("adv_entropy", "opsm"))
    kw = OPTION_CASES.get(case) or _tensor_knobs(d)[case]
    cfg = PolicyLossConfig(**kw)
    if case == "kl_clamp":
        d["ref"][0, :4] = d["lp"][0, :4] + 4.0  # k3 = e^4 - 5 > 10: the clamp acts
    roll = d["roll"].clone()
    roll[0, 1] = float("nan")
    hatt = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    weights = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    extra = dict(attention_entropy=hatt, training_progress=0.4)
    if case == "token_weights":
        extra["token_weights"] = weights
    lp = d["lp"].clone().requires_grad_()
    ent = d["ent"].clone().requires_grad_()
    want = ref.policy_loss_reference(
        lp, d["old"], d["adv"], d["mask"], cfg, ref=d["ref"], entropy=ent, rollout=roll, **extra
    )
    want.backward()
    m = d["mask"]
    for layout in ("padded", "packed"):
        lpx = d["lp"].clone().requires_grad_()
        entx = d["ent"].clone().requires_grad_()
        args = dict(ref_logprobs=d["ref"], rollout_logprobs=roll, entropy=entx, **extra)
        if layout == "padded":
            loss, metrics = policy_loss(lpx, d["old"], d["adv"], m, cfg, **args)
            drops = ("rs", "stapo", "opsm", "top_entropy", "adv_entropy", "attn_low", "attn_high")
            if case in drops or case.endswith("_mask"):
                assert 0 < float(metrics["masked_fraction"]) < 1  # the selection acts
        else:
            args = {k: v[m] if isinstance(v, torch.Tensor) else v for k, v in args.items()}
            adv = d["adv"] if d["adv"].dim() == 1 else d["adv"][m]
            loss, _ = policy_loss(
                lpx[m], d["old"][m], adv, m[m], _pack_cfg(cfg, m), cu_seqlens=cu_of(m), **args
            )
        loss.backward()
        close(loss.detach(), want.detach(), name=f"{layout} loss")
        close(lpx.grad, lp.grad, name=f"{layout} grad")
        if cfg.entropy_coef:
            close(entx.grad, ent.grad, name=f"{layout} entropy grad")


def test_gradients_reach_logprobs_and_entropy_only():
    d = make(6, per_token_adv=True)
    leaves = {k: d[k].clone().requires_grad_() for k in ("lp", "old", "ref", "roll", "ent", "adv")}
    extra = {k: torch.rand(B, T, dtype=torch.float64, requires_grad=True) for k in ("w", "h", "b")}
    cfg = PolicyLossConfig(
        objective="grpo",
        beta=extra["b"],
        entropy_coef=0.1,
        future_kl_coef=0.1,
        rollout_is="token",
        opsm_threshold=0.0,
        attn_entropy_weighting="tanh",
    )
    loss, _ = policy_loss(
        leaves["lp"],
        leaves["old"],
        leaves["adv"],
        d["mask"],
        cfg,
        ref_logprobs=leaves["ref"],
        rollout_logprobs=leaves["roll"],
        entropy=leaves["ent"],
        token_weights=extra["w"],
        attention_entropy=extra["h"],
    )
    loss.backward()
    assert leaves["lp"].grad.abs().sum() > 0 and leaves["ent"].grad.abs().sum() > 0
    for name, t in {**leaves, **extra}.items():
        if name not in ("lp", "ent"):
            assert t.grad is None, name


def test_metrics_left_out_when_not_computed():
    """Without a reference there is no ``kl`` metric, without entropies no ``entropy/mean``
    (not a 0 that reads like a measurement); given them, both appear."""
    d = make(5)
    cfg = PolicyLossConfig(objective="grpo")
    _, bare = policy_loss(d["lp"], d["old"], d["adv"], d["mask"], cfg)
    assert "kl" not in bare and "entropy/mean" not in bare
    _, full = policy_loss(d["lp"], d["old"], d["adv"], d["mask"], cfg, ref_logprobs=d["ref"],
                          entropy=d["ent"])
    assert {"kl", "entropy/mean"} <= full.keys()


def test_metrics_match_direct_formulas():
    d = make(12)
    m = d["mask"]
    cfg = PolicyLossConfig(
        objective="dapo", beta=0.1, kl_estimator="k2", rollout_is="token", top_entropy_quantile=0.5
    )
    _, _, _, metrics = run(cfg, d)
    r = torch.exp(d["lp"] - d["old"])[m]
    assert float(metrics["ratio/min"]) == float(r.min())
    assert float(metrics["ratio/max"]) == float(r.max())
    close(metrics["ratio/mean"], r.mean())
    close(metrics["approx_kl"], (d["old"] - d["lp"])[m].mean())
    close(metrics["kl"], (0.5 * (d["ref"] - d["lp"]) ** 2)[m].mean())
    close(metrics["entropy/mean"], d["ent"][m].mean())
    a = d["adv"][:, None].expand_as(d["lp"])[m]
    low = ((r < 0.8) & (a < 0)).double().mean()
    high = ((r > 1.28) & (a > 0)).double().mean()
    close(metrics["clip_ratio/low"], low)
    close(metrics["clip_ratio/high"], high)
    close(metrics["clip_ratio/region"], low + high)
    w = torch.exp(d["old"] - d["roll"])[m].clamp(max=2.0)
    close(metrics["is_weight/mean"], w.mean())
    kept = d["ent"][m] >= quantile(d["ent"][m], 0.5)
    close(metrics["masked_fraction"], 1 - kept.double().mean())


def test_low_precision_and_padded_empty_inputs():
    d = make(14)
    lp = d["lp"].float().requires_grad_()
    loss, metrics = policy_loss(
        lp, d["old"].float(), d["adv"].float(), d["mask"], PolicyLossConfig(objective="gspo")
    )
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.float32
    want, _, _, _ = run(PolicyLossConfig(objective="gspo"), d)
    close(loss.detach().double(), want, tol=1e-5)
    lpb = d["lp"].bfloat16().requires_grad_()
    loss, _ = policy_loss(lpb, d["old"].bfloat16(), d["adv"], d["mask"], PolicyLossConfig())
    loss.backward()
    assert loss.dtype == torch.float32 and lpb.grad.dtype == torch.bfloat16
    empty = torch.zeros(0, 7, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        empty,
        empty.detach(),
        torch.zeros(0, dtype=torch.float64),
        torch.zeros(0, 7, dtype=torch.bool),
        PolicyLossConfig(beta=0.1),
        ref_logprobs=empty.detach(),
    )
    loss.backward()
    assert loss.item() == 0.0 and all(float(v) == 0.0 for v in metrics.values())


def test_kl_in_reward():
    from logitless.fused_losses.objectives.kl import kl_in_reward

    d = make(3)
    rewards = torch.randn(B, T, dtype=torch.float64)
    out = kl_in_reward(rewards, d["lp"], d["ref"], 0.2, d["mask"])
    close(out, rewards - 0.2 * (d["lp"] - d["ref"]) * d["mask"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_quantile_is_quantile_of_the_valid_tokens_to_the_bit(dtype):
    """The traceable quantile (no boolean indexing) equals `quantile` of ``values[m]``
    exactly (NaN where it gives NaN: inf - inf at q = 1), with infinities and a NaN among the
    valid tokens, one valid token, and none."""
    g = torch.Generator().manual_seed(5)
    values = torch.randn(4, 9, generator=g, dtype=dtype)
    values[0, 1], values[2, 2] = torch.inf, -torch.inf
    masks = [torch.rand(4, 9, generator=g) < p for p in (0.3, 0.7, 1.0)]
    masks.append(torch.zeros(4, 9, dtype=torch.bool))
    masks[-1][3, 5] = True
    for m in masks:
        for q in (0.0, 0.13, 0.5, 0.77, 1.0):
            got, n = masked_quantile(values, m, q)
            assert int(n) == int(m.sum())
            torch.testing.assert_close(got, quantile(values[m], q), rtol=0, atol=0,
                                       equal_nan=True, msg=f"q={q}, n={int(n)}")
    with_nan = values.clone()
    with_nan[1, 0] = torch.nan
    m = torch.ones(4, 9, dtype=torch.bool)
    for q in (0.5, 1.0):
        want = quantile(with_nan[m], q)
        torch.testing.assert_close(masked_quantile(with_nan, m, q)[0], want, rtol=0, atol=0,
                                   equal_nan=True)
    assert int(masked_quantile(values, torch.zeros_like(m), 0.5)[1]) == 0


def test_packed_max_seqlen_sets_the_grid_width():
    """max_seqlen (at least the longest sequence) only widens the grid: the loss, metrics and
    gradients of the packed batch are those without it; too short, not an int, or given
    without cu_seqlens: a ValueError naming it."""
    d = make(6)
    cfg = PolicyLossConfig(objective="gspo", top_entropy_quantile=0.5, rollout_is="sequence",
                           rollout_is_batch_normalize=True, beta=0.05, entropy_coef=0.01)
    want = run(cfg, d, layout="packed")
    longest = int(d["mask"].sum(-1).max())
    for width in (longest, longest + 5):
        got = run(cfg, d, layout="packed", max_seqlen=width)
        for a, b, name in zip(got[:3], want[:3], ("loss", "lp.grad", "entropy.grad")):
            close(a, b, name=name)
        for k in want[3]:
            close(got[3][k], want[3][k], name=k)
    lp, old, adv, m = d["lp"], d["old"], d["adv"], d["mask"]
    for bad, message in ((longest - 1, "shorter than the longest sequence"),
                         (float(longest), "expected an int"), (-1, ">= 0")):
        with pytest.raises(ValueError, match=f"max_seqlen: .*{message}"):
            policy_loss(lp[m], old[m], adv, m[m], cfg, cu_seqlens=cu_of(m), max_seqlen=bad,
                        rollout_logprobs=d["roll"][m], entropy=d["ent"][m])
    with pytest.raises(ValueError, match="max_seqlen: given without cu_seqlens"):
        policy_loss(lp, old, adv, m, PolicyLossConfig(), max_seqlen=longest)
