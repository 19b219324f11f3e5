"""Context parallelism (``cp_group=``, issue 26 item 2) on real gloo processes on CPU: every
rank passes its contiguous piece of each sequence, padded or packed, and the loss and the
gradients equal those of the whole sequences on one rank, for every objective of the catalog
and every aggregation (one launch per world size, the configurations looped inside)."""

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.fused_losses.objectives.catalog import OBJECTIVES
from logitless.fused_losses.objectives.config import LOSS_AGGS, PolicyLossConfig
from logitless.reference import policy_loss as reference_policy_loss

from testing import run_on_gloo

B, T = 5, 13
LENGTHS = [13, 3, 9, 1, 7]  # sequence 1 (3 tokens) lies wholly on rank 0 in the padded layout
# Padded layout: the [B, T] grid cut into column pieces, unevenly.
COLUMNS = {2: [4, 9], 3: [4, 1, 8]}
# Packed layout: each sequence's tokens cut into pieces per rank, unevenly; sequence 2 lies
# wholly on the last rank, sequence 3 (one token) wholly on rank 0.
PIECES = {2: [[5, 8], [1, 2], [0, 9], [1, 0], [4, 3]],
          3: [[2, 6, 5], [0, 3, 0], [0, 0, 9], [1, 0, 0], [3, 1, 3]]}
REFUSED = ("clip_cov", "kl_cov")
# Options layered over every objective x aggregation, by turns.
EXTRAS = [
    dict(),
    dict(beta=0.1, kl_estimator="k3", entropy_coef=0.03),
    dict(rollout_is="sequence", rollout_rs="seq_max_k2,seq_mean_k1",
         rollout_rs_threshold="4.0,3.0", future_kl_coef=0.2),
    dict(rollout_is="token", rollout_is_batch_normalize=True, opsm_threshold=0.05,
         kl_bias_correction=True, beta=0.05, kl_estimator="k1"),
    dict(rollout_is="sequence_geometric", rollout_is_batch_normalize=True,
         stapo_prob_threshold=0.6, stapo_entropy_threshold=1.5, seq_count="nonempty",
         entropy_coef=0.02, entropy_agg="token-mean"),
    dict(prob_reweight_alpha=0.3, rollout_is="sequence", rollout_is_mode="mask",
         rollout_is_min=0.3, rollout_is_max=3.0, beta=0.1, kl_estimator="k3+"),
]
# Objective-specific variants, each run with every aggregation as well.
VARIANTS = [
    dict(objective="gspo", ratio_level="sequence_token"),
    dict(objective="gspo", seq_log_ratio_max=0.05),
    dict(objective="minpro", minpro_prefix="preceding"),
    dict(objective="ctpo", prefix_bound_growth="linear"),
    dict(objective="dhpo", dhpo_mix="entropy"),
    dict(objective="cispo", cispo_clip="upper"),
    dict(objective="vespo", rollout_is="sequence"),
]


# prompt-mean is refused with cp_group (its group token counts would span the ranks)
CP_AGGS = tuple(a for a in LOSS_AGGS if a != "prompt-mean")


def _configs():
    names = [n for n in sorted(OBJECTIVES) if n not in REFUSED and not OBJECTIVES[n].needs_topk]
    base = [dict(objective=n) for n in names] + VARIANTS
    k = 0
    for opts in base:
        for agg in CP_AGGS:
            extra = dict(EXTRAS[k % len(EXTRAS)])
            k += 1
            if opts["objective"] == "vespo" and "rollout_is" in opts:
                extra.pop("rollout_is", None)
                extra.pop("rollout_is_batch_normalize", None)
            yield PolicyLossConfig(**opts, **extra, loss_agg=agg, max_response_length=T + 2,
                                   loss_agg_divisor=T + 0.5)


