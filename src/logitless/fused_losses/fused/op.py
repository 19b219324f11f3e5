"""`fused_policy_loss` as one ``torch.library`` custom op, ``logitless::fused_policy_loss``:
the call's checks that read no values run in the wrapper (`op_call`, so they raise while
tracing), everything else in the op's implementation (`op_forward`, the eager chunk loop),
which returns the loss, the metrics as one tensor (named by `metric_names`) and the gradients
it computed in its forward; its backward is two or three multiplications by the loss's
incoming gradient. The `PolicyLossConfig` crosses as four lists (``oplib.config_layout``)."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import is_fake

from logitless.fused_losses.fused.chunks import run_call
from logitless.fused_losses.fused.grads import Need
from logitless.fused_losses.fused.validation import Head, check_static, checked_ref
from logitless.fused_losses.objectives.config import KL_EXACT, PolicyLossConfig
from logitless.fused_losses.objectives.policy_inputs import check_shapes
from logitless.fused_losses.objectives.policy_loss import policy_loss
from logitless.fused_losses.oplib import (
    CONFIG_LISTS,
    config_layout,
    define,
    distinct,
    is_compiling,
    none_grads,
)
from logitless.fused_losses.oplib import config_args as _pack
from logitless.fused_losses.oplib import config_from_args as _unpack
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


def op_call(head, targets, old_logprobs, advantages, mask, config, strategy, cu_seqlens,
             selection_entropy, memory_budget, tensors, loss_args, ref_args) -> tuple:
    """The call as the op: the checks that read no tensor's values here (so that they raise
    while tracing), everything else inside the op (`op_forward`), which returns the loss, the
    metrics as one tensor in the order of `metric_names`, and the gradients it computed."""
    check_static(head, targets, mask, strategy, cu_seqlens, memory_budget)
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if old_logprobs is None:
        raise ValueError("old_logprobs: required (pass logprobs.detach() when on-policy)")
    for name, t in (("advantages", advantages), ("cu_seqlens", cu_seqlens),
                    ("selection_entropy", selection_entropy), ("old_logprobs", old_logprobs),
                    *tensors.items()):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    check_shapes(mask, advantages, cu_seqlens, False,
                  dict(old_logprobs=old_logprobs, selection_entropy=selection_entropy, **tensors))
    checked_ref(head, config, *ref_args)
    for name in ("training_progress", "entropy_coef"):
        value = loss_args[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name}: expected a number or None, got {value!r}")
    counts = []
    for name in ("num_items_in_batch", "global_batch_size"):
        value = loss_args[name]
        if value is not None and not isinstance(value, torch.Tensor) and (
                isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        counts.append(value)
    need = Need.of(head.hidden, head.weight, head.bias)
    has_kl = (ref_args[0] if config.kl_estimator == KL_EXACT
              else tensors["ref_logprobs"]) is not None
    names = metric_names(config.objective, config.rollout_is, has_kl)
    loss, values, *_ = torch.ops.logitless.fused_policy_loss(
        head.hidden, head.weight, head.bias, targets, old_logprobs, advantages, mask,
        tensors["ref_logprobs"], tensors["rollout_logprobs"], tensors["token_weights"],
        tensors["attention_entropy"], cu_seqlens, selection_entropy, *ref_args,
        *(c if isinstance(c, torch.Tensor) else None for c in counts),
        float(head.temperature), None if head.softcap is None else float(head.softcap),
        float(head.logit_scale), *(None if isinstance(c, torch.Tensor) else c for c in counts),
        loss_args["training_progress"], loss_args["entropy_coef"], memory_budget, strategy,
        head.dtype, *need, list(names), *config_args(config))
    return loss, dict(zip(names, values.unbind()))


def op_forward(hidden, weight, bias, targets, old_logprobs, advantages, mask, ref_logprobs,
               rollout_logprobs, token_weights, attention_entropy, cu_seqlens,
               selection_entropy, ref_hidden, ref_weight, ref_bias, num_items_tensor,
               global_batch_size_tensor, temperature, softcap, logit_scale, num_items_in_batch,
               global_batch_size, training_progress, entropy_coef, memory_budget, strategy,
               dtype, need_hidden, need_weight, need_bias, names, config) -> tuple:
    """The op's implementation: `run_call` (every check, the plan, the chunks, or the whole
    batch streamed), the gradients computed now where needed (the streamed batch's by its
    graph), returned as plain tensors: ``(loss, metrics [len(names)], d_hidden, d_weight,
    d_bias)``, an empty tensor for a gradient not needed."""
    need = Need(need_hidden, need_weight, need_bias)
    leaves = [None if x is None else x.detach().requires_grad_(n)
              for x, n in zip((hidden, weight, bias), need)]
    head = Head(*leaves, temperature, softcap, logit_scale, dtype)
    tensors = dict(ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                   token_weights=token_weights, attention_entropy=attention_entropy)
    loss_args = dict(
        num_items_in_batch=num_items_in_batch if num_items_tensor is None else num_items_tensor,
        global_batch_size=(global_batch_size if global_batch_size_tensor is None
                           else global_batch_size_tensor),
        training_progress=training_progress, entropy_coef=entropy_coef)
    with _autograd_inside_op(need.any), torch.autocast(hidden.device.type, enabled=False):
        loss, metrics, grads = run_call(head, need, targets, old_logprobs, advantages, mask,
                                      config, strategy, cu_seqlens, selection_entropy,
                                      memory_budget, tensors, loss_args,
                                      (ref_hidden, ref_weight, ref_bias))
        if grads is None:  # the whole batch streamed: its graph differentiated now
            grads = _grads_of(loss, leaves, need)
    acc = tiles.acc_dtype(dtype)
    if list(metrics) != list(names) or loss.dtype != acc or any(
            v.dtype != acc for v in metrics.values()):
        raise RuntimeError(
            f"fused_policy_loss: the objective {config.objective!r} gave the metrics "
            f"{list(metrics)} (dtypes {[v.dtype for v in metrics.values()]}, loss "
            f"{loss.dtype}), not the {list(names)} in {acc} the op was traced for (found from "
            "the objective and rollout_is alone, by metric_names): an objective whose clip "
            "flags depend on other config fields does not compile as one op")
    outs = [loss.detach(), torch.stack(list(metrics.values())).detach()]
    for x, d, n in zip((hidden, weight, bias), grads, need):
        if not n:  # as the fake implementation (`_fpl_forward_fake`)
            outs.append((hidden if x is hidden else weight).new_empty(0))
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


_CONFIG_LAYOUT = config_layout(PolicyLossConfig)


def config_args(config: PolicyLossConfig) -> tuple[list, list, list, list]:
    """The config's fields as the op's four list arguments."""
    return _pack(config, _CONFIG_LAYOUT)


def config_from_args(numbers, strings, flags, tensors) -> PolicyLossConfig:
    """The `PolicyLossConfig` back from `config_args`'s lists (checked again on the way)."""
    return _unpack(PolicyLossConfig, _CONFIG_LAYOUT, numbers, strings, flags, tensors)


