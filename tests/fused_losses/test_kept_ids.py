"""`linear_logprobs(kept_ids=...)`: logprobs renormalised over a recorded kept set, against the
fp64 reference on the full logits; values, entropy, log_kept_mass and the gradients of hidden,
weight and bias; sets of different sizes per token; the input contract (issue 25)."""

import pytest
import torch

import logitless
from logitless import reference

N, D, V, K = 37, 96, 1007, 23


def _inputs(seed, dtype=torch.float64, n=N, k=K, v=V, inside=0.7):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=g, dtype=torch.float64)
    weight = torch.randn(v, D, generator=g, dtype=torch.float64) / D**0.5 * 2
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    # distinct ids per token, a random number of them, the rest -1
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    sizes = torch.randint(1, k + 1, (n,), generator=g)
    sizes[0], sizes[1] = 1, k  # one token keeps a single id, one the full K
    ids = torch.where(torch.arange(k)[None, :] < sizes[:, None], ids, -1)
    # most targets inside their set, at a random kept position
    put = torch.rand(n, generator=g) < inside
    pos = (torch.rand(n, generator=g) * sizes).long()
    targets = torch.where(put, ids[torch.arange(n), pos], targets)
    # shuffle the padding in between the ids: order must not matter
    perm = torch.argsort(torch.rand(n, k, generator=g), dim=-1)
    ids = ids.gather(-1, perm)
    if n > 5:
        targets[5] = -100
    cast = (lambda x: x.to(dtype))
    return cast(hidden), cast(weight), cast(bias), targets, ids


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def _grads(out, leaves, targets, seed):
    g = torch.Generator().manual_seed(seed)
    live = torch.isfinite(out["logprobs"]) & (targets != -100)
    up = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in out.items()}
    loss = sum((torch.where(live, out[k].double(), 0.0) * up[k]).sum() for k in out)
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("opts", [
    dict(),
    dict(temperature=0.7, softcap=4.0),
    dict(logit_scale=0.5, temperature="per-token"),
], ids=["plain", "softcap", "per-token-temperature"])
@pytest.mark.parametrize("budget", [None, 3 * K * D * 8 * 4])  # one chunk; chunks of 4 rows
def test_matches_the_fp64_reference(opts, budget):
    hidden, weight, bias, targets, ids = _inputs(1)
    opts = dict(opts)
    if opts.get("temperature") == "per-token":
        opts["temperature"] = torch.rand(N, dtype=torch.float64) + 0.5
    h1, w1, b1 = _leaves(hidden, weight, bias)
    ours = logitless.linear_logprobs(h1, w1, targets, bias=b1, kept_ids=ids,
                                     return_entropy=True, stats=("log_kept_mass",),
                                     max_tile_bytes=budget, **opts)
    h2, w2, b2 = _leaves(hidden, weight, bias)
    want = _oracle(h2, w2, targets, b2, kept_ids=ids, **opts)
    assert torch.isinf(want["logprobs"]).any() and torch.isfinite(want["logprobs"]).any()
    got = {"logprobs": ours.logprobs, "entropy": ours.entropy,
           "log_kept_mass": ours.log_kept_mass}
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-10, msg=key)
    for a, b in zip(_grads(got, (h1, w1, b1), targets, 2),
                    _grads(want, (h2, w2, b2), targets, 2)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_the_whole_vllm_kept_set_gives_the_sampler_path_numbers():
    """The set vLLM keeps for top-k/top-p, passed as ids, gives what the settings give."""
    hidden, weight, bias, targets, _ = _inputs(3)
    settings = dict(temperature=0.8, top_k=40, top_p=0.9)
    keep = reference.sampler_kept_mask(reference.linear_logits(hidden, weight, bias) / 0.8,
                                       top_k=40, top_p=0.9)
    k = int(keep.sum(-1).max())
    ids = torch.where(keep, torch.arange(V).expand(N, V), V).sort(-1).values[:, :k]
    ids = torch.where(ids == V, -1, ids)
    by_ids = logitless.linear_logprobs(hidden, weight, targets, bias=bias, kept_ids=ids,
                                       temperature=0.8, return_entropy=True)
    by_settings = logitless.linear_logprobs(hidden, weight, targets, bias=bias,
                                            return_entropy=True, **settings)
    torch.testing.assert_close(by_ids.logprobs, by_settings.logprobs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(by_ids.entropy, by_settings.entropy, rtol=1e-10, atol=1e-10)


def test_gradcheck_tiny():
    hidden, weight, bias, targets, ids = _inputs(4, n=5, k=4, v=11, inside=1.0)
    targets[5 - 1] = ids[4][ids[4] >= 0][0]

    def fn(h, w, b):
        out = logitless.linear_logprobs(h, w, targets, bias=b, kept_ids=ids, softcap=3.0,
                                        return_entropy=True, stats=("log_kept_mass",))
        return out.logprobs, out.entropy, out.log_kept_mass

    # 16 of the D=96 columns: gradcheck perturbs every input element (two forwards each), and
    # the kept set, its gather and the renormalisation are per vocabulary row, whatever D is
    hidden, weight = hidden[:5, :16].contiguous(), weight[:, :16].contiguous()
    torch.autograd.gradcheck(fn, _leaves(hidden, weight, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_three_way(dtype):
    hidden, weight, bias, targets, ids = _inputs(5)
    low = [x.to(dtype) for x in (hidden, weight, bias)]
    # the oracle on the same rounded inputs, in fp64
    exact = _oracle(*(x.double() for x in low[:2]), targets, low[2].double(),
                                      kept_ids=ids)
    ours = logitless.linear_logprobs(low[0], low[1], targets, bias=low[2], kept_ids=ids,
                                     return_entropy=True)
    plain = _oracle(*low[:2], targets, low[2], kept_ids=ids)
    live = torch.isfinite(exact["logprobs"])
    for key, got in (("logprobs", ours.logprobs), ("entropy", ours.entropy)):
        err = (got.double() - exact[key]).abs()[live]
        bound = (plain[key].double() - exact[key]).abs()[live] + 1e-2
        assert bool((err <= bound).all()), key
    assert torch.equal(torch.isinf(ours.logprobs), ~live)


def test_gradients_in_each_inputs_own_dtype():
    """An fp32 head on bf16 hidden states: each gradient comes back in its input's dtype."""
    hidden, weight, bias, targets, ids = _inputs(6)
    h, w, b = _leaves(hidden.bfloat16(), weight.float(), bias.float())
    out = logitless.linear_logprobs(h, w, targets, bias=b, kept_ids=ids)
    torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0).sum().backward()
    assert (h.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.bfloat16, torch.float32,
                                                         torch.float32)
    assert out.logprobs.dtype == torch.float32


@pytest.mark.parametrize(("change", "match"), [
    (lambda ids: dict(kept_ids=ids.int()), "kept_ids must be an int64 tensor"),
    (lambda ids: dict(kept_ids=ids.tolist()), "kept_ids must be an int64 tensor"),
    (lambda ids: dict(kept_ids=ids[:-1]), r"kept_ids must have shape \[\*targets.shape, K\]"),
    (lambda ids: dict(kept_ids=ids[:, :0]), "K >= 1"),
    (lambda ids: dict(kept_ids=torch.where(ids == ids[0, 0], V, ids)), r"in \[0, 1007\)"),
    (lambda ids: dict(kept_ids=torch.where(ids == ids[0, 0], -2, ids)), r"in \[0, 1007\)"),
    (lambda ids: dict(kept_ids=torch.cat([ids, ids[:, :1]], -1)), "at most once"),
    (lambda ids: dict(kept_ids=torch.cat([torch.full_like(ids[:1], -1), ids[1:]])),
     "at least one id"),
    (lambda ids: dict(top_k=5), "without"),
    (lambda ids: dict(stats=("sum_p_sq",)), "only 'log_kept_mass'"),
    (lambda ids: dict(temperature=torch.zeros(N)), r"temperature must be a number in \["),
])
def test_bad_input_raises_value_error(change, match):
    hidden, weight, bias, targets, ids = _inputs(7, dtype=torch.float32)
    args = dict(kept_ids=ids)
    args.update(change(ids))
    if "at most once" in match:  # the duplicated column must be a real id for some token
        assert bool((args["kept_ids"][:, -1] >= 0).any())
    with pytest.raises(ValueError, match=match):
        logitless.linear_logprobs(hidden, weight, targets, bias=bias, **args)


def test_an_ignored_token_may_keep_nothing():
    hidden, weight, bias, targets, ids = _inputs(8)
    ids[5] = -1  # targets[5] is ignore_index
    out = logitless.linear_logprobs(hidden, weight, targets, bias=bias, kept_ids=ids,
                                    return_entropy=True)
    assert out.logprobs[5] == 0 and out.entropy[5] == 0


def test_reference_keeps_id_zero_beside_padding():
    """A set holding id 0 and padding: the oracle keeps 0 (padding once scattered a False
    onto id 0, which raced with the set's own True)."""
    torch.manual_seed(5)
    hidden, weight = torch.randn(64, 6, dtype=torch.float64), torch.randn(9, 6, dtype=torch.float64)
    ids = torch.tensor([[0, 4, 7] + [-1] * 13] * 64)
    targets = torch.full((64,), 4)
    got = reference.kept_set_logprobs(hidden, weight, targets, ids)
    z = hidden @ weight.T
    want = z[:, 4] - torch.logsumexp(z[:, [0, 4, 7]], -1)
    torch.testing.assert_close(got["logprobs"], want)


def _oracle(hidden, weight, targets, bias, stats=("log_kept_mass",), **kw):
    """`reference.linear_logprobs` with the entropy and ``stats``: a dict of its fields."""
    out = reference.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                    stats=stats, **kw)
    return {k: v for k, v in vars(out).items() if v is not None}


def _live_logprobs(out, want, targets):
    """The logprobs of the tokens inside their set and the entropies of the live tokens."""
    inside = torch.isfinite(want["logprobs"]) & (targets != -100)
    assert bool(inside.any()) and bool(torch.isneginf(out.logprobs).any())
    assert torch.equal(torch.isneginf(out.logprobs), torch.isneginf(want["logprobs"]))
    return out.logprobs[inside].double(), want["logprobs"][inside]


@pytest.mark.parametrize("per_token", [False, True], ids=["number", "fp32-tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_take_the_temperature_as_given(dtype, per_token):
    """0.7 is no bf16 or fp16 number: the temperature enters the fp32 logits as given, so the
    results equal the fp64 oracle's on the same rounded inputs at that temperature to fp32
    rounding (rounded to the inputs' dtype, 0.69921875 in bf16, it moved them by ~1e-3)."""
    hidden, weight, bias, targets, ids = _inputs(9)
    low = [x.to(dtype) for x in (hidden, weight, bias)]
    temperature = 0.7
    if per_token:
        temperature = torch.rand(N, generator=torch.Generator().manual_seed(9)) * 0.4 + 0.55
    ours = logitless.linear_logprobs(low[0], low[1], targets, bias=low[2], kept_ids=ids,
                                     temperature=temperature, return_entropy=True)
    want = _oracle(*(x.double() for x in low[:2]), targets, low[2].double(),
                                     kept_ids=ids, temperature=temperature if not per_token
                                     else temperature.double())
    torch.testing.assert_close(*_live_logprobs(ours, want, targets), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.entropy.double(), want["entropy"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_set_of_the_whole_vocabulary_keeps_the_plain_lse(dtype):
    """``log_kept_mass`` of a set holding every id is the set's lse minus the untruncated
    pass's, at the same temperature: it is off 0 by no more than that pass's own lse is off
    the oracle (its 16-bit GEMM output rounds the logits), where the set's lse at a
    temperature rounded to bf16 read +0.018 and more."""
    hidden, weight, bias, targets, _ = _inputs(10)
    low = [x.to(dtype) for x in (hidden, weight, bias)]
    every = torch.arange(V).expand(N, V).contiguous()
    ours = logitless.linear_logprobs(low[0], low[1], targets, bias=low[2], kept_ids=every,
                                     temperature=0.7, stats=("log_kept_mass",))
    plain = logitless.linear_logprobs(low[0], low[1], targets, bias=low[2], temperature=0.7,
                                      stats=("lse",))
    exact = _oracle(*(x.double() for x in low[:2]), targets, low[2].double(),
                                      temperature=0.7, stats=("lse",))
    bound = (plain.lse.double() - exact["lse"]).abs() + 2e-5 * (1 + exact["lse"].abs())
    assert bool((ours.log_kept_mass.double().abs() <= bound).all())


def _upstream(out, targets, seed):
    """A loss on the logprobs inside the sets and the entropies, with random weights."""
    g = torch.Generator().manual_seed(seed)
    inside = torch.isfinite(out["logprobs"]) & (targets != -100)
    up = [torch.randn(targets.shape, generator=g, dtype=torch.float64) for _ in range(2)]
    return ((torch.where(inside, out["logprobs"].double(), 0.0) * up[0]).sum()
            + (out["entropy"].double() * up[1]).sum())


def test_autocast_gives_fp32_logits_and_their_own_gradient():
    """Under ``torch.autocast`` (``GRPOConfig(bf16=True)``) the head runs in bf16 (hidden
    rounded to it) with fp32 kept logits in the forward and the same logits in the backward:
    the values and the gradients of fp32 hidden, weight and bias equal the fp64 oracle's on
    the rounded hidden states, and the bias gradient sums to 0 over the vocabulary. The
    forward's bmm ran in bf16 (errors 1e-2) and the backward recomputed fp32 logits against
    its normaliser (d_hidden off 8e-3, the bias gradient summing to -2e-3)."""
    hidden, weight, bias, targets, ids = _inputs(11)
    leaves = _leaves(hidden.float(), weight.float(), bias.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = logitless.linear_logprobs(*leaves[:2], targets, bias=leaves[2], kept_ids=ids,
                                         temperature=0.7, return_entropy=True)
    assert ours.logprobs.dtype == torch.float32
    ref_leaves = _leaves(leaves[0].bfloat16().double(), *(x.double() for x in leaves[1:]))
    want = _oracle(*ref_leaves[:2], targets, ref_leaves[2], kept_ids=ids,
                                     temperature=0.7)
    torch.testing.assert_close(*_live_logprobs(ours, want, targets), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.entropy.double(), want["entropy"], rtol=1e-5, atol=1e-5)
    got = {"logprobs": ours.logprobs, "entropy": ours.entropy}
    grads = torch.autograd.grad(_upstream(got, targets, 12), leaves)
    ref_grads = torch.autograd.grad(_upstream(want, targets, 12), ref_leaves)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), r, rtol=0, atol=1e-5 * float(r.abs().max()),
                                   msg=name)
    assert abs(float(grads[2].sum())) < 1e-5


@pytest.mark.parametrize("bad", [V, V + 9, -1])
def test_a_target_outside_the_vocabulary_raises(bad):
    """As on every other path, not a logprob of -inf."""
    hidden, weight, bias, targets, ids = _inputs(13, dtype=torch.float32)
    targets[3] = bad
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 1007\)"):
        logitless.linear_logprobs(hidden, weight, targets, bias=bias, kept_ids=ids)


def test_a_non_finite_row_reads_nan_not_outside_the_set():
    """A NaN or inf hidden row has no distribution: its logprob is NaN whether its target is
    in the set or not (as on the sampler path), never the -inf that ``drop_outside_kept``
    reads as a target outside the set. The other rows keep their values."""
    hidden, weight, bias, targets, ids = _inputs(14, dtype=torch.float32)
    outside = [i for i in range(N) if targets[i] != -100 and not bool((ids[i] == targets[i]).any())]
    inside = [i for i in range(N) if bool((ids[i] == targets[i]).any())]
    rows = [outside[0], outside[1], inside[0]]
    clean = logitless.linear_logprobs(hidden, weight, targets, bias=bias, kept_ids=ids)
    hidden[rows[0], 3], hidden[rows[1], 5], hidden[rows[2], 0] = float("nan"), float("inf"), \
        float("nan")
    out = logitless.linear_logprobs(hidden, weight, targets, bias=bias, kept_ids=ids)
    assert bool(out.logprobs[rows].isnan().all())
    others = torch.ones(N, dtype=torch.bool)
    others[rows] = False
    torch.testing.assert_close(out.logprobs[others], clean.logprobs[others], rtol=0, atol=0)


def test_gather_weight_is_entered_by_the_backward():
    """``gather_weight`` (the ZeRO-3 hook): the caller runs the forward inside it, the
    backward enters it again before it reads the weight (the kept set's rows and, for
    ``log_kept_mass``, the untruncated pass's); outside it the weight holds NaN here. The
    backward ignored the hook and read the partitioned weight."""
    from testing import PartitionedHead

    hidden, weight, bias, targets, ids = _inputs(15)
    temperature = torch.rand(N, dtype=torch.float64) + 0.5  # the lse by the sampler path
    head = PartitionedHead(weight, bias)
    h = hidden.clone().requires_grad_()
    with head.gather():
        ours = logitless.linear_logprobs(h, head.weight, targets, bias=head.bias, kept_ids=ids,
                                         temperature=temperature, return_entropy=True,
                                         stats=("log_kept_mass",), gather_weight=head.gather)
    head.phase = "backward"
    got = {"logprobs": ours.logprobs, "entropy": ours.entropy,
           "log_kept_mass": ours.log_kept_mass}
    grads = _grads(got, (h, head.weight, head.bias), targets, 16)
    assert head.entries == ["forward", "backward", "backward"]
    ref_leaves = _leaves(hidden, weight, bias)
    want = _oracle(*ref_leaves[:2], targets, ref_leaves[2], kept_ids=ids,
                                     temperature=temperature)
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-10, msg=key)
    for g, r in zip(grads, _grads(want, ref_leaves, targets, 16)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)