def _problem(per_token_adv: bool):
    """The whole batch, right-padded ``[B, T]`` (fp64), the same on every rank."""
    g = torch.Generator().manual_seed(7)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    mask[0, 0] = mask[2, 4] = mask[4, 2] = False  # masked tokens inside sequences
    rnd = lambda: torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = -rnd().abs() - 0.05
    old = lp + 0.2 * rnd()
    tensors = dict(ref_logprobs=lp + 0.3 * rnd(), rollout_logprobs=old + 0.15 * rnd(),
                   token_weights=0.5 + torch.rand(B, T, generator=g, dtype=torch.float64))
    tensors["rollout_logprobs"][2, 1] = torch.nan  # a rollout value the engine did not give
    entropy = rnd().abs() + 0.1
    adv = rnd() if per_token_adv else torch.tensor([0.7, -1.3, 0.4, -0.2, 1.1],
                                                   dtype=torch.float64)
    return mask, lp, old, entropy, adv, tensors


def _whole(cfg, mask, lp, old, entropy, adv, tensors):
    """Loss and gradients (of lp, entropy) of the whole batch on one rank."""
    lp, entropy = lp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    loss, _ = logitless.policy_loss(lp, old, adv, mask, cfg, entropy=entropy, **tensors)
    loss.backward()
    return loss.detach(), lp.grad, entropy.grad


def _padded_piece(world, rank, x):
    lo = sum(COLUMNS[world][:rank])
    return x[:, lo:lo + COLUMNS[world][rank]]


def _packed_piece(world, rank, x):
    """The rank's tokens of each sequence, packed, and its local ``cu_seqlens``."""
    parts, lens = [], []
    for i, pieces in enumerate(PIECES[world]):
        lo = sum(pieces[:rank])
        parts.append(x[i, lo:lo + pieces[rank]])
        lens.append(pieces[rank])
    cu = torch.tensor([0, *lens]).cumsum(0)
    return torch.cat(parts), cu


def _grid_of_packed(world, rank, flat):
    """A rank's packed per-token values back on the whole batch's grid (zero elsewhere)."""
    out = torch.zeros(B, T, dtype=flat.dtype)
    at = 0
    for i, pieces in enumerate(PIECES[world]):
        lo = sum(pieces[:rank])
        out[i, lo:lo + pieces[rank]] = flat[at:at + pieces[rank]]
        at += pieces[rank]
    return out


def _sharded(cfg, world, rank, layout, mask, lp, old, entropy, adv, tensors):
    """The rank's loss and its gradients (of lp, entropy) on the whole grid (zero elsewhere)."""
    group = dist.group.WORLD
    per_token = adv.shape == mask.shape
    if layout == "padded":
        cut = lambda x: _padded_piece(world, rank, x)
        extra = {}
    else:
        cut = lambda x: _packed_piece(world, rank, x)[0]
        extra = dict(cu_seqlens=_packed_piece(world, rank, mask)[1])
    my_lp = cut(lp).clone().requires_grad_(True)
    my_ent = cut(entropy).clone().requires_grad_(True)
    loss, _ = logitless.policy_loss(
        my_lp, cut(old), cut(adv) if per_token else adv, cut(mask), cfg, entropy=my_ent,
        **{k: cut(v) for k, v in tensors.items()}, cp_group=group, **extra)
    loss.backward()
    local = [torch.zeros_like(x) if x.grad is None else x.grad for x in (my_lp, my_ent)]
    if layout == "padded":
        grids = []
        for g in local:
            full = torch.zeros(B, T, dtype=g.dtype)
            _padded_piece(world, rank, full).copy_(g)
            grids.append(full)
    else:
        grids = [_grid_of_packed(world, rank, g) for g in local]
    return loss.detach(), *grids


