"""Properties of `policy_loss` over drawn objectives, options, aggregations and layouts: the loss
and its gradients equal the plain-loop fp64 reference, padded and packed; a batch split into
whole sequences, each part run with the full batch's `BatchGlobals`, sums to the full loss."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from logitless import PolicyLossConfig, policy_loss, policy_loss_globals
from properties.harness import (
    close,
    configs,
    run_library,
    run_reference,
)
from properties.strategies import backend, finite, layouts, policy_batches, policy_configs


@st.composite
def cases(draw, objectives=None, packed=None):
    layout = draw(layouts(packed=packed))
    batch = draw(policy_batches(layout))
    kw = draw(policy_configs() if objectives is None else policy_configs(objectives=objectives))
    progress = draw(st.none() | finite(0.0, 1.0))
    return batch, kw, progress


@given(cases())
def test_matches_reference(case):
    batch, kw, progress = case
    ours, theirs = configs(kw, batch)
    with backend("torch"):
        loss, g_lp, g_ent, _ = run_library(batch, ours, progress)
    want, w_lp, w_ent = run_reference(batch, theirs, progress)
    close(loss, want, "loss")
    close(g_lp, w_lp, "d loss / d logprobs")
    close(g_ent, w_ent, "d loss / d entropy")


@given(cases(objectives=sorted(["grpo", "cispo", "gspo", "vespo", "dppo_kl", "clip_cov",
                                "kl_cov", "minpro", "ctpo"]), packed=False))
def test_packed_equals_padded(case):
    """The packed layout of a batch gives the padded layout's loss and gradients (every
    objective, the batch-statistic ones included)."""
    batch, kw, progress = case
    kw = dict(kw, cov_seed=3, cov_fraction=0.3, max_response_length=batch.layout.width)
    padded = run_library(batch, configs(kw, batch)[0], progress)
    batch.layout.packed = True
    packed = run_library(batch, configs(kw, batch)[0], progress)
    for name, got, want in zip(("loss", "d_lp", "d_entropy"), packed[:3], padded[:3]):
        close(got, want, name, rtol=1e-12)


@given(cases(), st.data())
def test_partition_shares_sum_to_the_loss(case, data):
    """Whole-sequence parts run with the full batch's globals sum to the full loss (the
    chunking contract `fused_policy_loss` relies on)."""
    batch, kw, progress = case
    batch.layout.packed = False
    cfg, _ = configs(kw, batch)
    full, g_full, _, _ = run_library(batch, cfg, progress)
    glob = policy_loss_globals(batch.mask, batch.adv, cfg, old_logprobs=batch.old,
                               rollout_logprobs=batch.rollout, entropy=batch.entropy,
                               attention_entropy=batch.attention_entropy)
    b = batch.mask.shape[0]
    cut = data.draw(st.integers(0, b))
    total, grads = 0.0, []
    for rows in (slice(0, cut), slice(cut, b)):
        if rows.start == rows.stop:
            continue
        lp = batch.lp[rows].clone().requires_grad_(True)
        tensor = lambda x, rows=rows: None if x is None else x[rows]
        part_cfg = cfg if batch.eps is None else PolicyLossConfig(
            **dict(kw, eps_low=batch.eps[0][rows], eps_high=batch.eps[1][rows]))
        loss, _ = policy_loss(
            lp, batch.old[rows], batch.adv[rows], batch.mask[rows], part_cfg,
            ref_logprobs=batch.ref[rows], rollout_logprobs=batch.rollout[rows],
            entropy=batch.entropy[rows], token_weights=tensor(batch.token_weights),
            attention_entropy=batch.attention_entropy[rows], batch_globals=glob,
            training_progress=progress)
        total = total + loss.detach()
        grads.append(torch.autograd.grad(loss, lp, allow_unused=True)[0]
                     if loss.requires_grad else None)
        grads[-1] = torch.zeros_like(lp) if grads[-1] is None else grads[-1]
    close(torch.as_tensor(total, dtype=full.dtype), full, "sum of the parts")
    close(torch.cat(grads), g_full, "gradient of the parts")
