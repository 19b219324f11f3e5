"""DPPO's trust-region objectives (docs/objectives.md, section 2): binary TV and KL, top-k TV
and KL. Against an fp64 loop written from the formula, against TRL's experimental DPPO trainer
when it is importable (TRL 1.0 to 1.8; later TRL removed it), and through fused_policy_loss on
both chunk stores. verl's ``dppo_tv`` / ``dppo_kl`` parity is in
tests/integrations/test_verl_parity.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from fused_losses.test_fused_policy_loss import (
    HEAD,
    V,
    make_batch,
    packed,
)
from fused_losses.test_fused_policy_loss_triton import triton_store  # noqa: F401 (fixture)
from logitless import PolicyLossConfig, policy_loss, reference
from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss

from testing import requires_triton

B, T, VOCAB, K = 4, 9, 37, 5
CAP = 3.0


def make(seed, per_token_adv=False):
    """A rollout distribution and a moved current one over a small vocabulary; the sampled
    token drawn from the rollout's, the top-k ids the rollout's largest."""
    g = torch.Generator().manual_seed(seed)
    old_logits = 2.0 * torch.randn(B, T, VOCAB, generator=g, dtype=torch.float64)
    cur_logits = old_logits + 0.6 * torch.randn(B, T, VOCAB, generator=g, dtype=torch.float64)
    old_lsm, cur_lsm = old_logits.log_softmax(-1), cur_logits.log_softmax(-1)
    targets = torch.multinomial(old_lsm.exp().reshape(-1, VOCAB), 1, generator=g).reshape(B, T)
    ids = old_logits.topk(K, dim=-1).indices
    mask = torch.arange(T)[None] < torch.tensor([T, 6, 0, 8])[:, None]
    mask[0, 4] = False
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g, dtype=torch.float64)
    return dict(
        lp=cur_lsm.gather(-1, targets[..., None])[..., 0],
        old=old_lsm.gather(-1, targets[..., None])[..., 0],
        topk=cur_lsm.gather(-1, ids), old_topk=old_lsm.gather(-1, ids), adv=adv, mask=mask)


def oracle(d, kind, eps_low, eps_high, lp):
    """The DPPO loss, one token at a time from the formula, token-mean over the mask."""
    adv = d["adv"] if d["adv"].dim() == 2 else d["adv"][:, None].expand(B, T)
    total, n = lp.new_zeros(()), 0
    for i in range(B):
        for t in range(T):
            if not d["mask"][i, t]:
                continue
            n += 1
            x, old, a = float(lp[i, t].detach()), float(d["old"][i, t]), float(adv[i, t])
            p, p_old = math.exp(x), math.exp(old)
            if kind == "binary_tv":
                div = abs(p - p_old)
            elif kind == "binary_kl":
                div = p_old * (old - x) + (1 - p_old) * math.log((1 - p_old + 1e-8)
                                                                  / (1 - p + 1e-8))
            else:
                q = [math.exp(float(v)) for v in d["topk"][i, t]]
                q_old = [math.exp(float(v)) for v in d["old_topk"][i, t]]
                rest, rest_old = max(1 - sum(q), 1e-12), max(1 - sum(q_old), 1e-12)
                if kind == "topk_tv":
                    div = (sum(abs(u - v) for u, v in zip(q, q_old)) + abs(rest - rest_old)) / 2
                else:
                    div = sum(v * math.log(v / u) for u, v in zip(q, q_old))
                    div += rest_old * math.log(rest_old / rest)
            if a > 0:
                inside = div <= eps_high or p <= p_old
            else:
                inside = div <= eps_low or p >= p_old
            if inside:
                total = total - a * min(math.exp(x - old), CAP) * lp[i, t]
    return total / max(n, 1)


# thresholds that bind for some tokens of `make` and not for others
EPS = {"binary_tv": (0.01, 0.015), "binary_kl": (0.003, 0.004), "topk_tv": (0.15, 0.2),
       "topk_kl": (0.08, 0.1)}
OBJECTIVE = {"binary_tv": "dppo_tv", "binary_kl": "dppo_kl", "topk_tv": "dppo_topk_tv",
             "topk_kl": "dppo_topk_kl"}


def _ours(d, kind, layout="padded", **cfg_kw):
    cfg = PolicyLossConfig(objective=OBJECTIVE[kind], dppo_ratio_cap=CAP, **cfg_kw)
    lp = d["lp"].clone().requires_grad_()
    topk = {}
    if kind.startswith("topk"):
        topk = dict(topk_logprobs=d["topk"], old_topk_logprobs=d["old_topk"])
    if layout == "padded":
        loss, metrics = policy_loss(lp, d["old"], d["adv"], d["mask"], cfg, **topk)
    else:
        m = d["mask"]
        cu = torch.cat([torch.zeros(1, dtype=torch.long), m.sum(-1).cumsum(0)])
        adv = d["adv"] if d["adv"].dim() == 1 else d["adv"][m]
        loss, metrics = policy_loss(lp[m], d["old"][m], adv, m[m], cfg, cu_seqlens=cu,
                                    **{k: v[m] for k, v in topk.items()})
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("kind", sorted(OBJECTIVE))
def test_dppo_matches_the_formula(kind, per_token_adv):
    d = make(3 + per_token_adv, per_token_adv)
    eps = dict(zip(("eps_low", "eps_high"), EPS[kind]))
    lp = d["lp"].clone().requires_grad_()
    want = oracle(d, kind, eps["eps_low"], eps["eps_high"], lp)
    (want_grad,) = torch.autograd.grad(want, lp)
    for layout in ("padded", "packed"):
        loss, grad, metrics = _ours(d, kind, layout, **eps)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)
    # the trust region binds for some tokens and not for others: the test sees both
    assert 0 < float(metrics["clip_ratio/region"]) < 1


def test_dppo_topk_divergences_are_distribution_divergences():
    """With every token of the vocabulary in the top-k (empty rest bucket), the top-k TV and KL
    are the full distributions' TV and KL(rollout || current)."""
    from logitless.fused_losses.objectives.catalog import topk_trust_region

    g = torch.Generator().manual_seed(5)
    old = torch.randn(3, 7, 11, generator=g, dtype=torch.float64).log_softmax(-1)
    cur = (old + torch.randn(3, 7, 11, generator=g, dtype=torch.float64)).log_softmax(-1)
    tv = (cur.exp() - old.exp()).abs().sum(-1) / 2
    kl = (old.exp() * (old - cur)).sum(-1)
    torch.testing.assert_close(topk_trust_region(cur, old, "tv"), tv, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(topk_trust_region(cur, old, "kl"), kl, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kind", sorted(OBJECTIVE))
def test_dppo_equals_trl_experimental_trainer(kind):
    """TRL's own mask (``DPPOTrainer._compute_divergence_mask``) in TRL's loss,
    ``-A min(r, clip_ratio_c) mask lp`` summed over ``num_items_in_batch``."""
    pytest.importorskip("trl.experimental.dppo", reason="TRL 1.0 to 1.8 ship the DPPO trainer")
    from trl.experimental.dppo.dppo_trainer import DPPOTrainer

    d = make(11, per_token_adv=True)
    eps_low, eps_high = EPS[kind]
    trainer = SimpleNamespace(epsilon_low=eps_low, epsilon_high=eps_high, divergence_type=kind)
    lp = d["lp"].clone().requires_grad_()
    m = d["mask"].double()
    keep = DPPOTrainer._compute_divergence_mask(
        trainer, lp, d["old"], d["adv"], m, current_topk_logps=d["topk"],
        sampling_topk_logps=d["old_topk"])
    ratio = torch.exp((lp - d["old"]).clamp(max=math.log(CAP))).detach()
    theirs = ((-d["adv"] * ratio * keep * lp) * m).sum() / m.sum()
    (their_grad,) = torch.autograd.grad(theirs, lp)
    loss, grad, metrics = _ours(d, kind, eps_low=eps_low, eps_high=eps_high)
    assert 0 < float(metrics["clip_ratio/region"]) < 1
    torch.testing.assert_close(loss, theirs.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, their_grad, rtol=1e-12, atol=1e-14)


def _fused_batch(seed=0, dtype=torch.float64):
    """The fused tests' batch with top-k inputs at K=4 random ids: the trainer's logprobs there
    from the reference head (what a caller computes under no_grad), the rollout's moved."""
    batch = make_batch(dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (*batch["targets"].shape, 4), generator=g)
    with torch.no_grad():
        topk = torch.stack([reference.linear_softmax_stats(
            batch["hidden"], batch["weight"], ids[..., k], batch["bias"], **HEAD)["logprobs"]
            for k in range(ids.shape[-1])], -1)
    batch["topk"] = topk
    batch["old_topk"] = topk + 0.5 * torch.randn(topk.shape, generator=g, dtype=topk.dtype)
    return batch


def _run(batch, cfg, fused, **kw):
    """fused_policy_loss, or policy_loss on the reference's materialised logprobs."""
    leaves = [batch[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    m = batch["mask"]
    topk = dict(topk_logprobs=batch["topk"], old_topk_logprobs=batch["old_topk"])
    if "cu_seqlens" in batch:
        topk = {k: v[batch["full_mask"]] for k, v in topk.items()}
    if fused:
        loss, metrics = fused_policy_loss(
            leaves[0], leaves[1], batch["targets"], batch["old"], batch["adv"], m, cfg,
            bias=leaves[2], cu_seqlens=batch.get("cu_seqlens"), **topk, **HEAD, **kw)
    else:
        scored = torch.where(m, batch["targets"], -100)
        lp = reference.linear_softmax_stats(leaves[0], leaves[1], scored, leaves[2],
                                            **HEAD)["logprobs"]
        loss, metrics = policy_loss(lp, batch["old"], batch["adv"], m, cfg,
                                    cu_seqlens=batch.get("cu_seqlens"), **topk)
    return loss, metrics, torch.autograd.grad(loss, leaves)


def _check_fused(cfg, layout, dtype=torch.float64, rtol=1e-10, **kw):
    """fused_policy_loss against policy_loss on the reference's logprobs in ``dtype`` (fp64
    for the torch store; the Triton one stores fp32 or bf16 logits)."""
    batch = _fused_batch(dtype=dtype)
    if layout == "packed":
        full_mask = batch["mask"]
        batch = packed(batch)
        batch["full_mask"] = full_mask
    loss, metrics, grads = _run(batch, cfg, fused=True, **kw)
    want_loss, want_metrics, want_grads = _run(batch, cfg, fused=False)
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=rtol * 1e-2)
    assert 0 < float(want_metrics["clip_ratio/region"]) < 1  # the region binds somewhere
    for k, v in want_metrics.items():
        torch.testing.assert_close(metrics[k], v, rtol=rtol, atol=rtol * 1e-2, msg=k)
    for g, w in zip(grads, want_grads):
        scale = float(w.abs().max())
        assert scale > 0
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * 1e-2 * scale)


# thresholds that bind for some tokens of `_fused_batch` and not for others
FUSED_EPS = {"dppo_topk_tv": dict(eps_low=0.01, eps_high=0.01),
             "dppo_topk_kl": dict(eps_low=0.003, eps_high=0.003)}


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("objective", ["dppo_topk_tv", "dppo_topk_kl"])
def test_dppo_topk_fused_torch_store(objective, layout):
    """Several chunks (a budget of 8 rows) and the whole batch streamed."""
    from fused_losses.test_fused_policy_loss import rows

    cfg = PolicyLossConfig(objective=objective, **FUSED_EPS[objective])
    _check_fused(cfg, layout, max_tile_bytes=rows(8))
    _check_fused(cfg, layout, strategy="streaming")


@requires_triton
@pytest.mark.parametrize("objective", ["dppo_topk_tv", "dppo_topk_kl"])
def test_dppo_topk_fused_triton_store(objective, triton_store):  # noqa: F811 (fixture)
    from fused_losses.test_fused_policy_loss_triton import budget

    cfg = PolicyLossConfig(objective=objective, **FUSED_EPS[objective])
    _check_fused(cfg, "packed", torch.float32, 1e-4, max_tile_bytes=budget(13, torch.float32))
    assert triton_store["forward"] >= 3 and triton_store["backward_"] >= 3


def test_dppo_topk_bad_inputs_name_the_argument():
    d = make(1)
    lp, old, adv, m = d["lp"], d["old"], d["adv"], d["mask"]
    topk_cfg = PolicyLossConfig(objective="dppo_topk_tv")
    with pytest.raises(ValueError, match="topk_logprobs: dppo_topk_tv needs"):
        policy_loss(lp, old, adv, m, topk_cfg)
    with pytest.raises(ValueError, match="topk_logprobs: dppo_topk_tv needs"):
        policy_loss(lp, old, adv, m, topk_cfg, topk_logprobs=d["topk"])
    with pytest.raises(ValueError, match="topk_logprobs: given, but dppo_tv"):
        policy_loss(lp, old, adv, m, PolicyLossConfig(objective="dppo_tv"),
                    topk_logprobs=d["topk"], old_topk_logprobs=d["old_topk"])
    with pytest.raises(ValueError, match=r"old_topk_logprobs: expected shape \(4, 9, 'K'\)"):
        policy_loss(lp, old, adv, m, topk_cfg, topk_logprobs=d["topk"],
                    old_topk_logprobs=d["old_topk"][:, :5])
    with pytest.raises(ValueError, match="old_topk_logprobs: expected the K of topk_logprobs"):
        policy_loss(lp, old, adv, m, topk_cfg, topk_logprobs=d["topk"],
                    old_topk_logprobs=d["old_topk"][..., :3])
    batch = make_batch()
    with pytest.raises(ValueError, match="topk_logprobs: dppo_topk_kl needs"):
        fused_policy_loss(batch["hidden"], batch["weight"], batch["targets"], batch["old"],
                          batch["adv"], batch["mask"], PolicyLossConfig(objective="dppo_topk_kl"))


def prime_rl_oracle(d, mask_low, mask_high, kl_tau, lp):
    """prime-rl's default loss (``prime_rl/trainer/rl/loss.py``, ``default_loss_fn`` with
    ``adv_tau=1``), written from its formula one token at a time: ``-A exp(lp - lp_inf)`` on
    the tokens whose probability moved by at most ``dppo_mask_high`` up (A > 0) or
    ``dppo_mask_low`` down (A <= 0), plus ``kl_tau (lp - lp_inf)^2`` on every loss token;
    summed and divided by the loss tokens (prime-rl's ``rl_scale``)."""
    adv = d["adv"] if d["adv"].dim() == 2 else d["adv"][:, None].expand(B, T)
    total, n = lp.new_zeros(()), 0
    for i in range(B):
        for t in range(T):
            if not d["mask"][i, t]:
                continue
            n += 1
            x, old, a = lp[i, t], float(d["old"][i, t]), float(adv[i, t])
            diff = math.exp(float(x.detach())) - math.exp(old)
            masked = diff > mask_high if a > 0 else diff < -mask_low
            if not masked:
                total = total - a * torch.exp(x - old)
            total = total + kl_tau * (x - old) ** 2
    return total / max(n, 1)


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_prime_rl_matches_the_formula(per_token_adv):
    d = make(7 + per_token_adv, per_token_adv)
    lp = d["lp"].clone().requires_grad_()
    want = prime_rl_oracle(d, 0.01, 0.015, 0.05, lp)
    (want_grad,) = torch.autograd.grad(want, lp)
    cfg = PolicyLossConfig(objective="prime_rl", eps_low=0.01, eps_high=0.015,
                           sq_log_ratio_coef=0.05)
    n = int(d["mask"].sum())
    for layout in ("padded", "packed"):
        for kw in ({}, dict(num_items_in_batch=n)):
            m = d["mask"]
            lp = d["lp"].clone().requires_grad_()
            if layout == "padded":
                loss, metrics = policy_loss(lp, d["old"], d["adv"], m, cfg, **kw)
            else:
                cu = torch.cat([torch.zeros(1, dtype=torch.long), m.sum(-1).cumsum(0)])
                adv = d["adv"] if d["adv"].dim() == 1 else d["adv"][m]
                loss, metrics = policy_loss(lp[m], d["old"][m], adv, m[m], cfg, cu_seqlens=cu,
                                            **kw)
            (grad,) = torch.autograd.grad(loss, lp)
            torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)
    assert 0 < float(metrics["clip_ratio/region"]) < 1  # the trust region binds for some


def test_prime_rl_defaults_and_bad_config():
    cfg = PolicyLossConfig(objective="prime_rl")
    # prime-rl's DefaultLossConfig: dppo_mask_low = dppo_mask_high = 0.2, kl_tau = 1e-3
    assert (cfg.eps_low, cfg.eps_high, cfg.sq_log_ratio_coef, cfg.loss_agg) == (
        0.2, 0.2, 1e-3, "token-mean")
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.sq_log_ratio_coef"):
        PolicyLossConfig(objective="prime_rl", sq_log_ratio_coef=-0.1)
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.ratio_level"):
        PolicyLossConfig(objective="prime_rl", ratio_level="sequence")
