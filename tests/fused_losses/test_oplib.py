"""``oplib.Op`` and ``oplib.Record``: an op, its fake, its backward op and its autograd from one
declaration of its arguments, and a dataclass crossing an op's boundary as flat arguments."""

import dataclasses
import types

import pytest
import torch

from logitless.fused_losses import oplib
from logitless.fused_losses.fused.grads import Need
from logitless.fused_losses.fused.op import REQUEST
from logitless.fused_losses.fused.validation import Request
from logitless.fused_losses.head.logprobs import LINEAR_LOGPROBS
from logitless.fused_losses.objectives.config import PolicyLossConfig


def _scaled_head(a):
    """``(hidden @ weight^T * scale + shift) [targets]`` and the full logits' sum."""
    z = a.hidden @ a.weight.T * a.scale + a.shift
    if a.bias is not None:
        z = z + a.bias
    return z.gather(-1, a.targets[..., None]).squeeze(-1), z.sum(-1)


def _scaled_fake(a):
    return tuple(a.hidden.new_empty(a.targets.shape) for _ in range(2))


def _scaled_backward(a):
    g = torch.zeros(*a.targets.shape, a.weight.shape[0], dtype=a.hidden.dtype)
    if a.g_picked is not None:
        g.scatter_add_(-1, a.targets[..., None], a.g_picked[..., None])
    if a.g_total is not None:
        g = g + a.g_total[..., None]
    d_h = g @ a.weight * a.scale if a.need[0] else a.hidden.new_empty(0)
    d_w = (g.reshape(-1, g.shape[-1]).T @ a.hidden.reshape(-1, a.hidden.shape[-1])) * a.scale \
        if a.need[1] else a.weight.new_empty(0)
    d_b = g.reshape(-1, g.shape[-1]).sum(0) if a.need[2] else a.weight.new_empty(0)
    return d_h, d_w, d_b


# "float shift=0.0": an argument added to the declaration only, read by name where it is used
_TEST_OP = oplib.Op(
    "test_scaled_head",
    ("Tensor hidden", "Tensor weight", "Tensor? bias", "Tensor targets", "float scale",
     "bool unused_flag", "float shift=0.0"),
    ("picked", "total"), _scaled_head, _scaled_fake, wrt=("hidden", "weight", "bias"),
    grads=("picked", "total"), backward=_scaled_backward, forward_only=("unused_flag",))
oplib.OPS.remove("logitless::test_scaled_head")  # not a public op (test_compile's opcheck)
oplib.OPS.remove("logitless::test_scaled_head_backward")


def _inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 7, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(13, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, 13, (3, 5), generator=g)
    return h, w, b, t


def test_op_schemas_follow_the_one_declaration():
    """The forward's schema is the declaration; the backward's holds the forward's tensors, the
    incoming gradients by output name, the other arguments less ``forward_only``, a flag per
    differentiable input, then the arguments with a default (their defaults kept)."""
    fwd = str(torch.ops.logitless.test_scaled_head.default._schema)
    assert fwd.endswith("(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, "
                        "float scale, bool unused_flag, float shift=0.) -> (Tensor, Tensor)")
    bwd = str(torch.ops.logitless.test_scaled_head_backward.default._schema)
    assert bwd.endswith(
        "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor? g_picked, "
        "Tensor? g_total, float scale, bool need_hidden, bool need_weight, bool need_bias, "
        "float shift=0.) -> (Tensor, Tensor, Tensor)")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shift", [None, 0.7])
def test_op_gradients_match_autograd_with_defaults_and_by_name(bias, shift):
    """The op's outputs and gradients equal plain autograd's on the same math, whether the
    argument with a default is given or not; a None bias gets no gradient."""
    h, w, b, t = _inputs(1, bias)
    extra = () if shift is None else (shift,)
    got = _TEST_OP(h, w, b, t, 1.3, True, *extra)
    want = _scaled_head(_TEST_OP.bind((h, w, b, t, 1.3, True, *extra)))
    leaves = [x for x in (h, w, b) if x is not None]
    r = torch.randn(3, 5, dtype=torch.float64)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad((got[0] * r).sum() + got[1].sum(), leaves, retain_graph=True)
    g_want = torch.autograd.grad((want[0] * r).sum() + want[1].sum(), leaves,
                                 retain_graph=True)
    for x, y in zip(g_got, g_want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    # one output's gradient only; and the weight alone needing one
    g_one = torch.autograd.grad(got[1].sum(), [w])[0]
    torch.testing.assert_close(g_one, torch.autograd.grad(want[1].sum(), [w])[0], rtol=1e-12,
                               atol=1e-12)


def test_op_passes_opcheck_and_compiles_as_one_node():
    h, w, b, t = _inputs(2)
    torch.library.opcheck(torch.ops.logitless.test_scaled_head.default, (h, w, b, t, 0.9, False))
    fn = torch.compile(lambda *xs: _TEST_OP(*xs, 0.9, False, 0.25), backend="aot_eager",
                       fullgraph=True)
    out = fn(h, w, b, t)
    want = _TEST_OP(h, w, b, t, 0.9, False, 0.25)
    for x, y in zip(out, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(out[0].sum(), [h, w, b])
    g_want = torch.autograd.grad(want[0].sum(), [h, w, b])
    for x, y in zip(g, g_want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_linear_logprobs_op_declares_each_argument_once():
    """The backward op of ``linear_logprobs`` takes the forward's arguments by the names of its
    declaration (less its forward-only flags), in the order the schema gives them."""
    fwd = [a.name for a in LINEAR_LOGPROBS.args]
    bwd = [a.name for a in LINEAR_LOGPROBS.backward_args]
    assert [x for x in fwd if x not in ("want_s2", "want_sum_z")] == [x for x in bwd if x in fwd]
    assert bwd[-3:] == ["group_name", "hidden_grad", "head_dtype"]


def test_request_crosses_the_op_boundary_whole():
    """Every op field of a `Request` comes back from its flat arguments: a tensor count in its
    tensor slot, a number count in its number slot, the flags, the names and the config."""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(2, 3, generator=g)
    cfg = PolicyLossConfig(objective="grpo", beta=0.04, eps_low=torch.rand(2, 3, generator=g))
    req = Request(hidden=torch.randn(2, 3, 4, generator=g), weight=torch.randn(9, 4, generator=g),
                  targets=torch.randint(0, 9, (2, 3), generator=g), old_logprobs=t - 3,
                  advantages=torch.randn(2, generator=g), mask=t > 0, config=cfg,
                  num_items_in_batch=torch.tensor(5.0), global_batch_size=7, temperature=0.8,
                  softcap=None, dtype=torch.float32, need=Need(True, False, False),
                  metric_names=("a", "b"), memory_budget=1 << 20, strategy="chunked")
    values = REQUEST.values(req)
    assert len(values) == len(REQUEST.args)
    back = REQUEST.record(types.SimpleNamespace(**{a.name: v for a, v in
                                                   zip(REQUEST.args, values)}))
    pairs = [(f.name, getattr(req, f.name), getattr(back, f.name))
             for f in dataclasses.fields(Request) if f.metadata.get("op") is not False]
    pairs += [(f"config.{c.name}", getattr(cfg, c.name), getattr(back.config, c.name))
              for c in dataclasses.fields(cfg) if c.init]
    for name, x, y in pairs:
        if name == "config":
            continue
        if isinstance(x, torch.Tensor):
            assert y is x, name
        else:
            assert x == y and type(x) is type(y), name
