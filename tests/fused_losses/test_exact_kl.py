"""``kl_estimator="exact"``: the full-vocabulary KL(policy || reference) in the policy loss.

Both forms (``fused_policy_loss(..., ref_hidden=, ref_weight=)`` and ``policy_loss(...,
kl=linear_divergence(..., beta=1))``) against the fp64 spec: both heads' logits materialised,
the KL by its formula, the loss by the token-loop reference; gradients of the policy's hidden,
weight and bias."""

import pytest
import torch

from logitless import PolicyLossConfig, linear_divergence, policy_loss, reference
from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss
from logitless.kernels import stored_logits_torch

from testing import assert_close_to_oracle, requires_triton

B, T, D, D_REF, V = 3, 37, 96, 80, 1007
TEMPERATURE = 0.8


def make_batch(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    hidden = torch.randn(B, T, D, **f64)
    weight = torch.randn(V, D, **f64) / D**0.5
    bias = 0.5 * torch.randn(V, **f64)
    # the reference: the policy's head moved a little, its own hidden size
    proj = torch.randn(D, D_REF, **f64) / D**0.5
    ref_hidden = hidden @ proj + 0.3 * torch.randn(B, T, D_REF, **f64)
    ref_weight = weight @ proj * 1.2 + 0.2 * torch.randn(V, D_REF, **f64) / D_REF**0.5
    ref_bias = bias + 0.3 * torch.randn(V, **f64)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.arange(T)[None, :] < torch.tensor([[T], [23], [11]])
    mask[0, 5] = mask[0, 30] = False  # tool tokens inside a response
    with torch.no_grad():
        lp = reference.linear_softmax_stats(hidden, weight, targets, bias,
                                            temperature=TEMPERATURE)["logprobs"]
    old = lp + 0.2 * torch.randn(B, T, **f64)
    adv = torch.randn(B, **f64)
    cast = lambda x: x.to(dtype)
    return dict(hidden=cast(hidden), weight=cast(weight), bias=cast(bias),
                ref_hidden=cast(ref_hidden), ref_weight=cast(ref_weight),
                ref_bias=cast(ref_bias), targets=targets, mask=mask, old=old, adv=adv)


def leaves(batch, dtype=None):
    return [(batch[k] if dtype is None else batch[k].to(dtype)).clone().requires_grad_(True)
            for k in ("hidden", "weight", "bias")]


def run_fused(batch, cfg, **kw):
    h, w, b = leaves(batch)
    loss, metrics = fused_policy_loss(
        h, w, batch["targets"], batch["old"], batch["adv"], batch["mask"], cfg, bias=b,
        ref_hidden=batch["ref_hidden"], ref_weight=batch["ref_weight"],
        ref_bias=batch["ref_bias"], temperature=TEMPERATURE, **kw)
    return loss, metrics, torch.autograd.grad(loss, (h, w, b))


def run_composed(batch, cfg, dtype=None):
    """``policy_loss`` on materialised logprobs with ``kl=linear_divergence(..., beta=1)``."""
    h, w, b = leaves(batch, dtype)
    scored = torch.where(batch["mask"], batch["targets"], -100)
    lp = reference.linear_softmax_stats(h, w, scored, b, temperature=TEMPERATURE)["logprobs"]
    kl = linear_divergence(h, w, batch["ref_hidden"], batch["ref_weight"], batch["mask"],
                           beta=1.0, temperature=TEMPERATURE, bias=b,
                           teacher_bias=batch["ref_bias"]).divergence
    loss, metrics = policy_loss(lp, batch["old"], batch["adv"], batch["mask"], cfg, kl=kl)
    return loss, metrics, torch.autograd.grad(loss, (h, w, b))


def run_spec(batch, cfg, dtype=torch.float64):
    """Both heads' logits materialised in ``dtype``, the KL by its formula, the loss by the
    token-loop reference (or by `policy_loss` in a low precision: the same-dtype torch path)."""
    h, w, b = leaves(batch, dtype)
    ref_h, ref_w, ref_b = (batch[k].to(dtype) for k in ("ref_hidden", "ref_weight", "ref_bias"))
    z = reference.linear_logits(h, w, b)
    kl = reference.generalized_jsd(z, reference.linear_logits(ref_h, ref_w, ref_b), 1.0,
                                   TEMPERATURE)
    kl = torch.where(batch["mask"], kl, 0.0)
    lp = torch.log_softmax(z / TEMPERATURE, -1).gather(-1, batch["targets"][..., None])[..., 0]
    if dtype == torch.float64:
        loss = reference.policy_loss_reference(lp, batch["old"], batch["adv"], batch["mask"],
                                               cfg, kl=kl)
    else:
        loss, _ = policy_loss(lp, batch["old"], batch["adv"], batch["mask"], cfg, kl=kl)
    shown = kl * (lp - batch["old"]).exp() if cfg.kl_bias_correction else kl  # token ratio
    kl_mean = shown[batch["mask"]].double().mean()
    return loss, kl_mean, torch.autograd.grad(loss, (h, w, b))


def assert_matches_spec(got, spec, rtol=1e-9):
    (loss, metrics, grads), (loss_s, kl_mean, grads_s) = got, spec
    torch.testing.assert_close(loss.double(), loss_s.double(), rtol=rtol, atol=1e-12)
    torch.testing.assert_close(metrics["kl"].double(), kl_mean, rtol=rtol, atol=1e-12)
    for name, g, gs in zip(("hidden", "weight", "bias"), grads, grads_s):
        scale = float(gs.abs().max())
        assert scale > 0, f"d_{name} is zero: the test would not see a wrong gradient"
        torch.testing.assert_close(g.double(), gs.double(), rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, name=name: f"d_{name}: {m}")


CONFIGS = {
    "grpo": dict(objective="grpo", beta=0.3),
    # the rules of the estimators: bias correction by sg(r), per-token beta, aggregation;
    # kl_clamp is k3's guard and leaves the exact KL alone
    "dapo-corrected": dict(objective="dapo", beta=0.3, kl_bias_correction=True, kl_clamp=True,
                           loss_agg="seq-mean-token-sum"),
}


@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_exact_kl_matches_the_fp64_spec(name, strategy, monkeypatch):
    """A budget of 30 rows: the first sequence (35 loss tokens) streamed, the others dense
    chunks in vocabulary blocks of 300 (the last partial)."""
    monkeypatch.setattr(stored_logits_torch, "VOCAB_BLOCK", 300)
    batch = make_batch()
    cfg = PolicyLossConfig(kl_estimator="exact", **CONFIGS[name])
    budget = 30 * stored_logits_torch.bytes_per_row(V, torch.float64, None)
    got = run_fused(batch, cfg, max_tile_bytes=budget, strategy=strategy)
    assert_matches_spec(got, run_spec(batch, cfg))


def test_composed_form_matches_the_spec_and_the_fused_form():
    """``policy_loss(..., kl=linear_divergence(..., beta=1))``: the same loss, metrics and
    gradients as the fused form; a per-token beta."""
    batch = make_batch(seed=1)
    beta = 0.05 + torch.rand(B, T, generator=torch.Generator().manual_seed(2),
                             dtype=torch.float64)
    cfg = PolicyLossConfig(objective="grpo", beta=beta, kl_estimator="exact",
                           entropy_coef=0.0)
    composed = run_composed(batch, cfg)
    assert_matches_spec(composed, run_spec(batch, cfg))
    fused = run_fused(batch, cfg, max_tile_bytes=24 * stored_logits_torch.bytes_per_row(
        V, torch.float64, None))
    assert_matches_spec(fused, (composed[0], composed[1]["kl"], composed[2]), rtol=1e-11)


def test_packed_equals_padded():
    batch = make_batch(seed=3)
    m = batch["mask"]
    lengths = m.sum(1)
    packed = dict(batch, mask=torch.ones(int(lengths.sum()), dtype=torch.bool),
                  cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    for k in ("hidden", "ref_hidden", "targets", "old"):
        packed[k] = batch[k][m]
    cfg = PolicyLossConfig(objective="grpo", beta=0.2, kl_estimator="exact")
    loss, metrics, grads = run_fused(packed, cfg, cu_seqlens=packed.pop("cu_seqlens"))
    loss_s, kl_mean, grads_s = run_spec(batch, cfg)
    assert_matches_spec((loss, metrics, (grads[0], *grads[1:])),
                        (loss_s, kl_mean, (grads_s[0][m], *grads_s[1:])))


def test_bf16_three_way():
    batch = make_batch(dtype=torch.bfloat16, seed=4)
    cfg = PolicyLossConfig(objective="grpo", beta=0.3, kl_estimator="exact")
    ours = run_fused(batch, cfg, max_tile_bytes=2**20)
    exact = run_spec(batch, cfg, torch.float64)
    same = run_spec(batch, cfg, torch.bfloat16)
    assert_close_to_oracle(ours[0], exact[0], same[0], tol=1e-3, name="loss")
    assert_close_to_oracle(ours[1]["kl"], exact[1], same[1], tol=1e-3, name="kl")
    for name, g, ge, gs in zip(("hidden", "weight", "bias"), ours[2], exact[2], same[2]):
        assert_close_to_oracle(g, ge, gs, tol=1e-2 * float(ge.abs().max()), name=f"d_{name}")


def test_no_gradient_to_the_reference():
    batch = make_batch(seed=5)
    ref_h, ref_w = batch["ref_hidden"].requires_grad_(), batch["ref_weight"].requires_grad_()
    cfg = PolicyLossConfig(objective="grpo", beta=0.3, kl_estimator="exact")
    loss, _, _ = run_fused(batch, cfg)
    assert loss.requires_grad
    assert torch.autograd.grad(loss, (ref_h, ref_w), allow_unused=True) == (None, None)


def _fused(batch, cfg, **kw):
    args = dict(bias=batch["bias"], temperature=TEMPERATURE)
    args.update(kw)
    return fused_policy_loss(batch["hidden"], batch["weight"], batch["targets"], batch["old"],
                             batch["adv"], batch["mask"], cfg, **args)


def test_bad_input():
    batch = make_batch(seed=6)
    exact = PolicyLossConfig(objective="grpo", beta=0.1, kl_estimator="exact")
    k3 = PolicyLossConfig(objective="grpo", beta=0.1)
    ref = dict(ref_hidden=batch["ref_hidden"], ref_weight=batch["ref_weight"])
    cases = [
        (exact, {}, "ref_hidden/ref_weight: kl_estimator='exact' with beta != 0 needs"),
        (exact, dict(ref_hidden=batch["ref_hidden"]), "ref_weight: the exact KL needs both"),
        (exact, dict(ref_weight=batch["ref_weight"]), "ref_hidden: the exact KL needs both"),
        (exact, dict(ref, ref_hidden=batch["ref_hidden"][:, :-1]),
         "ref_hidden must have hidden's token shape"),
        (exact, dict(ref, ref_weight=batch["ref_weight"][:-1]),
         "ref_weight must have the policy's vocabulary size 1007"),
        (exact, dict(ref, ref_weight=batch["ref_weight"][:, :-1]), "ref_weight must be a 2-D"),
        (exact, dict(ref, ref_bias=batch["ref_bias"][:-1]), "ref_bias must be"),
        (exact, dict(ref, softcap=30.0), "softcap: the exact KL"),
        (k3, ref, "ref_hidden/ref_weight: given, but kl_estimator is 'k3'"),
    ]
    for cfg, kw, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _fused(batch, cfg, ref_logprobs=batch["old"], **kw)
    lp, mask = batch["old"], batch["mask"]
    with pytest.raises(ValueError, match="kl: kl_estimator='exact' with beta != 0 needs kl"):
        policy_loss(lp, lp, batch["adv"], mask, exact)
    with pytest.raises(ValueError, match="kl: given, but kl_estimator is 'k3'"):
        policy_loss(lp, lp, batch["adv"], mask, k3, ref_logprobs=lp, kl=torch.zeros_like(lp))
    with pytest.raises(ValueError, match=r"kl: expected shape \(3, 37\)"):
        policy_loss(lp, lp, batch["adv"], mask, exact, kl=torch.zeros(3, 36))
    with pytest.raises(ValueError, match="kl_estimator"):
        PolicyLossConfig(kl_estimator="exact+")


def test_beta_zero_needs_no_reference():
    """As with the estimators, beta = 0 needs no reference: the loss is the plain one and the
    kl metric left out (nothing was computed); given one, the metric is its exact KL."""
    batch = make_batch(seed=7)
    cfg = PolicyLossConfig(objective="grpo", kl_estimator="exact")
    loss, metrics = _fused(batch, cfg)
    plain, _ = _fused(batch, PolicyLossConfig(objective="grpo"))
    torch.testing.assert_close(loss, plain, rtol=0, atol=0)
    assert "kl" not in metrics
    _, metrics = _fused(batch, cfg, ref_hidden=batch["ref_hidden"],
                        ref_weight=batch["ref_weight"], ref_bias=batch["ref_bias"])
    _, kl_mean, _ = run_spec(batch, cfg)
    torch.testing.assert_close(metrics["kl"].double(), kl_mean, rtol=1e-9, atol=1e-12)


@requires_triton
def test_the_fused_exact_kl_runs_the_triton_passes_where_triton_is_selected(monkeypatch):
    """Issue 24: where the Triton backend is selected (CUDA; here LOGITLESS_BACKEND=triton under
    the interpreter) the fused loss's exact KL runs the Triton two-head passes, not the torch
    twin's, and gives the torch path's loss and gradients."""
    from logitless.kernels import divergence, divergence_torch

    batch = make_batch(dtype=torch.float32, seed=6)
    cfg = PolicyLossConfig(objective="grpo", beta=0.3, kl_estimator="exact")
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    want = run_fused(batch, cfg, max_tile_bytes=2**20, strategy="chunked")
    calls = []
    for module in (divergence, divergence_torch):
        for name in ("divergence_forward", "divergence_backward"):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _r=real, _n=f"{module.__name__}.{name}",
                                **k: calls.append(_n) or _r(*a, **k))
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    got = run_fused(batch, cfg, max_tile_bytes=2**20, strategy="chunked")
    assert set(calls) == {"logitless.kernels.divergence.divergence_forward",
                          "logitless.kernels.divergence.divergence_backward"}
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))
