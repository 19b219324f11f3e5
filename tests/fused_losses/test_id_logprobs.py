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


def _rounded_logits(hidden, weight, bias, dtype):
    """The plain path's logits of 16-bit inputs: ``h . W + b`` of the inputs in ``dtype``,
    exact in fp64, rounded once to ``dtype`` (the GEMM's output), as fp64."""
    low = [x.to(dtype).double() for x in (hidden, weight, bias)]
    return reference.linear_logits(*low).to(dtype).double()


@pytest.mark.parametrize("per_token", [False, True], ids=["number", "fp32-tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_take_the_temperature_as_given(dtype, per_token):
    """The gathered logits are the plain path's (``h . W + b`` rounded to the 16-bit dtype,
    as its GEMM rounds them), then divided in fp32 by the temperature as given (0.7 is no
    bf16 number): ``id_logprobs + lse`` equals those logits to fp32 rounding."""
    hidden, weight, bias, targets, ids = _inputs(6)
    low = [x.to(dtype) for x in (hidden, weight, bias)]
    temperature = 0.7
    if per_token:
        temperature = torch.rand(N, generator=torch.Generator().manual_seed(6)) * 0.4 + 0.55
    out = logitless.linear_logprobs(low[0], low[1], targets, bias=low[2], ids=ids,
                                    temperature=temperature, stats=("lse",))
    t = temperature.double().unsqueeze(-1) if per_token else temperature
    z = (_rounded_logits(*low, dtype) / t).gather(-1, ids.clamp_min(0))
    live = _live(targets, ids)
    got = (out.id_logprobs + out.lse.unsqueeze(-1)).double()
    torch.testing.assert_close(got[live], z[live], rtol=1e-5, atol=1e-5)


def test_autocast_gives_fp32_gathered_logits():
    """Under ``torch.autocast`` the head runs in bf16 (hidden, weight and bias cast to it,
    the logits rounded to it as the plain path's GEMM does), the gathered logits fp32 from
    there, the gradients in each leaf's dtype."""
    hidden, weight, bias, targets, ids = _inputs(7)
    leaves = _leaves(hidden.float(), weight.float(), bias.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = logitless.linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], ids=ids,
                                        temperature=0.7, stats=("lse",))
    assert out.id_logprobs.dtype == torch.float32
    z = _rounded_logits(*(x.detach() for x in leaves), torch.bfloat16) / 0.7
    live = _live(targets, ids)
    got = (out.id_logprobs + out.lse.unsqueeze(-1)).double()
    torch.testing.assert_close(got[live], z.gather(-1, ids.clamp_min(0))[live], rtol=1e-5,
                               atol=1e-5)
    grads = torch.autograd.grad(_loss(out.id_logprobs, live, 8), leaves)
    assert all(g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["bfloat16", "float16", "autocast"])
def test_16_bit_id_logprobs_are_normalised_by_the_plain_lse(backend, mode, monkeypatch):
    """For 16-bit inputs (and under autocast, fp32 weights) the plain path's ``lse`` is that
    of logits rounded to 16 bits, so the gathered logits must be the same ones: at every id
    of the vocabulary the probabilities sum to 1, the id of the target reads the plain
    ``logprobs``, and no logprob is above 0. Fp32 logits against that lse read sums off by
    up to 2e-2 here (1.06 and top-1 logprobs of +0.06 for logits near 30, bf16 steps of
    0.125)."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    n, d, v = 13, 64, 257
    g = torch.Generator().manual_seed(21)
    # Multiples of 1/4 and 1/128, exact in 16 bits, whose fp32 dot products are exact in any
    # order: the GEMM's one rounding to 16 bits is then the same whatever its kernel. Logits
    # up to about 7, most of them not bf16 numbers.
    hidden = torch.randint(-12, 13, (n, d), generator=g).float() / 4
    weight = torch.randint(-32, 33, (v, d), generator=g).float() / 128
    bias = torch.randint(-64, 65, (v,), generator=g).float() / 128
    ids = torch.arange(v).expand(n, v).contiguous()
    targets = reference.linear_logits(hidden.double(), weight.double(), bias.double()).argmax(-1)
    if mode == "autocast":
        ctx, leaves = torch.autocast("cpu", dtype=torch.bfloat16), (hidden, weight, bias)
    else:
        dtype = getattr(torch, mode)
        ctx = torch.autocast("cpu", enabled=False)
        leaves = (hidden.to(dtype), weight, bias.to(dtype))  # an fp32 weight is cast
    with ctx:
        out = logitless.linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], ids=ids)
    total = out.id_logprobs.double().exp().sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.id_logprobs.gather(-1, targets[:, None])[:, 0],
                               out.logprobs, rtol=0, atol=1e-5)
    assert float(out.id_logprobs.max()) <= 0.0


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
