"""`fused_policy_loss` as one ``torch.library`` custom op, ``logitless::fused_policy_loss``:
the call's checks that read no values run in the wrapper (`op_call`, so they raise while
tracing), everything else in the op's implementation (`op_forward`, the eager chunk loop),
which returns the loss, the metrics as one tensor (named by `metric_names`) and the gradients
it computed in its forward; its backward is two or three multiplications by the loss's
incoming gradient. The call's `Request` crosses as flat arguments (``oplib.Record``: a count
given as a tensor or a number in a slot of each kind, the `PolicyLossConfig` as four lists)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch._subclasses.fake_tensor import is_fake

from logitless.fused_losses.fused.chunks import run_call
from logitless.fused_losses.fused.grads import Need
from logitless.fused_losses.fused.validation import Request, check_static, checked_ref
from logitless.fused_losses.objectives.config import KL_EXACT, PolicyLossConfig
from logitless.fused_losses.objectives.policy_inputs import check_shapes
from logitless.fused_losses.objectives.policy_loss import policy_loss
from logitless.fused_losses.oplib import Op, Record, distinct, is_compiling
from logitless.kernels import linear_softmax_torch as tiles


def as_op(hidden) -> bool:
    """Whether the call goes through the op ``logitless::fused_policy_loss``: while dynamo
    traces (one graph node), and for meta or fake tensors (its fake implementation gives the
    outputs' shapes). An eager call on real tensors runs `run_call` itself: the same code the op
    runs, with the backward that scales the stored gradients in place (`_StoredGradients`)
    and the streaming strategy's recomputing backward."""
    if is_compiling():
        return True
    return isinstance(hidden, torch.Tensor) and (hidden.device.type == "meta" or is_fake(hidden))


def op_call(req: Request) -> tuple:
    """The call as the op: the checks that read no tensor's values here (so that they raise
    while tracing), everything else inside the op (`op_forward`), which returns the loss, the
    metrics as one tensor in the order of `metric_names`, and the gradients it computed."""
    head, config, tensors = req.head, req.config, req.tensors
    check_static(head, req.targets, req.mask, req.strategy, req.cu_seqlens, req.memory_budget)
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    for name, t in (("advantages", req.advantages), ("cu_seqlens", req.cu_seqlens),
                    ("selection_entropy", req.selection_entropy),
                    ("old_logprobs", req.old_logprobs), *tensors.items()):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    check_shapes(req.mask, req.advantages, req.cu_seqlens, False,
                  dict(old_logprobs=req.old_logprobs, selection_entropy=req.selection_entropy,
                       **tensors))
    checked_ref(head, config, *req.ref_args)
    for name in ("training_progress", "entropy_coef"):
        value = getattr(req, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name}: expected a number or None, got {value!r}")
    for name in ("num_items_in_batch", "global_batch_size"):
        value = getattr(req, name)
        if value is not None and not isinstance(value, torch.Tensor) and (
                isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name}: expected a number, got {value!r}")
    has_kl = (req.ref_hidden if config.kl_estimator == KL_EXACT
              else req.ref_logprobs) is not None
    names = metric_names(config.objective, config.rollout_is, has_kl)
    req = dataclasses.replace(
        req, temperature=float(head.temperature),
        softcap=None if head.softcap is None else float(head.softcap),
        logit_scale=float(head.logit_scale), dtype=head.dtype,
        need=Need.of(head.hidden, head.weight, head.bias), metric_names=names)
    loss, values, *_ = FUSED_POLICY_LOSS(*REQUEST.values(req))
    return loss, dict(zip(names, values.unbind()))


def op_forward(a) -> tuple:
    """The op's implementation: `run_call` (every check, the plan, the chunks, or the whole
    batch streamed) on the request its arguments ``a`` hold, the gradients computed now where
    needed (the streamed batch's by its graph), returned as plain tensors: ``(loss, metrics
    [len(names)], d_hidden, d_weight, d_bias)``, an empty tensor for a gradient not needed."""
    req = REQUEST.record(a)
    need, given = req.need, (req.hidden, req.weight, req.bias)
    leaves = [None if x is None else x.detach().requires_grad_(n) for x, n in zip(given, need)]
    req = dataclasses.replace(req, hidden=leaves[0], weight=leaves[1], bias=leaves[2])
    with _autograd_inside_op(need.any), torch.autocast(req.hidden.device.type, enabled=False):
        loss, metrics, grads = run_call(req)
        if grads is None:  # the whole batch streamed: its graph differentiated now
            grads = _grads_of(loss, leaves, need)
    acc, names = tiles.acc_dtype(req.dtype), list(req.metric_names)
    if list(metrics) != names or loss.dtype != acc or any(
            v.dtype != acc for v in metrics.values()):
        raise RuntimeError(
            f"fused_policy_loss: the objective {req.config.objective!r} gave the metrics "
            f"{list(metrics)} (dtypes {[v.dtype for v in metrics.values()]}, loss "
            f"{loss.dtype}), not the {names} in {acc} the op was traced for (found from "
            "the objective and rollout_is alone, by metric_names): an objective whose clip "
            "flags depend on other config fields does not compile as one op")
    outs = [loss.detach(), torch.stack(list(metrics.values())).detach()]
    for x, d, n in zip(given, grads, need):
        if not n:  # as the fake implementation (`_fpl_forward_fake`)
            outs.append((given[0] if x is given[0] else given[1]).new_empty(0))
        else:  # contiguous, as the fake implementation says, whatever x's strides
            outs.append(x.new_zeros(x.shape) if d is None else d.contiguous())
    return distinct(outs)


def _grads_of(loss, leaves, need: Need) -> tuple:
    """``(d_hidden, d_weight, d_bias)`` of ``loss`` (None where not needed or unused)."""
    wanted = [x for x, n in zip(leaves, need) if n]
    if not wanted or not loss.requires_grad:
        return None, None, None
    got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    return tuple(next(got) if n else None for n in need)


_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor",
                  "ADInplaceOrView")


