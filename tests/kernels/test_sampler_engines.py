"""``sampler="sglang"`` and ``sampler="transformers"``: the kept sets against each engine's own
rules, the fp64 reference (``logitless.reference.sampler``) against them, and the torch path
(``kernels/sampler_torch.py``, through ``linear_logprobs``) against the reference: values,
entropy, ``log_kept_mass`` and the gradients of hidden, weight and bias.

SGLang cannot be installed here, so its filtering is cut below from its sources, run on
materialised fp64 probabilities: SGLang 0.5.23 ``python/sglang/srt/layers/sampler.py``,
``Sampler._sample_from_probs`` (the FlashInfer branch, the CUDA default that
``sglang/srt/arg_groups/overrides.py``, ``_sampling_backend_default``, picks), and the
FlashInfer 0.7.4 kernels it calls, ``include/flashinfer/sampling.cuh``
(``TopKTopPSamplingFromProbKernel``, ``MinPSamplingFromProbKernel``, ``TopPRenormProbKernel``)
and ``include/flashinfer/topk.cuh`` (``RadixTopKRenormProbKernel_MultiCTA``). transformers'
warpers are transformers' own, in the list ``GenerationMixin._get_logits_processor`` builds.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

import logitless
from logitless.kernels import sampler_torch
from logitless.kernels.sampler_torch import RowParams
from logitless.reference.sampler import sampler_kept_mask, sampler_logprobs

from testing import assert_sampler_matches, sampler_settings, scaled_head

ENGINES = ("sglang", "transformers")


# --- SGLang / FlashInfer, cut from the sources (one row at a time, fp64) -------------------

def _fi_joint_kept(probs, k, p):
    """``TopKTopPSamplingFromProbKernel``: a drawn token (``pivot_0``) is accepted when
    ``aggregate_gt_pivot_0.count < k && aggregate_gt_pivot_0.value < p``, the count and mass of
    the probabilities ``> pivot_0``; the tokens it can return are those it accepts."""
    gt = probs.unsqueeze(0) > probs.unsqueeze(1)  # [j, i]: probs[i] > probs[j]
    count = gt.sum(1)
    value = (gt * probs.unsqueeze(0)).sum(1)
    return (count < k) & (value < p)


def _fi_top_k_renorm(probs, k):
    """``RadixTopKRenormProbKernel_MultiCTA``: ``k >= vocab_size`` renormalises only; else the
    probabilities ``>= pivot`` (the ``k``-th largest) renormalised, the rest 0."""
    if k >= probs.numel():
        return probs / probs.sum()
    pivot = probs.sort(descending=True).values[k - 1]
    kept = torch.where(probs >= pivot, probs, 0.0)
    return kept / kept.sum()


def _fi_top_p_renorm(probs, p):
    """``TopPRenormProbKernel`` (the vocabularies below AIR's 2048 buckets), its ternary search
    line by line: ``low`` ends as the largest probability gap with ``sum(probs > low) >= p``."""
    if p >= 1.0:
        return probs / probs.sum()
    low, high = 0.0, float(probs.max())
    sum_low = 1.0
    while True:
        pivot_0 = (high + 2.0 * low) / 3.0
        pivot_1 = (2.0 * high + low) / 3.0
        agg_0 = float(probs[probs > pivot_0].sum())
        agg_1 = float(probs[probs > pivot_1].sum())
        above = probs[probs > low]
        below = probs[probs <= high]
        min_gt_low = min(high, float(above.min())) if above.numel() else high
        max_le_high = max(low, float(below.max())) if below.numel() else low
        if agg_1 >= p:
            low, sum_low = pivot_1, agg_1
        elif agg_0 >= p:
            low, high, sum_low = pivot_0, min(pivot_1, max_le_high), agg_0
        else:
            high = min(pivot_0, max_le_high)
        if not (min_gt_low < max_le_high
                and math.nextafter(min_gt_low, max_le_high) < max_le_high):
            break
    return torch.where(probs > low, probs / max(sum_low, 1e-8), 0.0)


def _fi_min_p_kept(probs, min_p):
    """``MinPSamplingFromProbKernel``: ``pivot = max_val * p``; tokens ``probs >= pivot``."""
    return probs >= probs.max() * min_p


def sglang_kept(z, top_k, top_p, min_p):
    """The tokens SGLang can draw for each row of the tempered logits ``z`` sent as a batch of
    one request (``need_min_p_sampling`` is per batch: ``any(min_p > 0)``), by
    ``Sampler._sample_from_probs``' FlashInfer branch."""
    rows = []
    for r in range(z.shape[0]):
        probs = torch.softmax(z[r], -1)  # Sampler.forward: logits.div_(T), softmax
        k, p, mp = int(top_k[r]), float(top_p[r]), float(min_p[r])
        if mp > 0:  # top_k_renorm_prob, top_p_renorm_prob, min_p_sampling_from_probs
            probs = _fi_top_p_renorm(_fi_top_k_renorm(probs, k), p)
            rows.append((probs > 0) & _fi_min_p_kept(probs, mp))
        else:  # top_k_top_p_sampling_from_probs(..., filter_apply_order="joint")
            rows.append(_fi_joint_kept(probs, k, p))
    return torch.stack(rows)


# --- transformers: its own processors ------------------------------------------------------

def transformers_scores(scores, top_k, top_p, min_p):
    """transformers' processed scores of each row (``-inf`` outside the kept set), from the
    processor list ``GenerationMixin._get_logits_processor`` builds for ``do_sample=True``
    (no model: the list builder only merges with the caller's processors). The tests that
    call it skip where transformers is not installed; the SGLang ones run."""
    generation = pytest.importorskip("transformers.generation.utils")
    GenerationConfig, GenerationMixin = generation.GenerationConfig, generation.GenerationMixin
    me = types.SimpleNamespace(_merge_criteria_processor_list=lambda procs, extra: procs)
    out = []
    for r in range(scores.shape[0]):
        config = GenerationConfig(do_sample=True, top_k=int(top_k[r]), top_p=float(top_p[r]),
                                  min_p=float(min_p[r]) if min_p[r] > 0 else None)
        procs = GenerationMixin._get_logits_processor(me, config)
        out.append(procs(None, scores[r:r + 1].clone())[0])
    return torch.stack(out)


def _settings(n, v, gen):
    k = torch.randint(1, v + 3, (n,), generator=gen)
    p = torch.rand(n, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    mp = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0,
                     torch.rand(n, generator=gen, dtype=torch.float64) * 0.3)
    # min_p = 1 keeps the tokens equal to the max: the threshold is inclusive
    mp[torch.rand(n, generator=gen) < 0.1] = 1.0
    return k, p, mp


def _tied(n=200, v=41, seed=3):
    """Integer logits in [-3, 3] over 41 ids: ties at every boundary."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randint(-3, 4, (n, v), generator=gen).double()
    return z, gen


def _cut(k, p, mp, which):
    """The settings of ``which`` (a subset of "kpm"), the others off."""
    v_big = 10**6
    return (k if "k" in which else torch.full_like(k, v_big),
            p if "p" in which else torch.ones_like(p),
            mp if "m" in which else torch.zeros_like(mp))


WHICH = ["k", "p", "m", "kp", "km", "pm", "kpm"]


@pytest.mark.parametrize("which", WHICH)
def test_reference_sglang_is_flashinfer_on_ties(which):
    z, gen = _tied()
    k, p, mp = _cut(*_settings(*z.shape, gen), which)
    want = sglang_kept(z, k, p, mp)
    assert torch.equal(sampler_kept_mask(z, k, p, mp, sampler="sglang"), want)
    # every tie at a boundary shares one fate: no row splits a value
    t = torch.where(want, z, math.inf).amin(1, keepdim=True)
    assert not ((z == t) & ~want).any() or which == "m"  # min-p alone: its own threshold


@pytest.mark.parametrize("which", WHICH)
def test_reference_transformers_is_its_warpers_on_ties(which):
    """Away from ties the kept sets are transformers'; at a tie split by TopP, transformers'
    unstable sort picks which tied ids go, not how many: the kept logits per row (a multiset)
    are transformers', and the reference keeps the lowest ids of a split tie."""
    z, gen = _tied()
    k, p, mp = _cut(*_settings(*z.shape, gen), which)
    theirs = transformers_scores(z, k, p, mp) > -math.inf
    ours = sampler_kept_mask(z, k, p, mp, sampler="transformers")
    assert torch.equal(ours.sum(1), theirs.sum(1))
    kept_values = [torch.where(m, z, math.inf).sort(1).values for m in (ours, theirs)]
    assert torch.equal(*kept_values)
    t = torch.where(ours, z, math.inf).amin(1, keepdim=True)
    at = (z == t)
    split = (at & ~ours).any(1)
    if "p" in which:
        assert int(split.sum()) > 10  # the rule is exercised
    # in a split tie, the kept ids come before the dropped ones
    last_kept = torch.where(at & ours, torch.arange(z.shape[1]), -1).amax(1)
    first_dropped = torch.where(at & ~ours, torch.arange(z.shape[1]), 10**6).amin(1)
    assert bool((last_kept < first_dropped).all())
    if "k" in which and "p" not in which and "m" not in which:
        assert not split.any()  # TopK keeps every token tied at the k-th value


@pytest.mark.parametrize("engine", ENGINES)
def test_engines_without_ties_match_their_sources_exactly(engine):
    gen = torch.Generator().manual_seed(8)
    n, v = 120, 97
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * 2
    k, p, mp = _settings(n, v, gen)
    if engine == "sglang":
        want = sglang_kept(z, k, p, mp)
    else:
        want = transformers_scores(z, k, p, mp) > -math.inf
    got = sampler_kept_mask(z, k, p, mp, sampler=engine)
    assert torch.equal(got, want)
    # the engines really differ from vLLM (and from each other) on these rows
    others = [sampler_kept_mask(z, k, p, mp, sampler=e) for e in ("vllm", *ENGINES)
              if e != engine]
    assert all(int((o != got).any(1).sum()) > 5 for o in others)


def _rebuild(keys, key, count):
    seen = torch.zeros(keys.shape[0], dtype=torch.int32)
    return sampler_torch._prefix_slice(keys.t().contiguous(), key.to(keys.dtype), count.int(),
                                       seen)[0].t()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cols", [4096, 5])
def test_torch_path_kept_set_on_ties(engine, dtype, cols, monkeypatch):
    """The torch path's selection on tied integer logits, in one slice or slices of 5 ids:
    the reference's set for every combination of settings, and the stored (key, count) pair
    rebuilds it (what the backward does)."""
    monkeypatch.setattr(sampler_torch, "_COLS", cols)
    z, gen = _tied(n=150)
    k, p, mp = _settings(*z.shape, gen)
    keys = sampler_torch.ordered_keys(z.to(dtype))
    for which in WHICH:
        kk, pp, mm = _cut(k, p, mp, which)
        params = RowParams(torch.ones(z.shape[0], dtype=dtype), kk if "k" in which else None,
                           pp if "p" in which else None,
                           mm.to(dtype) if "m" in which else None, engine)
        targets = torch.randint(0, z.shape[1], (z.shape[0],), generator=gen)
        got, outs = sampler_torch.select(z.to(dtype), targets, params)
        want = sampler_kept_mask(z, kk, pp, mm, sampler=engine)
        assert torch.equal(got, want), which
        assert torch.equal(_rebuild(keys, outs[-2], outs[-1]), got), which
        y_kept = want.gather(1, targets.unsqueeze(1)).squeeze(1)
        assert torch.equal(torch.isfinite(outs[0]), y_kept), which


# --- values and gradients through linear_logprobs (torch path) -----------------------------

N, D, V = 37, 96, 1007


def _inputs(seed=0, scale=3.0):
    gen, h, w, b, z = scaled_head(N, D, V, seed, scale)
    top = z.topk(4, dim=-1).indices
    t = top.gather(1, torch.randint(0, 4, (N, 1), generator=gen)).squeeze(1)
    t = torch.where(torch.rand(N, generator=gen) < 0.3, torch.randint(0, V, (N,),
                                                                      generator=gen), t)
    t[-3:] = -100
    return h, w, b, t


CASES = {
    "top_k": dict(top_k=7),
    "combined": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02),
    "top_k_top_p": dict(top_k=30, top_p=0.7),
    "per_token": sampler_settings(N, 80, 1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ENGINES)
def test_torch_path_matches_reference(engine, case, monkeypatch):
    monkeypatch.setenv("LOGITLESS_BACKEND", "torch")
    kw = CASES[case]
    h, w, b, t = _inputs()
    leaves = [x.float().requires_grad_() for x in (h, w, b)]
    f32 = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
           for k, v in kw.items()}
    out = logitless.linear_logprobs(*leaves[:2], t, bias=leaves[2], return_entropy=True,
                                    stats=("log_kept_mass",), sampler=engine, **f32)
    ref_leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    ref = sampler_logprobs(ref_leaves[0], ref_leaves[1], t, ref_leaves[2], sampler=engine,
                           **kw)
    vllm = sampler_logprobs(h, w, t, b, **kw)
    finite = torch.isfinite(ref["logprobs"])
    assert finite.any() and (~finite & (t != -100)).any()
    assert_sampler_matches(out, ref, leaves, ref_leaves)
    # the engine's numbers are not vLLM's on these inputs where its rules differ without ties
    # (top-k alone is the same everywhere; transformers' top-k then top-p is vLLM's)
    if "min_p" in kw or (engine == "sglang" and "top_p" in kw):
        assert not torch.allclose(ref["entropy"].detach(), vllm["entropy"], atol=1e-3)


def test_unknown_sampler_raises():
    h, w, _, t = _inputs()
    for bad in ("vLLM", "hf", None, 1):
        with pytest.raises(ValueError, match="sampler must be one of"):
            logitless.linear_logprobs(h, w, t, top_k=5, sampler=bad)
    with pytest.raises(ValueError, match="sampler must be one of"):
        sampler_kept_mask(torch.randn(2, 3), top_k=1, sampler="trl")
