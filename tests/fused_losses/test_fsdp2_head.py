"""FSDP2 DTensor heads (``fully_shard``, ``Shard(0)`` over the vocabulary) without a weight
gather, on real gloo process groups on CPU: each rank scores its own tokens (unequal counts,
the vocabulary not divisible by the world size) and the values and gradients equal one process
running every rank's tokens through the unsharded head in fp64 (``logitless.reference``), with
the loss ``mean_r loss_r`` for the weight and bias (FSDP2's average) and ``loss_r`` for rank r's
hidden rows."""

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless import PolicyLossConfig, reference

from testing import MatmulFlops, run_on_gloo

pytestmark = pytest.mark.dist

V, D = 37, 24  # 37 rows: 19 + 18 on two ranks, 13 + 13 + 11 on three
COUNTS = {2: [11, 6], 3: [7, 12, 0]}  # a rank may hold no tokens


def _problem(world, seed=0):
    """The same full problem on every rank: the head and each rank's tokens."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64) / D**0.5 * 2
    bias = torch.randn(V, generator=gen, dtype=torch.float64)
    ranks = []
    for n in COUNTS[world]:
        hidden = torch.randn(n, D, generator=gen, dtype=torch.float64)
        targets = torch.randint(0, V, (n,), generator=gen)
        targets[1::4] = -100
        ranks.append((hidden, targets))
    return gen, weight, bias, ranks


def _sharded_head(weight, bias, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    head = torch.nn.Linear(D, V, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    fully_shard(head, mesh=init_device_mesh("cpu", (world,)))
    assert type(head.weight).__name__ == "DTensor"
    return head


def _shard(full, rank, world):
    return full.chunk(world)[rank]  # FSDP2's Shard(0): torch.chunk's rows in rank order


def _check_reference(rank, world, head, weight, bias, ranks, ours_of, ref_of, names, tol):
    """``ours_of(hidden, targets, w, b)`` on the sharded head against ``ref_of`` (same
    arguments, dict of per-token fp64 tensors) on the unsharded head: every output, rank r's
    hidden gradient of ``loss_r`` and the shards' gradients of ``mean_r loss_r``."""
    gen = torch.Generator().manual_seed(1)
    upstream = [[torch.randn(len(t), generator=gen, dtype=torch.float64) for _ in names]
                for _, t in ranks]

    def loss(outs, r):
        return sum((o * u).sum() for o, u in zip(outs, upstream[r]))

    w = weight.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True)
    hs = [h.clone().requires_grad_(True) for h, _ in ranks]
    refs = [ref_of(h, t, w, b) for h, (_, t) in zip(hs, ranks)]
    total = sum(loss([ref[n] for n in names], r) for r, ref in enumerate(refs)) / world
    total.backward()

    hidden, targets = ranks[rank]
    h = hidden.clone().requires_grad_(True)
    out = ours_of(h, targets, head.weight, head.bias)
    loss([getattr(out, n) for n in names], rank).backward()
    for n in names:
        torch.testing.assert_close(getattr(out, n), refs[rank][n].detach(), rtol=tol, atol=tol)
    # rank r's loss is loss_r: its hidden rows get d loss_r / d h_r = world * d total / d h_r
    torch.testing.assert_close(h.grad, hs[rank].grad * world, rtol=tol, atol=tol)
    for param, full in ((head.weight, w), (head.bias, b)):
        grad = param.grad
        assert type(grad).__name__ == "DTensor" and tuple(grad.placements) == tuple(
            param.placements)
        torch.testing.assert_close(grad.to_local(), _shard(full.grad, rank, world),
                                   rtol=tol, atol=tol)
        param.grad = None


def _check_logprobs(rank, world, softcap):
    _, weight, bias, ranks = _problem(world)
    head = _sharded_head(weight, bias, world)
    opts = dict(temperature=0.8, softcap=softcap)
    names = ("logprobs", "entropy", "sum_p_sq", "mean_logit", "lse")

    def ours(h, t, w, b):
        out = logitless.linear_logprobs(h, w, t, bias=b, return_entropy=True,
                                        stats=("sum_p_sq", "mean_logit", "is_top1", "lse"),
                                        **opts)
        expected = reference.linear_logprobs(h.detach(), weight, t, bias=bias,
                                             stats=("is_top1",), **opts).is_top1
        assert torch.equal(out.is_top1, expected)
        return out

    def ref(h, t, w, b):
        return vars(reference.linear_logprobs(h, w, t, bias=b, return_entropy=True,
                                              stats=names[2:], **opts))

    _check_reference(rank, world, head, weight, bias, ranks, ours, ref, names, 1e-10)