def _check_policy_loss(rank, world):
    problems = [_problem(False), _problem(True)]  # advantages per sequence, per token
    for k, cfg in enumerate(_configs()):
        per_token_adv = k % 3 == 1  # by turns (not in step with EXTRAS' period of 6)
        problem = problems[per_token_adv]
        expected = _whole(cfg, *problem)
        for layout in ("padded", "packed"):
            got = _sharded(cfg, world, rank, layout, *problem)
            grads = torch.stack(got[1:])
            dist.all_reduce(grads)  # every rank's tokens' gradients, on the whole grid
            where = f"{cfg.objective}/{cfg.loss_agg}/{layout}/adv per token {per_token_adv}"
            torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=1e-13,
                                       msg=lambda m, w=where: f"loss {w}: {m}")
            for name, g, e in zip(("lp", "entropy"), grads, expected[1:]):
                e = torch.zeros_like(g) if e is None else e
                torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-13,
                                           msg=lambda m, w=where, n=name: f"{n} {w}: {m}")


def _check_reference(rank, world):
    """A few configurations against the fp64 token-by-token reference of the whole batch."""
    mask, lp, old, entropy, adv, tensors = _problem(True)
    for cfg in (PolicyLossConfig(objective="gspo", beta=0.1, entropy_coef=0.01),
                PolicyLossConfig(objective="ctpo", loss_agg="seq-mean-token-mean"),
                PolicyLossConfig(objective="grpo", rollout_is="sequence", future_kl_coef=0.1)):
        x = lp.clone().requires_grad_(True)
        ref = reference_policy_loss(x, old, adv, mask, cfg, entropy=entropy, **tensors)
        ref.backward()
        got = _sharded(cfg, world, rank, "packed", mask, lp, old, entropy, adv, tensors)
        grad = got[1].clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(got[0], ref.detach(), rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(grad, x.grad, rtol=1e-11, atol=1e-13)


def _cut(world, rank, layout, mask):
    """The rank's piece of a per-token tensor in ``layout`` (a function) and the keywords
    of that layout (packed: the rank's ``cu_seqlens``)."""
    if layout == "padded":
        return (lambda x: _padded_piece(world, rank, x)), {}
    return (lambda x: _packed_piece(world, rank, x)[0],
            dict(cu_seqlens=_packed_piece(world, rank, mask)[1]))


def _check_fused(rank, world):
    """fused_policy_loss under cp_group: loss, and gradients of hidden, weight and bias."""
    g = torch.Generator().manual_seed(3)
    d, v = 16, 37
    mask, _, old, _, adv, tensors = _problem(False)
    hidden = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (B, T), generator=g)
    group = dist.group.WORLD
    for cfg in (PolicyLossConfig(objective="gspo", beta=0.1, entropy_coef=0.02),
                PolicyLossConfig(objective="dhpo", dhpo_mix="entropy", loss_agg="balanced",
                                 rollout_is="sequence"),
                PolicyLossConfig(objective="ctpo", loss_agg="seq-mean-token-mean",
                                 future_kl_coef=0.1)):
        full = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        expected, _ = logitless.fused_policy_loss(full[0], full[1], targets, old, adv, mask,
                                                  cfg, bias=full[2], **tensors)
        expected.backward()
        for layout in ("padded", "packed"):
            cut, extra = _cut(world, rank, layout, mask)
            h = cut(hidden).clone().requires_grad_(True)
            w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
            loss, _ = logitless.fused_policy_loss(
                h, w, cut(targets), cut(old), adv, cut(mask), cfg, bias=b,
                **{k: cut(x) for k, x in tensors.items()}, cp_group=group, **extra)
            loss.backward()
            torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(h.grad, cut(full[0].grad), rtol=1e-11, atol=1e-13)
            wb = torch.cat([w.grad.flatten(), b.grad])
            dist.all_reduce(wb)  # the head's gradient: summed over the group, as for any model
            torch.testing.assert_close(wb, torch.cat([full[1].grad.flatten(), full[2].grad]),
                                       rtol=1e-11, atol=1e-13)


def _worker(rank, world):
    _check_policy_loss(rank, world)
    _check_reference(rank, world)
    _check_fused(rank, world)


@pytest.mark.dist  # a minute and a half on two cores: make test-dist
@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_matches_whole_sequences(world):
    run_on_gloo(world, _worker)


