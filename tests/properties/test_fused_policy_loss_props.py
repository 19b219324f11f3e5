"""Properties of `fused_policy_loss` over drawn layouts, heads, objectives, options, chunk budgets
and strategies: the loss and the gradients of hidden, weight and bias equal the fp64 reference
(materialised logits, then the plain-loop objective), on the torch twin and on Triton.

fp64 runs on the torch twin to a tight tolerance; fp32 (both backends, Triton at tiny shapes) by
the three-way rule against `policy_loss` on materialised fp32 logits."""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitless import (
    PolicyLossConfig,
    fused_policy_loss,
    linear_logprobs,
    policy_loss,
)
from logitless import reference as ref
from logitless.kernels import stored_logits_torch
from properties.harness import configs
from properties.strategies import (
    PolicyBatch,
    backend,
    head_transforms,
    layouts,
    policy_batches,
    policy_configs,
    seeds,
)

from testing import assert_close_to_oracle, requires_triton


@dataclass
class FusedCase:
    batch: PolicyBatch  # lp / entropy: the fp64 head's
    hidden: torch.Tensor  # fp64 [B, T, D] grid
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor  # [B, T]
    transform: dict
    kw: dict  # PolicyLossConfig arguments
    memory_rows: int | None
    strategy: str


@st.composite
def fused_cases(draw, *, max_d=24, max_v=60, max_b=3, max_t=5):
    layout = draw(layouts(max_b=max_b, max_t=max_t))
    batch = draw(policy_batches(layout))
    d, v = draw(st.integers(1, max_d)), draw(st.integers(2, max_v))
    gen = torch.Generator().manual_seed(draw(seeds))
    b, t = batch.mask.shape
    hidden = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * (2 / d**0.5)
    bias = torch.randn(v, generator=gen, dtype=torch.float64) if draw(st.booleans()) else None
    targets = torch.randint(0, v, (b, t), generator=gen)
    transform = draw(head_transforms())
    with torch.no_grad():  # old / ref / rollout near the current policy, as in training
        stats = ref.linear_softmax_stats(hidden, weight, targets, bias, **transform)
        lp = stats["logprobs"]
    noise = lambda s: s * torch.randn(b, t, generator=gen, dtype=torch.float64)
    batch.lp, batch.entropy = stats["logprobs"], stats["entropy"]  # what the head gives
    batch.old = lp + noise(0.15)
    batch.ref = batch.old + noise(0.1)
    batch.rollout = torch.where(torch.isnan(batch.rollout), batch.rollout, batch.old + noise(0.05))
    return FusedCase(
        batch=batch, hidden=hidden, weight=weight, bias=bias, targets=targets,
        transform=transform, kw=draw(policy_configs()),
        memory_rows=draw(st.none() | st.integers(1, 8)),
        strategy=draw(st.sampled_from(["auto", "auto", "chunked", "streaming"])),
    )


def _leaves(case, dtype):
    out = []
    for x in (case.hidden, case.weight, case.bias):
        out.append(None if x is None else x.to(dtype).detach().clone().requires_grad_(True))
    return out


def _grads(loss, leaves):
    params = [x for x in leaves if x is not None]
    if not loss.requires_grad:
        return [torch.zeros_like(p) for p in params]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, got)]


def run_fused(case: FusedCase, cfg, dtype):
    batch, layout = case.batch, case.batch.layout
    h, w, b = _leaves(case, dtype)
    hidden = h[layout.mask] if layout.packed else h
    budget = None
    if case.memory_rows is not None:
        budget = case.memory_rows * stored_logits_torch.bytes_per_row(
            w.shape[0], dtype, case.transform["softcap"])
    loss, _ = fused_policy_loss(
        hidden, w, batch.pack(case.targets), batch.pack(batch.old), batch.pack(batch.adv),
        batch.pack(batch.mask), cfg, bias=b, ref_logprobs=batch.pack(batch.ref),
        rollout_logprobs=batch.pack(batch.rollout),
        token_weights=batch.pack(batch.token_weights),
        attention_entropy=batch.pack(batch.attention_entropy),
        cu_seqlens=layout.cu_seqlens if layout.packed else None, max_tile_bytes=budget,
        strategy=case.strategy, **case.transform)
    return loss.detach(), _grads(loss, (h, w, b))


