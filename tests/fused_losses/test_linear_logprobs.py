"""linear_logprobs against the fp64 reference: values, every gradient, every option, both
backends (Triton under the interpreter), plus the input contract."""

import os

import pytest
import torch

import logitless
from logitless import reference
from logitless.fused_losses.head import logprobs as logprobs_module

from testing import assert_close_to_oracle, requires_triton, tied_head_inputs

FLOAT_OUTS = ("logprobs", "entropy", "sum_p_sq", "mean_logit", "lse")
ALL_STATS = ("sum_p_sq", "mean_logit", "is_top1", "lse")
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]
# The Triton launcher's row chunk, shrunk from 1024: its backward launches one program per
# padded row, so N=37 would run 1024 interpreted programs per call; with 16 it runs 48, and
# the odd N still ends in a padded chunk (now after whole ones).
ROW_CHUNK = 16


@pytest.fixture(autouse=True)
def _small_row_chunks(monkeypatch):
    if requires_triton.args[0]:  # no Triton here: the Triton cases skip
        return
    from logitless.kernels import linear_softmax

    monkeypatch.setattr(linear_softmax, "ROW_CHUNK", ROW_CHUNK)


def make_inputs(n=37, d=96, v=1007, dtype=torch.float32, bias=True, batch=None, ignore=0.2):
    """Fresh random head inputs at odd sizes; a fraction of targets ignored, some at the argmax."""
    shape = (n,) if batch is None else (batch, n)
    hidden = torch.randn(*shape, d, dtype=torch.float64)
    weight = torch.randn(v, d, dtype=torch.float64) / d**0.5 * 2
    b = torch.randn(v, dtype=torch.float64) if bias else None
    targets = torch.randint(0, v, shape)
    # Make a few targets the argmax so is_top1 is exercised both ways.
    logits = hidden @ weight.t() + (b if b is not None else 0)
    top = logits.argmax(-1)
    pick = torch.rand(shape) < 0.3
    targets = torch.where(pick, top, targets)
    targets[torch.rand(shape) < ignore] = -100
    cast = lambda x: None if x is None else x.to(dtype)
    return cast(hidden), cast(weight), cast(b), targets


