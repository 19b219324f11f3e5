"""One public convention (issue 39, item 5; docs/api-changes.md): one ignore rule, one name per
concept, return types that no flag changes, the objective types exported, and
`logitless.reference` under the public ops' signatures and result types. Each deprecated alias
warns and still gives the new name's numbers."""

import inspect

import pytest
import torch

import logitless
from fused_losses.test_fused_policy_loss import make_batch
from logitless import PolicyLossConfig, reference
from logitless.integrations.sampler_config import SamplerTruncation, read_sampler_config

# What a fast op takes to decide how it runs, never what it computes: the reference has none.
EXECUTION = {"max_tile_bytes", "vocab_parallel", "gather_weight", "hidden_grad", "strategy",
             "cp_group", "memory_budget"}
HEAD_OPS = ("linear_logprobs", "linear_divergence", "linear_topk_distill", "mtp_draft_loss",
            "attention_entropy")


def _batch(seed=0):
    """``(hidden, weight, bias, targets, mask, old, adv)``: fp64 ``[5, 13]`` tokens, D=24,
    V=301, an empty sequence and a hole in one mask."""
    b = make_batch(seed=seed)
    return b["hidden"], b["weight"], b["bias"], b["targets"], b["mask"], b["old"], b["adv"]


def _leaves(*xs):
    return [x.clone().requires_grad_(True) for x in xs]


def _fused(hidden, weight, bias, targets, mask, old, adv, cfg, **kw):
    h, w, b = _leaves(hidden, weight, bias)
    loss, _ = logitless.fused_policy_loss(h, w, targets, old, adv, mask, cfg, bias=b,
                                          temperature=0.8, **kw)
    return loss, torch.autograd.grad(loss, (h, w, b))


# --- one ignore rule ------------------------------------------------------------------------


@pytest.mark.parametrize("ignore_index", [-100, -1])
@pytest.mark.parametrize("strategy", ["chunked", "streaming"])
def test_fused_policy_loss_drops_ignored_targets(ignore_index, strategy):
    """A target of ``ignore_index`` inside ``mask`` drops its token: the loss and gradients of
    the same call with those tokens masked out, and the fp64 oracle's (which also takes
    ``ignore_index``). The fused op used to refuse such a target (out of the vocabulary)."""
    hidden, weight, bias, targets, mask, old, adv = _batch(1)
    drop = torch.zeros_like(mask)
    drop[0, [2, 7]] = drop[1, 4] = True  # inside the mask; two in one sequence
    assert bool((drop & mask).sum() == 3)
    cfg = PolicyLossConfig(objective="grpo", entropy_coef=0.01)
    ignored = torch.where(drop, ignore_index, targets)
    kw = dict(strategy=strategy, ignore_index=ignore_index)
    got, got_grads = _fused(hidden, weight, bias, ignored, mask, old, adv, cfg, **kw)
    want, want_grads = _fused(hidden, weight, bias, targets, mask & ~drop, old, adv, cfg,
                              strategy=strategy)
    h, w, b = _leaves(hidden, weight, bias)
    oracle = reference.fused_policy_loss(h, w, ignored, old, adv, mask.double(), cfg, bias=b,
                                         temperature=0.8, ignore_index=ignore_index)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, oracle, rtol=1e-9, atol=1e-12)
    for a, e, o in zip(got_grads, want_grads, torch.autograd.grad(oracle, (h, w, b))):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a, o, rtol=1e-8, atol=1e-11)


def test_fused_policy_loss_drops_ignored_targets_under_compile():
    """The rule holds in the one custom op ``torch.compile`` sees (fullgraph)."""
    hidden, weight, bias, targets, mask, old, adv = _batch(3)
    ignored = targets.clone()
    ignored[0, 3] = ignored[1, 2] = -100
    cfg = PolicyLossConfig(objective="grpo")

    def loss(t, m):
        return logitless.fused_policy_loss(hidden, weight, t, old, adv, m, cfg, bias=bias)[0]

    got = torch.compile(loss, backend="eager", fullgraph=True)(ignored, mask)
    torch.testing.assert_close(got, loss(targets, mask & (ignored != -100)), rtol=1e-12,
                               atol=1e-14)


@pytest.mark.parametrize("bad", [1.5, "-100", True, None])
def test_fused_policy_loss_checks_ignore_index(bad):
    hidden, weight, _bias, targets, mask, old, adv = _batch()
    with pytest.raises(ValueError, match="ignore_index must be an integer"):
        logitless.fused_policy_loss(hidden, weight, targets, old, adv, mask,
                                    PolicyLossConfig(objective="grpo"), ignore_index=bad)


