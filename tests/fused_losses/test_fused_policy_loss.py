"""fused_policy_loss equals policy_loss on the fp64 reference's logprobs and entropies, for every
objective, both strategies, packed and padded layouts, with gradients to the head."""

import pytest
import torch

from logitless import PolicyLossConfig, policy_loss, reference
from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss, plan_chunks
from logitless.fused_losses.objectives.catalog import OBJECTIVES
from logitless.kernels import stored_logits_torch

from testing import assert_close_to_oracle

B, T, D, V = 5, 13, 24, 301
HEAD = dict(temperature=0.9, softcap=5.0)


def rows(n):
    """A memory budget of ``n`` chunk rows here (fp64, soft-capped), at the current block."""
    return n * stored_logits_torch.bytes_per_row(V, torch.float64, HEAD["softcap"])


@pytest.fixture(params=[None, 64], ids=["one-block", "vocab-blocks-of-64"])
def vocab_block(request, monkeypatch):
    """The whole vocabulary in one block, or in blocks of 64 (the last one partial)."""
    if request.param is not None:
        monkeypatch.setattr(stored_logits_torch, "VOCAB_BLOCK", request.param)
    return request.param


def make_batch(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64) / D**0.5
    bias = torch.randn(V, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=gen)
    lengths = torch.tensor([13, 7, 0, 11, 4])  # one empty sequence
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask[3, 2] = False  # a tool token inside a response
    with torch.no_grad():
        lp = reference.linear_softmax_stats(hidden, weight, targets, bias, **HEAD)["logprobs"]
    old = lp + 0.15 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = old + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    rollout = old + 0.05 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    rollout[0, 3] = float("nan")
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    cast = lambda x: x.to(dtype)
    return dict(hidden=cast(hidden), weight=cast(weight), bias=cast(bias), targets=targets,
                mask=mask, old=old, ref=ref, rollout=rollout, adv=adv)


