"""The public segmented ops (``objectives/segments.py``): their Triton autograd Functions
against ``gradcheck`` and the torch twin's gradients, the backend rule that picks them, and
`policy_loss` giving the same loss and gradients on either backend. Batches in
``tests/segment_cases.py``; the kernels' values in ``tests/kernels/test_segments_triton.py``."""

import pytest
import torch

from logitless.fused_losses.objectives import segments
from logitless.kernels import segments as kernels
from logitless.kernels import segments_torch

from segment_cases import PICKS, SUMS, batch, on_torch, on_triton, triton_forced
from testing import requires_triton

pytestmark = requires_triton


def test_packed_broadcast_and_its_gradient():
    x, _, cu = batch("packed")
    values = torch.randn(cu.numel() - 1, requires_grad=True)
    want_values = values.detach().clone().requires_grad_(True)
    with triton_forced():
        got = segments.broadcast(values, x, cu)
    want = segments_torch.broadcast(want_values, x, cu)
    assert type(got.grad_fn).__name__ == "_BroadcastPackedBackward"
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(values.grad, want_values.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", [*SUMS, *PICKS])
def test_gradcheck_fp64(op, layout):
    x, mask, cu = batch(layout, dtype=torch.float64, seed=1)
    x.requires_grad_(True)

    def f(v):
        y = on_triton(op, v, mask, cu)
        return torch.where(torch.isinf(y), 0.0, y)  # prefix minima of no token: +inf, no grad

    assert torch.autograd.gradcheck(f, (x,), fast_mode=True)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", [*SUMS, *PICKS])
def test_gradients_match_the_torch_twin_with_ties(op, layout):
    # Integer values: maxima tie (amax splits the gradient evenly) and prefix minima tie
    # (cummin sends it to the latest of the tied tokens); sums are exact in fp32.
    x, mask, cu = batch(layout, ties=True, seed=2)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    got = on_triton(op, xs[0], mask, cu)
    want = on_torch(op, xs[1], mask, cu)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    finite = torch.isfinite(want)  # +inf prefix minima: no token to send a gradient to
    got.backward(torch.where(finite, g, 0))
    want.backward(torch.where(finite, g, 0))
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("op", [*SUMS, *PICKS])
def test_forced_calls_run_the_autograd_functions(op, dtype):
    # What the kernel tests and the gradchecks here compare is the Triton path, not the twin.
    x, mask, cu = batch("packed", dtype=dtype)
    y = on_triton(op, x.requires_grad_(True), mask, cu)
    name = type(y.grad_fn).__name__
    assert name.startswith(("_Segment", "_Prefix")) and name.endswith("Backward"), name


def test_dispatch_follows_the_backend_rule(monkeypatch):
    x, mask, _ = batch("padded")
    x.requires_grad_(True)
    monkeypatch.setenv("LOGITLESS_BACKEND", "triton")
    assert type(segments.segment_mean(x, mask).grad_fn).__name__ == "_SegmentMeanBackward"
    assert type(segments.prefix_min(x, mask).grad_fn).__name__ == "_PrefixMinBackward"
    # fp64 stays on the torch twin (oracles and gradcheck), as for linear_logprobs.
    assert "_Segment" not in type(segments.segment_mean(x.double(), mask).grad_fn).__name__
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    assert "_Segment" not in type(segments.segment_mean(x, mask).grad_fn).__name__


# One configuration per segmented op the objective library reaches: GSPO (sequence mean with
# gradient), GMPO, CTPO (prefix sum), MinPRO both ways (prefix min), DHPO with entropy mixing
# (max with gradient, into the entropy), sequence IS and max rejection (sum, max), FRPO
# (suffix sum), per-sequence attention-entropy weighting (means), seq-mean aggregation.
POLICY_CONFIGS = {
    "gspo": dict(objective="grpo", ratio_level="sequence", loss_agg="seq-mean-token-mean"),
    "gmpo": dict(objective="grpo", ratio_level="geometric"),
    "ctpo": dict(objective="ctpo"),
    "minpro": dict(objective="minpro"),
    "minpro_preceding": dict(objective="minpro", minpro_prefix="preceding"),
    "dhpo_entropy": dict(objective="dhpo", dhpo_mix="entropy"),
    "rollout_seq": dict(rollout_is="sequence", rollout_rs="seq_max_k2,seq_sum_k1",
                        rollout_rs_threshold="4.0,8.0"),
    "frpo": dict(future_kl_coef=0.1),
    "attn_softmax": dict(attn_entropy_weighting="softmax"),
}


def _policy_inputs(seed=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([37, 0, 9, 30, 1])
    mask = torch.arange(37)[None] < lengths[:, None]
    old = -torch.rand(5, 37, generator=g) * 2.5 - 0.05
    return dict(
        logprobs=(old + 0.3 * torch.randn(5, 37, generator=g)).clamp(max=-1e-3),
        old_logprobs=old,
        advantages=torch.randn(5, generator=g),
        mask=mask,
        ref_logprobs=old + 0.2 * torch.randn(5, 37, generator=g),
        rollout_logprobs=old + 0.1 * torch.randn(5, 37, generator=g),
        entropy=torch.rand(5, 37, generator=g) * 2,
        attention_entropy=torch.rand(5, 37, generator=g),
    )


def _policy_loss(backend, cfg, d, layout, monkeypatch):
    from logitless import PolicyLossConfig, policy_loss

    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    lp = d["logprobs"].clone().requires_grad_(True)
    ent = d["entropy"].clone().requires_grad_(True)
    m = d["mask"]
    tensors = dict(d, logprobs=lp, entropy=ent)
    kw = {}
    if layout == "packed":
        tensors = {k: v if k == "advantages" else v[m] for k, v in tensors.items()}
        kw["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), m.sum(-1).cumsum(0)])
    args = [tensors.pop(k) for k in ("logprobs", "old_logprobs", "advantages", "mask")]
    loss, _ = policy_loss(*args, PolicyLossConfig(**cfg), **tensors, **kw)
    loss.backward()
    return loss.detach(), lp.grad, ent.grad if ent.grad is not None else torch.zeros_like(ent)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", sorted(POLICY_CONFIGS))
def test_policy_loss_is_the_same_on_both_backends(name, layout, monkeypatch):
    # fp32: the Triton path runs for these (fp64 would stay on the torch twins).
    d = _policy_inputs()
    calls = []
    for launcher in ("segment_reduce", "segment_scan"):
        real = getattr(kernels, launcher)
        monkeypatch.setattr(kernels, launcher,
                            lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    got = _policy_loss("triton", POLICY_CONFIGS[name], d, layout, monkeypatch)
    assert calls, "the Triton kernels were not reached"
    want = _policy_loss("torch", POLICY_CONFIGS[name], d, layout, monkeypatch)
    for a, b, what in zip(got, want, ("loss", "d logprobs", "d entropy")):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6, msg=what)
