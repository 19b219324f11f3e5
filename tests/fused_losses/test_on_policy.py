"""fused_policy_loss on-policy (``old_logprobs=None``: the old policy is the current one) equals
the same call given the current logprobs, detached, from a separate pass: against the fp64
reference given its own logprobs as the old ones, for every objective and for the paths that
read the old logprobs (sequence ratios, KL estimators, OPSM, rollout IS and rejection, STAPO,
entropy selections), on the chunked and streaming strategies and the Triton store; and
``out_logprobs`` / ``out_entropy`` hand back the per-token values the loss used."""

import pytest
import torch

from fused_losses.test_fused_policy_loss import (
    HEAD,
    OBJECTIVE_EXTRAS,
    T,
    assert_same,
    config_for,
    make_batch,
    packed,
    rows,
    run_fused,
    run_reference,
)
from fused_losses.test_fused_policy_loss_triton import CHUNK_ROWS, budget, triton_store  # noqa: F401
from logitless import PolicyLossConfig, reference
from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss
from logitless.fused_losses.objectives.catalog import OBJECTIVES

from testing import requires_triton


def current(batch):
    """The fp64 reference's own logprobs and entropies, detached: a separate pass."""
    scored = torch.where(batch["mask"], batch["targets"], -100)
    with torch.no_grad():
        stats = reference.linear_softmax_stats(*(batch[k].double() for k in ("hidden", "weight")),
                                               scored, batch["bias"].double(), **HEAD)
    return stats["logprobs"], stats["entropy"]


def on_policy_pair(batch, cfg, *, with_rollout=False, **kw):
    """``(fused with old_logprobs=None, the reference with its own logprobs as the old)``."""
    off = dict(batch, old=current(batch)[0])
    with_ref = cfg.beta != 0 or cfg.future_kl_coef != 0
    got = run_fused(dict(batch, old=None), cfg, with_ref=with_ref, with_rollout=with_rollout,
                    **kw)
    want = run_reference(off, cfg, with_ref=with_ref, with_rollout=with_rollout)
    return got, want


@pytest.mark.parametrize("name", sorted(n for n, s in OBJECTIVES.items() if not s.needs_topk))
def test_every_objective_on_policy(name):
    """Several chunks (a budget of 8 rows), a KL to the reference: every objective's loss,
    metrics (ratios of 1, approx_kl 0, clip flags) and gradients as given the old logprobs."""
    cfg = config_for(name, beta=0.05, **OBJECTIVE_EXTRAS.get(name, {}))
    assert_same(*on_policy_pair(make_batch(seed=11), cfg, max_tile_bytes=rows(8)))


OLD_READERS = {
    "k3-entropy-bonus": dict(objective="grpo", beta=0.1, kl_estimator="k3",
                             entropy_coef=0.01, kl_bias_correction=True),
    "sequence-opsm": dict(objective="gspo", ratio_level="sequence_token", opsm_threshold=0.5),
    "sequence-ratio": dict(objective="gspo", beta=0.05, kl_estimator="k2"),
    "rollout-rs-entropy-quantile": dict(objective="dapo", top_entropy_quantile=0.5,
                                        rollout_rs="token_k1", rollout_rs_threshold="2.0"),
    "rollout-rs-only": dict(objective="dapo", rollout_rs="token_k1", rollout_rs_threshold="2.0"),
    "rollout-is-batch-normalize": dict(objective="grpo", rollout_is="sequence",
                                       rollout_is_batch_normalize=True, rollout_is_max=2.0),
    "stapo": dict(objective="grpo", stapo_prob_threshold=0.9, stapo_entropy_threshold=0.5),
    "adv-entropy": dict(objective="cispo", adv_entropy_top_fraction=0.5),
    "dppo": dict(objective="dppo_tv"),
    "clip-cov-whole-batch": dict(objective="clip_cov", cov_fraction=0.2, cov_seed=7),
}


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
@pytest.mark.parametrize("name", sorted(OLD_READERS))
def test_old_logprob_readers_on_policy(name, strategy, layout):
    cfg = PolicyLossConfig(**OLD_READERS[name])
    if cfg.objective == "clip_cov" and strategy == "chunked":
        strategy = "auto"  # it needs the whole batch: streamed either way
    batch = make_batch(seed=12)
    if layout == "packed":
        batch = packed(batch)
    assert_same(*on_policy_pair(batch, cfg, with_rollout=True, strategy=strategy,
                                max_tile_bytes=rows(8)))


@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
def test_selection_entropy_given_on_policy(strategy):
    """The caller's selection entropies (an old-policy pass's) with on-policy logprobs."""
    batch = make_batch(seed=13)
    sel = current(batch)[1] + 0.05 * torch.randn(batch["mask"].shape, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(1))
    cfg = PolicyLossConfig(objective="dapo", top_entropy_quantile=0.4, entropy_coef=0.02)
    got = run_fused(dict(batch, old=None), cfg, with_ref=False, selection_entropy=sel,
                    strategy=strategy, max_tile_bytes=rows(8))
    off = dict(batch, old=current(batch)[0])
    want = run_fused(off, cfg, with_ref=False, selection_entropy=sel, strategy=strategy,
                     max_tile_bytes=rows(8))
    assert_same(got, want)


