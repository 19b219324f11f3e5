"""linear_logprobs with vLLM's truncations (top-k, top-p, min-p, per-token temperature)
against the fp64 reference ``logitless.reference.sampler``, which follows vLLM 0.34.0:
``vllm/v1/worker/gpu/sample/sampler.py`` (``Sampler.apply_sampling_params``: temperature,
min-p, then top-k/top-p), ``vllm/v1/worker/gpu/sample/min_p.py`` (``_min_p_kernel``) and
``vllm/v1/sample/ops/topk_topp_triton.py`` (``apply_top_k_top_p_triton``, its tie handling),
with the top-p rule as ``vllm/v1/sample/ops/topk_topp_sampler.py``
(``apply_top_k_top_p_pytorch``) writes it."""

import math

import pytest
import torch

import logitless
from logitless.kernels import sampler_torch
from logitless.reference.sampler import sampler_kept_mask, sampler_logprobs

from testing import (
    assert_backward_enters_gather,
    assert_close_to_oracle,
    assert_sampler_matches,
    sampler_settings,
    scaled_head,
)

N, D, V = 37, 96, 1007
OUTS = ("logprobs", "entropy", "log_kept_mass")


@pytest.fixture(autouse=True, params=[None, 5], ids=["one-slice", "slices-of-5"])
def _slices(request, monkeypatch):
    """Every test twice: with the torch path's passes taking these vocabularies in one slice
    (they are narrower than its default slice), and in slices of 5 ids, where histograms, tie
    ranks, the kept set's (key, count) and the target's place carry from slice to slice."""
    if request.param is not None:
        monkeypatch.setattr(sampler_torch, "_COLS", request.param)


def make_inputs(n=N, d=D, v=V, seed=0, scale=3.0):
    gen, hidden, weight, bias, logits = scaled_head(n, d, v, seed, scale)
    # targets: the argmax, a token from the top few, or any token (mostly outside the kept set)
    top = logits.topk(4, dim=-1).indices
    pick = torch.randint(0, 4, (n,), generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    r = torch.rand(n, generator=gen)
    targets = torch.where(r < 0.6, top.gather(1, pick.unsqueeze(1)).squeeze(1), targets)
    targets[r > 0.9] = -100
    return hidden, weight, bias, targets


def per_token(n, seed=1):
    return sampler_settings(n, 80, seed)


CASES = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "combined": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02),
    "per_token": per_token(N),
}


def _cast(kw, dtype):
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kw.items()}


def _run(h, w, b, t, **kw):
    return logitless.linear_logprobs(h, w, t, bias=b, return_entropy=True,
                                     stats=("log_kept_mass",), **kw)


def _finite_sum(outs, upstream):
    return sum((torch.where(torch.isfinite(o), o, 0.0).double() * g).sum()
               for o, g in zip(outs, upstream))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(case):
    kw = CASES[case]
    h, w, b, t = make_inputs()
    leaves = [x.float().requires_grad_() for x in (h, w, b)]
    out = _run(*leaves, t, **_cast(kw, torch.float32))
    ref_leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    ref = sampler_logprobs(ref_leaves[0], ref_leaves[1], t, ref_leaves[2], **kw)
    finite = torch.isfinite(ref["logprobs"])
    valid = t != -100
    # targets inside and outside the kept set both occur
    assert (finite & valid).any() and (~finite).any()
    assert_sampler_matches(out, ref, leaves, ref_leaves)


@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "per_token"])
def test_gather_weight_is_entered_by_the_backward(case):
    """``gather_weight`` (the ZeRO-3 hook) with top-k, top-p, min-p or a per-token
    temperature: the caller runs the forward inside it, the backward enters it again before
    it reads the head, which holds NaN outside it here (`PartitionedHead`). The backward
    ignored the hook and read the partitioned head."""
    kw = CASES[case]
    assert_backward_enters_gather(
        lambda *args, **g: _run(*args, **g, **_cast(kw, torch.float32)), *make_inputs(), kw)


