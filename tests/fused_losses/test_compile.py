"""torch.compile, torch.export and meta tensors over the public ops (issue 17).

Each op is one ``torch.library`` custom op, defined beside its implementation
(its name in ``fused_losses/oplib.OPS``): compiled with
``fullgraph=True`` and ``dynamic=True`` it must trace without a graph break, compile once for
two batch sizes, and give eager's forward and backward. The ``aot_eager`` backend runs in the
default suite, and so does ``inductor`` for two training steps (composed and fused), each
compiled once with static shapes; the other ``inductor`` cases (a C++ compile of every graph:
minutes on a loaded CPU) run when ``LOGITLESS_TEST_INDUCTOR=1`` is set. Every ``inductor``
case needs a C++ compiler on PATH.
"""

import dataclasses
import functools
import os
import shutil

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from logitless.fused_losses import oplib
from logitless.fused_losses.fused.fused_policy_loss import fused_policy_loss, metric_names
from logitless.fused_losses.head.attention_entropy import attention_entropy
from logitless.fused_losses.head.divergence import linear_divergence, linear_topk_distill
from logitless.fused_losses.head.logprobs import linear_logprobs
from logitless.fused_losses.objectives.catalog import OBJECTIVES
from logitless.fused_losses.objectives.config import PolicyLossConfig
from logitless.fused_losses.objectives.policy_loss import policy_loss

CONFIG_LAYOUT = oplib.config_layout(PolicyLossConfig)

D, V, T = 96, 1007, 37
IGNORE = -100
CFG = PolicyLossConfig(objective="grpo", beta=0.04, entropy_coef=0.01)
# inductor's CPU code generation compiles C++ (make test's machine has g++; the default
# suite's inductor test runs there)
_NO_CXX = shutil.which(os.environ.get("CXX", "g++")) is None
CXX = pytest.mark.skipif(_NO_CXX, reason="inductor needs a C++ compiler ($CXX or g++)")
INDUCTOR = pytest.mark.skipif(
    os.environ.get("LOGITLESS_TEST_INDUCTOR") != "1" or _NO_CXX,
    reason="inductor tests: set LOGITLESS_TEST_INDUCTOR=1 (needs a C++ compiler; slow)")


def _batch(b, dtype=torch.float32, seed=0):
    """A right-padded batch: hidden [b, T, D] with gradient, targets with ignored tails."""
    g = torch.Generator().manual_seed(seed + b)
    hidden = torch.randn(b, T, D, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (b, T), generator=g)
    mask = torch.ones(b, T)
    for i in range(b):
        mask[i, T - 3 - 5 * i:] = 0  # every row ends with padding of its own length
    targets = torch.where(mask != 0, targets, IGNORE)
    old = (torch.randn(b, T, generator=g, dtype=dtype) - 3) * mask
    ref = (torch.randn(b, T, generator=g, dtype=dtype) - 3) * mask
    adv = torch.randn(b, generator=g, dtype=dtype)
    return hidden, targets, mask, old, adv, ref