def test_cp_configs_cover_the_catalog():
    """The launch above runs every objective (but the two refused) with every aggregation."""
    seen = {(c.objective, c.loss_agg) for c in _configs()}
    names = {n for n in OBJECTIVES if not OBJECTIVES[n].needs_topk} - set(REFUSED)
    assert seen == {(n, a) for n in names for a in CP_AGGS}


def _refusals(rank, world):
    group = dist.group.WORLD
    lp = torch.randn(2, 3, dtype=torch.float64)
    mask, adv = torch.ones(2, 3), torch.ones(2)
    cases = [
        (dict(objective="clip_cov"), "objective"),
        (dict(objective="kl_cov"), "objective"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
        (dict(adv_entropy_top_fraction=0.5), "adv_entropy_top_fraction"),
        (dict(attn_entropy_weighting="tanh"), "attn_entropy_weighting"),
        (dict(loss_agg="seq-mean-token-sum-norm"), "max_response_length"),
        (dict(loss_agg="prompt-mean", prompt_group_size=2), "loss_agg"),
    ]
    for opts, name in cases:
        with pytest.raises(ValueError, match=rf"^{name}:"):
            logitless.policy_loss(lp, lp, adv, mask, PolicyLossConfig(**opts), entropy=-lp,
                                  attention_entropy=-lp, cp_group=group)
    cfg = PolicyLossConfig()
    glob = logitless.policy_loss_globals(mask, adv, cfg)
    with pytest.raises(ValueError, match=r"^batch_globals:"):
        logitless.policy_loss(lp, lp, adv, mask, cfg, batch_globals=glob, cp_group=group)
    with pytest.raises(ValueError, match=r"^cp_group:"):
        logitless.policy_loss(lp, lp, adv, mask, cfg, cp_group="world")
    hidden, weight = torch.randn(2, 3, 4), torch.randn(5, 4)
    targets = torch.zeros(2, 3, dtype=torch.long)
    # chunks of one rank's tokens only where no term reads a whole sequence (GSPO's ratio)
    with pytest.raises(ValueError, match=r"^strategy: .*ratio_level='sequence'"):
        logitless.fused_policy_loss(hidden, weight, targets, lp, adv, mask,
                                    PolicyLossConfig(objective="gspo"), strategy="chunked",
                                    cp_group=group)


def test_cp_group_needs_torch_distributed():
    lp = torch.randn(2, 3)
    cfg = PolicyLossConfig()
    with pytest.raises(ValueError, match=r"^cp_group: torch\.distributed is not initialised"):
        logitless.policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), cfg, cp_group=object())


# Collectives of one call, forward and backward (docs/scale.md): the counts of the batch's
# normalisers and the loss value (2), plus each sequence-level reduction of the objective.
COLLECTIVES = [
    (dict(objective="grpo"), 2),
    (dict(objective="gspo"), 4),  # + the sequence ratio's mean, and its backward
    (dict(objective="ctpo"), 5),  # + the prefix sums' rank totals (forward, backward), counts
    (dict(objective="minpro"), 3),  # + the rank minima
    (dict(objective="grpo", rollout_is="sequence", rollout_is_batch_normalize=True), 5),
    (dict(objective="gspo", beta=0.1, entropy_coef=0.01, rollout_is="sequence",
          rollout_rs="seq_max_k2", rollout_rs_threshold="4.0", opsm_threshold=0.1), 8),
]


def _count_collectives(rank, world):
    problem = _problem(False)
    orig = dist.all_reduce
    for opts, expected in COLLECTIVES:
        calls = []

        def counted(*args, calls=calls, **kwargs):
            calls.append(1)
            return orig(*args, **kwargs)

        dist.all_reduce = counted
        try:
            _sharded(PolicyLossConfig(**opts), world, rank, "packed", *problem)
        finally:
            dist.all_reduce = orig
        assert len(calls) == expected, (opts, len(calls))