def packed(batch):
    m = batch["mask"]
    lengths = m.sum(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    out = dict(batch)
    for k in ("targets", "old", "ref", "rollout"):
        out[k] = batch[k][m]
    out["hidden"] = batch["hidden"][m]
    out["mask"] = torch.ones(int(lengths.sum()), dtype=torch.bool)
    out["cu_seqlens"] = cu
    return out


def config_for(name, **extra):
    base = dict(objective=name, cov_seed=7, cov_fraction=0.2)
    if name in ("clip_cov", "kl_cov"):
        base.update(cov_fraction=0.2)
    else:
        base.pop("cov_fraction")
    base.update(extra)
    return PolicyLossConfig(**base)


def run_fused(batch, cfg, *, with_ref=True, with_rollout=False, **kw):
    leaves = [batch[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss, metrics = fused_policy_loss(
        leaves[0], leaves[1], batch["targets"], batch["old"], batch["adv"], batch["mask"], cfg,
        bias=leaves[2], ref_logprobs=batch["ref"] if with_ref else None,
        rollout_logprobs=batch["rollout"] if with_rollout else None,
        cu_seqlens=batch.get("cu_seqlens"), **HEAD, **kw)
    grads = torch.autograd.grad(loss, leaves)
    return loss, metrics, grads


def run_reference(batch, cfg, *, with_ref=True, with_rollout=False, dtype=torch.float64):
    """The spec: materialised logits in ``dtype``, then the one copy of the objective."""
    leaves = [batch[k].to(dtype).clone().requires_grad_(True)
              for k in ("hidden", "weight", "bias")]
    scored = torch.where(batch["mask"], batch["targets"], -100)
    stats = reference.linear_softmax_stats(leaves[0], leaves[1], scored, leaves[2], **HEAD)
    loss, metrics = policy_loss(
        stats["logprobs"], batch["old"], batch["adv"], batch["mask"], cfg,
        entropy=stats["entropy"], ref_logprobs=batch["ref"] if with_ref else None,
        rollout_logprobs=batch["rollout"] if with_rollout else None,
        cu_seqlens=batch.get("cu_seqlens"))
    grads = torch.autograd.grad(loss, leaves)
    return loss, metrics, grads


def assert_same(got, want, rtol=1e-10):
    (loss, metrics, grads), (loss_r, metrics_r, grads_r) = got, want
    torch.testing.assert_close(loss.double(), loss_r.double(), rtol=rtol, atol=1e-12)
    assert list(metrics) == list(metrics_r)  # the same names: kl only given a reference
    for k, v in metrics_r.items():
        torch.testing.assert_close(metrics[k].double(), v.double(), rtol=rtol, atol=1e-12,
                                   msg=lambda m, k=k: f"metric {k}: {m}")
    for name, g, gr in zip(("hidden", "weight", "bias"), grads, grads_r):
        scale = float(gr.abs().max())
        assert scale > 0, f"d_{name} is zero: the test would not see a wrong gradient"
        torch.testing.assert_close(g.double(), gr.double(), rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, name=name: f"d_{name}: {m}")


OBJECTIVE_EXTRAS = {"dhpo": {"dhpo_mix": "entropy"}}


@pytest.mark.parametrize("layout", ["padded", "packed"])
# the DPPO top-k objectives read top-k inputs: tests/fused_losses/test_dppo.py
@pytest.mark.parametrize("name", sorted(n for n, s in OBJECTIVES.items() if not s.needs_topk))
def test_every_objective_many_chunks(name, layout, vocab_block):
    """A budget of 8 rows splits the batch into several chunks; results equal the spec."""
    batch = make_batch()
    if layout == "packed":
        batch = packed(batch)
    cfg = config_for(name, beta=0.05, **OBJECTIVE_EXTRAS.get(name, {}))
    if layout == "packed" and cfg.loss_agg == "seq-mean-token-sum-norm":
        cfg = config_for(name, beta=0.05, max_response_length=T)
    got = run_fused(batch, cfg, max_tile_bytes=rows(8))
    assert_same(got, run_reference(batch, cfg))


@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
@pytest.mark.parametrize("cfg", [
    dict(objective="grpo", entropy_coef=0.01, beta=0.1, kl_estimator="k3+",
         rollout_is="token", rollout_is_max=2.0),
    dict(objective="dapo", top_entropy_quantile=0.5, rollout_rs="token_k1",
         rollout_rs_threshold="2.0"),
    dict(objective="gspo", ratio_level="sequence_token", opsm_threshold=0.5),
    dict(objective="dr_grpo", dual_clip_c=3.0, delta=2.0),
], ids=["grpo-kl-entropy-tis", "dapo-quantile-rs", "gspo-token-opsm", "drgrpo-dual-delta"])
def test_options_with_rollout_logprobs(cfg, strategy, vocab_block):
    batch = make_batch(seed=1)
    config = PolicyLossConfig(**cfg)
    got = run_fused(batch, config, with_rollout=True, max_tile_bytes=rows(20), strategy=strategy)
    assert_same(got, run_reference(batch, config, with_rollout=True))


def test_sequence_longer_than_budget_is_streamed(monkeypatch):
    """One 13-token sequence with a 6-row budget: streamed alone, exact all the same."""
    from logitless.fused_losses.fused.chunks import ChunkRunner

    calls = []
    real = ChunkRunner._streamed
    monkeypatch.setattr(ChunkRunner, "_streamed",
                        lambda self, chunk, *a: calls.append((chunk.s0, chunk.s1))
                        or real(self, chunk, *a))
    batch = make_batch(seed=2)
    cfg = PolicyLossConfig(objective="grpo", beta=0.02, entropy_coef=0.003)
    got = run_fused(batch, cfg, max_tile_bytes=rows(6))
    assert (0, 1) in calls and (3, 4) in calls  # the 13- and 10-token sequences
    assert_same(got, run_reference(batch, cfg))


@pytest.mark.parametrize("strategy", ["auto", "streaming"])
def test_inputs_are_checked_once(monkeypatch, strategy):
    """The head's arguments and the policy inputs are checked once for the call, not again by
    each chunk (a streamed chunk takes the op's private path, which checks nothing)."""
    from logitless.fused_losses.fused import validation as module
    from logitless.fused_losses.head import logprobs
    from logitless.fused_losses.objectives import policy_inputs

    calls = []
    for mod, name in ((module, "check_head_args"), (logprobs, "check_head_args"),
                      (policy_inputs, "check_shapes")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k:
                            calls.append(_n) or _real(*a, **k))
    batch = make_batch(seed=2)
    cfg = PolicyLossConfig(objective="grpo", top_entropy_quantile=0.5)
    got = run_fused(batch, cfg, max_tile_bytes=rows(6), strategy=strategy)  # 2 streamed chunks
    assert sorted(calls) == ["check_head_args", "check_shapes"]
    assert_same(got, run_reference(batch, cfg))


def test_per_token_clip_bounds_and_beta_are_cut_per_chunk():
    batch = make_batch(seed=3)
    gen = torch.Generator().manual_seed(5)
    cfg = PolicyLossConfig(objective="grpo", eps_low=0.1 + 0.2 * torch.rand(B, T, generator=gen),
                           eps_high=0.2 + 0.2 * torch.rand(B, T, generator=gen),
                           beta=0.1 * torch.rand(B, T, generator=gen, dtype=torch.float64))
    got = run_fused(batch, cfg, max_tile_bytes=rows(9))
    assert_same(got, run_reference(batch, cfg))


def test_frozen_weight_gets_no_weight_gradient():
    batch = make_batch(seed=4)
    cfg = PolicyLossConfig(objective="grpo")
    h = batch["hidden"].clone().requires_grad_(True)
    loss, _ = fused_policy_loss(h, batch["weight"], batch["targets"], batch["old"],
                                batch["adv"], batch["mask"], cfg, bias=batch["bias"],
                                max_tile_bytes=rows(8), **HEAD)
    loss.backward()
    _, _, (g_ref, _, _) = run_reference(batch, cfg, with_ref=False)
    torch.testing.assert_close(h.grad, g_ref, rtol=1e-10, atol=1e-14)


def test_gradient_accumulation_over_two_calls():
    """Two micro-batches with the global normaliser: .grad sums as for the composed loss."""
    cfg = PolicyLossConfig(objective="dapo")
    a, b = make_batch(seed=5), make_batch(seed=6)
    b["weight"], b["bias"] = a["weight"], a["bias"]
    n_items = int(a["mask"].sum() + b["mask"].sum())
    w = a["weight"].clone().requires_grad_(True)
    w_ref = a["weight"].clone().requires_grad_(True)
    for mb in (a, b):
        loss, _ = fused_policy_loss(mb["hidden"], w, mb["targets"], mb["old"], mb["adv"],
                                    mb["mask"], cfg, bias=mb["bias"], num_items_in_batch=n_items,
                                    max_tile_bytes=rows(10), **HEAD)
        loss.backward()
        scored = torch.where(mb["mask"], mb["targets"], -100)
        stats = reference.linear_softmax_stats(mb["hidden"], w_ref, scored, mb["bias"], **HEAD)
        loss_r, _ = policy_loss(stats["logprobs"], mb["old"], mb["adv"], mb["mask"], cfg,
                                entropy=stats["entropy"], num_items_in_batch=n_items)
        loss_r.backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-10, atol=1e-14)


def test_no_grad_returns_the_loss_only():
    batch = make_batch(seed=7)
    cfg = PolicyLossConfig(objective="grpo")
    with torch.no_grad():
        loss, _ = fused_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                    batch["old"], batch["adv"], batch["mask"], cfg,
                                    bias=batch["bias"], **HEAD)
    loss_r, _, _ = run_reference(batch, cfg, with_ref=False)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, loss_r.detach(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
def test_selection_entropy_from_the_old_pass(strategy):
    """The top-entropy selection reads the entropies the caller supplies (old-policy pass), for
    its threshold and for the tokens it keeps: the loss is the unselected one with the selected
    tokens as weights (a selection zeroes a token's policy term, the normalisers unchanged).
    The chunks compared the current entropies with that threshold instead."""
    batch = make_batch(seed=8)
    cfg = PolicyLossConfig(objective="grpo", top_entropy_quantile=0.3)
    old_entropy = torch.rand(B, T, dtype=torch.float64) * 3
    leaves = [batch[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss, _ = fused_policy_loss(leaves[0], leaves[1], batch["targets"], batch["old"],
                                batch["adv"], batch["mask"], cfg, bias=leaves[2],
                                selection_entropy=old_entropy, max_tile_bytes=rows(8),
                                strategy=strategy, **HEAD)
    ref_leaves = [batch[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    scored = torch.where(batch["mask"], batch["targets"], -100)
    stats = reference.linear_softmax_stats(ref_leaves[0], ref_leaves[1], scored, ref_leaves[2],
                                           **HEAD)
    kept = batch["mask"] & (old_entropy >= torch.quantile(old_entropy[batch["mask"]], 0.7))
    loss_r, _ = policy_loss(stats["logprobs"], batch["old"], batch["adv"], batch["mask"],
                            PolicyLossConfig(objective="grpo"), entropy=stats["entropy"],
                            token_weights=kept.double())
    torch.testing.assert_close(loss, loss_r, rtol=1e-10, atol=1e-14)
    for g, gr in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(loss_r, ref_leaves)):
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
@pytest.mark.parametrize("given_entropy", [True, False], ids=["selection-entropy", "current"])
def test_batch_globals_from_the_caller(strategy, given_entropy):
    """``batch_globals`` computed by the caller (here a top-entropy threshold and an
    |A| H threshold of a larger "world" batch, with this batch's own counts, as a trainer over
    several processes builds them): the loss and gradients are `policy_loss`'s with the same
    globals on the fp64 reference's logprobs and entropies, and not those of the call's own
    thresholds."""
    import dataclasses

    from logitless import policy_loss_globals

    batch = make_batch(seed=12)
    cfg = PolicyLossConfig(objective="grpo", top_entropy_quantile=0.6,
                           adv_entropy_top_fraction=0.8, entropy_coef=0.02)
    ref_leaves = [batch[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    scored = torch.where(batch["mask"], batch["targets"], -100)
    stats = reference.linear_softmax_stats(*ref_leaves[:2], scored, ref_leaves[2], **HEAD)
    ent = stats["entropy"].detach()
    own = policy_loss_globals(batch["mask"], batch["adv"], cfg, entropy=ent)
    # thresholds halfway between two of this batch's values, away from its own quantiles
    values = ent[batch["mask"]].sort().values
    scores = (batch["adv"][:, None].abs() * ent)[batch["mask"]].sort().values
    glob = dataclasses.replace(own, entropy_threshold=float(values[6:8].mean()),
                               adv_entropy_threshold=float(scores[3:5].mean()))
    assert glob.entropy_threshold < own.entropy_threshold

    def fused(globals_):
        leaves = [batch[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        loss, metrics = fused_policy_loss(
            leaves[0], leaves[1], batch["targets"], batch["old"], batch["adv"], batch["mask"],
            cfg, bias=leaves[2], selection_entropy=ent if given_entropy else None,
            batch_globals=globals_, max_tile_bytes=rows(8), strategy=strategy, **HEAD)
        return loss, metrics, torch.autograd.grad(loss, leaves)

    loss, metrics, grads = fused(glob)
    loss_r, metrics_r = policy_loss(stats["logprobs"], batch["old"], batch["adv"],
                                    batch["mask"], cfg, entropy=stats["entropy"],
                                    batch_globals=glob)
    torch.testing.assert_close(loss, loss_r, rtol=1e-10, atol=1e-14)
    for g, gr in zip(grads, torch.autograd.grad(loss_r, ref_leaves)):
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-12 * float(gr.abs().max()))
    for name, value in metrics_r.items():
        torch.testing.assert_close(metrics[name], value, rtol=1e-10, atol=1e-14)
    alone, _, _ = fused(None)  # the call's own thresholds select other tokens
    assert abs(float(alone) - float(loss)) > 1e-3 * abs(float(loss))


def test_batch_globals_refusals():
    from logitless import policy_loss_globals

    batch = make_batch(seed=13)
    args = (batch["hidden"], batch["weight"], batch["targets"], batch["old"], batch["adv"],
            batch["mask"])
    cfg = PolicyLossConfig(objective="grpo")
    with pytest.raises(ValueError, match="batch_globals: expected a BatchGlobals"):
        fused_policy_loss(*args, cfg, batch_globals={"entropy_threshold": 1.0})
    cov = PolicyLossConfig(objective="clip_cov")
    glob = policy_loss_globals(batch["mask"], batch["adv"], cov)
    with pytest.raises(ValueError, match="batch_globals: clip_cov selects tokens"):
        fused_policy_loss(*args, cov, batch_globals=glob)
    meta = [a.to("meta") if a.is_floating_point() else a for a in args]  # the op's path
    with pytest.raises(ValueError, match=r"batch_globals: not supported under torch\.compile"):
        fused_policy_loss(*meta, cfg, batch_globals=policy_loss_globals(
            batch["mask"], batch["adv"], cfg))


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_plain_head_in_vocab_blocks(monkeypatch, entropy_coef):
    """No bias, no transform (the usual head), the vocabulary in blocks of 40, 9 rows a chunk."""
    monkeypatch.setattr(stored_logits_torch, "VOCAB_BLOCK", 40)
    b = make_batch(seed=10)
    cfg = PolicyLossConfig(objective="grpo", entropy_coef=entropy_coef)
    leaves = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight")]
    budget = 9 * stored_logits_torch.bytes_per_row(V, torch.float64, None)
    loss, _ = fused_policy_loss(leaves[0], leaves[1], b["targets"], b["old"], b["adv"],
                                b["mask"], cfg, max_tile_bytes=budget)
    ref_leaves = [b[k].clone().requires_grad_(True) for k in ("hidden", "weight")]
    scored = torch.where(b["mask"], b["targets"], -100)
    stats = reference.linear_softmax_stats(ref_leaves[0], ref_leaves[1], scored)
    loss_r, _ = policy_loss(stats["logprobs"], b["old"], b["adv"], b["mask"], cfg,
                            entropy=stats["entropy"])
    torch.testing.assert_close(loss, loss_r, rtol=1e-10, atol=1e-14)
    for g, gr in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(loss_r, ref_leaves)):
        assert gr.abs().max() > 0
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-12 * float(gr.abs().max()))


@pytest.mark.parametrize("softcap", [None, 150.0])
def test_fp32_logits_far_below_the_block_maximum(monkeypatch, softcap):
    """Logits spread over hundreds: most exponentials of a block underflow to 0 in fp32. Their
    probabilities are 0 and so are their gradient terms (the entropy term's log of 0 included);
    the results stay within fp32 PyTorch's own distance from fp64."""
    monkeypatch.setattr(stored_logits_torch, "VOCAB_BLOCK", 64)
    b = make_batch(seed=11)
    b["hidden"] = b["hidden"] * 100.0
    head = dict(temperature=0.8, softcap=softcap)
    cfg = PolicyLossConfig(objective="grpo", entropy_coef=0.05)

    def run(dtype, fused):
        leaves = [b[k].to(dtype).clone().requires_grad_(True)
                  for k in ("hidden", "weight", "bias")]
        if fused:
            loss, _ = fused_policy_loss(leaves[0], leaves[1], b["targets"], b["old"], b["adv"],
                                        b["mask"], cfg, bias=leaves[2], max_tile_bytes=2**20,
                                        **head)
        else:
            scored = torch.where(b["mask"], b["targets"], -100)
            st = reference.linear_softmax_stats(leaves[0], leaves[1], scored, leaves[2], **head)
            loss, _ = policy_loss(st["logprobs"], b["old"], b["adv"], b["mask"], cfg,
                                  entropy=st["entropy"])
        return loss, torch.autograd.grad(loss, leaves)

    ours, exact, same = run(torch.float32, True), run(torch.float64, False), \
        run(torch.float32, False)
    assert torch.isfinite(ours[0]) and all(torch.isfinite(g).all() for g in ours[1])
    assert_close_to_oracle(ours[0], exact[0], same[0], tol=1e-5, name="loss")
    for name, g, ge, gs in zip(("hidden", "weight", "bias"), ours[1], exact[1], same[1]):
        assert_close_to_oracle(g, ge, gs, tol=1e-5 * float(ge.abs().max()), name=f"d_{name}")


@pytest.mark.parametrize("block", [None, 96])
def test_bf16_three_way(monkeypatch, block):
    if block is not None:
        monkeypatch.setattr(stored_logits_torch, "VOCAB_BLOCK", block)
    batch = make_batch(dtype=torch.bfloat16, seed=9)
    cfg = PolicyLossConfig(objective="grpo", entropy_coef=0.01)
    ours = run_fused(batch, cfg, with_ref=False, max_tile_bytes=2**20)
    exact = run_reference(batch, cfg, with_ref=False, dtype=torch.float64)
    same = run_reference(batch, cfg, with_ref=False, dtype=torch.bfloat16)
    assert_close_to_oracle(ours[0], exact[0], same[0], tol=1e-3, name="loss")
    for name, g, ge, gs in zip(("hidden", "weight", "bias"), ours[2], exact[2], same[2]):
        assert_close_to_oracle(g, ge, gs, tol=1e-2 * float(ge.abs().max()), name=f"d_{name}")


def test_plan_chunks():
    assert plan_chunks([3, 4, 2, 9, 1, 0, 5], 6) == [
        (0, 1, False), (1, 3, False), (3, 4, True), (4, 7, False)]
    assert plan_chunks([], 4) == []
    assert plan_chunks([2, 2, 2], 100) == [(0, 3, False)]
    # The fewest chunks (greedy: 3 + 3 + 3 + 3 + 3 + 1 sequences), evened out to 3 or 2 each,
    # contiguous and covering the batch.
    plan = plan_chunks([96] + [128] * 15, 430)
    assert sorted(b - a for a, b, _ in plan) == [2, 2, 3, 3, 3, 3]
    assert [a for a, _, _ in plan[1:]] == [b for _, b, _ in plan[:-1]]
    assert plan[0][0] == 0 and plan[-1][1] == 16
    assert not any(streamed for *_, streamed in plan)
    # Even cuts that would overflow the budget fall back to the greedy ones.
    # (nearest cuts 4 | 4 1 4 | 4: 9 rows in the middle one)
    assert plan_chunks([4, 4, 1, 4, 4], 8) == [(0, 2, False), (2, 4, False), (4, 5, False)]


def test_bad_input():
    batch = make_batch()
    cfg = PolicyLossConfig(objective="grpo")
    args = (batch["hidden"], batch["weight"], batch["targets"], batch["old"], batch["adv"],
            batch["mask"], cfg)
    with pytest.raises(ValueError, match="strategy"):
        fused_policy_loss(*args, strategy="fastest")
    bad_targets = batch["targets"].clone()
    bad_targets[0, 0] = V
    with pytest.raises(ValueError, match="targets"):
        fused_policy_loss(args[0], args[1], bad_targets, *args[3:])
    with pytest.raises(ValueError, match="hidden"):
        fused_policy_loss(args[0][0], *args[1:])


def _chunked_loss(batch, strategy="chunked"):
    leaves = [batch[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss, _ = fused_policy_loss(leaves[0], leaves[1], batch["targets"], batch["old"],
                                batch["adv"], batch["mask"], PolicyLossConfig(objective="grpo"),
                                bias=leaves[2], strategy=strategy, **HEAD)
    return loss, leaves


def test_second_backward_is_refused():
    """The chunked strategy hands its forward-computed gradients to the first backward."""
    loss, leaves = _chunked_loss(make_batch())
    loss.backward(retain_graph=True)
    first = [x.grad.clone() for x in leaves]
    with pytest.raises(RuntimeError, match="backward ran a second time"):
        loss.backward()
    for x, g in zip(leaves, first):  # the first backward's gradients are left as they were
        assert torch.equal(x.grad, g)


def test_create_graph_is_refused():
    loss, leaves = _chunked_loss(make_batch())
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, leaves, create_graph=True)


def test_streaming_backpropagates_a_retained_graph_again():
    loss, leaves = _chunked_loss(make_batch(), strategy="streaming")
    loss.backward(retain_graph=True)
    first = [x.grad.clone() for x in leaves]
    loss.backward()
    for x, g in zip(leaves, first):
        torch.testing.assert_close(x.grad, 2 * g, rtol=1e-14, atol=0)


@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
@pytest.mark.parametrize("name,value", [("num_items_in_batch", 0), ("num_items_in_batch", -4),
                                        ("global_batch_size", 0), ("global_batch_size", -1.0)])
def test_bad_global_counts(strategy, name, value):
    batch = make_batch()
    with pytest.raises(ValueError, match=name):
        fused_policy_loss(batch["hidden"], batch["weight"], batch["targets"], batch["old"],
                          batch["adv"], batch["mask"], PolicyLossConfig(objective="grpo"),
                          strategy=strategy, **{name: value})
