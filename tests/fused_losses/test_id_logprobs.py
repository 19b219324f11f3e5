"""`linear_logprobs(ids=...)`: full-vocabulary logprobs at K given ids per token (a teacher's
top-k, the rollout's top-k, soft labels' ids) from a gather of their rows and the plain path's
lse, against the fp64 formula on the materialised logits: values and the gradients of hidden,
weight and bias, both backends for the lse pass, padding, ignored rows, repeats, autocast,
16-bit inputs, ``gather_weight`` and the input contract (issue 38)."""

import pytest
import torch

import logitless
from logitless import reference

from testing import PartitionedHead, requires_triton

N, D, V, K = 37, 64, 1007, 9
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


def _inputs(seed, dtype=torch.float64, n=N, d=D, v=V, k=K):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5 * 2
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    ids = torch.randint(0, v, (n, k), generator=g)
    if n > 5:
        targets[5] = -100
        ids[3, 1:4] = -1  # padding
        ids[4, 2] = ids[4, 0]  # a repeated id
    return (*(x.to(dtype) for x in (hidden, weight, bias)), targets, ids)


def _oracle(hidden, weight, bias, targets, ids, temperature=1.0, softcap=None, logit_scale=1.0):
    """``log_softmax(z)`` at ``ids`` on the materialised fp64 logits (padding and ignored rows
    read garbage here: the caller masks them), and the entropy."""
    z = reference.linear_logits(hidden, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    logp = torch.log_softmax(z * logit_scale / t, dim=-1)
    return logp.gather(-1, ids.clamp_min(0)), -(logp.exp() * logp).sum(-1)


def _live(targets, ids):
    return (ids >= 0) & (targets != -100).unsqueeze(-1)


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def _loss(lp, live, seed):
    up = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed),
                     dtype=torch.float64)
    return (torch.where(live, lp.double(), 0.0) * up).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", [
    dict(),
    dict(temperature=0.7, softcap=4.0),
    dict(logit_scale=0.5, temperature="per-token"),
], ids=["plain", "softcap", "per-token-temperature"])
def test_matches_the_fp64_formula(backend, opts, monkeypatch):
    """fp32 on either backend for the lse pass against the fp64 formula: values, and the
    gradients of hidden, weight and bias through ``id_logprobs`` and the other outputs."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, bias, targets, ids = _inputs(1)
    opts = dict(opts)
    if opts.get("temperature") == "per-token":
        opts["temperature"] = torch.rand(N, dtype=torch.float64) + 0.5
    ours_opts = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    leaves = _leaves(hidden.float(), weight.float(), bias.float())
    out = logitless.linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], ids=ids,
                                    return_entropy=True, **ours_opts)
    ref_leaves = _leaves(hidden, weight, bias)
    want, ent = _oracle(*ref_leaves, targets, ids, **opts)
    live = _live(targets, ids)
    assert out.id_logprobs.shape == (N, K) and out.id_logprobs.dtype == torch.float32
    assert out.lse is None
    torch.testing.assert_close(out.id_logprobs.double()[live], want[live], rtol=2e-5,
                               atol=2e-5)
    assert bool(torch.isneginf(out.id_logprobs[ids < 0][:3]).all())
    assert bool((out.id_logprobs[5] == 0).all())
    assert out.id_logprobs[4, 2] == out.id_logprobs[4, 0]
    keep = targets != -100
    loss = _loss(out.id_logprobs, live, 2) + (out.entropy.double()[keep] * 0.3).sum()
    ref_loss = _loss(want, live, 2) + (ent[keep] * 0.3).sum()
    for name, g, r in zip(("hidden", "weight", "bias"), torch.autograd.grad(loss, leaves),
                          torch.autograd.grad(ref_loss, ref_leaves)):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), r, rtol=0, atol=2e-5 * float(r.abs().max()),
                                   msg=name)


def test_fp64_matches_to_rounding():
    hidden, weight, bias, targets, ids = _inputs(3)
    leaves = _leaves(hidden, weight, bias)
    out = logitless.linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], ids=ids,
                                    temperature=0.8, softcap=5.0, stats=("lse",),
                                    max_tile_bytes=5 * K * D * 8 * 3)  # chunks of 5 rows
    ref_leaves = _leaves(hidden, weight, bias)
    want = _oracle(*ref_leaves, targets, ids, temperature=0.8, softcap=5.0)[0]
    live = _live(targets, ids)
    torch.testing.assert_close(out.id_logprobs[live], want[live], rtol=1e-12, atol=1e-12)
    assert out.lse is not None
    for g, r in zip(torch.autograd.grad(_loss(out.id_logprobs, live, 4), leaves),
                    torch.autograd.grad(_loss(want, live, 4), ref_leaves)):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_gradcheck_tiny():
    hidden, weight, bias, targets, ids = _inputs(5, n=4, d=6, v=13, k=3)
    ids[1, 2] = -1
    targets[2] = -100

    def fn(h, w, b):
        out = logitless.linear_logprobs(h, w, targets, bias=b, ids=ids, softcap=3.0,
                                        temperature=0.9, return_entropy=True)
        return torch.where(ids >= 0, out.id_logprobs, 0.0), out.logprobs, out.entropy

    torch.autograd.gradcheck(fn, _leaves(hidden, weight, bias))


@pytest.mark.parametrize("per_token", [False, True], ids=["number", "fp32-tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_take_the_temperature_as_given(dtype, per_token):
    """The gathered logits are fp32 at the temperature as given (0.7 is no bf16 number):
    ``id_logprobs + lse`` equals the fp64 tempered logits of the same rounded inputs to fp32
    rounding (the lse pass is the plain path's, whose own accuracy its tests cover)."""
    hidden, weight, bias, targets, ids = _inputs(6)
    low = [x.to(dtype) for x in (hidden, weight, bias)]
    temperature = 0.7
    if per_token:
        temperature = torch.rand(N, generator=torch.Generator().manual_seed(6)) * 0.4 + 0.55
    out = logitless.linear_logprobs(low[0], low[1], targets, bias=low[2], ids=ids,
                                    temperature=temperature, stats=("lse",))
    t = temperature.double().unsqueeze(-1) if per_token else temperature
    z = (reference.linear_logits(*(x.double() for x in low)) / t).gather(-1, ids.clamp_min(0))
    live = _live(targets, ids)
    got = (out.id_logprobs + out.lse.unsqueeze(-1)).double()
    torch.testing.assert_close(got[live], z[live], rtol=1e-5, atol=1e-5)


def test_autocast_gives_fp32_gathered_logits():
    """Under ``torch.autocast`` the head runs in bf16 (hidden rounded to it) and the gathered
    logits stay fp32, the gradients in each leaf's dtype."""
    hidden, weight, bias, targets, ids = _inputs(7)
    leaves = _leaves(hidden.float(), weight.float(), bias.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = logitless.linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], ids=ids,
                                        temperature=0.7, stats=("lse",))
    assert out.id_logprobs.dtype == torch.float32
    z = (reference.linear_logits(leaves[0].detach().bfloat16().double(),
                                 weight.float().double(), bias.float().double()) / 0.7)
    live = _live(targets, ids)
    got = (out.id_logprobs + out.lse.unsqueeze(-1)).double()
    torch.testing.assert_close(got[live], z.gather(-1, ids.clamp_min(0))[live], rtol=1e-5,
                               atol=1e-5)
    grads = torch.autograd.grad(_loss(out.id_logprobs, live, 8), leaves)
    assert all(g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in grads)