# The op's arguments: tensors (the call's, then the global counts given as tensors), then
# the call's scalars, then the config's four lists.
_FPL_TENSORS = ("hidden", "weight", "bias", "targets", "old_logprobs", "advantages", "mask",
                "ref_logprobs", "rollout_logprobs", "token_weights", "attention_entropy",
                "cu_seqlens", "selection_entropy", "ref_hidden", "ref_weight", "ref_bias",
                "num_items_in_batch_tensor", "global_batch_size_tensor")


_FPL_REQUIRED = ("hidden", "weight", "targets", "old_logprobs", "advantages", "mask")


_FPL_SCALARS = ("float temperature, float? softcap, float logit_scale, "
                "Scalar? num_items_in_batch, Scalar? global_batch_size, "
                "float? training_progress, float? entropy_coef, int? memory_budget, "
                "str strategy, ScalarType dtype, bool need_hidden, bool need_weight, "
                "bool need_bias, str[] metric_names")



_N_FPL_INPUTS = len(_FPL_TENSORS) + _FPL_SCALARS.count(",") + 1 + 4


_FPL_OPTIONS = len(_FPL_TENSORS) + 9  # dtype, need_hidden, need_weight, need_bias, names


def _fpl_forward(*args):
    return op_forward(*args[:-4], config_from_args(*args[-4:]))


def _fpl_forward_fake(*args):
    hidden, weight, bias = args[:3]
    dtype, need_hidden, need_weight, need_bias, names = args[_FPL_OPTIONS:_FPL_OPTIONS + 5]
    acc = tiles.acc_dtype(dtype)
    # the gradients contiguous whatever the inputs' strides (the implementation makes them so)
    return (hidden.new_empty((), dtype=acc), hidden.new_empty((len(names),), dtype=acc),
            hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)),
            bias.new_empty(bias.shape) if need_bias else weight.new_empty(0))


def _fpl_setup_context(ctx, inputs, output):
    ctx.need = inputs[_FPL_OPTIONS + 1:_FPL_OPTIONS + 4]
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[2:])


def _fpl_backward(ctx, g_loss, *_):
    """The gradients were computed in the forward: scaled by the loss's incoming gradient.
    Plain multiplications (no op of their own): inductor fuses them into one kernel that
    writes into the stored gradients' buffers (saved tensors the backward donates), so the
    compiled backward allocates no second [V, D] weight gradient."""
    if g_loss is None:
        return none_grads(_N_FPL_INPUTS)
    need = (a and b for a, b in zip(ctx.need, ctx.needs_input_grad[:3]))
    grads = tuple(d * g_loss.to(d.dtype) if n else None
                  for d, n in zip(ctx.saved_tensors, need))
    return (*grads, *none_grads(_N_FPL_INPUTS - 3))


_fused_policy_loss_op = define(
    "fused_policy_loss",
    "(" + ", ".join(f"Tensor{'' if t in _FPL_REQUIRED else '?'} {t}" for t in _FPL_TENSORS)
    + ", " + _FPL_SCALARS + ", " + CONFIG_LISTS
    + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fpl_forward, _fpl_forward_fake)
_fused_policy_loss_op.register_autograd(_fpl_backward, setup_context=_fpl_setup_context)
