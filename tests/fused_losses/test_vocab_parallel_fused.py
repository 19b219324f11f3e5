"""``fused_policy_loss(..., vocab_parallel=group)`` (issue 37 item 3) on real gloo processes on
CPU: each rank holds an unequal slice of the head's vocabulary (and of the exact KL's reference
head), and the loss, the metrics and the gradients of hidden, of the rank's weight and bias
slices equal those of one process over the whole head, in fp64, for every objective of the
catalog (token, sequence and prefix ratios, the whole-batch ones streamed), the exact KL and
the entropy terms. One launch per world size, every case looped inside."""

import os

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless import reference
from logitless.fused_losses.objectives.catalog import OBJECTIVES, needs_whole_batch
from logitless.fused_losses.objectives.config import PolicyLossConfig

from testing import run_on_gloo

B, T, D, D_REF = 4, 11, 24, 16
# Uneven, contiguous slices of the vocabulary in rank order (one rank holds a single row).
SPLITS = {2: [40, 67], 3: [30, 1, 76]}
LENGTHS = [11, 4, 8, 1]
TEMPERATURE = 0.9
# Options layered over the objectives by turns: the exact KL (reference head sharded too),
# entropy bonus and entropy selections, a sampled KL, rollout IS, a soft-capped head.
EXTRAS = [
    dict(cfg=dict(beta=0.2, kl_estimator="exact")),
    dict(cfg=dict(entropy_coef=0.03, top_entropy_quantile=0.6)),
    dict(cfg=dict(beta=0.1, kl_estimator="k3", rollout_is="token"), kw=dict(softcap=4.0)),
    dict(cfg=dict(beta=0.1, kl_estimator="exact", entropy_coef=0.02,
                  adv_entropy_top_fraction=0.7)),
    dict(cfg=dict(stapo_prob_threshold=0.5, stapo_entropy_threshold=0.5,
                  rollout_is="sequence", loss_agg="seq-mean-token-sum")),
]
VARIANTS = [
    dict(objective="gspo", ratio_level="sequence_token"),
    dict(objective="minpro", minpro_prefix="preceding"),
    dict(objective="ctpo", prefix_bound_growth="linear"),
    dict(objective="dhpo", dhpo_mix="entropy"),
]


def _cases():
    """``(config, keywords)`` per case: every objective but the DPPO top-k ones (their top-k
    inputs are the caller's), the options by turns."""
    names = [n for n in sorted(OBJECTIVES) if not OBJECTIVES[n].needs_topk]
    for k, opts in enumerate([dict(objective=n) for n in names] + VARIANTS):
        extra = EXTRAS[k % len(EXTRAS)]
        cfg = dict(extra["cfg"])
        if needs_whole_batch(opts["objective"]) and cfg.get("kl_estimator") == "exact":
            cfg.update(kl_estimator="k1")  # streamed: the exact KL is refused there
        kw = dict(extra.get("kw", {}))
        if cfg.get("kl_estimator") == "exact":
            kw.pop("softcap", None)
        yield PolicyLossConfig(**opts, **cfg), kw


def _problem(world):
    """The whole problem in fp64, the same on every rank."""
    v = sum(SPLITS[world])
    g = torch.Generator().manual_seed(3)
    f64 = dict(generator=g, dtype=torch.float64)
    hidden = torch.randn(B, T, D, **f64)
    weight = torch.randn(v, D, **f64) * 2 / D**0.5
    bias = 0.5 * torch.randn(v, **f64)
    proj = torch.randn(D, D_REF, **f64) / D**0.5
    ref = dict(ref_hidden=hidden @ proj + 0.3 * torch.randn(B, T, D_REF, **f64),
               ref_weight=torch.randn(v, D_REF, **f64) * 2 / D_REF**0.5,
               ref_bias=0.5 * torch.randn(v, **f64))
    targets = torch.randint(0, v, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    mask[0, 3] = mask[2, 5] = False
    targets[1, 2] = -100  # dropped by ignore_index
    with torch.no_grad():
        lp = reference.linear_softmax_stats(
            hidden, weight, targets.clamp_min(0), bias, temperature=TEMPERATURE)["logprobs"]
    old = lp + 0.2 * torch.randn(B, T, **f64)
    tensors = dict(ref_logprobs=lp + 0.3 * torch.randn(B, T, **f64),
                   rollout_logprobs=old + 0.1 * torch.randn(B, T, **f64))
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, mask=mask, old=old,
                adv=torch.randn(B, **f64), tensors=tensors, ref=ref)


