"""`mtp_draft_loss`: the soft cross-entropy of a draft (MTP) head against the detached main
head, whole-vocabulary or against the main head's top-k renormalised, against the fp64
formula on materialised logits (`reference.mtp_draft_loss`): values and the gradients of the
draft's hidden, weight and bias, the main head's lack of any, one shared head or two, masks,
both backends for the streamed passes, gradcheck and the input contract (issue 38)."""

import pytest
import torch

import logitless
from logitless import reference

from testing import requires_triton

N, D, D_MAIN, V = 37, 48, 40, 1007
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


def _inputs(seed, n=N, d=D, d_main=D_MAIN, v=V, batch=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shape = (n,) if batch is None else (batch, n)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g)
    out = dict(hidden=r(*shape, d), weight=r(v, d) * 2 / d**0.5, bias=r(v) * 0.5,
               main_hidden=r(*shape, d_main), main_weight=r(v, d_main) * 2 / d_main**0.5,
               main_bias=r(v) * 0.5, mask=torch.rand(*shape, generator=g) < 0.8)
    return {k: (t if t.dtype == torch.bool else t.to(dtype)) for k, t in out.items()}


def _leaves(x):
    return [x[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]


def _call(fn, x, leaves, shared, **kw):
    h, w, b = leaves
    main = {} if shared else dict(main_weight=x["main_weight"], main_bias=x["main_bias"])
    main_hidden = x["main_hidden"][..., :D] if shared else x["main_hidden"]
    if shared and main_hidden.shape[-1] != D:  # the shared head needs the draft's D
        main_hidden = torch.nn.functional.pad(main_hidden, (0, D - main_hidden.shape[-1]))
    return fn(h, w, main_hidden, x["mask"], bias=b, **main, **kw)


@pytest.mark.parametrize("top_k", [None, 7])
@pytest.mark.parametrize("shared", [False, True], ids=["two-heads", "shared-head"])
def test_matches_the_fp64_formula(top_k, shared):
    x = _inputs(1, batch=2)
    for k in ("main_hidden", "main_weight", "main_bias"):
        x[k].requires_grad_(True)
    ours_leaves, ref_leaves = _leaves(x), _leaves(x)
    kw = dict(top_k=top_k, temperature=0.8)
    ours = _call(logitless.mtp_draft_loss, x, ours_leaves, shared, max_tile_bytes=48 * 1024,
                 **kw)
    want = _call(reference.mtp_draft_loss, x, ref_leaves, shared, **kw)
    assert ours.shape == (2, N) and bool((ours[~x["mask"]] == 0).all())
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
    up = torch.randn(2, N, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for name, g, r in zip(("hidden", "weight", "bias"),
                          torch.autograd.grad((ours * up).sum(), ours_leaves),
                          torch.autograd.grad((want * up).sum(), ref_leaves)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=name)
    assert all(x[k].grad is None for k in ("main_hidden", "main_weight", "main_bias"))


def test_the_whole_vocabulary_is_skyrls_soft_cross_entropy():
    """The formula SkyRL's ``draft_soft_ce`` takes per token, on the materialised logits:
    ``-sum softmax(main) * log_softmax(draft)``, and the value is the forward KL plus the main
    head's entropy (not the KL alone)."""
    x = _inputs(3)
    ours = _call(logitless.mtp_draft_loss, x, _leaves(x), shared=False)
    zs = reference.linear_logits(x["hidden"], x["weight"], x["bias"])
    zm = reference.linear_logits(x["main_hidden"], x["main_weight"], x["main_bias"])
    ce = -(torch.softmax(zm, -1) * torch.log_softmax(zs, -1)).sum(-1)
    torch.testing.assert_close(ours, torch.where(x["mask"], ce, 0.0), rtol=1e-10, atol=1e-12)
    kl = logitless.linear_divergence(x["hidden"], x["weight"], x["main_hidden"],
                                     x["main_weight"], x["mask"], beta=0.0, bias=x["bias"],
                                     teacher_bias=x["main_bias"]).divergence
    assert bool((ours - kl)[x["mask"]].gt(0.1).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", [None, 5])
def test_fp32_on_either_backend(backend, top_k, monkeypatch):
    """fp32 through the backend's streamed passes (the divergence and the entropy, or the
    draft head's lse) against the fp64 formula."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    x = _inputs(4, n=13, v=257, dtype=torch.float32)
    leaves = _leaves(x)
    ours = _call(logitless.mtp_draft_loss, x, leaves, shared=False, top_k=top_k,
                 temperature=0.7)
    assert ours.dtype == torch.float32
    x64 = {k: (t if t.dtype == torch.bool else t.double()) for k, t in x.items()}
    ref_leaves = _leaves(x64)
    want = _call(reference.mtp_draft_loss, x64, ref_leaves, shared=False, top_k=top_k,
                 temperature=0.7)
    torch.testing.assert_close(ours.double(), want, rtol=2e-5, atol=2e-5)
    for name, g, r in zip(("hidden", "weight", "bias"), torch.autograd.grad(ours.sum(), leaves),
                          torch.autograd.grad(want.sum(), ref_leaves)):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), r, rtol=0, atol=2e-5 * float(r.abs().max()),
                                   msg=name)


@pytest.mark.parametrize("top_k", [None, 4])
def test_gradcheck_tiny(top_k):
    x = _inputs(5, n=4, d=5, d_main=3, v=13)

    def fn(h, w, b):
        return logitless.mtp_draft_loss(h, w, x["main_hidden"], x["mask"], bias=b,
                                        main_weight=x["main_weight"],
                                        main_bias=x["main_bias"], top_k=top_k,
                                        temperature=0.9)

    torch.autograd.gradcheck(fn, _leaves(x))


def _bad(**change):
    x = _inputs(6, dtype=torch.float32)
    kw = dict(hidden=x["hidden"], weight=x["weight"], main_hidden=x["main_hidden"],
              mask=x["mask"], bias=x["bias"], main_weight=x["main_weight"],
              main_bias=x["main_bias"])
    kw.update(change)
    return kw


@pytest.mark.parametrize(("change", "match"), [
    (dict(main_weight=None), "main_bias needs main_weight"),
    (dict(top_k=0), r"top_k must be None or an integer in \[1, V\]"),
    (dict(top_k=V + 1), r"top_k must be None or an integer in \[1, V\]"),
    (dict(top_k=True), r"top_k must be None or an integer in \[1, V\]"),
    (dict(main_hidden=torch.randn(N - 1, D_MAIN)), "main_hidden must have hidden's token"),
    (dict(main_weight=torch.randn(V - 1, D_MAIN), main_bias=None),
     "main_weight must have the draft head's vocabulary"),
    (dict(main_weight=torch.randn(V, D_MAIN + 1)), "main_weight must be a 2-D tensor"),
    (dict(mask=torch.full((N,), 0.5)), "mask must be bool or hold 0 and 1"),
    (dict(temperature=0.0), "temperature"),
])
def test_bad_input_raises_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        logitless.mtp_draft_loss(**_bad(**change))