def _head(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    weight = (torch.randn(V, D, generator=g, dtype=dtype) / D**0.5).requires_grad_()
    bias = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_()
    return weight, bias


# --- the steps compiled ---------------------------------------------------------------------


def logprobs_step(hidden, weight, bias, targets):
    out = linear_logprobs(hidden, weight, targets, bias=bias, temperature=0.9, softcap=20.0,
                          logit_scale=1.1, ignore_index=IGNORE, return_entropy=True,
                          stats=("sum_p_sq", "mean_logit", "is_top1", "lse"),
                          max_tile_bytes=1 << 16)
    loss = (out.logprobs.sum() + 0.3 * out.entropy.sum() + 0.2 * out.sum_p_sq.sum()
            + 0.1 * out.mean_logit.sum() + 0.01 * out.lse.square().sum())
    return loss, out.logprobs, out.entropy, out.is_top1


def sampled_step(hidden, weight, bias, targets):
    """vLLM's truncations: per-token temperature and top_p (tensors), scalar top_k, min_p."""
    h = hidden.detach()
    out = linear_logprobs(hidden, weight, targets, bias=bias,
                          temperature=0.8 + 0.4 * h[..., 0].sigmoid(), top_k=40,
                          top_p=0.6 + 0.3 * h[..., 1].sigmoid(), min_p=0.01,
                          ignore_index=IGNORE, return_entropy=True,
                          stats=("lse", "log_kept_mass"))
    kept = torch.isfinite(out.logprobs)
    loss = (torch.where(kept, out.logprobs, 0.0).sum() + 0.3 * out.entropy.sum()
            + 0.2 * out.log_kept_mass.sum() + 0.01 * out.lse.square().sum())
    return loss, out.logprobs, out.entropy, out.log_kept_mass


def composed_step(hidden, weight, bias, targets, mask, old, adv, ref):
    out = linear_logprobs(hidden, weight, targets, bias=bias, ignore_index=IGNORE,
                          return_entropy=True)
    return policy_loss(out.logprobs, old, adv, mask, CFG, ref_logprobs=ref, entropy=out.entropy)


def fused_step(hidden, weight, bias, targets, mask, old, adv, ref):
    return fused_policy_loss(hidden, weight, targets, old, adv, mask, CFG, bias=bias,
                             ref_logprobs=ref)


EXACT = PolicyLossConfig(objective="grpo", beta=0.04, kl_estimator="exact")
REF_WEIGHT = torch.randn(V, 40, generator=torch.Generator().manual_seed(13)) / 40**0.5


def exact_kl_step(hidden, weight, bias, targets, mask, old, adv, ref):
    """The fused loss with the exact KL to a reference head of another hidden size."""
    ref_hidden = hidden.detach()[..., :40].flip(-1)
    return fused_policy_loss(hidden, weight, targets, old, adv, mask, EXACT, bias=bias,
                             temperature=0.9, ref_hidden=ref_hidden,
                             ref_weight=REF_WEIGHT.to(hidden.dtype))


@functools.cache
def _compiled(step, backend):
    """One compiled function per (step, backend), shared by the tests, and its frame counter.
    Python floats (the config's knobs) are specialised, as README advises: left symbolic,
    dynamo traces every step twice (it restarts to specialise them)."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)

    @torch._dynamo.config.patch(specialize_float=True)
    def run(*args):
        return compiled(*args)

    return run, counter


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def _check_logprobs(backend, step=logprobs_step):
    weight, bias = _head()
    fn, counter = _compiled(step, backend)
    for b in (2, 3):
        hidden, targets, *_ = _batch(b)
        got, want = fn(hidden, weight, bias, targets), step(hidden, weight, bias, targets)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
        assert (got[1][targets == IGNORE] == 0).all()
        leaves = (hidden, weight, bias)
        for x, y in zip(_grads(got[0], *leaves), _grads(want[0], *leaves)):
            torch.testing.assert_close(x, y)
    assert counter.frame_count == 1  # dynamic=True: the second batch size did not recompile


def _check_training_step(step, backend, dtype):
    weight, bias = _head(dtype)
    fn, counter = _compiled(step, backend)
    for b in (2, 3):
        hidden, targets, mask, old, adv, ref = _batch(b, dtype)
        args = (hidden, weight, bias, targets, mask, old, adv, ref)
        (loss, metrics), (loss_e, metrics_e) = fn(*args), step(*args)
        torch.testing.assert_close(loss, loss_e)
        assert metrics.keys() == metrics_e.keys()
        for k in metrics:
            torch.testing.assert_close(metrics[k], metrics_e[k], msg=k)
        for x, y in zip(_grads(loss, hidden, weight, bias), _grads(loss_e, hidden, weight, bias)):
            torch.testing.assert_close(x, y)
    assert counter.frame_count == 1


def test_linear_logprobs_compiled_matches_eager():
    _check_logprobs("aot_eager")


def test_sampled_logprobs_compiled_matches_eager():
    _check_logprobs("aot_eager", sampled_step)
    weight, bias = _head()
    hidden, targets, *_ = _batch(2)
    fn, _ = _compiled(sampled_step, "aot_eager")
    got, want = fn(hidden, weight, bias, targets)[0], sampled_step(hidden, weight, bias, targets)[0]
    for x, y in zip(_grads(got, hidden, weight, bias), _grads(want, hidden, weight, bias)):
        torch.testing.assert_close(x, y)


def test_composed_training_step_compiled_matches_eager():
    _check_training_step(composed_step, "aot_eager", torch.float32)


def test_fused_training_step_compiled_matches_eager():
    # Compiled or eager, the same chunks run (inside the op when compiled).
    _check_training_step(fused_step, "aot_eager", torch.float32)


def test_fused_exact_kl_step_compiled_matches_eager():
    _check_training_step(exact_kl_step, "aot_eager", torch.float64)


@CXX
def test_training_steps_inductor_once():
    """The default suite's inductor case: a composed and a fused step, each compiled once,
    static shapes, one batch; forward and backward as eager. One test for both, so that one
    xdist worker pays inductor's start-up (most of the 20 s they take with a cold cache on a
    2-core CPU)."""
    weight, bias = _head()
    hidden, targets, mask, old, adv, ref = _batch(2)
    args = (hidden, weight, bias, targets, mask, old, adv, ref)
    for step in (composed_step, fused_step):
        name = step.__name__
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
        with torch._dynamo.config.patch(specialize_float=True):
            loss, metrics = compiled(*args)
        loss_e, metrics_e = step(*args)
        torch.testing.assert_close(loss, loss_e, msg=name)
        assert list(metrics) == list(metrics_e), name
        for k in metrics:
            torch.testing.assert_close(metrics[k], metrics_e[k], msg=f"{name}: {k}")
        grads = _grads(loss, hidden, weight, bias)
        for x, y in zip(grads, _grads(loss_e, hidden, weight, bias)):
            torch.testing.assert_close(x, y, msg=name)
        assert counter.frame_count == 1, name


@INDUCTOR
@pytest.mark.parametrize("step", [composed_step, fused_step])
def test_training_steps_inductor(step):
    _check_training_step(step, "inductor", torch.float64)


def _forward(hidden, weight, bias, targets):
    out = linear_logprobs(hidden, weight, targets, bias=bias, ignore_index=IGNORE,
                          return_entropy=True)
    return out.logprobs * 2 + out.entropy


@INDUCTOR
def test_linear_logprobs_forward_inductor():
    # Forward only, static shapes, one batch: opt-in, as test_training_steps_inductor_once
    # covers the op forward and backward in the default suite.
    weight, bias = _head()
    hidden, targets, *_ = _batch(2)
    compiled = torch.compile(_forward, backend="inductor", fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(hidden, weight, bias, targets),
                                   _forward(hidden, weight, bias, targets))


@INDUCTOR
def test_linear_logprobs_inductor():
    _check_logprobs("inductor")


def _attention_inputs():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    cu = torch.tensor([0, 4, 9, 18], dtype=torch.int32)
    packed_q, packed_k = q.permute(0, 2, 1, 3).reshape(18, 4, 8), k.permute(0, 2, 1, 3).reshape(
        18, 2, 8)
    return q, k, attention_mask, packed_q, packed_k, cu


def attention_step(q, k, attention_mask, packed_q, packed_k, cu):
    return (attention_entropy(q, k, attention_mask=attention_mask, window=5, softcap=30.0),
            attention_entropy(packed_q, packed_k, cu_seqlens=cu, reduce_heads="mean"))


def test_attention_entropy_compiled_matches_eager():
    fn, counter = _compiled(attention_step, "aot_eager")
    args = _attention_inputs()
    for x, y in zip(fn(*args), attention_step(*args)):
        torch.testing.assert_close(x, y)
    assert counter.frame_count == 1


def divergence_step(hidden, weight, bias, teacher_hidden, teacher_weight, mask):
    out = linear_divergence(hidden, weight, teacher_hidden, teacher_weight, mask, bias=bias,
                            beta=0.3, temperature=0.8, return_entropy=True)
    div, entropy = out.divergence, out.entropy
    ids = teacher_weight[:, :4].argsort(0)[:T].T.reshape(1, T, 4).expand(*mask.shape, 4)
    teacher_logprobs = torch.log_softmax(teacher_hidden[..., :4], -1)
    topk = linear_topk_distill(hidden, weight, ids, teacher_logprobs, mask, bias=bias,
                               temperature=0.8, log_prob_min_clamp=-8.0)
    return div.sum() + div.square().sum() + topk.sum(), div, entropy, topk


def _divergence_inputs(b):
    hidden, _, mask, *_ = _batch(b)
    g = torch.Generator().manual_seed(11)
    teacher_hidden = torch.randn(b, T, 40, generator=g)
    teacher_weight = torch.randn(V, 40, generator=g) / 40**0.5
    return hidden, teacher_hidden, teacher_weight, mask != 0


def test_linear_divergence_compiled_matches_eager():
    weight, bias = _head()
    fn, counter = _compiled(divergence_step, "aot_eager")
    for b in (2, 3):
        hidden, teacher_hidden, teacher_weight, mask = _divergence_inputs(b)
        args = (hidden, weight, bias, teacher_hidden, teacher_weight, mask)
        got, want = fn(*args), divergence_step(*args)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
        assert (got[1][~mask] == 0).all() and (got[3][~mask] == 0).all()
        assert not got[2].requires_grad
        leaves = (hidden, weight, bias)
        for x, y in zip(_grads(got[0], *leaves), _grads(want[0], *leaves)):
            torch.testing.assert_close(x, y)
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", ["logprobs", "sampled", "composed", "fused", "attention",
                                  "divergence"])
def test_no_graph_breaks(name):
    if name == "attention":
        step, args = attention_step, _attention_inputs()
    elif name == "divergence":
        weight, bias = _head()
        hidden, teacher_hidden, teacher_weight, mask = _divergence_inputs(2)
        step, args = divergence_step, (hidden, weight, bias, teacher_hidden, teacher_weight, mask)
    else:
        weight, bias = _head()
        hidden, targets, mask, old, adv, ref = _batch(2)
        step = {"logprobs": logprobs_step, "sampled": sampled_step, "composed": composed_step,
                "fused": fused_step}[name]
        args = (hidden, weight, bias, targets)
        if name not in ("logprobs", "sampled"):
            args += (mask, old, adv, ref)
    explained = torch._dynamo.explain(step)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_target_out_of_range_raises_inside_the_compiled_op():
    weight, bias = _head()
    hidden, targets, *_ = _batch(2)
    targets = targets.clone()
    targets[1, 2] = V  # read inside the op: the check survives compilation
    fn, _ = _compiled(logprobs_step, "aot_eager")
    with pytest.raises(ValueError, match="targets must lie in"):
        fn(hidden, weight, bias, targets)


# --- opcheck, export, meta ------------------------------------------------------------------


def _opcheck_args(name):
    g = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    hidden, weight, bias = randn(2, 3, 8), randn(11, 8), randn(11)
    targets = torch.tensor([[1, IGNORE, 10], [0, 5, 5]])
    config = (0.9, 20.0, 1.1, IGNORE, None, torch.float64)
    if name == "logitless::linear_logprobs":
        return (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), targets,
                *config, True, True)
    if name == "logitless::linear_logprobs_backward":
        top, log_l, ent, s2, g_lp, g_ent = (randn(2, 3) for _ in range(6))
        return (hidden, weight, bias, targets, top + 3, log_l.abs(), ent.abs(), s2.abs(), g_lp,
                g_ent, None, None, None, *config, True, True, True)
    if name.startswith("logitless::linear_divergence"):
        t_hidden, t_weight = randn(2, 3, 5), randn(11, 5)
        mask = torch.tensor([[True, False, True], [True, True, True]])
        if name == "logitless::linear_divergence":
            return (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(),
                    t_hidden, t_weight, None, mask, 0.3, 0.9, None, True)
        top_s, log_l_s, top_t, log_l_t, aux, grad = (randn(2, 3) for _ in range(6))
        return (hidden, weight, bias, t_hidden, t_weight, None, mask, top_s + 3, log_l_s.abs(),
                top_t + 3, log_l_t.abs(), aux.abs(), grad, 0.3, 0.9, None, True, True, True)
    if name.startswith("logitless::linear_topk_logprobs"):
        ids = torch.tensor([[[1, 4], [0, 99], [10, 3]], [[2, 2], [5, 6], [7, 0]]])
        mask = torch.tensor([[True, False, True], [True, True, True]])  # 99: dropped row
        if name == "logitless::linear_topk_logprobs":
            return (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), ids,
                    mask, 0.9, None)
        return (hidden, weight, bias, ids, mask, randn(2, 3) + 3, randn(2, 3).abs(),
                randn(2, 3, 2), 0.9, None, True, True, True)
    if name == "logitless::fused_policy_loss":
        cfg = PolicyLossConfig(objective="grpo", beta=0.04, entropy_coef=0.01,
                               eps_low=0.1 + 0.1 * randn(2, 3).abs())  # a tensor knob too
        mask = targets != IGNORE
        hidden = randn(3, 2, 8).transpose(0, 1)  # dense but not contiguous: gradient strides
        return (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), targets,
                randn(2, 3) - 3, randn(2), mask, randn(2, 3) - 3, *(None,) * 14, 0.9, 20.0, 1.1,
                None, None, None, None, None, "auto", torch.float64, True, True, True,
                list(metric_names("grpo", None, kl=True)), *oplib.config_args(cfg, CONFIG_LAYOUT),
                "tf32",  # head_dtype
                None, 0.9, None, "sglang")  # top_k, top_p, min_p, sampler
    if name.startswith("logitless::sampled_logprobs"):
        settings = (0.5 + randn(2, 3).abs(), torch.tensor([[3, 11, 1], [20, 2, 5]]),
                    randn(2, 3).sigmoid(), torch.full((2, 3), 0.05, dtype=torch.float64))
        config = (20.0, 1.1, IGNORE, None, torch.float64, "sglang")
        if name == "logitless::sampled_logprobs":
            return (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(),
                    targets, *settings, *config)
        outs = torch.ops.logitless.sampled_logprobs(hidden, weight, bias, targets, *settings,
                                                    *config)
        lp, ent, kept_mass, _, m, log_kept, key, count = outs
        return (hidden, weight, bias, targets, *settings, key, count, m, log_kept, kept_mass,
                ent, lp, randn(2, 3), randn(2, 3), None, randn(2, 3), *config, True, True, True)
    valid = torch.tensor([[True, True, False], [True, True, True]])
    if name == "logitless::cov_drop_mask":
        return (valid & torch.tensor([[True, False, True], [True, True, False]]), valid, 0.5, 3)
    if name == "logitless::cov_top_mask":
        return (randn(2, 3), valid, 0.5)
    assert name == "logitless::attention_entropy"
    q, k = torch.randn(7, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    return (q, k, torch.tensor([0, 3, 7]), None, None, True, 0.35, None, None, False)


@pytest.mark.parametrize("name", oplib.OPS)
def test_opcheck(name):
    op = torch.ops.logitless
    for part in name.split("::")[1].split("."):
        op = getattr(op, part)
    torch.library.opcheck(op.default, _opcheck_args(name))


def test_export_module_calling_linear_logprobs():
    weight, _ = _head()

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(weight.detach().clone())

        def forward(self, hidden, targets):
            out = linear_logprobs(hidden, self.weight, targets, return_entropy=True)
            return out.logprobs, out.entropy

    module = Head()
    hidden, targets, *_ = _batch(2)
    hidden = hidden.detach()
    exported = torch.export.export(module, (hidden, targets))
    ops = {node.target for node in exported.graph.nodes if node.op == "call_function"}
    assert torch.ops.logitless.linear_logprobs.default in ops
    for x, y in zip(exported.module()(hidden, targets), module(hidden, targets)):
        torch.testing.assert_close(x, y)


def test_meta_tensors_give_meta_outputs():
    meta = torch.device("meta")
    hidden = torch.empty(3, T, D, device=meta, requires_grad=True)
    weight = torch.empty(V, D, device=meta, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.empty(3, T, device=meta, dtype=torch.long)
    out = linear_logprobs(hidden, weight, targets, return_entropy=True,
                          stats=("is_top1", "lse", "sum_p_sq", "mean_logit"))
    for name in ("logprobs", "entropy", "lse", "sum_p_sq", "mean_logit", "is_top1"):
        x = getattr(out, name)
        assert x.device == meta and x.shape == (3, T), name
        assert x.dtype == (torch.bool if name == "is_top1" else torch.float32), name
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert hidden.grad.shape == hidden.shape and hidden.grad.device == meta
    assert weight.grad.shape == weight.shape and weight.grad.dtype == torch.bfloat16
    div = linear_divergence(hidden, weight, torch.empty(3, T, 40, device=meta),
                            torch.empty(V, 40, device=meta)).divergence
    assert div.device == meta and div.shape == (3, T) and div.dtype == torch.float32
    q = torch.empty(2, 4, 9, 8, device=meta)
    k = torch.empty(2, 2, 9, 8, device=meta)
    assert attention_entropy(q, k).shape == (2, 4, 9)
    assert attention_entropy(q, k, reduce_heads="mean").shape == (2, 9)


# --- fused_policy_loss: one op ---------------------------------------------------------------


class _GraphRecorder:
    """A dynamo backend that keeps the FX graphs it is handed and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm.graph)
        return gm.forward

    def logitless_ops(self) -> list[str]:
        """The logitless ops called, by name (the packet or its overload)."""
        return [str(n.target).removesuffix(".default") for g in self.graphs for n in g.nodes
                if n.op == "call_function" and str(n.target).startswith("logitless.")]


