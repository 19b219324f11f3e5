"""`linear_topk_distill(direction="reverse")`: the student-top-k renormalised reverse KL (verl
#6676) from both heads, against the fp64 formula on materialised logits
(`reference.topk_reverse_kl`): values and the student's gradients, the teacher's lack of any,
clamps, masks, tiles, k = V as the full reverse KL, gradcheck, 16-bit inputs and autocast, and
the input contract (issue 38)."""

import pytest
import torch

import logitless
from logitless import reference

from testing import divergence_heads

N, D, D_T, V, K = 37, 48, 40, 1007, 13
TILE = 48 * 1024  # small tiles: the streamed top-k crosses several row and vocabulary tiles


def _heads(seed=0, n=N, d=D, d_t=D_T, v=V, batch=None, dtype=torch.float64):
    return divergence_heads(n, d, d_t, v, batch=batch, dtype=dtype, seed=seed)


def _student_leaves(x):
    return [x[key].detach().clone().requires_grad_(True) for key in ("hidden", "weight", "bias")]


def _run(fn, x, leaves, **kw):
    h, w, b = leaves
    return fn(h, w, mask=kw.pop("mask", None), bias=b, direction="reverse",
              teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
              teacher_bias=x["teacher_bias"], **kw)


@pytest.mark.parametrize("clamps", [{}, dict(log_prob_min_clamp=None, loss_max_clamp=None),
                                    dict(log_prob_min_clamp=-2.0, loss_max_clamp=0.3)],
                         ids=["verl-defaults", "no-clamps", "tight-clamps"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_the_fp64_formula(clamps, temperature):
    x = _heads(1, batch=2)
    mask = torch.rand(2, N, generator=torch.Generator().manual_seed(2)) < 0.8
    ours_leaves, ref_leaves = _student_leaves(x), _student_leaves(x)
    teacher = [x[key].requires_grad_(True) for key in ("teacher_hidden", "teacher_weight",
                                                       "teacher_bias")]
    kw = dict(k=K, temperature=temperature, mask=mask, **clamps)
    ours = _run(logitless.linear_topk_distill, x, ours_leaves, max_tile_bytes=TILE, **kw)
    want = _run(reference.linear_topk_distill, x, ref_leaves, **kw)
    assert ours.shape == (2, N) and bool((ours[~mask] == 0).all())
    assert bool((want[mask] > 0).any())
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
    up = torch.randn(2, N, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((ours * up).sum(), ours_leaves)
    for name, g, r in zip(("hidden", "weight", "bias"), grads,
                          torch.autograd.grad((want * up).sum(), ref_leaves)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=name)
    assert all(t.grad is None for t in teacher)
    assert ours.grad_fn is not None


def test_the_set_is_the_students_top_k():
    """Renormalised over the student's own top-k, not the teacher's: the teacher's top-k
    (the forward direction's set) gives another number."""
    x = _heads(4)
    ours = _run(logitless.linear_topk_distill, x, _student_leaves(x), k=K,
                log_prob_min_clamp=None, loss_max_clamp=None)
    zs = reference.linear_logits(x["hidden"], x["weight"], x["bias"])
    zt = reference.linear_logits(x["teacher_hidden"], x["teacher_weight"], x["teacher_bias"])
    ids = zt.topk(K, dim=-1).indices
    log_s, log_t = (torch.log_softmax(z.gather(-1, ids), -1) for z in (zs, zt))
    teacher_set = (log_s.exp() * (log_s - log_t)).sum(-1)
    assert not torch.allclose(ours.detach(), teacher_set, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("given", ["logprobs", "logits"])
def test_a_recorded_set_with_the_teachers_scores(given):
    """The rollout's recorded student top-k (``teacher_ids``) with the teacher's log-probs
    there (verl #7806's fixed-token scoring) gives what the teacher head gives; raw teacher
    logits at the set give the same, the renormalisation cancels their normaliser."""
    x = _heads(10, batch=2)
    mask = torch.rand(2, N, generator=torch.Generator().manual_seed(11)) < 0.8
    zs = reference.linear_logits(x["hidden"], x["weight"], x["bias"], temperature=0.9)
    zt = reference.linear_logits(x["teacher_hidden"], x["teacher_weight"], x["teacher_bias"],
                                 temperature=0.9)
    ids = zs.topk(K, dim=-1).indices
    scores = (torch.log_softmax(zt, -1) if given == "logprobs" else zt).gather(-1, ids)
    leaves, ref_leaves = _student_leaves(x), _student_leaves(x)
    ours = logitless.linear_topk_distill(leaves[0], leaves[1], ids, scores, mask, bias=leaves[2],
                                         direction="reverse", temperature=0.9)
    want = _run(reference.linear_topk_distill, x, ref_leaves, k=K, temperature=0.9, mask=mask)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
    for g, r in zip(torch.autograd.grad(ours.sum(), leaves),
                    torch.autograd.grad(want.sum(), ref_leaves)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_k_equal_to_the_vocabulary_is_the_full_reverse_kl():
    """With ``S`` the whole vocabulary nothing is renormalised: KL(student || teacher), as
    ``linear_divergence(beta=1)`` gives it."""
    x = _heads(5, v=211)
    ours = _run(logitless.linear_topk_distill, x, _student_leaves(x), k=211, temperature=0.8,
                log_prob_min_clamp=None, loss_max_clamp=None)
    full = logitless.linear_divergence(x["hidden"], x["weight"], x["teacher_hidden"],
                                       x["teacher_weight"], beta=1.0, temperature=0.8,
                                       bias=x["bias"], teacher_bias=x["teacher_bias"]).divergence
    torch.testing.assert_close(ours, full, rtol=1e-10, atol=1e-12)


def test_gradcheck_tiny():
    x = _heads(6, n=4, d=5, d_t=3, v=17)

    def fn(h, w, b):
        return logitless.linear_topk_distill(
            h, w, bias=b, direction="reverse", k=5, temperature=0.9, loss_max_clamp=None,
            teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
            teacher_bias=x["teacher_bias"])

    torch.autograd.gradcheck(fn, _student_leaves(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_match_the_fp64_formula_on_the_rounded_inputs(dtype):
    """fp32 logits from 16-bit heads and the temperature as given: the fp64 formula on the
    same rounded inputs to fp32 rounding."""
    x = _heads(7, dtype=dtype)
    ours = _run(logitless.linear_topk_distill, x, _student_leaves(x), k=K, temperature=0.7)
    assert ours.dtype == torch.float32
    x64 = {key: t.double() for key, t in x.items()}
    want = _run(reference.linear_topk_distill, x64, _student_leaves(x64), k=K, temperature=0.7)
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)


def test_autocast_runs_the_student_head_in_its_dtype():
    """Under ``torch.autocast`` the student head runs in bf16 (its hidden, weight and bias
    rounded to it), the logits in fp32; fp32 result and gradients."""
    x = _heads(8, dtype=torch.float32)
    leaves = _student_leaves(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _run(logitless.linear_topk_distill, x, leaves, k=K)
    assert ours.dtype == torch.float32
    x64 = {key: t.bfloat16().double() for key, t in x.items()}
    want = _run(reference.linear_topk_distill, x64, _student_leaves(x64), k=K)
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(ours.sum(), leaves)
    assert all(g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in grads)


def _bad(**change):
    x = _heads(9, dtype=torch.float32)
    kw = dict(hidden=x["hidden"], weight=x["weight"], bias=x["bias"], direction="reverse", k=K,
              teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
              teacher_bias=x["teacher_bias"])
    kw.update(change)
    return kw


@pytest.mark.parametrize(("change", "match"), [
    (dict(direction="sideways"), "direction must be 'forward' or 'reverse'"),
    (dict(k=0), r"k must be an integer in \[1, V\]"),
    (dict(k=V + 1), r"k must be an integer in \[1, V\]"),
    (dict(k=2.0), r"k must be an integer in \[1, V\]"),
    (dict(k=None), r"k must be an integer in \[1, V\]"),
    (dict(teacher_weight=None), "needs the teacher head"),
    (dict(teacher_weight=None, teacher_hidden=None, teacher_bias=None, k=None),
     "needs the teacher head"),
    (dict(teacher_hidden=torch.randn(N - 1, D_T)), "teacher_hidden must have hidden's token"),
    (dict(teacher_weight=torch.randn(V - 1, D_T), teacher_bias=None),
     "teacher_weight must have the student's"),
    (dict(teacher_ids=torch.zeros(N, K, dtype=torch.long), teacher_logprobs=torch.zeros(N, K)),
     r"either a recorded set .* not both: drop \['k', 'teacher_hidden'"),
    (dict(k=None, teacher_hidden=None, teacher_weight=None, teacher_bias=None,
          teacher_ids=torch.zeros(N, K, dtype=torch.long)), "teacher_logprobs must be a float"),
    (dict(k=None, teacher_hidden=None, teacher_weight=None, teacher_bias=None,
          teacher_ids=torch.full((N, K), V), teacher_logprobs=torch.zeros(N, K)),
     r"teacher_ids must lie in \[0, 1007\)"),
    (dict(direction="forward", teacher_ids=torch.zeros(N, K, dtype=torch.long),
          teacher_logprobs=torch.zeros(N, K)), r"\['k', 'teacher_hidden'"),
    (dict(loss_max_clamp=0.0), "loss_max_clamp must be None or a number > 0"),
    (dict(mask=torch.full((N,), 0.5)), "mask must be bool or hold 0 and 1"),
])
def test_bad_input_raises_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        logitless.linear_topk_distill(**_bad(**change))