def _run(p, cfg, kw, lo=None, hi=None, group=None, **extra):
    """Loss, metrics and the gradients of (hidden, weight, bias); with ``group``, over the
    rank's vocabulary slice ``lo:hi`` of both heads."""
    cut = (lambda x: x) if group is None else (lambda x: x[lo:hi])
    h = p["hidden"].clone().requires_grad_(True)
    w = cut(p["weight"]).clone().requires_grad_(True)
    b = cut(p["bias"]).clone().requires_grad_(True)
    ref = {}
    if cfg.kl_estimator == "exact":
        ref = dict(ref_hidden=p["ref"]["ref_hidden"], ref_weight=cut(p["ref"]["ref_weight"]),
                   ref_bias=cut(p["ref"]["ref_bias"]))
    loss, metrics = logitless.fused_policy_loss(
        h, w, p["targets"], p["old"], p["adv"], p["mask"], cfg, bias=b,
        temperature=TEMPERATURE, vocab_parallel=group, **p["tensors"], **ref, **kw, **extra)
    loss.backward()
    return loss.detach(), metrics, (h.grad, w.grad, b.grad)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")


def _check_cases(rank, world):
    p = _problem(world)
    lo, hi = sum(SPLITS[world][:rank]), sum(SPLITS[world][:rank + 1])
    group = dist.group.WORLD
    # by turns: two dense chunks (about 13 fp64 rows of the largest slice a chunk), dense and
    # streamed chunks (4 rows a chunk: the longer sequences stream), one chunk, all streamed
    strategies = [dict(max_tile_bytes=16000), dict(max_tile_bytes=5000), dict(),
                  dict(strategy="streaming")]
    for k, (cfg, kw) in enumerate(_cases()):
        extra = strategies[k % len(strategies)]
        if cfg.kl_estimator == "exact" and extra != {}:
            extra = strategies[0]
        what = f"{cfg.objective} {cfg.kl_estimator} {kw} {extra}"
        want = _run(p, cfg, kw, **extra)
        got = _run(p, cfg, kw, lo, hi, group, **extra)
        _close(got[0], want[0], f"{what}: loss")
        assert list(got[1]) == list(want[1]), what
        for name in want[1]:
            _close(got[1][name], want[1][name], f"{what}: metric {name}")
        d_hidden, d_weight, d_bias = want[2]
        _close(got[2][0], d_hidden, f"{what}: hidden gradient")
        _close(got[2][1], d_weight[lo:hi], f"{what}: weight gradient")
        _close(got[2][2], d_bias[lo:hi], f"{what}: bias gradient")
    # hidden_grad="partial": this rank's share, the group's sum the whole gradient
    cfg = PolicyLossConfig(objective="grpo", beta=0.1, kl_estimator="exact", entropy_coef=0.01)
    want = _run(p, cfg, {})
    got = _run(p, cfg, {}, lo, hi, group, hidden_grad="partial")
    partial = got[2][0].clone()
    dist.all_reduce(partial)
    _close(partial, want[2][0], "hidden_grad='partial', summed")
    assert not torch.allclose(got[2][0], want[2][0]), "a rank's share is not the whole"