@pytest.mark.parametrize("step", [fused_step, exact_kl_step])
def test_fused_policy_loss_is_one_graph_node(step):
    """The whole fused loss, the exact KL's reference head included, is the one op: no
    linear_logprobs / linear_divergence node and no policy_loss graph around them."""
    weight, bias = _head()
    hidden, targets, mask, old, adv, ref = _batch(2)
    recorder = _GraphRecorder()
    compiled = torch.compile(step, backend=recorder, fullgraph=True, dynamic=True)
    compiled(hidden, weight, bias, targets, mask, old, adv, ref)
    assert recorder.logitless_ops() == ["logitless.fused_policy_loss"]


def _packed_batch(b, seed=0):
    """b packed sequences of lengths 9, 14, ...; the first 2 tokens of each (the prompt) and
    one more outside the mask."""
    g = torch.Generator().manual_seed(seed + 10 * b)
    lengths = torch.tensor([9 + 5 * i for i in range(b)])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(cu[-1])
    mask = torch.ones(n, dtype=torch.bool)
    for start in cu[:-1].tolist():
        mask[start:start + 2] = False
    mask[cu[1] + 4] = False
    targets = torch.where(mask, torch.randint(0, V, (n,), generator=g), IGNORE)
    hidden = torch.randn(n, D, generator=g).requires_grad_()
    old = torch.where(mask, torch.randn(n, generator=g) - 3, 0.0)
    rollout = old + 0.1 * torch.randn(n, generator=g)
    selection = torch.rand(n, generator=g) * 3  # entropies of the old-policy pass
    adv = torch.randn(b, generator=g)
    return hidden, targets, mask, old, adv, rollout, selection, cu