def test_gradcheck_fp64_with_softcap_and_scale():
    h, w, b, t = make_inputs(n=6, d=5, v=13, seed=2)
    t[t == -100] = 3
    kw = dict(top_k=6, top_p=0.85, min_p=0.02, softcap=3.0, logit_scale=1.3,
              temperature=torch.rand(6, dtype=torch.float64) + 0.5)

    def f(h, w, b):
        out = _run(h, w, b, t, **kw)
        lp = torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0)
        return lp, out.entropy, out.log_kept_mass

    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)
    ref = sampler_logprobs(h, w, t, b, **kw)
    for name, got in zip(OUTS, f(h, w, b)):
        want = ref[name]
        if name == "logprobs":
            assert torch.isfinite(want).any() and not torch.isfinite(want).all()
            want = torch.where(torch.isfinite(want), want, 0.0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_bf16_three_way():
    """bf16 inputs (no bias: the reference's ``x + b`` would round the logits twice where the
    kernels' fused GEMM rounds once). The kept set is discontinuous in the logits: rows where
    rounding the logits to bf16 moves a token across a boundary are left out."""
    temperature = per_token(N)["temperature"]
    kw = dict(top_k=40, top_p=0.9, min_p=0.02)
    h, w, _, t = make_inputs(seed=3, scale=1.5)
    h16, w16 = h.bfloat16(), w.bfloat16()
    out = _run(h16, w16, None, t, temperature=temperature.float(), **kw)
    # the oracle on the bf16-rounded inputs, and the same-dtype computation (bf16 throughout)
    ref = sampler_logprobs(h16.double(), w16.double(), t, temperature=temperature, **kw)
    same = sampler_logprobs(h16, w16, t, temperature=temperature.bfloat16(), **kw)
    z16 = (h16 @ w16.t()).double() / temperature.unsqueeze(1)
    stable = (sampler_kept_mask(z16, **kw) == ref["kept"]).all(1) & (t != -100)
    assert stable.sum() > N // 2
    for name in OUTS:
        sel = stable & torch.isfinite(ref["logprobs"]) if name == "logprobs" else stable
        assert_close_to_oracle(getattr(out, name)[sel], ref[name][sel], same[name][sel], 1e-2,
                               name)


def _all_targets(z_rows, **kw):
    """logprobs of every token of each row of integer logits ``z_rows [R, V]`` (one-hot hidden
    states against ``weight = z_rows^T``)."""
    r, v = z_rows.shape
    hidden = torch.eye(r, dtype=torch.float64).repeat_interleave(v, 0)
    targets = torch.arange(v).repeat(r)
    out = _run(hidden, z_rows.t().contiguous(), None, targets, **kw)
    return out.logprobs.view(r, v)


def test_ties_keep_the_lowest_ids():
    """Integer logits tied at the k-th value and at the top-p boundary: vLLM's CUDA path keeps
    exactly k, the lowest ids first; top-p keeps the fewest tied tokens that reach p."""
    z = torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0, 2.0, 3.0],
                      [0.0, 2.0, 2.0, 2.0, -1.0, 2.0, 1.0]])
    kept_k = torch.isfinite(_all_targets(z, top_k=2))
    assert kept_k[0].nonzero().flatten().tolist() == [1, 3]
    assert torch.equal(kept_k, sampler_kept_mask(z, top_k=2))
    # row 1: four ids tied at 2 hold ~0.95 of the mass, ~0.24 each: p = 0.5 needs three of them
    kept_p = torch.isfinite(_all_targets(z[1:], top_p=0.5))
    assert kept_p[0].nonzero().flatten().tolist() == [1, 2, 3]
    assert torch.equal(kept_p, sampler_kept_mask(z[1:], top_p=0.5))


def test_gradients_with_ties_split_at_the_boundary():
    """Integer logits whose top-k and top-p boundaries fall inside runs of tied tokens: the
    gradients (which see the kept set through q) equal the reference's, so the backward
    rebuilds the forward's set, lowest tied ids first, slice after slice."""
    gen = torch.Generator().manual_seed(7)
    r, v = 6, 23
    z = torch.randint(-2, 3, (r, v), generator=gen).double()
    kw = dict(top_k=torch.randint(3, 12, (r,), generator=gen), top_p=0.6)
    kept = sampler_kept_mask(z, **kw)
    edge = torch.where(kept, z, float("inf")).amin(1, keepdim=True)
    assert int(((z == edge) & ~kept).any(1).sum()) >= 3  # ties split at the boundary
    hidden = torch.eye(r, dtype=torch.float64)
    targets = torch.where(kept, z, -float("inf")).argmax(1)
    leaves = [hidden.clone().requires_grad_(), z.t().contiguous().requires_grad_()]
    out = _run(leaves[0], leaves[1], None, targets, **kw)
    ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    ref = sampler_logprobs(ref_leaves[0], ref_leaves[1], targets, None, **kw)
    up = [torch.randn(r, generator=gen, dtype=torch.float64) for _ in OUTS]
    grads = torch.autograd.grad(_finite_sum([getattr(out, k) for k in OUTS], up), leaves)
    ref_grads = torch.autograd.grad(_finite_sum([ref[k] for k in OUTS], up), ref_leaves)
    for g, want in zip(grads, ref_grads):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def test_sampler_draws_follow_the_logprobs():
    """Monte-Carlo: Gumbel-max draws over the reference's processed logits (tokens outside the
    kept set at -inf, as vLLM's ``gumbel_sample`` sees them) land with frequencies
    ``exp(logprobs)``; tokens with logprob -inf are never drawn."""
    gen = torch.Generator().manual_seed(7)
    v = 29
    z = torch.randn(2, v, generator=gen, dtype=torch.float64) * 2
    kw = dict(temperature=0.8, top_k=12, top_p=0.85, min_p=0.01)
    lp = _all_targets(z, **kw)
    processed = torch.where(sampler_kept_mask(z / 0.8, top_k=12, top_p=0.85, min_p=0.01),
                            z / 0.8, -math.inf)
    draws = 40000
    u = torch.rand(draws, 2, v, generator=gen, dtype=torch.float64)
    sample = (processed - torch.log(-torch.log(u))).argmax(-1)
    freq = torch.stack([torch.bincount(sample[:, i], minlength=v) for i in range(2)]) / draws
    prob = lp.exp()
    assert (freq[prob == 0] == 0).all() and (prob > 0).sum() >= 4
    assert ((freq - prob).abs() <= 5 * (prob * (1 - prob) / draws).sqrt() + 1e-9).all()


