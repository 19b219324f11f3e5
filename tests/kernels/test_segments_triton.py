"""Segmented Triton kernels (under TRITON_INTERPRET=1 on CPU) against their torch twins.

Odd sizes on purpose: B=5 sequences (the interpreter's programs own 4, so the last program is
ragged), T=37 (three token blocks of 16, the last partial) and T=32 (a whole number of blocks),
a sequence without valid tokens, and for the packed layout an empty sequence too.
"""

import pytest
import torch

from logitless.fused_losses import segments, segments_triton
from logitless.kernels import segments as kernels

from testing import assert_close_to_oracle, requires_triton

pytestmark = requires_triton

SUMS = ("segment_sum", "segment_mean", "prefix_sum", "suffix_sum")
PICKS = ("segment_max", "prefix_min", "prefix_min_exclusive")


def _batch(layout, t=37, dtype=torch.float32, seed=0, ties=False):
    """``(x, mask, cu_seqlens)``: padded [5, t] or packed with lengths (t, 0, 9, 16, 1, 23)."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "padded":
        shape = (5, t)
        cu = None
    else:
        lengths = torch.tensor([t, 0, 9, 16, 1, 23])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        shape = (int(lengths.sum()),)
    if ties:  # few distinct values: maxima and prefix minima tie
        x = torch.randint(-2, 3, shape, generator=gen).to(torch.float64)
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    mask = torch.rand(shape, generator=gen) < 0.7
    if layout == "padded":
        mask[2] = False  # a sequence without valid tokens
        mask[0, -1] = True
    else:
        mask[int(cu[3]):int(cu[4])] = False
    return x.to(dtype), mask, cu


def _call(module, op, x, mask, cu):
    if op == "prefix_min_exclusive":
        return module.prefix_min(x, mask, cu, exclusive=True)
    if op == "segment_max":
        return module.segment_max(x, mask, cu, empty=-5.0)
    return getattr(module, op)(x, mask, cu)


def _torch(op, x, mask, cu):
    # The torch twins, forced whatever LOGITLESS_BACKEND says: fp64 never leaves the torch path.
    if x.dtype == torch.float64:
        return _call(segments, op, x, mask, cu)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGITLESS_BACKEND", "torch")
        return _call(segments, op, x, mask, cu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [37, 32], ids=["T37", "T32"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", SUMS)
def test_sums_and_means_against_the_torch_twin(op, layout, t, dtype):
    x, mask, cu = _batch(layout, t, dtype)
    got = _call(segments_triton, op, x, mask, cu)
    assert got.dtype == dtype and got.shape == _torch(op, x, mask, cu).shape
    truth = _torch(op, x.double(), mask, cu)
    same = _torch(op, x, mask, cu)
    # Bound of fp32 summation error on the partial sums, plus (bf16) the rounding of the result:
    # the kernels accumulate in fp32 whatever the input dtype.
    scale = _torch(op, x.double().abs(), mask, cu)
    tol = 1e-6 * scale + (2.0**-8 * truth.abs() if dtype == torch.bfloat16 else 0.0)
    assert_close_to_oracle(got, truth, same, tol, op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", PICKS)
def test_max_and_prefix_min_pick_the_same_element(op, layout, dtype):
    x, mask, cu = _batch(layout, dtype=dtype)
    got = _call(segments_triton, op, x, mask, cu)
    want = _torch(op, x, mask, cu)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)  # +inf where a prefix has no valid token, `empty` for max


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_count(layout):
    _, mask, cu = _batch(layout)
    got = segments_triton.segment_count(mask, cu)
    assert got.dtype == torch.int64
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGITLESS_BACKEND", "torch")
        assert torch.equal(got, segments.segment_count(mask, cu))


def test_packed_broadcast_and_its_gradient():
    x, _, cu = _batch("packed")
    values = torch.randn(cu.numel() - 1, requires_grad=True)
    want_values = values.detach().clone().requires_grad_(True)
    got = segments_triton.broadcast(values, x, cu)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGITLESS_BACKEND", "torch")
        want = segments.broadcast(want_values, x, cu)
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(values.grad, want_values.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", [*SUMS, *PICKS])
def test_gradcheck_fp64(op, layout):
    x, mask, cu = _batch(layout, dtype=torch.float64, seed=1)
    x.requires_grad_(True)

    def f(v):
        y = _call(segments_triton, op, v, mask, cu)
        return torch.where(torch.isinf(y), 0.0, y)  # prefix minima of no token: +inf, no grad

    assert torch.autograd.gradcheck(f, (x,), fast_mode=True)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("op", [*SUMS, *PICKS])
def test_gradients_match_the_torch_twin_with_ties(op, layout):
    # Integer values: maxima tie (amax splits the gradient evenly) and prefix minima tie
    # (cummin sends it to the latest of the tied tokens); sums are exact in fp32.
    x, mask, cu = _batch(layout, ties=True, seed=2)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    got = _call(segments_triton, op, xs[0], mask, cu)
    want = _torch(op, xs[1], mask, cu)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    finite = torch.isfinite(want)  # +inf prefix minima: no token to send a gradient to
    got.backward(torch.where(finite, g, 0))
    want.backward(torch.where(finite, g, 0))
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-6, atol=1e-6)


def test_strided_padded_inputs_and_non_bool_mask():
    x, mask, _ = _batch("padded", t=40)
    x_t = x.t().contiguous().t()[:, 3:]  # column-major slice: strides (1, 5)
    m = mask[:, 3:].to(torch.float32)
    for op in ("segment_sum", "prefix_sum", "suffix_sum", "segment_max", "prefix_min"):
        got = _call(segments_triton, op, x_t, m, None)
        want = _torch(op, x_t.contiguous(), m.bool(), None)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_empty_batches():
    cu = torch.zeros(1, dtype=torch.int64)
    x = torch.zeros(0)
    assert segments_triton.segment_sum(x, x.bool(), cu).shape == (0,)
    assert segments_triton.prefix_sum(x, x.bool(), cu).shape == (0,)
    lengths_zero = torch.zeros(3, dtype=torch.int64)
    cu3 = torch.cat([cu, lengths_zero.cumsum(0)])
    assert torch.equal(segments_triton.segment_max(x, x.bool(), cu3, -1.0), torch.full((3,), -1.0))


def test_bad_inputs_are_refused():
    x, mask, cu = _batch("packed")
    with pytest.raises(ValueError, match="mask"):
        kernels.segment_reduce(x, mask[:-1], cu, "sum")
    with pytest.raises(ValueError, match="packed"):
        kernels.segment_reduce(x[None], mask[None], cu, "sum")
    with pytest.raises(ValueError, match="cu_seqlens"):
        kernels.segment_scan(x, mask, cu.float(), "prefix_sum")
    with pytest.raises(ValueError, match="op"):
        kernels.segment_scan(x, mask, cu, "prefix_max")


def test_dispatch_follows_the_backend_rule(monkeypatch):
    x, mask, _ = _batch("padded")
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