SELECTING = PolicyLossConfig(objective="grpo", top_entropy_quantile=0.5, rollout_is="sequence",
                             rollout_is_batch_normalize=True, entropy_coef=0.01)


def selecting_step(hidden, weight, bias, targets, mask, old, adv, rollout, selection, cu):
    return fused_policy_loss(hidden, weight, targets, old, adv, mask, SELECTING, bias=bias,
                             cu_seqlens=cu, rollout_logprobs=rollout, selection_entropy=selection,
                             num_items_in_batch=int(mask.sum()) + 3)


def test_fused_packed_selections_compiled_match_eager():
    """The packed layout, entropy-quantile selections, rollout IS batch normalisation and
    selection_entropy compile inside the op: fullgraph, dynamic, two batch sizes, equal to
    eager."""
    weight, bias = _head()
    fn, counter = _compiled(selecting_step, "aot_eager")
    for b in (2, 3):
        hidden, *rest = _packed_batch(b)
        args = (hidden, weight, bias, *rest)
        (loss, metrics), (loss_e, metrics_e) = fn(*args), selecting_step(*args)
        torch.testing.assert_close(loss, loss_e)
        assert list(metrics) == list(metrics_e)
        for k in metrics:
            assert not metrics[k].requires_grad
            torch.testing.assert_close(metrics[k], metrics_e[k], msg=k)
        for x, y in zip(_grads(loss, hidden, weight, bias), _grads(loss_e, hidden, weight, bias)):
            torch.testing.assert_close(x, y)
    assert counter.frame_count == 1