def test_gather_weight_is_entered_by_the_backward():
    """``gather_weight`` (ZeRO-3): both backward passes (the lse pass and the gathered rows)
    enter it before they read the weight, which holds NaN outside it."""
    hidden, weight, bias, targets, ids = _inputs(9)
    head = PartitionedHead(weight, bias)
    h = hidden.clone().requires_grad_()
    with head.gather():
        out = logitless.linear_logprobs(h, head.weight, targets, bias=head.bias, ids=ids,
                                        temperature=0.9, gather_weight=head.gather)
    head.phase = "backward"
    live = _live(targets, ids)
    grads = torch.autograd.grad(_loss(out.id_logprobs, live, 10), (h, head.weight, head.bias))
    assert head.entries == ["forward", "backward", "backward"]
    ref_leaves = _leaves(hidden, weight, bias)
    want = _oracle(*ref_leaves, targets, ids, temperature=0.9)[0]
    torch.testing.assert_close(out.id_logprobs[live], want[live], rtol=1e-10, atol=1e-10)
    for g, r in zip(grads, torch.autograd.grad(_loss(want, live, 10), ref_leaves)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(("change", "match"), [
    (lambda ids: dict(ids=ids.int()), "ids must be an int64 tensor"),
    (lambda ids: dict(ids=ids.tolist()), "ids must be an int64 tensor"),
    (lambda ids: dict(ids=ids[:-1]), r"ids must have shape \[\*targets.shape, K\]"),
    (lambda ids: dict(ids=ids[:, :0]), "K >= 1"),
    (lambda ids: dict(ids=torch.where(ids == ids[0, 0], V, ids)), r"ids must be .*\[0, 1007\)"),
    (lambda ids: dict(ids=torch.where(ids == ids[0, 0], -2, ids)), r"ids must be .*\[0, 1007\)"),
    (lambda ids: dict(ids=ids, top_k=5), r"without \['top_k'\]"),
    (lambda ids: dict(ids=ids, kept_ids=ids), r"without \['kept_ids'\]"),
    (lambda ids: dict(ids=ids, vocab_parallel=object()), "ids is unsupported with vocab_parallel"),
    (lambda ids: dict(ids=ids, temperature=torch.rand(N - 1) + 0.5), "temperature as a tensor"),
    (lambda ids: dict(ids=ids, max_tile_bytes=0), "max_tile_bytes"),
])
def test_bad_input_raises_value_error(change, match):
    hidden, weight, bias, targets, ids = _inputs(11, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        logitless.linear_logprobs(hidden, weight, targets, bias=bias, **change(ids))


def test_a_batched_token_shape():
    """``[B, T]`` targets and ``[B, T, K]`` ids: the same numbers as the flattened call."""
    hidden, weight, bias, targets, ids = _inputs(12, n=36)
    flat = logitless.linear_logprobs(hidden, weight, targets, bias=bias, ids=ids)
    out = logitless.linear_logprobs(hidden.view(4, 9, D), weight, targets.view(4, 9), bias=bias,
                                    ids=ids.view(4, 9, K))
    assert out.id_logprobs.shape == (4, 9, K)
    torch.testing.assert_close(out.id_logprobs.reshape(36, K), flat.id_logprobs, rtol=0, atol=0)