def run_oracle(case: FusedCase, cfg):
    """fp64 logits materialised, then the plain-loop objective on the ``[B, T]`` grid."""
    batch = case.batch
    h, w, b = _leaves(case, torch.float64)
    scored = torch.where(batch.mask, case.targets, -100)
    stats = ref.linear_softmax_stats(h, w, scored, b, **case.transform)
    loss = ref.policy_loss_reference(
        stats["logprobs"], batch.old, batch.adv, batch.mask, cfg, ref=batch.ref,
        entropy=stats["entropy"], rollout=batch.rollout, token_weights=batch.token_weights,
        attention_entropy=batch.attention_entropy)
    return loss.detach(), _grads(loss, (h, w, b))


def run_same_dtype(case: FusedCase, cfg, dtype):
    """`policy_loss` on materialised logits in ``dtype``: the three-way rule's yardstick."""
    batch = case.batch
    h, w, b = _leaves(case, dtype)
    scored = torch.where(batch.mask, case.targets, -100)
    stats = ref.linear_softmax_stats(h, w, scored, b, **case.transform)
    loss, _ = policy_loss(
        stats["logprobs"], batch.old, batch.adv, batch.mask, cfg, entropy=stats["entropy"],
        ref_logprobs=batch.ref, rollout_logprobs=batch.rollout,
        token_weights=batch.token_weights, attention_entropy=batch.attention_entropy)
    return loss.detach(), _grads(loss, (h, w, b))


def _check_fp64(case):
    ours, theirs = configs(case.kw, case.batch)
    with backend("torch"):
        loss, grads = run_fused(case, ours, torch.float64)
    want, want_grads = run_oracle(case, theirs)
    torch.testing.assert_close(loss, want, rtol=1e-8, atol=1e-10)
    for name, g, gw in zip(("hidden", "weight", "bias"), grads, want_grads):
        torch.testing.assert_close(g, gw, rtol=1e-7, atol=1e-9 * (1 + float(gw.abs().max())),
                                   msg=lambda m, name=name: f"d_{name}: {m}")


def _check_fp32(case, backend_name):
    ours, theirs = configs(case.kw, case.batch)
    with backend(backend_name):
        loss, grads = run_fused(case, ours, torch.float32)
    want, want_grads = run_oracle(case, theirs)
    with backend("torch"):
        same, same_grads = run_same_dtype(case, theirs, torch.float32)
    scale = 1 + float(want.abs())
    assert_close_to_oracle(loss, want, same, tol=2e-5 * scale, name="loss")
    for name, g, gw, gs in zip(("hidden", "weight", "bias"), grads,
                               want_grads, same_grads):
        tol = 1e-4 * (float(gw.abs().max()) if gw.numel() else 0.0) + 1e-7
        assert_close_to_oracle(g, gw, gs, tol=tol, name=f"d_{name}")


@given(fused_cases())
def test_fp64_matches_reference(case):
    _check_fp64(case)


@given(fused_cases(max_d=16, max_v=40, max_b=2, max_t=4))
def test_fp32_torch_three_way(case):
    _check_fp32(case, "torch")


@requires_triton
@given(fused_cases(max_d=12, max_v=24, max_b=2, max_t=3))
def test_fp32_triton_three_way(case):
    _check_fp32(case, "triton")


@pytest.mark.parametrize(("seed", "dtype", "quantile"),
                         [(15, torch.float32, 0.0), (18, torch.float64, 0.5)])
def test_entropy_selection_keeps_the_threshold_token(seed, dtype, quantile):
    """The documented equality with policy_loss on linear_logprobs' values, where the top-entropy
    threshold is one token's entropy (q = 0: the highest; q = 0.5 of 15 tokens: the median).
    The chunk compared its own recomputed entropies with the no-grad pass's threshold and
    dropped the token at it (1 ulp lower)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 5, 16, generator=gen).to(dtype)
    weight = (torch.randn(50, 16, generator=gen) / 2).to(dtype)
    targets = torch.randint(0, 50, (3, 5), generator=gen)
    adv = torch.randn(3, generator=gen)
    mask = torch.ones(3, 5, dtype=torch.bool)
    cfg = PolicyLossConfig(objective="grpo", top_entropy_quantile=quantile)
    with backend("torch"), torch.no_grad():
        out = linear_logprobs(hidden, weight, targets, return_entropy=True)
        old = out.logprobs + 0.1
        fused, _ = fused_policy_loss(hidden, weight, targets, old, adv, mask, cfg)
        want, _ = policy_loss(out.logprobs, old, adv, mask, cfg, entropy=out.entropy)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-7)