def test_every_op_spells_the_ignore_rule_alike():
    """Ops with targets take ``ignore_index=-100`` (keyword-only); ops without take an optional
    ``mask`` (None: every token)."""
    with_targets = [logitless.linear_logprobs, logitless.fused_policy_loss]
    for fn in with_targets:
        p = inspect.signature(fn).parameters
        assert "targets" in p, fn.__name__
        assert p["ignore_index"].default == -100, fn.__name__
        assert p["ignore_index"].kind is inspect.Parameter.KEYWORD_ONLY, fn.__name__
    for fn in (logitless.linear_divergence, logitless.linear_topk_distill,
               logitless.mtp_draft_loss):
        p = inspect.signature(fn).parameters
        assert "targets" not in p and "ignore_index" not in p, fn.__name__
        assert p["mask"].default is None, fn.__name__


def test_mask_may_be_bool_or_0_1_float():
    """``mtp_draft_loss`` (the op the divergence tests do not cover) gives the same numbers
    for a bool mask and its 0/1 float."""
    hidden, weight, _, _, mask, *_ = _batch(2)
    main = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)
    want = logitless.mtp_draft_loss(hidden, weight, main, mask)
    got = logitless.mtp_draft_loss(hidden, weight, main, mask.double())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert float(want[~mask].abs().max()) == 0.0 and float(want[mask].abs().min()) > 0


# --- one name per concept, with the old names deprecated --------------------------------------


def test_memory_budget_is_a_deprecated_name_of_max_tile_bytes():
    hidden, weight, bias, targets, mask, old, adv = _batch(4)
    cfg = PolicyLossConfig(objective="grpo")
    budget = 7 * weight.shape[0] * 8  # a few rows per chunk: several chunks
    want, want_grads = _fused(hidden, weight, bias, targets, mask, old, adv, cfg,
                              max_tile_bytes=budget, strategy="chunked")
    with pytest.warns(DeprecationWarning, match="memory_budget is deprecated"):
        got, got_grads = _fused(hidden, weight, bias, targets, mask, old, adv, cfg,
                                memory_budget=budget, strategy="chunked")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="memory_budget is the deprecated name of "
                                         "max_tile_bytes"):
        _fused(hidden, weight, bias, targets, mask, old, adv, cfg, memory_budget=budget,
               max_tile_bytes=budget)
    with pytest.raises(ValueError, match="max_tile_bytes must be None or an integer"):
        _fused(hidden, weight, bias, targets, mask, old, adv, cfg, max_tile_bytes=0)


def test_engine_is_a_deprecated_name_of_sampler():
    want = SamplerTruncation(top_k=5, top_p=0.9, sampler="sglang")
    with pytest.warns(DeprecationWarning, match="engine is deprecated"):
        got = SamplerTruncation(top_k=5, top_p=0.9, engine="sglang")
    assert got == want and got.kwargs() == {"top_k": 5, "top_p": 0.9, "sampler": "sglang"}
    with pytest.warns(DeprecationWarning, match="engine is deprecated"):
        assert got.engine == "sglang"
    names = dict(temperature="t", top_k="k", top_p="p", min_p="m")
    read = dict(temperature=1.0, top_k=5, top_p=0.9, min_p=None, names=names, top_k_off=(0,))
    with pytest.warns(DeprecationWarning, match="engine is deprecated"):
        assert read_sampler_config(engine="sglang", **read) == want
    assert read_sampler_config(sampler="sglang", **read) == want
    with pytest.raises(ValueError, match="sampler: expected one of"):
        SamplerTruncation(sampler="tgi")
    with pytest.raises(ValueError, match="engine is the deprecated name of sampler"):
        SamplerTruncation(sampler="sglang", engine="transformers")


# --- return types no flag changes -------------------------------------------------------------


def _divergence(fn, **kw):
    hidden, weight, bias, _, mask, *_ = _batch(5)
    g = torch.Generator().manual_seed(6)
    t_hidden = torch.randn(*mask.shape, 9, generator=g, dtype=torch.float64)
    t_weight = torch.randn(weight.shape[0], 9, generator=g, dtype=torch.float64)
    return fn(hidden, weight, t_hidden, t_weight, mask, beta=0.3, temperature=0.9, bias=bias,
              **kw)


@pytest.mark.parametrize("fn", [logitless.linear_divergence, reference.linear_divergence],
                         ids=["public", "reference"])
def test_linear_divergence_returns_one_type(fn):
    plain = _divergence(fn)
    both = _divergence(fn, return_entropy=True)
    assert type(plain) is type(both) is logitless.DivergenceOutput
    assert plain.entropy is None and both.entropy is not None
    torch.testing.assert_close(plain.divergence, both.divergence, rtol=0, atol=0)