def _explicit_group(rank, world):
    from logitless.fused_losses.objectives import segments
    from logitless.fused_losses.objectives.catalog import ObjectiveOutput, register_objective
    from logitless.reference import segments as ref

    g = torch.Generator().manual_seed(12)
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.rand(B, T, generator=g) < 0.7
    group = dist.group.WORLD
    px, pm = _padded_piece(world, rank, x), _padded_piece(world, rank, m)
    whole_sum = ref.segment_sum_loop(x, m)
    count = m.sum(-1)
    checks = [
        (segments.segment_sum(px, pm, group=group), whole_sum),
        (segments.segment_count(pm, group=group), count),
        (segments.segment_mean(px, pm, group=group), whole_sum / count.clamp(min=1)),
        (segments.segment_max(px, pm, group=group),
         torch.stack([x[i][m[i]].max() if m[i].any() else x.new_zeros(()) for i in range(B)])),
        (segments.prefix_sum(px, pm, group=group),
         _padded_piece(world, rank, ref.prefix_sum_loop(x, m))),
        (segments.suffix_sum(px, pm, group=group),
         _padded_piece(world, rank, ref.suffix_sum_loop(x, m))),
        (segments.prefix_min(px, pm, group=group, exclusive=True),
         _padded_piece(world, rank, ref.prefix_min_loop(x, m, exclusive=True))),
        # no group: this rank's tokens only, whatever call runs over a group
        (segments.segment_sum(px, pm), ref.segment_sum_loop(px, pm)),
    ]
    for i, (got, want) in enumerate(checks):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-12, atol=1e-12, msg=str(i))

    seen = []

    @register_objective("test_sees_its_group")
    def _sees(x):
        seen.append(x.cp_group)
        share = segments.segment_mean(x.d, x.m, group=x.cp_group)[:, None].expand_as(x.d)
        return ObjectiveOutput(-x.adv * torch.exp(share))

    lp, old, adv = px.clone().requires_grad_(), px - 0.1, torch.randn(B, generator=g).double()
    cfg = PolicyLossConfig(objective="test_sees_its_group")
    logitless.policy_loss(lp, old, adv, pm, cfg, cp_group=group)
    logitless.policy_loss(lp, old, adv, pm, cfg)
    assert seen == [group, None]


# fused_policy_loss's chunks under cp_group: configurations whose every term is the rank's
# tokens' own given the batch's globals (`cp_sequence_terms`)
CHUNKED_CP = [
    dict(objective="grpo", loss_agg="token-mean", beta=0.1, kl_estimator="k3",
         entropy_coef=0.02),
    dict(objective="dapo", entropy_coef=0.03),
    dict(objective="grpo", loss_agg="seq-mean-token-sum-norm", max_response_length=T + 2,
         beta=0.05, kl_estimator="k3", entropy_coef=0.01),
    dict(objective="grpo", loss_agg="seq-mean-token-mean", rollout_is="token",
         rollout_is_batch_normalize=True, rollout_rs="seq_max_k2", rollout_rs_threshold="4.0"),
    dict(objective="grpo", loss_agg="seq-mean-token-mean", kl_estimator="exact", beta=0.1,
         stapo_prob_threshold=0.6, stapo_entropy_threshold=1.5),
]