def _check_refusals(rank, world):
    p = _problem(world)
    lo, hi = sum(SPLITS[world][:rank]), sum(SPLITS[world][:rank + 1])
    group = dist.group.WORLD
    exact = PolicyLossConfig(objective="grpo", beta=0.1, kl_estimator="exact")
    with pytest.raises(ValueError, match="vocab_parallel: the exact KL"):
        _run(p, exact, {}, lo, hi, group, strategy="streaming")
    with pytest.raises(ValueError, match="vocab_parallel: not supported together with cp_group"):
        _run(p, PolicyLossConfig(), {}, lo, hi, group, cp_group=group)
    with pytest.raises(ValueError, match="max_tile_bytes"):  # a sequence streamed
        _run(p, exact, {}, lo, hi, group, max_tile_bytes=5000)
    meta = torch.empty(B, T, D, device="meta")
    with pytest.raises(ValueError, match=r"vocab_parallel: not supported under torch\.compile"):
        logitless.fused_policy_loss(meta, torch.empty(hi - lo, D, device="meta"), p["targets"],
                                    p["old"], p["adv"], p["mask"], PolicyLossConfig(),
                                    vocab_parallel=group)
    with pytest.raises(ValueError, match="targets must lie in"):  # global ids checked
        bad = p["targets"].clone()
        bad[0, 0] = sum(SPLITS[world])
        _run(dict(p, targets=bad), PolicyLossConfig(), {}, lo, hi, group)


def _check_triton(rank, world):
    """The Triton chunk store and two-head passes (``LOGITLESS_BACKEND=triton``, under the CPU
    interpreter) in fp32, against one process in fp64 (fp32 rounding apart): their partials
    and their normalisers (the exact KL's maxima untempered) reduced over the group."""
    p = _problem(world)
    lo, hi = sum(SPLITS[world][:rank]), sum(SPLITS[world][:rank + 1])
    f32 = {k: v.float() if k in ("hidden", "weight", "bias") else v for k, v in p.items()}
    f32["ref"] = {k: v.float() for k, v in p["ref"].items()}
    for cfg, kw in ((PolicyLossConfig(objective="gspo", beta=0.1, kl_estimator="exact",
                                      entropy_coef=0.02), {}),
                    (PolicyLossConfig(objective="minpro", entropy_coef=0.01), dict(softcap=4.0))):
        want = _run(p, cfg, kw, max_tile_bytes=16000)
        os.environ["LOGITLESS_BACKEND"] = "triton"
        try:
            got = _run(f32, cfg, kw, lo, hi, dist.group.WORLD, max_tile_bytes=6000)
        finally:
            del os.environ["LOGITLESS_BACKEND"]
        for name, g, w in (("loss", got[0], want[0]), ("hidden", got[2][0], want[2][0]),
                           ("weight", got[2][1], want[2][1][lo:hi]),
                           ("bias", got[2][2], want[2][2][lo:hi])):
            err = float((g.double() - w).abs().max() / w.abs().max())
            assert err < 1e-5, (cfg.objective, name, err)


def _worker(rank, world):
    _check_refusals(rank, world)
    _check_cases(rank, world)
    if world == 2 and os.environ.get("TRITON_INTERPRET") == "1":  # as make test-dist runs
        _check_triton(rank, world)


@pytest.mark.dist  # one spawn per world size (~20 s of imports each): make test-dist
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_fused_loss_matches_one_process(world):
    run_on_gloo(world, _worker)


def test_vocab_parallel_and_hidden_grad_checked():
    """Bad ``vocab_parallel`` / ``hidden_grad`` raise before anything runs."""
    p = _problem(2)
    args = (p["hidden"], p["weight"], p["targets"], p["old"], p["adv"], p["mask"],
            PolicyLossConfig())
    with pytest.raises(ValueError, match=r"vocab_parallel must be None or a torch\.distributed"):
        logitless.fused_policy_loss(*args, vocab_parallel="tp")
    with pytest.raises(ValueError, match="hidden_grad must be 'sum' or 'partial'"):
        logitless.fused_policy_loss(*args, hidden_grad="mean")