def test_fused_policy_loss_on_meta_tensors():
    """The op's fake implementation serves meta tensors: shapes and dtypes of the loss, the
    metrics (named as eager names them) and the gradients, without reading a value."""
    meta = torch.device("meta")
    hidden = torch.empty(3, T, D, device=meta, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.empty(V, D, device=meta, requires_grad=True)
    bias = torch.empty(V, device=meta, requires_grad=True)
    targets = torch.empty(3, T, device=meta, dtype=torch.long)
    mask, old = torch.empty(3, T, device=meta), torch.empty(3, T, device=meta)
    cfg = PolicyLossConfig(objective="cispo", rollout_is="token")
    loss, metrics = fused_policy_loss(hidden, weight, targets, old, torch.empty(3, device=meta),
                                      mask, cfg, bias=bias, rollout_logprobs=old)
    assert loss.device == meta and loss.shape == () and loss.dtype == torch.float32
    assert list(metrics) == list(metric_names("cispo", "token"))
    assert {"clip_ratio/low", "is_weight/mean", "entropy/bonus_sum"} <= metrics.keys()
    for v in metrics.values():
        assert v.device == meta and v.shape == () and v.dtype == torch.float32
        assert not v.requires_grad
    loss.backward()
    for x in (hidden, weight, bias):
        assert x.grad.device == meta and x.grad.shape == x.shape and x.grad.dtype == x.dtype


def _through_the_op(monkeypatch):
    """Eager calls of fused_policy_loss go through the op (its implementation runs for real)."""
    from logitless.fused_losses.fused import fused_policy_loss as module

    monkeypatch.setattr(module, "as_op", lambda hidden: True)


@pytest.mark.parametrize("strategy", ["auto", "streaming"])
def test_op_equals_the_direct_call_for_every_objective(monkeypatch, strategy):
    """The op's implementation (the gradients computed in its forward, the metrics named by
    metric_names, the config rebuilt from its lists) against the direct eager call, for every
    registered objective, with and without rollout IS weights."""
    from fused_losses.test_fused_policy_loss import (
        OBJECTIVE_EXTRAS,
        config_for,
        make_batch,
        run_fused,
    )

    batch = make_batch(seed=3)
    wanted = {}
    for name in sorted(n for n, s in OBJECTIVES.items() if not s.needs_topk):
        for rollout_is in (None, "token"):
            cfg = config_for(name, rollout_is=rollout_is, beta=0.03,
                             **OBJECTIVE_EXTRAS.get(name, {}))
            wanted[name, rollout_is] = cfg, run_fused(batch, cfg, with_rollout=True,
                                                      strategy=strategy)
    _through_the_op(monkeypatch)
    for (name, rollout_is), (cfg, want) in wanted.items():
        loss, metrics, grads = run_fused(batch, cfg, with_rollout=True, strategy=strategy)
        msg = f"{name}, rollout_is={rollout_is}"
        torch.testing.assert_close(loss, want[0], rtol=1e-12, atol=0, msg=msg)
        assert list(metrics) == list(want[1]), msg
        for k, v in metrics.items():
            torch.testing.assert_close(v, want[1][k], rtol=1e-12, atol=0, msg=f"{msg}: {k}")
        for g, w in zip(grads, want[2]):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=0, msg=msg)