def _check_sampled(rank, world):
    """Per-token settings (a temperature and a top-k per token) are gathered with the tokens;
    the distributed select gives the unsharded kept set."""
    gen, weight, bias, ranks = _problem(world, seed=2)
    head = _sharded_head(weight, bias, world)
    settings = [(0.5 + torch.rand(len(t), generator=gen, dtype=torch.float64),
                 torch.randint(3, V, (len(t),), generator=gen)) for _, t in ranks]
    temp_of = {id(t): s for (_, t), s in zip(ranks, settings)}

    def ours(h, t, w, b):
        temperature, top_k = temp_of[id(t)]
        return logitless.linear_logprobs(h, w, t, bias=b, temperature=temperature,
                                         top_k=top_k, return_entropy=True)

    def ref(h, t, w, b):
        if not len(t):  # a rank without tokens (the reference sampler needs one)
            return {"logprobs": h.sum(-1), "entropy": h.sum(-1)}
        temperature, top_k = temp_of[id(t)]
        return vars(reference.linear_logprobs(h, w, t, bias=b, temperature=temperature,
                                              top_k=top_k, return_entropy=True))

    # the targets lie in the kept set (finite logprobs): a gradient check needs them there
    for r, (h, t) in enumerate(ranks):
        if not len(t):
            continue
        keep = reference.linear_logprobs(h, weight, t, bias=bias, temperature=settings[r][0],
                                         top_k=settings[r][1]).logprobs.isfinite()
        t[~keep] = -100
    _check_reference(rank, world, head, weight, bias, ranks, ours, ref,
                     ("logprobs", "entropy"), 1e-10)


def _check_fused(rank, world):
    """``fused_policy_loss`` on the DTensor head against the reference loss of each rank's own
    batch: in chunks (``"auto"``, ``"chunked"``: the ranks' batches in turn, three GEMM passes
    over the local slice), with a selection by entropy, and streamed (four); ``vocab_parallel``
    and the exact KL refused."""
    gen, weight, bias, _ = _problem(world, seed=3)
    head = _sharded_head(weight, bias, world)
    config = PolicyLossConfig(objective="grpo", entropy_coef=0.01)
    batches = []
    for r in range(world):
        b_, t_ = 2, 3 + 2 * r  # a padded [B, T] batch a rank, of the rank's own size
        hidden = torch.randn(b_, t_, D, generator=gen, dtype=torch.float64)
        targets = torch.randint(0, V, (b_, t_), generator=gen)
        mask = torch.ones(b_, t_, dtype=torch.bool)
        mask[1, t_ - 1 - r:] = False
        old = -torch.rand(b_, t_, generator=gen, dtype=torch.float64) * 3
        adv = torch.randn(b_, generator=gen, dtype=torch.float64)
        batches.append((hidden, targets, old, adv, mask))
    hidden, targets, old, adv, mask = batches[rank]
    h = hidden.clone().requires_grad_(True)
    rows = sum(int(x[4].sum()) for x in batches)  # every rank's loss rows
    v_local = head.weight.to_local().shape[0]
    # (config, {strategy: the head's GEMM passes in aten matmuls}): in chunks they are the only
    # ones, over every rank's rows and the local slice; not counted (None) where the head
    # streams (logitless's kernels) or a selection by entropy adds its no-grad pass (its rows
    # padded to a tile)
    cases = ((config, {"auto": 3, "chunked": 3, "streaming": None}),
             (PolicyLossConfig(objective="dapo", top_entropy_quantile=0.5), {"auto": None}))
    for cfg, strategies in cases:
        w = weight.clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        hs = [x[0].clone().requires_grad_(True) for x in batches]
        losses = [reference.fused_policy_loss(h_, w, t, old_, adv_, m, cfg, bias=b)
                  for h_, (_, t, old_, adv_, m) in zip(hs, batches)]
        (sum(losses) / world).backward()
        for strategy, passes in strategies.items():
            counter = MatmulFlops()
            counter.counting = True
            with counter:
                loss, _ = logitless.fused_policy_loss(h, head.weight, targets, old, adv, mask,
                                                      cfg, bias=head.bias, strategy=strategy)
                loss.backward()
            if passes is not None:
                assert counter.flops == passes * 2 * rows * D * v_local, (strategy,
                                                                          counter.flops)
            torch.testing.assert_close(loss.detach(), losses[rank].detach(), rtol=1e-10,
                                       atol=1e-12)
            torch.testing.assert_close(h.grad, hs[rank].grad * world, rtol=1e-10, atol=1e-12)
            for param, full in ((head.weight, w), (head.bias, b)):
                torch.testing.assert_close(param.grad.to_local(),
                                           _shard(full.grad, rank, world),
                                           rtol=1e-10, atol=1e-12)
                param.grad = None
            h.grad = None
    # each rank's slice gradient holds every rank's batch: a loss scaled differently on each
    # rank cannot be split after the fact, so every rank's backward refuses it
    loss, _ = logitless.fused_policy_loss(h, head.weight, targets, old, adv, mask, config,
                                          bias=head.bias)
    with pytest.raises(RuntimeError, match="incoming gradient differs across the ranks"):
        (loss * (rank + 1)).backward()
    h.grad = head.weight.grad = head.bias.grad = None
    # a per-rank count given as a number (HF's num_items_in_batch when tokens are not averaged
    # over the devices): each batch is normalised by its own rank's count, not this rank's
    counts = [float(7 + 5 * r) for r in range(world)]
    token_mean = PolicyLossConfig(objective="grpo", loss_agg="token-mean")
    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    for (h_, t, old_, adv_, m), n_items in zip(batches, counts):
        logitless.fused_policy_loss(h_, w, t, old_, adv_, m, token_mean, bias=b,
                                    num_items_in_batch=n_items)[0].div(world).backward()
    loss, _ = logitless.fused_policy_loss(h, head.weight, targets, old, adv, mask, token_mean,
                                          bias=head.bias, num_items_in_batch=counts[rank])
    loss.backward()
    for param, full in ((head.weight, w), (head.bias, b)):
        torch.testing.assert_close(param.grad.to_local(), _shard(full.grad, rank, world),
                                   rtol=1e-10, atol=1e-12)
    h.grad = head.weight.grad = head.bias.grad = None
    with pytest.raises(ValueError, match="vocab_parallel"):
        logitless.fused_policy_loss(h, head.weight, targets, old, adv, mask, config,
                                    bias=head.bias, vocab_parallel=dist.group.WORLD)
    kl = PolicyLossConfig(objective="grpo", beta=0.1, kl_estimator="exact")
    with pytest.raises(ValueError, match="ref_weight"):
        logitless.fused_policy_loss(h, head.weight, targets, old, adv, mask, kl,
                                    bias=head.bias, ref_hidden=h.detach(), ref_weight=weight)


