"""The ``prompt-mean`` and ``constant`` aggregations (docs/objectives.md, section 7), as AReaL
(#1546), SkyRL (``loss_reduction``) and miles (#1498) define them, against fp64 loops written
from those definitions: values and gradients, padded and packed, through ``policy_loss`` and
``fused_policy_loss`` (whose chunks each get their exact share)."""

import pytest
import torch

from fused_losses.test_fused_policy_loss import (
    make_batch,
    packed,
    rows,
    run_fused,
    run_reference,
)
from logitless import PolicyLossConfig, policy_loss, policy_loss_globals

B, T = 6, 10


def make(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 0, 10, 3, 9, 5])  # one empty sequence
    mask = torch.arange(T)[None] < lengths[:, None]
    mask[2, 4] = False
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    lp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return lp, old, adv, mask


def token_loss(lp, old, adv):
    """REINFORCE's ``-A lp``: the aggregation is what is under test."""
    return -adv[:, None] * lp


def prompt_mean_oracle(loss, mask, group_size):
    """``(1 / P) sum_g (sum_{i in g, t} m l) / max(sum_{i in g} L_i, 1)``, groups of
    ``group_size`` consecutive sequences."""
    groups = [range(s, s + group_size) for s in range(0, B, group_size)]
    total = loss.new_zeros(())
    for g in groups:
        num = sum(loss[i, t] for i in g for t in range(T) if mask[i, t])
        den = sum(int(mask[i].sum()) for i in g)
        total = total + num / max(den, 1)
    return total / len(groups)


def constant_oracle(loss, mask, divisor):
    """``sum m l / (divisor N)``, ``N`` the sequences."""
    return sum(loss[i, t] for i in range(B) for t in range(T) if mask[i, t]) / (divisor * B)


CASES = [
    ("prompt-mean", dict(prompt_group_size=2), lambda x, m: prompt_mean_oracle(x, m, 2)),
    ("prompt-mean", dict(prompt_group_size=3), lambda x, m: prompt_mean_oracle(x, m, 3)),
    ("constant", dict(loss_agg_divisor=12.5), lambda x, m: constant_oracle(x, m, 12.5)),
]


@pytest.mark.parametrize(("agg", "kw", "oracle"), CASES, ids=["G2", "G3", "constant"])
def test_aggregation_matches_the_definition(agg, kw, oracle):
    lp, old, adv, mask = make(4)
    x = lp.clone().requires_grad_()
    want = oracle(token_loss(x, old, adv), mask)
    (want_grad,) = torch.autograd.grad(want, x)
    cfg = PolicyLossConfig(objective="reinforce", loss_agg=agg, **kw)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(-1).cumsum(0)])
    for layout in ("padded", "packed"):
        x = lp.clone().requires_grad_()
        if layout == "padded":
            loss, _ = policy_loss(x, old, adv, mask, cfg)
        else:
            loss, _ = policy_loss(x[mask], old[mask], adv, mask[mask], cfg, cu_seqlens=cu)
        (grad,) = torch.autograd.grad(loss, x)
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)


def test_prompt_mean_is_not_token_or_sequence_mean():
    """The groups matter: a different grouping changes the loss (the test above would not
    notice prompt-mean silently computed as another mean)."""
    lp, old, adv, mask = make(4)
    losses = {agg: float(policy_loss(lp, old, adv, mask, PolicyLossConfig(
        objective="reinforce", loss_agg=agg, prompt_group_size=2, loss_agg_divisor=T))[0])
        for agg in ("prompt-mean", "token-mean", "seq-mean-token-mean", "constant",
                    "seq-mean-token-sum-norm")}
    assert len({round(v, 12) for k, v in losses.items() if k != "constant"}) == 4
    assert losses["constant"] == pytest.approx(losses["seq-mean-token-sum-norm"], rel=1e-12)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kw", [dict(loss_agg="prompt-mean", prompt_group_size=1),
                                dict(loss_agg="constant", loss_agg_divisor=9.0),
                                dict(loss_agg="token-mean", entropy_coef=0.05,
                                     entropy_agg="prompt-mean", prompt_group_size=1)],
                         ids=["prompt-mean", "constant", "entropy-prompt-mean"])
def test_fused_chunks_get_their_exact_share(kw, layout):
    """Chunks of 8 rows; the chunks' shares add up to the loss of materialised logits (fp64).
    The fused tests' batch has 5 sequences: groups of 1, whose weights differ by sequence, so
    a chunk reading another chunk's weights would show."""
    batch = make_batch()
    if layout == "packed":
        batch = packed(batch)
    cfg = PolicyLossConfig(objective="grpo", beta=0.05, **kw)
    got = run_fused(batch, cfg, max_tile_bytes=rows(8))
    want = run_reference(batch, cfg)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12 * float(w.abs().max()))


def test_bad_config_and_inputs_name_the_field():
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.prompt_group_size"):
        PolicyLossConfig(loss_agg="prompt-mean")
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.prompt_group_size"):
        PolicyLossConfig(entropy_agg="prompt-mean", entropy_coef=0.1)
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.prompt_group_size"):
        PolicyLossConfig(loss_agg="prompt-mean", prompt_group_size=0)
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.loss_agg_divisor"):
        PolicyLossConfig(loss_agg="constant")
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.loss_agg_divisor"):
        PolicyLossConfig(loss_agg="constant", loss_agg_divisor=-2.0)
    lp, old, adv, mask = make(1)
    cfg = PolicyLossConfig(loss_agg="prompt-mean", prompt_group_size=4)
    with pytest.raises(ValueError, match="prompt_group_size: the batch's 6 sequences"):
        policy_loss(lp, old, adv, mask, cfg)
    cfg = PolicyLossConfig(loss_agg="prompt-mean", prompt_group_size=3)
    glob = policy_loss_globals(mask, adv, cfg, old_logprobs=old)
    with pytest.raises(ValueError, match="prompt_group_size: the batch's 2 sequences"):
        policy_loss(lp[:2], old[:2], adv[:2], mask[:2], cfg, batch_globals=glob)


@pytest.mark.parametrize("group_size", [2, 3])
def test_parts_of_whole_groups_sum_to_the_loss(group_size):
    """With the whole batch's `BatchGlobals`, parts made of whole prompt groups return their
    exact shares (the groups' count comes from the globals)."""
    lp, old, adv, mask = make(6)
    cfg = PolicyLossConfig(objective="reinforce", loss_agg="prompt-mean",
                           prompt_group_size=group_size)
    x = lp.clone().requires_grad_()
    full, _ = policy_loss(x, old, adv, mask, cfg)
    (want_grad,) = torch.autograd.grad(full, x)
    glob = policy_loss_globals(mask, adv, cfg, old_logprobs=old)
    x = lp.clone().requires_grad_()
    total = sum(policy_loss(x[s], old[s], adv[s], mask[s], cfg, batch_globals=glob)[0]
                for s in (slice(0, group_size), slice(group_size, B)))
    (grad,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)
