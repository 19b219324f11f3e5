"""Properties of `linear_logprobs` over drawn shapes, dtypes and options: every value and every
gradient against the fp64 reference, on the torch twin and on Triton (interpreter, tiny shapes).

fp32 is checked to a tolerance; bf16/fp16 by the three-way rule: no further from fp64 than the
plain reference run in the same dtype, plus a small tolerance."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import logitless
from logitless import reference
from properties.strategies import LOW_PRECISION, HeadProblem, backend, head_problems, seeds

from testing import assert_close_to_oracle, requires_triton

DIFFERENTIABLE = ("logprobs", "entropy", "sum_p_sq", "mean_logit")


def _leaves(problem: HeadProblem, dtype=None):
    out = []
    for t in (problem.hidden, problem.weight, problem.bias):
        t = None if t is None else (t if dtype is None else t.to(dtype))
        out.append(None if t is None else t.detach().clone().requires_grad_(True))
    return out


def _upstream(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen, dtype=torch.float64) for k in DIFFERENTIABLE}


def _reference(problem, dtype, upstream, names):
    """Reference statistics in ``dtype`` and the gradients of ``sum upstream * stat``."""
    h, w, b = _leaves(problem, dtype)
    stats = reference.linear_softmax_stats(h, w, problem.targets, b,
                                           ignore_index=problem.ignore_index,
                                           **problem.transform)
    params = [t for t in (h, w, b) if t is not None]
    grads = [torch.zeros_like(p) for p in params]
    if names:
        total = sum((stats[k].double() * upstream[k]).sum() for k in names)
        grads = torch.autograd.grad(total, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    return stats, grads


def check_against_reference(problem: HeadProblem, upstream_seed: int):
    h, w, b = _leaves(problem)
    out = logitless.linear_logprobs(h, w, problem.targets, **problem.kwargs(b))
    names = [k for k in DIFFERENTIABLE if getattr(out, k) is not None]
    upstream = _upstream(problem.targets.shape, upstream_seed)
    params = [t for t in (h, w, b) if t is not None]
    total = sum((getattr(out, k).double() * upstream[k]).sum() for k in names)
    grads = torch.autograd.grad(total, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    oracle, oracle_grads = _reference(problem, torch.float64, upstream, names)
    dtype = problem.hidden.dtype
    same, same_grads = _reference(problem, dtype, upstream, names)
    low = dtype in LOW_PRECISION
    for k in [*names, "lse"] if out.lse is not None else names:
        got = getattr(out, k)
        assert got.shape == problem.targets.shape and got.dtype == torch.float32, k
        scale = 1 + float(oracle[k].detach().abs().max()) if oracle[k].numel() else 1.0
        tol = 1e-2 * scale if low else 2e-5 * scale
        assert_close_to_oracle(got, oracle[k], same[k], tol=tol, name=k)
    ignored = problem.targets == problem.ignore_index
    for k in names:
        assert (getattr(out, k)[ignored] == 0).all(), f"{k} not 0 at ignored targets"
    if out.is_top1 is not None:
        _check_top1(problem, out.is_top1, ignored)
    for name, g, g64, gs in zip(("hidden", "weight", "bias"), grads, oracle_grads, same_grads):
        scale = float(g64.abs().max()) if g64.numel() else 0.0
        tol = (1e-2 if low else 1e-4) * scale + 1e-6
        assert_close_to_oracle(g, g64, gs, tol=tol, name=f"d_{name}")


def _check_top1(problem, is_top1, ignored):
    """``is_top1`` where the fp64 logits leave no doubt: the target is the max by a margin, or
    below it by one. Ignored rows are False."""
    assert not is_top1[ignored].any()
    z = reference.linear_logits(
        problem.hidden.double(), problem.weight.double(),
        None if problem.bias is None else problem.bias.double(),
        temperature=problem.transform["temperature"],
        softcap_value=problem.transform["softcap"],
        logit_scale=problem.transform["logit_scale"])
    safe = torch.where(ignored, 0, problem.targets).clamp(0, z.shape[-1] - 1)
    z_y = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    others = z.scatter(-1, safe.unsqueeze(-1), -torch.inf).amax(-1)
    margin = 0.05 if problem.hidden.dtype in LOW_PRECISION else 1e-3
    surely_top = ~ignored & (z_y > others + margin)
    surely_not = ~ignored & (z_y < others - margin)
    assert is_top1[surely_top].all() and not is_top1[surely_not].any()


@given(head_problems(dtypes=(torch.float32, torch.bfloat16, torch.float16)), seeds)
def test_torch_twin_matches_reference(problem, upstream_seed):
    with backend("torch"):
        check_against_reference(problem, upstream_seed)


@pytest.fixture(scope="module")
def small_row_chunks():
    """The Triton launcher's row chunk shrunk from 1024 to 4: its backward runs one interpreted
    program per padded row, so a problem of up to 10 rows ran 1024 of them; now at most 12,
    and the drawn sizes land on both sides of a chunk boundary. Module-scoped: hypothesis
    refuses function-scoped fixtures."""
    from logitless.kernels import linear_softmax

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(linear_softmax, "ROW_CHUNK", 4)
        yield


@requires_triton
@pytest.mark.usefixtures("small_row_chunks")
@given(head_problems(max_n=5, max_d=20, max_v=40,
                     dtypes=(torch.float32, torch.bfloat16, torch.float16)), seeds)
def test_triton_matches_reference(problem, upstream_seed):
    with backend("triton"):
        check_against_reference(problem, upstream_seed)


@given(head_problems(max_n=6, max_d=12, max_v=30), st.integers(1, 400))
def test_tile_budget_is_invisible(problem, tile_bytes):
    """Any ``max_tile_bytes`` (down to one logit per tile) gives the untiled values in fp64."""
    problem.hidden, problem.weight = problem.hidden.double(), problem.weight.double()
    problem.bias = None if problem.bias is None else problem.bias.double()
    with backend("torch"):
        problem.max_tile_bytes = None
        whole = logitless.linear_logprobs(problem.hidden, problem.weight, problem.targets,
                                          **problem.kwargs(problem.bias))
        problem.max_tile_bytes = tile_bytes
        tiled = logitless.linear_logprobs(problem.hidden, problem.weight, problem.targets,
                                          **problem.kwargs(problem.bias))
    for k in ("logprobs", "entropy", "sum_p_sq", "mean_logit", "lse"):
        if getattr(whole, k) is not None:
            torch.testing.assert_close(getattr(tiled, k), getattr(whole, k), rtol=1e-12,
                                       atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")