def test_metrics_the_objective_name_does_not_decide_raise(monkeypatch):
    """An objective whose clip flags depend on another config field gives metrics the op was
    not traced for: a RuntimeError saying so, never metrics under the wrong names."""
    from logitless.fused_losses.fused import op as module
    from logitless.fused_losses.objectives import catalog as objectives

    def flags_with_delta(x):
        loss = -x.adv * x.ratio.value
        if x.cfg.delta is None:
            return objectives.ObjectiveOutput(loss)
        return objectives.ObjectiveOutput(
            loss, *objectives.clip_flags(x.ratio.value.detach(), x.adv, 0.8, 1.2))

    # registered in a copy of the registry, which the test's end drops
    monkeypatch.setattr(objectives, "OBJECTIVES", dict(objectives.OBJECTIVES))
    objectives.register_objective("flags_with_delta")(flags_with_delta)
    monkeypatch.setattr(module, "_METRIC_NAMES", {})
    weight, bias = _head()
    hidden, targets, mask, old, adv, _ = _batch(2)
    cfg = PolicyLossConfig(objective="flags_with_delta", delta=2.0)
    eager = fused_policy_loss(hidden, weight, targets, old, adv, mask, cfg, bias=bias)[1]
    assert "clip_ratio/low" in eager
    _through_the_op(monkeypatch)
    with pytest.raises(RuntimeError, match=r"not the .* the op was traced for"):
        fused_policy_loss(hidden, weight, targets, old, adv, mask, cfg, bias=bias)