@contextlib.contextmanager
def _autograd_inside_op(on: bool):
    """Autograd recording inside the op's implementation (``on``; grad mode off otherwise).
    torch runs a custom op's implementation below autograd, with the autograd dispatch keys
    excluded, and the chunks differentiate their share of the loss there: the keys are let
    through again for the call (they are restored on exit)."""
    with contextlib.ExitStack() as stack:
        if on:
            for name in _AUTOGRAD_KEYS:
                stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(
                    getattr(torch._C.DispatchKey, name), False))
        stack.enter_context(torch.enable_grad() if on else torch.no_grad())
        yield


_METRIC_NAMES: dict[tuple, tuple[str, ...]] = {}


@torch.compiler.assume_constant_result
def metric_names(objective: str, rollout_is: str | None, kl: bool = False) -> tuple[str, ...]:
    """The names, in order, of the metrics `fused_policy_loss` returns for ``objective`` with
    ``rollout_is``, with a ``kl`` metric or not (a reference given: its logprobs, or its head
    for ``kl_estimator="exact"``): those of `policy_loss` given the entropies, found once by
    running it on a two-token batch (the objective decides whether there are clip metrics,
    ``rollout_is`` whether there are IS-weight metrics). Under dynamo a constant of the graph:
    the op returns the metrics as one tensor and the wrapper names its entries."""
    key = (objective, rollout_is, kl)
    if key not in _METRIC_NAMES:
        cfg = PolicyLossConfig(objective=objective, rollout_is=rollout_is)
        lp = torch.tensor([[-1.0, -2.0]])
        with torch.no_grad():
            _, metrics = policy_loss(lp, lp - 0.1, torch.ones(1), torch.ones(1, 2), cfg,
                                     entropy=-lp, rollout_logprobs=lp - 0.2,
                                     ref_logprobs=lp - 0.3 if kl else None)
        _METRIC_NAMES[key] = tuple(metrics)
    return _METRIC_NAMES[key]




# The op's arguments: the request's fields (`Request`, flattened by `oplib.Record`).
REQUEST = Record(Request)


def _fpl_forward_fake(a):
    acc = tiles.acc_dtype(a.dtype)
    need = REQUEST.field(a, "need")
    # the gradients contiguous whatever the inputs' strides (the implementation makes them so)
    return (a.hidden.new_empty((), dtype=acc),
            a.hidden.new_empty((len(a.metric_names),), dtype=acc),
            a.hidden.new_empty(a.hidden.shape if need.hidden else (0,)),
            a.weight.new_empty(a.weight.shape if need.weight else (0,)),
            a.bias.new_empty(a.bias.shape) if need.bias else a.weight.new_empty(0))


def _fpl_backward(a):
    """The gradients were computed in the forward: scaled by the loss's incoming gradient.
    Plain multiplications (no op of their own): inductor fuses them into one kernel that
    writes into the stored gradients' buffers (saved tensors the backward donates), so the
    compiled backward allocates no second [V, D] weight gradient."""
    computed = REQUEST.field(a, "need")
    return tuple(d * a.g_loss.to(d.dtype) if n and c else None
                 for d, n, c in zip((a.d_hidden, a.d_weight, a.d_bias), a.need, computed))


FUSED_POLICY_LOSS = Op(
    "fused_policy_loss", REQUEST.args, ("loss", "metrics", "d_hidden", "d_weight", "d_bias"),
    op_forward, _fpl_forward_fake, wrt=("hidden", "weight", "bias"), grads=("loss",),
    saved=("d_hidden", "d_weight", "d_bias"), autograd=_fpl_backward,
    non_differentiable=("metrics", "d_hidden", "d_weight", "d_bias"))