def leaf(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def upstream_mix(shape):
    """Fixed-seed random upstream gradients for every differentiable output."""
    gen = torch.Generator().manual_seed(1234)
    return {k: torch.randn(shape, dtype=torch.float64, generator=gen) for k in FLOAT_OUTS}


def run_both(hidden, weight, bias, targets, backend, monkeypatch, **opts):
    """Ours (given backend) and the fp64 reference, values and gradients of a random mix of
    the differentiable outputs."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    h, w, b = leaf(hidden, weight, bias)
    out = logitless.linear_logprobs(h, w, targets, bias=b, return_entropy=True,
                                    stats=ALL_STATS, **opts)
    h64, w64, b64 = leaf(*(None if t is None else t.double() for t in (hidden, weight, bias)))
    ref = reference.linear_softmax_stats(h64, w64, targets, b64, **opts)
    upstream = upstream_mix(targets.shape)
    ours = sum((getattr(out, k).double() * upstream[k]).sum() for k in FLOAT_OUTS)
    theirs = sum((ref[k] * upstream[k]).sum() for k in FLOAT_OUTS)
    params = [t for t in (h, w, b) if t is not None]
    params64 = [t for t in (h64, w64, b64) if t is not None]
    grads = torch.autograd.grad(ours, params)
    grads64 = torch.autograd.grad(theirs, params64)
    return out, ref, grads, grads64


OPTIONS = [
    {},
    {"temperature": 0.7},
    {"softcap": 4.0},
    {"temperature": 1.3, "softcap": 6.0, "logit_scale": 0.8},
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items())
                         or "plain")
def test_fp32_matches_fp64_reference(backend, opts, monkeypatch):
    hidden, weight, bias, targets = make_inputs(batch=2, n=19)
    out, ref, grads, grads64 = run_both(hidden, weight, bias, targets, backend, monkeypatch,
                                        **opts)
    for k in FLOAT_OUTS:
        assert getattr(out, k).dtype == torch.float32
        torch.testing.assert_close(getattr(out, k).double(), ref[k], rtol=1e-5, atol=2e-5,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert torch.equal(out.is_top1, ref["is_top1"])
    assert out.is_top1.any() and not out.is_top1.all()
    for name, g, g64 in zip(("hidden", "weight", "bias"), grads, grads64):
        scale = g64.abs().max()
        torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m, name=name: f"d_{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_three_way(backend, monkeypatch):
    """bf16: no worse than plain torch in bf16, measured against fp64, plus a small tol."""
    hidden, weight, bias, targets = make_inputs(n=29, dtype=torch.bfloat16)
    out, ref, grads, grads64 = run_both(hidden, weight, bias, targets, backend, monkeypatch,
                                        softcap=5.0)
    h, w, b = leaf(hidden, weight, bias)
    same = reference.linear_softmax_stats(h, w, targets, b, softcap=5.0)
    upstream = upstream_mix(targets.shape)
    same_grads = torch.autograd.grad(
        sum((same[k].double() * upstream[k]).sum() for k in FLOAT_OUTS), [h, w, b])
    for k in FLOAT_OUTS:
        assert_close_to_oracle(getattr(out, k), ref[k], same[k], tol=1e-2, name=k)
    for name, g, g64, gs in zip(("hidden", "weight", "bias"), grads, grads64, same_grads):
        assert_close_to_oracle(g, g64, gs, tol=1e-2 * float(g64.abs().max()), name=f"d_{name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [{}, {"softcap": 30.0, "temperature": 0.7}], ids=["plain", "cap"])
def test_is_top1_is_the_first_maximum(backend, dtype, opts, monkeypatch):
    """Tied maxima (exact integer logits): only the lowest index counts as top-1, within a
    tile and across vocabulary tiles, as torch.argmax (and TRL) decide."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, bias, targets = tied_head_inputs()
    logits = hidden @ weight.t() + bias  # exact: integer logits, and the transform is monotone
    expected = logits.argmax(-1) == targets
    at_max = logits.gather(1, targets[:, None]).squeeze(1) == logits.amax(-1)
    assert expected.any() and (at_max & ~expected).any()  # both kinds of tie occur
    ref = reference.linear_softmax_stats(hidden, weight, targets, bias, **opts)["is_top1"]
    assert torch.equal(ref, expected)
    cast = [x.to(dtype) for x in (hidden, weight, bias)]
    for tile_bytes in (None, 4 * 2 * 300):
        out = logitless.linear_logprobs(cast[0], cast[1], targets, bias=cast[2], stats=("is_top1",),
                                        max_tile_bytes=tile_bytes, **opts)
        assert torch.equal(out.is_top1, expected), tile_bytes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_zero_logit_scale_is_uniform(backend, softcap, monkeypatch):
    """logit_scale=0: every logit is 0, so the softmax is uniform and nothing has a gradient
    (with or without a cap), as the reference computes it."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, bias, targets = make_inputs(n=11)
    out, ref, grads, grads64 = run_both(hidden, weight, bias, targets, backend, monkeypatch,
                                        logit_scale=0.0, softcap=softcap)
    for k in FLOAT_OUTS:
        torch.testing.assert_close(getattr(out, k).double(), ref[k], rtol=1e-6, atol=1e-6)
    assert torch.equal(out.is_top1, ref["is_top1"])
    for g, g64 in zip(grads, grads64):
        assert torch.equal(g64, torch.zeros_like(g64)) and torch.equal(g, torch.zeros_like(g))


def test_gradcheck_fp64():
    hidden, weight, bias, targets = make_inputs(n=5, d=7, v=11, dtype=torch.float64, ignore=0.3)
    targets[0] = 3

    def f(h, w, b):
        o = logitless.linear_logprobs(h, w, targets, bias=b, return_entropy=True,
                                      stats=("sum_p_sq", "mean_logit"), softcap=3.0,
                                      temperature=0.9, max_tile_bytes=4 * 2 * 3 * 2)
        return o.logprobs, o.entropy, o.sum_p_sq, o.mean_logit

    assert torch.autograd.gradcheck(f, leaf(hidden, weight, bias))


def test_z_loss_on_lse_passes_gradcheck():
    """``lse`` is differentiable (d lse / dz_j = p_j): a z-loss on it, alone and beside the
    logprob loss, passes gradcheck in fp64 (the torch path; vocabulary split into tiles)."""
    hidden, weight, bias, targets = make_inputs(n=5, d=7, v=11, dtype=torch.float64, ignore=0.3)

    def f(h, w, b):
        o = logitless.linear_logprobs(h, w, targets, bias=b, stats=("lse",), softcap=3.0,
                                      max_tile_bytes=4 * 2 * 3 * 2)
        return o.lse.square().mean(), o.lse.square().mean() - o.logprobs.mean()

    assert torch.autograd.gradcheck(f, leaf(hidden, weight, bias))


@pytest.mark.parametrize("backend", BACKENDS)
def test_z_loss_gradients_match_reference(backend, monkeypatch):
    """The z-loss's gradients alone (the other outputs get none), fp32 on either backend."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, bias, targets = make_inputs(n=23)
    leaves = leaf(hidden, weight, bias)
    out = logitless.linear_logprobs(*leaves[:2], targets, bias=leaves[2], stats=("lse",),
                                    softcap=3.0)
    got = torch.autograd.grad(out.lse.square().sum(), leaves)
    leaves64 = leaf(*(x.double() for x in (hidden, weight, bias)))
    ref = reference.linear_softmax_stats(*leaves64[:2], targets, leaves64[2], softcap=3.0)
    want = torch.autograd.grad(ref["lse"].square().sum(), leaves64)
    for g, g64 in zip(got, want):
        torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-5 * float(g64.abs().max()))


