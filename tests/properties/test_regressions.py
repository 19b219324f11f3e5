"""Targeted cases the property tests found (issue 12), each pinned so that it runs whatever
hypothesis draws: the library against the plain-loop reference on one forced option."""

import pytest
import torch
from hypothesis import given

from logitless import reference as ref
from logitless.fused_losses.objectives.config import KL_ESTIMATORS, LOSS_AGGS
from logitless.fused_losses.objectives.kl import kl_estimate
from properties.harness import close, configs, run_library, run_reference
from properties.strategies import Layout, layouts, policy_batches


def _compare(batch, **kw):
    ours, theirs = configs(dict(kw), batch)
    loss, g_lp, g_ent, _ = run_library(batch, ours)
    want, w_lp, w_ent = run_reference(batch, theirs)
    close(loss, want, "loss")
    close(g_lp, w_lp, "d loss / d logprobs")
    close(g_ent, w_ent, "d loss / d entropy")
    return loss


@given(policy_batches(layouts(min_b=2)))
def test_rollout_is_without_bounds(batch):
    """TIS with neither bound: the plain weight (torch.clamp refused two None bounds)."""
    for level in ("token", "sequence", "sequence_geometric"):
        _compare(batch, objective="grpo", rollout_is=level, rollout_is_min=None,
                 rollout_is_max=None)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_loop_keeps_the_straight_through_form_under_the_clamp(estimator):
    gen = torch.Generator().manual_seed(4)
    lp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    ref_lp = lp.detach() + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 2
    for clamp in (False, True):
        got = kl_estimate(lp, ref_lp, estimator, clamp=clamp)
        want = ref.kl_loop(lp, ref_lp, estimator, clamp=clamp)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g, = torch.autograd.grad(got.sum(), lp)
        g_want, = torch.autograd.grad(want.sum(), lp)
        torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-12)


@given(policy_batches(layouts(min_b=2, packed=False)))
def test_selections_over_a_batch_without_loss_tokens(batch):
    """Entropy / |A| H / attention quantiles over no valid token select nothing (the reference
    took a quantile of an empty list)."""
    batch.mask[:] = False
    for kw in (dict(top_entropy_quantile=0.3), dict(adv_entropy_top_fraction=0.4),
               dict(attn_entropy_weighting="tanh", attn_entropy_standardize="batch")):
        loss = _compare(batch, objective="grpo", entropy_coef=0.01, **kw)
        assert loss == 0


@given(policy_batches(layouts(min_b=2, packed=False)))
def test_aggregations_over_a_batch_without_loss_tokens(batch):
    """Every aggregation of no token is 0 (the reference divided by a length-power sum of 0)."""
    batch.mask[:] = False
    for agg in LOSS_AGGS:
        assert _compare(batch, objective="grpo", loss_agg=agg, entropy_coef=0.01,
                        prompt_group_size=1, loss_agg_divisor=3.0) == 0


@given(policy_batches(layouts(min_b=2, packed=False)))
def test_attention_quantile_selection_over_a_batch_without_loss_tokens(batch):
    """No valid token: no quantile thresholds, every weight 0 (the weights indexed
    thresholds=None, a TypeError)."""
    batch.mask[:] = False
    for mode in ("low_quantile", "high_quantile"):
        loss = _compare(batch, objective="grpo",
                        attn_entropy_weighting=mode)
        assert loss == 0


@given(policy_batches(layouts(min_b=2, packed=False)))
def test_attention_batch_standardisation_of_one_token(batch):
    """One valid token has no spread: z = 0 and weight 1, as per-sequence standardisation
    (the batch statistics were (0, 1) below two tokens, so z was the raw entropy)."""
    batch.mask[:] = False
    batch.mask[1, 0] = True
    _compare(batch, objective="grpo", attn_entropy_weighting="tanh",
             attn_entropy_standardize="batch", attn_entropy_alpha=0.7)


@given(policy_batches(layouts(min_b=2)))
def test_per_token_bounds_of_dppo_and_dhpo(batch):
    """Per-token eps: the reference used the scalar config value (or failed on a tensor)."""
    gen = torch.Generator().manual_seed(1)
    batch.eps = tuple(0.02 + 0.3 * torch.rand(batch.lp.shape, generator=gen,
                                              dtype=torch.float64) for _ in range(2))
    for objective in ("dppo_tv", "dppo_kl", "dhpo"):
        _compare(batch, objective=objective)


@given(policy_batches(layouts(min_b=2)))
def test_dhpo_sequence_bounds(batch):
    """DHPO's own sequence bounds (the reference clipped s with eps_low/eps_high instead)."""
    _compare(batch, objective="dhpo", seq_eps_low=0.01, seq_eps_high=0.02)


@given(policy_batches(layouts(min_b=2)))
def test_vespo_with_masked_rollout_weights(batch):
    """MIS zeroes weights outside its bounds; vespo folds log w, clamped at log 1e-8 (the
    reference took log 0)."""
    _compare(batch, objective="vespo", rollout_is="token", rollout_is_mode="mask",
             rollout_is_min=0.9, rollout_is_max=1.05)


@given(policy_batches(Layout([0, 2, 1], 2, 0.0, packed=True), per_token_adv=True))
def test_packed_per_token_advantages_when_n_equals_b(batch):
    """Three tokens in three sequences, one advantage per token: as the padded layout (an [N]
    tensor shaped like the mask is per token, even when N == B; it was read per sequence)."""
    _compare(batch, objective="grpo")


@given(policy_batches(Layout([0, 2, 1], 2, 0.0, packed=True), per_token_adv=False))
def test_packed_per_sequence_advantages_when_n_equals_b(batch):
    """The same batch with one advantage per sequence, passed as [B, 1]."""
    assert batch.pack(batch.adv).shape == (3, 1)
    _compare(batch, objective="grpo")