def test_the_old_uses_of_linear_divergence_warn_and_still_work():
    """Until the next release the result stands in for the tensor (and the tuple) it was."""
    out = _divergence(logitless.linear_divergence, return_entropy=True)
    div, ent = out.divergence, out.entropy
    mask = _batch(5)[4]
    with pytest.warns(DeprecationWarning, match="linear_divergence returns a DivergenceOutput"):
        a, b = out
    assert a is div and b is ent
    plain = _divergence(logitless.linear_divergence)
    for old_use, want in ((lambda x: x.sum(), div.sum()), (lambda x: x.shape, div.shape),
                          (lambda x: x + 1.5, div + 1.5), (lambda x: 2 * x, 2 * div),
                          (lambda x: x[1], div[1]), (lambda x: -x, -div),
                          (lambda x: torch.where(mask, x, 0.0), torch.where(mask, div, 0.0)),
                          (lambda x: ent + x, ent + div)):
        with pytest.warns(DeprecationWarning, match="returns a DivergenceOutput"):
            got = old_use(plain)
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            assert got == want


# --- the objective types --------------------------------------------------------------------


def test_objective_types_are_exported():
    """An objective written on the exported types, as the README shows, runs; the batch
    globals are the exported type."""
    from logitless.fused_losses.objectives import aggregation, catalog

    assert logitless.ObjectiveInputs is catalog.ObjectiveInputs
    assert logitless.ObjectiveOutput is catalog.ObjectiveOutput
    assert logitless.BatchGlobals is aggregation.BatchGlobals
    assert {"ObjectiveInputs", "ObjectiveOutput", "BatchGlobals"} <= set(logitless.__all__)

    @logitless.register_objective("test_public_api_pg", loss_agg="token-mean")
    def pg(x: logitless.ObjectiveInputs) -> logitless.ObjectiveOutput:
        return logitless.ObjectiveOutput(-x.adv * x.ratio.value)

    try:
        *_, mask, old, adv = _batch(7)
        lp = (old + 0.1).requires_grad_(True)
        cfg = PolicyLossConfig(objective="test_public_api_pg")
        loss, _ = logitless.policy_loss(lp, old, adv, mask, cfg)
        ratio = (lp - old).exp()
        want = (-adv[:, None] * ratio)[mask].mean()
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
        glob = logitless.policy_loss_globals(mask, adv, cfg)
        assert isinstance(glob, logitless.BatchGlobals)
    finally:
        catalog.OBJECTIVES.pop("test_public_api_pg", None)


# --- the reference under the public signatures -------------------------------------------------


def _params(fn, drop=()):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name not in drop]


@pytest.mark.parametrize("name", HEAD_OPS)
def test_reference_head_ops_have_the_public_signatures(name):
    """Same names, kinds (``bias`` keyword-only) and defaults, in order, apart from the
    execution knobs; two different functions (the reference is its own plain-torch code)."""
    ours, oracle = getattr(logitless, name), getattr(reference, name)
    assert inspect.unwrap(ours) is not inspect.unwrap(oracle)
    assert inspect.unwrap(oracle).__module__.startswith("logitless.reference.")
    assert _params(oracle) == _params(ours, drop=EXECUTION)


@pytest.mark.parametrize("name", ["policy_loss", "fused_policy_loss"])
def test_reference_losses_take_the_public_keywords(name):
    """The reference losses cover part of the public arguments: each one they take is the
    public op's, of the same kind and default."""
    ours, oracle = getattr(logitless, name), getattr(reference, name)
    assert inspect.unwrap(ours) is not inspect.unwrap(oracle)
    public = {n: (k, d) for n, k, d in _params(ours)}
    for n, k, d in _params(oracle):
        assert public.get(n) == (k, d), n


def test_reference_linear_logprobs_returns_the_public_object():
    """The same `LogprobOutput`, the same fields filled for the same call (None where not
    asked), the same numbers, ``ids`` included."""
    hidden, weight, bias, targets, mask, *_ = _batch(8)
    targets = torch.where(mask, targets, -100)
    ids = torch.randint(-1, weight.shape[0], (*targets.shape, 4),
                        generator=torch.Generator().manual_seed(9))
    for kw in (dict(), dict(return_entropy=True, stats=("lse", "is_top1", "sum_p_sq")),
               dict(ids=ids, stats=("lse",)), dict(top_k=40, top_p=0.8, return_entropy=True,
                                                   stats=("log_kept_mass",))):
        ours = logitless.linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.7,
                                         **kw)
        want = reference.linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.7,
                                         **kw)
        assert type(want) is logitless.LogprobOutput
        for field, value in vars(ours).items():
            assert (getattr(want, field) is None) == (value is None), (kw, field)
            if value is not None:
                torch.testing.assert_close(value, getattr(want, field), rtol=1e-9, atol=1e-9,
                                           msg=f"{kw}: {field}")


def test_reference_positional_bias_is_deprecated():
    hidden, weight, bias, targets, *_ = _batch(10)
    want = reference.linear_logprobs(hidden, weight, targets, bias=bias)
    with pytest.warns(DeprecationWarning, match="bias is keyword-only"):
        got = reference.linear_logprobs(hidden, weight, targets, bias)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    with pytest.raises(TypeError, match="multiple values for argument 'bias'"):
        reference.linear_logprobs(hidden, weight, targets, bias, bias=bias)