@pytest.mark.parametrize("tile_bytes", [8 * 300, 8 * 2 * 1007 * 5])
def test_tiling_is_invisible(tile_bytes):
    """Vocab-split tiles (a row does not fit) and row tiles give the untiled result."""
    hidden, weight, bias, targets = make_inputs(n=23, dtype=torch.float64)
    a = logitless.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                  stats=("sum_p_sq",), max_tile_bytes=tile_bytes)
    b = logitless.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                  stats=("sum_p_sq",))
    for k in ("logprobs", "entropy", "sum_p_sq"):
        torch.testing.assert_close(getattr(a, k), getattr(b, k), rtol=1e-12, atol=1e-12)


def test_frozen_weight_and_unused_outputs_cost_nothing(monkeypatch):
    """A frozen weight is never asked for; an output without gradient is not passed down."""
    calls = []
    real = logitless.fused_losses.head.logprobs.linear_softmax_torch.backward

    def spy(*args, **kw):
        calls.append((args, kw))
        return real(*args, **kw)

    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")  # the spy sits on the torch path
    monkeypatch.setattr(logprobs_module.linear_softmax_torch, "backward", spy)
    hidden, weight, _, targets = make_inputs(bias=False)
    h = hidden.clone().requires_grad_(True)
    out = logitless.linear_logprobs(h, weight, targets, return_entropy=True)
    out.logprobs.sum().backward()
    args, kw = calls[0]
    assert kw["need_hidden"] and not kw["need_weight"] and not kw["need_bias"]
    g_entropy, g_sum_p_sq, g_mean = args[9], args[10], args[11]
    assert g_entropy is None and g_sum_p_sq is None and g_mean is None and kw["g_lse"] is None
    assert args[6] is None  # the entropy is not even handed to the backward


def test_no_grad_saves_nothing():
    hidden, weight, _bias, targets = make_inputs()
    h, w = leaf(hidden, weight)
    with torch.no_grad():
        out = logitless.linear_logprobs(h, w, targets, return_entropy=True)
    assert out.logprobs.grad_fn is None and out.entropy.grad_fn is None