def _check_refusals(rank, world):
    _, weight, bias, ranks = _problem(world)
    head = _sharded_head(weight, bias, world)
    hidden, targets = ranks[rank]
    lp = logitless.linear_logprobs
    cases = [
        (dict(vocab_parallel=dist.group.WORLD), "vocab_parallel"),
        (dict(hidden_grad="partial"), "hidden_grad"),
        (dict(kept_ids=torch.zeros(*targets.shape, 2, dtype=torch.int64)), "kept_ids"),
        (dict(temperature=torch.ones(len(targets) + 1, dtype=torch.float64)), "temperature"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            lp(hidden, head.weight, targets, bias=head.bias, **kwargs)
    with pytest.raises(ValueError, match="bias"):
        lp(hidden, head.weight, targets, bias=bias)  # a plain bias beside a DTensor weight
    with pytest.raises(ValueError, match="bias"):
        lp(hidden, weight, targets, bias=head.bias)  # and the other way round


def _check_empty_shard(rank, world):
    """A vocabulary so small that FSDP2 leaves a rank no rows: refused on every rank."""
    v = 4 if world == 3 else 1  # torch.chunk: 2 + 2 + 0 rows; 1 + 0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    head = torch.nn.Linear(D, v, dtype=torch.float64)
    fully_shard(head, mesh=init_device_mesh("cpu", (world,)))
    hidden = torch.randn(3, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="no rows"):
        logitless.linear_logprobs(hidden, head.weight, torch.zeros(3, dtype=torch.int64),
                                  bias=head.bias)


def _worker(rank, world):
    for softcap in (None, 4.0):
        _check_logprobs(rank, world, softcap)
    _check_sampled(rank, world)
    _check_fused(rank, world)
    _check_refusals(rank, world)
    _check_empty_shard(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_head_without_gather(world):
    run_on_gloo(world, _worker)