def test_equals_its_own_separate_pass():
    """On-policy equals the same call fed its own logprobs (``out_logprobs`` of a first call),
    detached: the ratios are exactly 1."""
    batch = make_batch(seed=14)
    cfg = PolicyLossConfig(objective="gspo", beta=0.05)
    lp = torch.full(batch["mask"].shape, float("nan"), dtype=torch.float64)
    got = run_fused(dict(batch, old=None), cfg, out_logprobs=lp, max_tile_bytes=rows(8))
    assert float(got[1]["ratio/min"]) == 1.0 == float(got[1]["ratio/max"])
    assert float(got[1]["approx_kl"]) == 0.0
    assert_same(got, run_fused(dict(batch, old=lp), cfg, max_tile_bytes=rows(8)))


@requires_triton
@pytest.mark.parametrize("cfg", [PolicyLossConfig(objective="grpo", beta=0.05),
                                 PolicyLossConfig(objective="gspo", entropy_coef=0.02)],
                         ids=["grpo-k3", "gspo-entropy"])
def test_triton_store_on_policy(triton_store, cfg):  # noqa: F811
    batch = make_batch(dtype=torch.float32, seed=15)
    (loss, metrics, grads), (loss_r, metrics_r, grads_r) = on_policy_pair(
        batch, cfg, max_tile_bytes=budget(CHUNK_ROWS, torch.float32))
    assert triton_store["forward"] >= 3 and triton_store["backward_"] >= 3
    torch.testing.assert_close(loss.double(), loss_r, rtol=1e-5, atol=1e-6)
    assert list(metrics) == list(metrics_r)
    for k, v in metrics_r.items():
        torch.testing.assert_close(metrics[k].double(), v.double(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=k: f"metric {k}: {m}")
    for what, g, gr in zip(("hidden", "weight", "bias"), grads, grads_r):
        scale = float(gr.abs().max())
        assert scale > 0
        torch.testing.assert_close(g.double(), gr, rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m, what=what: f"d_{what}: {m}")


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
def test_out_buffers_hold_the_current_values(strategy, layout):
    """``out_logprobs`` / ``out_entropy`` (fp32 buffers here, of NaN) hold the reference's
    values at the loss's tokens and 0 elsewhere; the loss is the same as without them."""
    batch = make_batch(seed=16)
    if layout == "packed":
        batch = packed(batch)
    lp_r, ent_r = current(batch)
    shape = batch["mask"].shape
    lp, ent = (torch.full(shape, float("nan"), dtype=torch.float32) for _ in range(2))
    cfg = PolicyLossConfig(objective="grpo")
    got = run_fused(batch, cfg, out_logprobs=lp, out_entropy=ent, strategy=strategy,
                    max_tile_bytes=rows(8))
    m = batch["mask"]
    for out, want in ((lp, lp_r), (ent, ent_r)):
        torch.testing.assert_close(out[m].double(), want[m], rtol=1e-6, atol=1e-6)
        assert (out[~m] == 0).all()
    assert_same(got, run_fused(batch, cfg, strategy=strategy, max_tile_bytes=rows(8)))


def test_out_buffers_refused():
    batch = make_batch()
    cfg = PolicyLossConfig(objective="grpo")
    args = (batch["hidden"], batch["weight"], batch["targets"], None, batch["adv"],
            batch["mask"], cfg)
    with pytest.raises(ValueError, match="out_logprobs: expected shape"):
        fused_policy_loss(*args, out_logprobs=torch.zeros(5, T + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="out_entropy: expected a floating-point"):
        fused_policy_loss(*args, out_entropy=torch.zeros(batch["mask"].shape, dtype=torch.long))
    with pytest.raises(ValueError, match="out_logprobs: expected a tensor without a graph"):
        fused_policy_loss(*args, out_logprobs=torch.zeros(batch["mask"].shape,
                                                          requires_grad=True))
    meta = [x.to("meta") for x in args[:3]]
    with pytest.raises(ValueError, match=r"out_logprobs/out_entropy: not supported under "
                                          r"torch\.compile"):
        fused_policy_loss(*meta, None, batch["adv"].to("meta"), batch["mask"].to("meta"), cfg,
                          out_logprobs=torch.zeros(batch["mask"].shape, device="meta"))


@pytest.mark.parametrize("strategy", ["auto", "streaming"])
def test_op_on_policy_equals_the_direct_call(monkeypatch, strategy):
    """Through the op (what torch.compile runs: ``old_logprobs`` an optional tensor argument),
    on-policy calls equal the direct eager ones."""
    from fused_losses.test_compile import _through_the_op

    batch = dict(make_batch(seed=17), old=None)
    cfgs = [PolicyLossConfig(**OLD_READERS[n]) for n in ("k3-entropy-bonus", "sequence-opsm",
                                                         "rollout-rs-entropy-quantile")]
    wanted = [run_fused(batch, cfg, with_rollout=True, strategy=strategy,
                        max_tile_bytes=rows(8)) for cfg in cfgs]
    _through_the_op(monkeypatch)
    for cfg, want in zip(cfgs, wanted):
        got = run_fused(batch, cfg, with_rollout=True, strategy=strategy,
                        max_tile_bytes=rows(8))
        assert_same(got, want, rtol=1e-12)