def test_ignored_rows_are_zero_and_dropped(monkeypatch):
    seen = []
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")  # the spy sits on the torch path
    real = logprobs_module.linear_softmax_torch.forward
    monkeypatch.setattr(logprobs_module.linear_softmax_torch, "forward",
                        lambda h, *a, **k: seen.append(h.shape[0]) or real(h, *a, **k))
    hidden, weight, bias, targets = make_inputs(batch=3, n=11, ignore=0.4)
    out = logitless.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True)
    assert seen == [int((targets != -100).sum())]
    ignored = targets == -100
    assert (out.logprobs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
    assert out.logprobs.shape == targets.shape


def test_all_ignored_gives_zeros_and_zero_gradients():
    hidden, weight, bias, targets = make_inputs(n=6)
    targets[:] = -1
    h, w, b = leaf(hidden, weight, bias)
    out = logitless.linear_logprobs(h, w, targets, bias=b, ignore_index=-1, return_entropy=True)
    assert (out.logprobs == 0).all() and (out.entropy == 0).all()
    (out.logprobs.sum() + out.entropy.sum()).backward()
    for t in (h, w, b):
        assert t.grad is not None and (t.grad == 0).all()


def test_empty_input():
    hidden, weight, _, _ = make_inputs()
    h, w = leaf(hidden[:0], weight)
    out = logitless.linear_logprobs(h, w, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert out.logprobs.shape == (0,) and out.entropy.shape == (0,)
    out.logprobs.sum().backward()
    assert (w.grad == 0).all()


def test_non_contiguous_inputs():
    hidden, weight, bias, targets = make_inputs(batch=4, n=9, dtype=torch.float64)
    h_nc = hidden.transpose(0, 1)  # [9, 4, D], non-contiguous
    w_nc = weight.t().contiguous().t()  # same values, column-major
    out = logitless.linear_logprobs(h_nc, w_nc, targets.t(), bias=bias, return_entropy=True)
    ref = reference.linear_softmax_stats(h_nc, weight, targets.t(), bias)
    torch.testing.assert_close(out.logprobs, ref["logprobs"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, ref["entropy"], rtol=1e-12, atol=1e-12)


MIXED = [(torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.float32, None),
         (torch.float16, torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16,
                                                         torch.bfloat16)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", MIXED, ids=lambda d: "-".join(str(x)[6:] for x in d))
def test_mixed_dtypes_compute_in_hidden_dtype(backend, dtypes, monkeypatch):
    """TRL's rule: any mix of dtypes computes in hidden's (the head cast to it inside the
    op), and each input's gradient comes back in its own dtype, rounded once from the fp32
    accumulator. Three calls: the mix; everything cast to hidden's dtype first; the mix with
    the head widened to fp32 (exactly), whose head gradients are the accumulators."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, bias, targets = make_inputs(n=23, bias=dtypes[2] is not None)
    mixed = [None if x is None else x.to(dt) for x, dt in zip((hidden, weight, bias), dtypes)]
    calls = {
        "mixed": mixed,
        "same": [None if x is None else x.to(dtypes[0]) for x in mixed],
        "wide": [mixed[0]] + [None if x is None else x.float() for x in mixed[1:]],
    }
    outs, grads = {}, {}
    for name, inputs in calls.items():
        h, w, b = leaf(*inputs)
        out = logitless.linear_logprobs(h, w, targets, bias=b, return_entropy=True,
                                        stats=("sum_p_sq",))
        (out.logprobs.sum() + 0.5 * out.entropy.sum() + out.sum_p_sq.sum()).backward()
        outs[name] = out
        grads[name] = [None if x is None else x.grad for x in (h, w, b)]
    for k in ("logprobs", "entropy", "sum_p_sq"):
        assert torch.equal(getattr(outs["mixed"], k), getattr(outs["same"], k)), k
        assert torch.equal(getattr(outs["wide"], k), getattr(outs["same"], k)), k
    for i, x in enumerate(mixed):
        if x is None:
            continue
        g, g_same, acc = grads["mixed"][i], grads["same"][i], grads["wide"][i]
        assert g.dtype == x.dtype
        assert torch.equal(g, acc.to(x.dtype))  # rounded once, from the accumulator
        assert torch.equal(acc.to(dtypes[0]), g_same)  # the same accumulator


def test_autocast_follows_compute_dtype():
    """Trainers call the head under autocast with fp32 weights: compute follows autocast."""
    hidden, weight, bias, targets = make_inputs(n=17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = logitless.linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True)
        expected = logitless.linear_logprobs(hidden.bfloat16(), weight.bfloat16(), targets,
                                             bias=bias.bfloat16(), return_entropy=True)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected.logprobs)
    torch.testing.assert_close(out.entropy, expected.entropy)


@pytest.mark.slow
def test_more_than_2_pow_31_logits():
    """N * V > 2**31 on the chunked path: offsets never wrap; checked on a sample of rows."""
    n, d, v = 16_500, 4, 131_101
    assert n * v > 2**31
    hidden = torch.randn(n, d)
    weight = torch.randn(v, d)
    targets = torch.randint(0, v, (n,))
    targets[-1] = v - 1
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # the one large test: use the cores
    try:
        with torch.no_grad():
            out = logitless.linear_logprobs(hidden, weight, targets, return_entropy=True)
    finally:
        torch.set_num_threads(threads)
    rows = torch.cat([torch.arange(0, n, 997), torch.tensor([n - 1])])
    ref = reference.linear_softmax_stats(hidden[rows].double(), weight.double(), targets[rows])
    torch.testing.assert_close(out.logprobs[rows].double(), ref["logprobs"], rtol=1e-5,
                               atol=1e-4)
    torch.testing.assert_close(out.entropy[rows].double(), ref["entropy"], rtol=1e-5, atol=1e-4)


BAD = [
    ("targets", lambda h, w, t, b: dict(targets=t.float())),
    ("targets", lambda h, w, t, b: dict(targets=t[:-1])),
    ("targets", lambda h, w, t, b: dict(targets=torch.where(t == t[0], w.shape[0], t))),
    ("targets", lambda h, w, t, b: dict(targets=torch.full_like(t, -5))),
    ("weight", lambda h, w, t, b: dict(weight=w[:, :-1])),
    ("weight", lambda h, w, t, b: dict(weight=w.long())),
    ("weight", lambda h, w, t, b: dict(weight=w[0])),
    ("bias", lambda h, w, t, b: dict(bias=b[:-1])),
    ("bias", lambda h, w, t, b: dict(bias=b.int())),
    ("temperature", lambda h, w, t, b: dict(temperature=0.0)),
    ("temperature", lambda h, w, t, b: dict(temperature=float("inf"))),
    ("softcap", lambda h, w, t, b: dict(softcap=-1.0)),
    ("softcap", lambda h, w, t, b: dict(softcap="30")),
    ("temperature", lambda h, w, t, b: dict(temperature="0.7")),
    ("logit_scale", lambda h, w, t, b: dict(logit_scale=True)),
    ("hidden", lambda h, w, t, b: dict(hidden=h[:, :0], weight=w[:, :0])),
    ("hidden", lambda h, w, t, b: dict(hidden=h.long())),
    ("stats", lambda h, w, t, b: dict(stats=("median",))),
    ("vocab_parallel", lambda h, w, t, b: dict(vocab_parallel="WORLD")),  # a group's name
]


@pytest.mark.parametrize("name,change", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_input_names_the_argument(name, change):
    hidden, weight, bias, targets = make_inputs(n=8, ignore=0.0)
    args = dict(hidden=hidden, weight=weight, targets=targets, bias=bias)
    args.update(change(hidden, weight, targets, bias))
    with pytest.raises(ValueError, match=name):
        logitless.linear_logprobs(**args)


# --- the temperature's range: one rule on every path (issue 40, items 8 and 12) ----------

FP32_RANGE = (r"temperature must be a number in \[1\.1754943508222875e-38, "
              r"3\.4028234663852886e\+38\] \(the normal numbers of torch\.float32")
# A kept set per token: the target and the next four ids.
TEMPERATURE_PATHS = {
    "plain": lambda targets, v: {},
    "top_k": lambda targets, v: dict(top_k=5),
    "kept_ids": lambda targets, v: dict(kept_ids=(targets[:, None] + torch.arange(5)) % v),
}


def _one_token_at(value, dtype):
    """A per-token temperature, all in range but token 3, which holds ``value``."""
    t = torch.rand(9, dtype=torch.float64) + 0.5
    t[3] = value
    return t.to(dtype)


OUT_OF_FP32 = {
    "1e300": lambda: 1e300,
    "1e-300": lambda: 1e-300,
    "denormal": lambda: 1e-40,
    "per-token-denormal": lambda: _one_token_at(1e-40, torch.float32),
    "per-token-fp64-1e-50": lambda: _one_token_at(1e-50, torch.float64),
    "per-token-fp64-1e300": lambda: _one_token_at(1e300, torch.float64),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", list(TEMPERATURE_PATHS))
@pytest.mark.parametrize("temperature", list(OUT_OF_FP32))
def test_temperature_outside_fp32_refused_alike_on_every_path(backend, path, temperature,
                                                              monkeypatch):
    """An fp32 head (fp32 accumulation) refuses, on every path and with the range in the
    message, a temperature that is not a normal fp32 number: a denormal, one below the smallest
    normal (which the cast flushes to 0, or whose 1/T overflows) or one past the largest.
    Before: the plain path gave NaN at 1e-300 and 1e-40; top_k refused 1e-300 as "must be >
    0" and raised an overflow RuntimeError at 1e300; a per-token 1e-40 passed and gave NaN;
    kept_ids gave NaN or -inf for 1e-300 and a per-token fp64 1e-50, and a RuntimeError for
    1e300."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, bias, targets = make_inputs(n=9, d=16, v=53, ignore=0.0)
    args = TEMPERATURE_PATHS[path](targets, 53)
    with pytest.raises(ValueError, match=FP32_RANGE):
        logitless.linear_logprobs(hidden, weight, targets, bias=bias,
                                  temperature=OUT_OF_FP32[temperature](), **args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", list(TEMPERATURE_PATHS))
def test_temperature_at_the_range_ends_accepted_alike_on_every_path(backend, path, monkeypatch):
    """The ends of the range run on every path: an fp32 head at T = the largest fp32 (every
    tempered logit about 0: the uniform distribution over the kept set, which the fp64
    reference also gives), and an fp64 head (fp64 accumulation) at T = 1e-300 and 1e300,
    which fp32 refuses; each against the fp64 reference."""
    monkeypatch.setenv("LOGITLESS_BACKEND", backend)
    hidden, weight, bias, targets = make_inputs(n=9, d=16, v=53, ignore=0.0)
    args = TEMPERATURE_PATHS[path](targets, 53)
    cases = [(torch.float32, float(torch.finfo(torch.float32).max)),
             (torch.float64, 1e-300), (torch.float64, 1e300)]
    for dtype, t in cases:
        h, w, b = (x.to(dtype) for x in (hidden, weight, bias))
        out = logitless.linear_logprobs(h, w, targets, bias=b, temperature=t,
                                        return_entropy=True, **args)
        ref = reference.linear_logprobs(h.double(), w.double(), targets, bias=b.double(),
                                        temperature=t, return_entropy=True, **args)
        for name in ("logprobs", "entropy"):
            torch.testing.assert_close(getattr(out, name).double(), getattr(ref, name),
                                       rtol=1e-6,
                                       atol=1e-6, msg=f"{name} at T={t} ({dtype})")


def test_backend_env_is_validated(monkeypatch):
    hidden, weight, _bias, targets = make_inputs(n=4)
    monkeypatch.setenv("LOGITLESS_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="LOGITLESS_BACKEND"):
        logitless.linear_logprobs(hidden, weight, targets)