def test_noop_settings_leave_the_plain_numbers_unchanged():
    h, w, b, t = make_inputs(n=9, d=16, v=50)
    h, w, b = h.float(), w.float(), b.float()
    plain = _run(h, w, b, t)
    noop = _run(h, w, b, t, top_k=50, top_p=1.0, min_p=0.0)
    for name in OUTS:
        assert torch.equal(getattr(plain, name), getattr(noop, name))
    assert not plain.log_kept_mass.any()
    # a per-token temperature takes the sampler path: same numbers as the scalar one
    per = _run(h, w, b, t, temperature=torch.full((9,), 0.7))
    scalar = _run(h, w, b, t, temperature=0.7)
    for name in OUTS:
        torch.testing.assert_close(getattr(per, name), getattr(scalar, name), rtol=0,
                                   atol=1e-5)


BAD = [
    (dict(top_k=0), "top_k"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=torch.zeros(4)), "temperature"),
    (dict(temperature=torch.full((4,), math.inf)), "temperature"),
    (dict(top_k=torch.ones(3, dtype=torch.long)), "top_k"),
    (dict(top_k=torch.ones(4)), "top_k"), (dict(top_k=torch.zeros(4, dtype=torch.long)), "top_k"),
    (dict(top_p=torch.full((4,), 1.5)), "top_p"), (dict(top_p=torch.ones(4, 1)), "top_p"),
    (dict(top_p=torch.ones(4, dtype=torch.long)), "top_p"),
    (dict(min_p=torch.full((4,), math.nan)), "min_p"),
    (dict(top_k=3, vocab_parallel=object()), "vocab_parallel"),
    (dict(top_p=0.5, stats=("sum_p_sq",)), "stats"),
]


@pytest.mark.parametrize("kw,name", BAD)
def test_bad_input(kw, name):
    h, w, t = torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,))
    with pytest.raises(ValueError, match=name):
        logitless.linear_logprobs(h, w, t, **kw)


def test_per_token_settings_checked_before_the_cast():
    """Wider per-token settings are checked as given, then cast to the accumulation dtype:
    an fp64 ``min_p`` just above 1 is refused (fp32 would round it to 1), an fp64 temperature
    that fp32 flushes to 0 is refused as outside fp32's normal numbers (it is > 0), and valid
    fp64 settings give what fp32 ones give."""
    h, w, t = torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,))
    above_one = torch.full((4,), 1 + 1e-12, dtype=torch.float64)
    assert float(above_one.float()[0]) == 1.0
    with pytest.raises(ValueError, match=r"min_p must lie in \[0, 1\]"):
        logitless.linear_logprobs(h, w, t, min_p=above_one)
    tiny = torch.full((4,), 1e-46, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"temperature must be a number in \[1\.17549.*float32"):
        logitless.linear_logprobs(h, w, t, temperature=tiny)
    temp, min_p = torch.rand(4, dtype=torch.float64) + 0.5, torch.full((4,), 0.05).double()
    wide = logitless.linear_logprobs(h, w, t, temperature=temp, min_p=min_p, return_entropy=True)
    narrow = logitless.linear_logprobs(h, w, t, temperature=temp.float(), min_p=min_p.float(),
                                       return_entropy=True)
    for name in ("logprobs", "entropy"):
        a, b = getattr(wide, name), getattr(narrow, name)
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