def test_config_crosses_the_op_boundary_whole():
    """Every field, whatever its kind (tensor knobs, a string dhpo_mix, ints), comes back."""
    g = torch.Generator().manual_seed(4)
    cfg = PolicyLossConfig(objective="dhpo", dhpo_mix="entropy", eps_low=torch.rand(2, 3,
                           generator=g) * 0.2, beta=torch.rand(2, 3, generator=g), delta=3,
                           rollout_is="token", rollout_rs="token_k1,seq_max_k2",
                           rollout_rs_threshold="2.0,0.5", max_response_length=64, cov_seed=3,
                           hard_trust_region=True)
    back = oplib.config_from_args(PolicyLossConfig, CONFIG_LAYOUT,
                                  *oplib.config_args(cfg, CONFIG_LAYOUT))
    for f in dataclasses.fields(cfg):
        a, b = getattr(cfg, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f.name
        else:
            assert a == b and type(a) is type(b), f.name


def test_op_path_bad_input(monkeypatch):
    """Through the op, a bad argument is still a ValueError naming it: from the checks that
    read no values, before the op (meta tensors here: no value to read), and from inside the
    op for the rest (a target id out of range)."""
    meta = torch.device("meta")
    hidden = torch.empty(2, T, D, device=meta, requires_grad=True)
    weight = torch.empty(V, D, device=meta)
    targets = torch.empty(2, T, device=meta, dtype=torch.long)
    mask, old, adv = (torch.empty(2, T, device=meta), torch.empty(2, T, device=meta),
                      torch.empty(2, device=meta))
    cfg = PolicyLossConfig(objective="grpo")

    def call(**kw):
        args = dict(old_logprobs=old, advantages=adv, config=cfg)
        args.update(kw)
        return fused_policy_loss(hidden, weight, targets, args.pop("old_logprobs"),
                                 args.pop("advantages"), mask, args.pop("config"), **args)

    for kw, message in [
        (dict(old_logprobs=torch.empty(2, T + 1, device=meta)), "old_logprobs: expected shape"),
        (dict(advantages=torch.empty(3, device=meta)), "advantages: expected"),
        (dict(advantages=[1.0, 2.0]), "advantages: expected a tensor"),
        (dict(ref_logprobs=torch.empty(2, T + 1, device=meta)), "ref_logprobs: expected shape"),
        (dict(config="grpo"), "config must be a PolicyLossConfig"),
        (dict(training_progress="half"), "training_progress: expected a number"),
        (dict(num_items_in_batch=True), "num_items_in_batch: expected a number"),
        (dict(strategy="fast"), "strategy must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(**kw)
    weight_, bias = _head()
    hidden_, targets_, mask_, old_, adv_, _ = _batch(2)
    targets_ = targets_.clone()
    targets_[1, 2] = V
    _through_the_op(monkeypatch)
    with pytest.raises(ValueError, match="targets must lie in"):
        fused_policy_loss(hidden_, weight_, targets_, old_, adv_, mask_, cfg, bias=bias)


# --- policy_loss alone: the batch-level selections and the packed layout ----------------------


def _policy_inputs(b, packed=False):
    """policy_loss's inputs for b right-padded sequences of T tokens (each row with a padded
    tail of its own length, and one more token outside the mask): logprobs and entropy with
    gradient, rollout logprobs with one NaN (not given by the engine), attention entropies;
    ``packed``: the same sequences, cut shorter, packed, with their cu_seqlens."""
    g = torch.Generator().manual_seed(b)
    mask = torch.arange(T)[None] < torch.tensor([T - 3 - 7 * i for i in range(b)])[:, None]
    mask[0, 4] = False
    old = torch.randn(b, T, generator=g) - 2
    lp = (old + 0.2 * torch.randn(b, T, generator=g)).requires_grad_()
    ent = (torch.rand(b, T, generator=g) * 2).requires_grad_()
    roll = old + 0.2 * torch.randn(b, T, generator=g)
    roll[1, 3] = torch.nan
    hatt = torch.rand(b, T, generator=g) * 3
    adv = torch.randn(b, generator=g)
    x = dict(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, entropy=ent,
             rollout_logprobs=roll, attention_entropy=hatt)
    if not packed:
        return x
    # the first T - 2 - 5 i positions of row i, packed: the tails of the two layouts differ,
    # masked tokens stay inside the sequences
    keep = torch.arange(T)[None] < T - 2 - 5 * torch.arange(b)[:, None]
    x = {k: v if k == "advantages" else v.detach()[keep].requires_grad_(v.requires_grad)
         for k, v in x.items()}
    x["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), keep.sum(-1).cumsum(0)])
    return x


def _policy_step(cfg):
    """A step calling policy_loss with ``cfg`` on the inputs of `_policy_inputs`."""

    def step(logprobs, old_logprobs, advantages, mask, entropy, rollout_logprobs,
             attention_entropy, cu_seqlens=None):
        return policy_loss(logprobs, old_logprobs, advantages, mask, cfg, entropy=entropy,
                           rollout_logprobs=rollout_logprobs, cu_seqlens=cu_seqlens,
                           attention_entropy=attention_entropy, training_progress=0.5)

    return step


def _check_policy_step(cfg, packed=False):
    """Compiled (aot_eager, fullgraph, dynamic) against eager for two batch sizes: loss,
    metrics and the gradients of logprobs and entropy; one frame. ``fullgraph=True`` raises at
    the first graph break, so passing means none."""
    step = _policy_step(cfg)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for b in (2, 3):
        x = _policy_inputs(b, packed)
        with torch._dynamo.config.patch(specialize_float=True):
            loss, metrics = compiled(**x)
        loss_e, metrics_e = step(**x)
        torch.testing.assert_close(loss, loss_e)
        assert list(metrics) == list(metrics_e)
        for k in metrics:
            torch.testing.assert_close(metrics[k], metrics_e[k], msg=k)
        leaves = (x["logprobs"], x["entropy"])
        for got, want in zip(_grads(loss, *leaves), _grads(loss_e, *leaves)):
            torch.testing.assert_close(got, want)
    assert counter.frame_count == 1


def test_policy_loss_batch_selections_compile():
    """What reads the whole batch, right-padded: the top-entropy quantile (entropy bonus and
    policy term), the |A| H top fraction, attention-entropy weighting by batch quantile and
    rollout IS batch normalisation, all taken without a host read."""
    _check_policy_step(PolicyLossConfig(
        objective="grpo", top_entropy_quantile=0.4, adv_entropy_top_fraction=0.7,
        attn_entropy_weighting="low_quantile", rollout_is="token",
        rollout_is_batch_normalize=True, entropy_coef=0.01))


@pytest.mark.parametrize("objective", ["clip_cov", "kl_cov"])
def test_policy_loss_cov_objectives_compile(objective):
    """verl's clip_cov (a seeded random share of the tokens in a covariance band dropped) and
    kl_cov (the top share by covariance penalised): their token choices, counted on the host,
    are ops, so the step traces whole and matches eager."""
    _check_policy_step(PolicyLossConfig(objective=objective, cov_fraction=0.3, cov_seed=5,
                                        clip_cov_lb=-1.0, clip_cov_ub=5.0, entropy_coef=0.01))


def test_policy_loss_packed_compiles():
    """The packed layout (cu_seqlens): the grid laid out without reading L_max; sequence-level
    ratios, IS weights (batch-normalised) and aggregation over it, the entropy quantile and
    attention weights standardised with the batch mean and std."""
    _check_policy_step(PolicyLossConfig(
        objective="gspo", rollout_is="sequence", rollout_is_max=2.0,
        rollout_is_batch_normalize=True, loss_agg="seq-mean-token-mean",
        top_entropy_quantile=0.6, attn_entropy_weighting="tanh",
        attn_entropy_standardize="batch", attn_entropy_alpha_final=0.5, entropy_coef=0.01),
        packed=True)


def test_policy_loss_packed_max_seqlen_traces():
    """max_seqlen (an int, symbolic under dynamic=True) sets the packed grid's width under
    compile too: one frame for two batch sizes and two widths, eager's loss and gradient.
    Dynamo's own tracing (backend "eager"): max_seqlen changes no op that AOT autograd sees
    differently from test_policy_loss_packed_compiles."""
    cfg = PolicyLossConfig(objective="gspo", top_entropy_quantile=0.4, entropy_coef=0.01)

    def step(logprobs, old_logprobs, advantages, mask, entropy, cu_seqlens, max_seqlen):
        return policy_loss(logprobs, old_logprobs, advantages, mask, cfg, entropy=entropy,
                           cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)[0]

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for b in (2, 3):
        x = _policy_inputs(b, packed=True)
        del x["rollout_logprobs"], x["attention_entropy"]
        with torch._dynamo.config.patch(specialize_float=True):
            loss = compiled(**x, max_seqlen=T - 2 + b)
        loss_e = step(**x, max_seqlen=T - 2)
        torch.testing.assert_close(loss, loss_e)
        torch.testing.assert_close(_grads(loss, x["logprobs"])[0],
                                   _grads(loss_e, x["logprobs"])[0])
    assert counter.frame_count == 1
