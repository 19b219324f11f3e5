"""``head_dtype``: an fp32 (or tf32) LM head from 16-bit inputs, on every op that computes
logits. Oracle: `logitless.reference` on the inputs upcast to fp64; the bound is the fp32
reference's own error there (fp32 rounding), the gradients' one bf16/fp16 rounding more, as
they come back in the inputs' dtypes."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logitless
from logitless import reference
from logitless.fused_losses.objectives.config import PolicyLossConfig

from testing import requires_triton, run_on_gloo

BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]
LOW = [torch.bfloat16, torch.float16]
N, D, V = 37, 48, 301
TOL = 2e-5  # fp32 summation order beyond the fp32 reference's own error


def _head(dtype, seed=0, d=D, n=N):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(V, d, generator=g, dtype=torch.float64) * 2 / d**0.5
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[::6] = -100
    return [x.to(dtype) for x in (hidden, weight, bias)], targets


def _finite(x):
    return torch.where(torch.isfinite(x), x, 0.0)


def _check(run, ref, dtype, names, seed=0, d=D, extra=()):
    """``run(h, w, b, head_dtype=...)`` on 16-bit leaves against ``ref(h, w, b)`` on their fp32
    and fp64 upcasts: values (fp32) and the gradients of hidden, weight and bias (the leaves'
    dtype) under random upstream gradients. ``extra``: 16-bit tensors (a teacher head) that
    ``run`` and ``ref`` take after the leaves, upcast alike."""
    leaves, _ = _head(dtype, seed, d)
    leaves = [x.requires_grad_(True) for x in leaves]
    out = run(*leaves, *extra, head_dtype="float32")
    ups = [torch.randn(out[k].shape, dtype=torch.float64) for k in names]
    results = {}
    for cast in (torch.float32, torch.float64):
        ref_leaves = [x.detach().to(cast).requires_grad_(True) for x in leaves]
        got = ref(*ref_leaves, *(x.to(cast) for x in extra))
        loss = sum((_finite(got[k]).double() * u).sum() for k, u in zip(names, ups))
        results[cast] = got, torch.autograd.grad(loss, ref_leaves)
    (r32, g32), (r64, g64) = results[torch.float32], results[torch.float64]
    for k in names:
        assert out[k].dtype == torch.float32, k
        assert torch.equal(torch.isinf(out[k]), torch.isinf(r64[k])), k
        err = (_finite(out[k]).double() - _finite(r64[k])).abs()
        bound = (_finite(r32[k]).double() - _finite(r64[k])).abs() + TOL * (1 + r64[k].abs())
        assert (err <= _finite(bound)).all(), f"{k}: max err {float(err.max()):.3e}"
    loss = sum((_finite(out[k]).double() * u).sum() for k, u in zip(names, ups))
    grads = torch.autograd.grad(loss, leaves)
    eps = torch.finfo(dtype).eps
    for name, g, a, b in zip(("hidden", "weight", "bias"), grads, g32, g64):
        assert g.dtype == dtype, name
        err = (g.double() - b).abs()
        bound = (a.double() - b).abs() + eps * b.abs() + TOL * (1 + b.abs().max())
        assert (err <= bound).all(), f"d_{name}: max err {float(err.max()):.3e}"


def _lp(**kw):
    """linear_logprobs's outputs as a dict, op and reference alike."""
    def run(h, w, b, head_dtype=None, *, fn):
        extra = {} if head_dtype is None else {"head_dtype": head_dtype}
        out = fn(h, w, kw["targets"], bias=b, **extra,
                 **{k: v for k, v in kw.items() if k != "targets"})
        return {k: v for k, v in vars(out).items() if v is not None}
    return (lambda *a, **k: run(*a, **k, fn=logitless.linear_logprobs),
            lambda *a: run(*a, fn=reference.linear_logprobs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LOW)
def test_linear_logprobs_fp32_head(backend, dtype, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    _, targets = _head(dtype)
    run, ref = _lp(targets=targets, temperature=0.7, return_entropy=True,
                   stats=("lse", "sum_p_sq"))
    _check(run, ref, dtype, ("logprobs", "entropy", "lse", "sum_p_sq"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_logprobs_fp32_head(backend, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    _, targets = _head(torch.bfloat16, seed=1)
    run, ref = _lp(targets=targets, top_k=40, top_p=0.9, return_entropy=True)
    _check(run, ref, torch.bfloat16, ("logprobs", "entropy"), seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_ids_and_ids_fp32_head(backend, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    _, targets = _head(torch.float16, seed=2)
    kept = (targets.clamp_min(0)[:, None] + 31 * torch.arange(9)) % V  # distinct per token
    kept[::4, -2:] = -1
    run, ref = _lp(targets=targets, kept_ids=kept, return_entropy=True, stats=("log_kept_mass",))
    _check(run, ref, torch.float16, ("logprobs", "entropy", "log_kept_mass"), seed=2)
    run, ref = _lp(targets=targets, ids=kept, stats=("lse",))
    _check(run, ref, torch.float16, ("logprobs", "id_logprobs", "lse"), seed=2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LOW)
def test_fused_policy_loss_fp32_head(backend, dtype, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    _, targets = _head(dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(N, generator=g, dtype=torch.float64) * 6
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = (torch.rand(N, generator=g) > 0.2).double()
    cfg = PolicyLossConfig()
    shape = (1, N)

    def run(h, w, b, head_dtype=None, fn=logitless.fused_policy_loss):
        extra = {} if head_dtype is None else {"head_dtype": head_dtype}
        got = fn(h.reshape(*shape, -1), w, targets.reshape(shape), old.reshape(shape).float(),
                 adv.reshape(shape).float(),
                 mask.reshape(shape), cfg, bias=b, **extra)
        return {"loss": (got[0] if isinstance(got, tuple) else got).reshape(1)}

    def ref(h, w, b):
        return {"loss": reference.fused_policy_loss(
            h.reshape(*shape, -1), w, targets.reshape(shape), old.reshape(shape).to(h.dtype),
            adv.reshape(shape).to(h.dtype), mask.reshape(shape).to(h.dtype), cfg,
            bias=b).reshape(1)}

    _check(run, ref, dtype, ("loss",), seed=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_divergence_fp32_head(backend, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    (t_h, t_w, t_b), _ = _head(torch.bfloat16, seed=7, d=40)
    mask = torch.arange(N) % 5 != 0

    def run(h, w, b, th, tw, tb, head_dtype=None, fn=logitless.linear_divergence):
        extra = {} if head_dtype is None else {"head_dtype": head_dtype}
        out = fn(h, w, th, tw, mask, beta=0.3, temperature=0.9, bias=b, teacher_bias=tb,
                 **extra)
        return {"divergence": out.divergence}

    _check(run, lambda *a: run(*a, fn=reference.linear_divergence), torch.bfloat16,
           ("divergence",), seed=6, extra=(t_h, t_w, t_b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_topk_distill_fp32_head(backend, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, V, (N, 5), generator=g)
    t_lp = torch.log_softmax(torch.randn(N, 5, generator=g), -1) - 0.5
    mask = torch.arange(N) % 4 != 0

    def run(h, w, b, head_dtype=None, fn=logitless.linear_topk_distill):
        extra = {} if head_dtype is None else {"head_dtype": head_dtype}
        return {"loss": fn(h, w, ids, t_lp, mask, temperature=1.1, bias=b, **extra)}

    _check(run, lambda *a: run(*a, fn=reference.linear_topk_distill), torch.bfloat16,
           ("loss",), seed=8)
    (t_h, t_w, t_b), _ = _head(torch.bfloat16, seed=9, d=40)

    def reverse(h, w, b, th, tw, tb, head_dtype=None, fn=logitless.linear_topk_distill):
        extra = {} if head_dtype is None else {"head_dtype": head_dtype}
        return {"loss": fn(h, w, mask=mask, direction="reverse", k=7, teacher_hidden=th,
                           teacher_weight=tw, teacher_bias=tb, bias=b, **extra)}

    _check(reverse, lambda *a: reverse(*a, fn=reference.linear_topk_distill), torch.bfloat16,
           ("loss",), seed=10, extra=(t_h, t_w, t_b))


def test_head_dtype_refused():
    (h, w, _), t = _head(torch.bfloat16)
    for bad in ("fp32", torch.float32, "bfloat16", 32):
        with pytest.raises(ValueError, match="head_dtype"):
            logitless.linear_logprobs(h, w, t, head_dtype=bad)
        with pytest.raises(ValueError, match="head_dtype"):
            logitless.linear_divergence(h, w, h, w, head_dtype=bad)
        with pytest.raises(ValueError, match="head_dtype"):
            logitless.linear_topk_distill(h, w, t.clamp_min(0)[:, None],
                                          torch.zeros(N, 1), head_dtype=bad)
        with pytest.raises(ValueError, match="head_dtype"):
            logitless.fused_policy_loss(h[None], w, t[None], torch.zeros(1, N),
                                        torch.zeros(1, N), torch.ones(1, N),
                                        PolicyLossConfig(), head_dtype=bad)


# --- the precision reaches every GEMM ---------------------------------------------------

_GEMMS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)


class _Precisions(TorchDispatchMode):
    """Records torch's fp32 matmul precision at each GEMM, inside logitless's custom ops too
    (their implementations run under the mode)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "logitless":
            op = torch._library.custom_ops._maybe_get_opdef(func)
            with self:
                return op._init_fn(*args, **kwargs)
        if func.overloadpacket in _GEMMS:
            self.seen.append(torch.get_float32_matmul_precision())
        return func(*args, **kwargs)


# The GEMM-precision test's rows: a few, as which GEMMs run and under which precision does not
# depend on them (one chunk and one row granule at N=37 as at 7); the interpreted sampler and
# head passes take a program per row.
TF32_N = 7


def _calls():
    """``name -> f(h, w, b, head_dtype)`` returning a scalar to differentiate: every op."""
    (t_h, t_w, t_b), targets = _head(torch.bfloat16, seed=11, d=40, n=TF32_N)
    ids = (targets.clamp_min(0)[:, None] + 17 * torch.arange(4)) % V
    lp = logitless.linear_logprobs

    def fused(h, w, b, hd, strategy, exact=False):
        ref = dict(ref_hidden=t_h[None], ref_weight=t_w, ref_bias=t_b) if exact else {}
        cfg = PolicyLossConfig(kl_estimator="exact", beta=0.1) if exact else PolicyLossConfig()
        return logitless.fused_policy_loss(
            h[None], w, targets[None], torch.full((1, TF32_N), -3.0), torch.randn(1, TF32_N),
            torch.ones(1, TF32_N), cfg, bias=b, strategy=strategy, head_dtype=hd, **ref)[0]

    return {
        "plain": lambda h, w, b, hd: lp(h, w, targets, bias=b, head_dtype=hd,
                                        return_entropy=True).entropy.sum(),
        "gathered": lambda h, w, b, hd: lp(h, w, targets, bias=b, head_dtype=hd,
                                           gather_weight=contextlib.nullcontext).logprobs.sum(),
        "sampled": lambda h, w, b, hd: _finite(lp(h, w, targets, bias=b, head_dtype=hd,
                                                  top_k=30).logprobs).sum(),
        "kept_ids": lambda h, w, b, hd: _finite(lp(h, w, targets, bias=b, head_dtype=hd,
                                                   kept_ids=ids).logprobs).sum(),
        "ids": lambda h, w, b, hd: _finite(lp(h, w, targets, bias=b, head_dtype=hd,
                                              ids=ids).id_logprobs).sum(),
        "fused_chunked": lambda h, w, b, hd: fused(h, w, b, hd, "chunked"),
        "fused_streaming": lambda h, w, b, hd: fused(h, w, b, hd, "streaming"),
        "fused_exact_kl_chunked": lambda h, w, b, hd: fused(h, w, b, hd, "chunked", True),
        "fused_exact_kl_streaming": lambda h, w, b, hd: fused(h, w, b, hd, "streaming", True),
        "divergence": lambda h, w, b, hd: logitless.linear_divergence(
            h, w, t_h, t_w, bias=b, teacher_bias=t_b, head_dtype=hd).divergence.sum(),
        "topk_distill": lambda h, w, b, hd: logitless.linear_topk_distill(
            h, w, ids, torch.full((TF32_N, 4), -1.5), bias=b, head_dtype=hd).sum(),
        "topk_reverse": lambda h, w, b, hd: logitless.linear_topk_distill(
            h, w, direction="reverse", k=5, teacher_hidden=t_h, teacher_weight=t_w,
            teacher_bias=t_b, bias=b, head_dtype=hd).sum(),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(_calls()))
def test_tf32_reaches_every_gemm(name, backend, monkeypatch):
    """With ``head_dtype="tf32"`` every GEMM of the forward and of the backward runs under
    fp32 matmul precision "high"; the caller's setting is back after each; with "float32"
    none does."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    call = _calls()[name]
    before = torch.get_float32_matmul_precision()
    for head_dtype, want in (("tf32", "high"), ("float32", before)):
        (h, w, b), _ = _head(torch.bfloat16, seed=13, n=TF32_N)
        leaves = [x.requires_grad_(True) for x in (h, w, b)]
        forward, backward = _Precisions(), _Precisions()
        with forward:
            loss = call(*leaves, head_dtype)
        assert torch.get_float32_matmul_precision() == before
        with backward:
            loss.backward()
        assert torch.get_float32_matmul_precision() == before
        assert forward.seen, "no GEMM seen in the forward"
        assert set(forward.seen) == {want}, (head_dtype, forward.seen)
        assert set(backward.seen) <= {want}, (head_dtype, backward.seen)
        if "chunked" not in name:  # the chunked loss computes its gradients
            assert backward.seen, "no GEMM seen in the backward"  # in its forward
        assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in leaves)


def _vocab_parallel_rank(rank, world):
    """Each rank's slice of a bf16 head with head_dtype="float32" (and "tf32", fp32 on CPU):
    the whole head's fp32 results, each rank its slice's weight gradient, every GEMM of a
    "tf32" call under precision "high"."""
    import torch.distributed as dist

    (hidden, weight, bias), targets = _head(torch.bfloat16, seed=14)
    lo, hi = (0, 120) if rank == 0 else (120, V)
    up = torch.randn(2, N, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    full = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    want = logitless.linear_logprobs(*full[:2], targets, bias=full[2], return_entropy=True,
                                     head_dtype="float32")
    (want.logprobs.double() * up[0] + want.entropy.double() * up[1]).sum().backward()
    for head_dtype in ("float32", "tf32"):
        h = hidden.clone().requires_grad_(True)
        w = weight[lo:hi].clone().requires_grad_(True)
        b = bias[lo:hi].clone().requires_grad_(True)
        seen = _Precisions()
        with seen:
            got = logitless.linear_logprobs(h, w, targets, bias=b, return_entropy=True,
                                            vocab_parallel=dist.group.WORLD,
                                            head_dtype=head_dtype)
            (got.logprobs.double() * up[0] + got.entropy.double() * up[1]).sum().backward()
        assert seen.seen and set(seen.seen) == {"high" if head_dtype == "tf32" else "highest"}
        assert got.logprobs.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
        for g, ref in ((h.grad, full[0].grad), (w.grad, full[1].grad[lo:hi]),
                       (b.grad, full[2].grad[lo:hi])):  # one bf16 rounding apart at most
            torch.testing.assert_close(g.float(), ref.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.dist  # gloo ranks, as every multi-process test: make test-dist
def test_vocab_parallel_fp32_head():
    run_on_gloo(2, _vocab_parallel_rank)