def _check_fused_chunks(rank, world):
    """fused_policy_loss(cp_group=) in chunks of the rank's tokens (several per rank): the
    loss the whole batch's (single-process fused_policy_loss and the fp64 oracle), the metrics
    those of the streamed CP call, ``hidden``'s gradient the whole loss's at the rank's tokens,
    the head's summed over the group the whole loss's, in 3 GEMM passes of the rank's rows."""
    from torch.utils.flop_counter import FlopCounterMode

    from logitless.fused_losses.fused import chunks
    from logitless.kernels.stored_logits_torch import bytes_per_row
    from logitless.reference import fused_policy_loss as reference_fused

    g = torch.Generator().manual_seed(11)
    d, v = 16, 37
    mask, _, old, _, adv, tensors = _problem(False)
    tensors = dict(ref_logprobs=tensors["ref_logprobs"],
                   rollout_logprobs=old + 0.1 * torch.randn(B, T, generator=g,
                                                            dtype=torch.float64))
    hidden = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (B, T), generator=g)
    ref_head = dict(ref_hidden=torch.randn(B, T, d + 3, generator=g, dtype=torch.float64),
                    ref_weight=torch.randn(v, d + 3, generator=g, dtype=torch.float64) / d**0.5)
    group = dist.group.WORLD
    plans, orig = [], chunks.make_plan

    def planned(*args):
        plans.append(orig(*args))
        return plans[-1]

    chunks.make_plan = planned
    try:
        for opts in CHUNKED_CP:
            cfg = PolicyLossConfig(**opts)
            # the exact KL from the reference head
            exact = cfg.kl_estimator == "exact"
            given = dict(tensors, ref_logprobs=None, **ref_head) if exact else tensors
            full = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
            expected, _ = logitless.fused_policy_loss(full[0], full[1], targets, old, adv, mask,
                                                      cfg, bias=full[2], **given)
            expected.backward()
            # the fp64 oracle has neither rollout_is_batch_normalize nor the exact KL's head
            by_oracle = not (cfg.rollout_is_batch_normalize or exact)
            wants = [full]
            if by_oracle:
                oracle = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
                ref = reference_fused(oracle[0], oracle[1], targets, old, adv, mask, cfg,
                                      bias=oracle[2], **tensors)
                ref.backward()
                wants.append(oracle)
            for layout in ("padded", "packed"):
                cut, extra = _cut(world, rank, layout, mask)
                where = f"{cfg.objective}/{cfg.loss_agg}/{layout}"
                grid = cut(mask) if layout == "padded" else _grid_of_packed(
                    world, rank, cut(mask).double())
                # chunks of the rank's longest piece of a sequence: several, none streamed
                budget = int(grid.sum(-1).max()) * bytes_per_row(v, torch.float64, None)
                got = {}
                for strategy in ("chunked", "streaming"):
                    h = cut(hidden).clone().requires_grad_(True)
                    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
                    plans.clear()
                    with FlopCounterMode(display=False) as flops:
                        loss, metrics = logitless.fused_policy_loss(
                            h, w, cut(targets), cut(old), adv, cut(mask), cfg, bias=b,
                            **{k: x if x is None or k == "ref_weight" else cut(x)
                               for k, x in given.items()},
                            cp_group=group,
                            max_tile_bytes=budget, strategy=strategy, **extra)
                        loss.backward()
                    got[strategy] = (loss.detach(), metrics, h.grad, w.grad, b.grad,
                                     flops.get_total_flops(), list(plans))
                loss, metrics, gh, gw, gb, flop, plan = got["chunked"]
                rows = int(cut(mask).sum())
                assert len(plan) == 1 and len(plan[0].chunks) >= 2, where  # several chunks
                assert not any(c.streamed for c in plan[0].chunks), where
                if not exact:  # 3 GEMM passes (the exact KL adds the reference head's, and
                    # STAPO a no-grad pass for the entropies of its globals)
                    assert flop == 3 * 2 * rows * d * v, (where, flop, rows)
                    assert got["streaming"][5] > flop, where  # streamed: recomputed backward
                torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-13,
                                           msg=lambda m, w=where: f"loss {w}: {m}")
                if by_oracle:
                    torch.testing.assert_close(loss, ref.detach(), rtol=1e-11, atol=1e-13)
                stream = got["streaming"][1]
                assert metrics.keys() == stream.keys(), where
                for name, value in metrics.items():  # the rank's tokens' metrics, as streamed
                    torch.testing.assert_close(value, stream[name], rtol=1e-12, atol=1e-13,
                                               msg=lambda m, w=where, n=name: f"{n} {w}: {m}")
                for want in wants:
                    torch.testing.assert_close(gh, cut(want[0].grad), rtol=1e-11, atol=1e-13)
                wb = torch.cat([gw.flatten(), gb])
                dist.all_reduce(wb)  # the head's gradient: summed over the group
                for want in wants:
                    torch.testing.assert_close(
                        wb, torch.cat([want[1].grad.flatten(), want[2].grad]), rtol=1e-11,
                        atol=1e-13, msg=lambda m, w=where: f"head {w}: {m}")
    finally:
        chunks.make_plan = orig


def _sequence_sum_objective(x):
    """A user objective that sums each sequence's log-ratio over the group (as the registry's
    comment says to: ``group=x.cp_group``)."""
    from logitless.fused_losses.objectives import segments
    from logitless.fused_losses.objectives.catalog import ObjectiveOutput

    total = segments.segment_sum(x.d, x.m, group=x.cp_group)[:, None].expand_as(x.d)
    return ObjectiveOutput(-x.adv * torch.exp(0.5 * total))


def _check_unflagged_objective(rank, world):
    """An objective reducing per sequence over ``x.cp_group`` but registered without
    ``reads_sequences``: fused_policy_loss(cp_group=) would run it on each rank's own chunks
    (several here, a different plan per rank), so the collective is refused with a
    ``ValueError`` naming the fix, on every rank and before any collective runs (the launch
    goes on: no rank is left in one). Registered with the flag, the batch streams and the
    loss and gradients are those of the whole batch on one process."""
    from logitless.fused_losses.objectives.catalog import register_objective
    from logitless.kernels.stored_logits_torch import bytes_per_row

    register_objective("test_sums_unflagged")(_sequence_sum_objective)
    register_objective("test_sums_flagged", reads_sequences=True)(_sequence_sum_objective)
    g = torch.Generator().manual_seed(17)
    d, v = 16, 37
    mask, _, old, _, adv, _ = _problem(False)
    hidden = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5
    targets = torch.randint(0, v, (B, T), generator=g)
    cut, _ = _cut(world, rank, "padded", mask)
    budget = int(cut(mask).sum(-1).max()) * bytes_per_row(v, torch.float64, None)
    group = dist.group.WORLD
    with pytest.raises(ValueError, match=r"^objective: 'test_sums_unflagged' .* reads whole "
                       r"sequences under cp_group: register it with reads_sequences=True"):
        logitless.fused_policy_loss(cut(hidden).requires_grad_(True), weight, cut(targets),
                                    cut(old), adv, cut(mask),
                                    PolicyLossConfig(objective="test_sums_unflagged"),
                                    cp_group=group, max_tile_bytes=budget)
    cfg = PolicyLossConfig(objective="test_sums_flagged")
    full = hidden.clone().requires_grad_(True)
    expected, _ = logitless.fused_policy_loss(full, weight, targets, old, adv, mask, cfg)
    expected.backward()
    h = cut(hidden).clone().requires_grad_(True)
    loss, _ = logitless.fused_policy_loss(h, weight, cut(targets), cut(old), adv, cut(mask), cfg,
                                          cp_group=group, max_tile_bytes=budget)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(h.grad, cut(full.grad), rtol=1e-11, atol=1e-13)


def _refusals_collectives_and_groups(rank, world):
    _refusals(rank, world)
    _count_collectives(rank, world)
    _explicit_group(rank, world)
    _check_fused_chunks(rank, world)
    _check_unflagged_objective(rank, world)


@pytest.mark.dist  # gloo ranks, as every multi-process test: make test-dist
def test_cp_refusals_collectives_and_explicit_groups():
    """One launch of two ranks for five checks (a launch costs more than any of them): the
    refusals name the option; the collectives of one call; the segment ops reduce over the
    group passed to them (``group=``), never over one set by an enclosing call, with an
    objective reading the call's group from its inputs (``x.cp_group``: None without one);
    fused_policy_loss's chunks under cp_group (3 GEMM passes); and an objective reducing over
    the group without ``reads_sequences`` refused there. A collective that waits on a peer
    for minutes (a rank left in one) fails the launch instead of hanging it."""
    run_on_gloo(2, _refusals_collectives_and_groups, timeout=300)
