"""``fused_policy_loss``: from hidden states to the policy loss at the 3-GEMM floor.

Two strategies (docs/design.md, "Op 4"):

- **Sequence-aligned chunks** (gradient in the forward). Whole sequences are grouped up to a
  token budget. For each group the logits are computed once (GEMM 1), reduced to per-token
  ``lp`` and ``H``, and the objective runs on that group through :func:`policy_loss` (its
  private entry for a validated batch) with the batch's :class:`BatchGlobals`, so autograd on
  the small per-token graph gives ``d loss / d lp`` and ``d loss / d H``. The logits buffer
  then becomes ``dz`` in place and two GEMMs give the group's hidden gradient and add to the
  weight gradient (fp32). The backward of the returned loss only scales the stored gradients.
  6 N D V FLOPs, memory one group: its logits in one buffer reused by every group
  (``kernels/stored_logits.py``, vocab-major fp32 exponentials, on CPU;
  ``kernels/stored_logits_triton.py``, the logits in the input dtype with Triton passes,
  wherever Triton is selected, i.e. on CUDA).
- **Streaming**: ``policy_loss(linear_logprobs(...))``, the vocabulary streamed forward and
  recomputed backward (8 N D V FLOPs), never the full logits. Used when asked for, for
  objectives that select tokens from statistics of the whole batch's current logprobs
  (``clip_cov``, ``kl_cov``), and for a single sequence longer than the budget.

Either way the loss math is :func:`policy_loss`, run once more on the collected per-token
``lp`` and ``H`` (O(N), no vocabulary) for the loss value and the metrics.

The code: checks (once, for the whole call), plan, chunk loop (`_ChunkRunner`, with a pluggable
`ChunkStore` for the dense chunks); and the op (`_op_call`, `op_forward`): under
``torch.compile`` the whole call is the one custom op ``logitless::fused_policy_loss``
(defined in ``custom_ops.py``, the config crossing as four lists), whose implementation runs
this eager code, the plan from the mask and ``cu_seqlens`` included, and returns the loss, the
metrics as one tensor (named by `metric_names`) and the gradients it computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from typing import NamedTuple, Protocol

import torch
from torch._subclasses.fake_tensor import is_fake

from logitless.fused_losses import custom_ops, gpu_plan
from logitless.fused_losses.aggregation import check_global_counts
from logitless.fused_losses.backend import triton_selected
from logitless.fused_losses.config import PolicyLossConfig
from logitless.fused_losses.custom_ops import is_compiling
from logitless.fused_losses.divergence import exact_kl_rows, reference_head
from logitless.fused_losses.logprobs import (
    _rows_logprobs,
    check_byte_budget,
    check_head_args,
    compute_dtype,
)
from logitless.fused_losses.objectives import needs_whole_batch
from logitless.fused_losses.policy_loss import (
    _Batch,
    _check_shapes,
    _dtype,
    _globals_and_masks,
    _loss_of_batch,
    _Masks,
    _policy_loss,
    _to_batch,
    check_exact_kl,
    policy_loss,
)
from logitless.kernels import divergence_torch, stored_logits
from logitless.kernels import linear_softmax_torch as tiles

__all__ = ["CPU_MEMORY_BUDGET", "ChunkStore", "fused_policy_loss", "plan_chunks"]

CPU_MEMORY_BUDGET = 256 * 2**20
STRATEGIES = ("auto", "chunked", "streaming")


def _default_budget(device: torch.device) -> int:
    """A fixed number of bytes per device type, never read off the allocator: on CUDA the one
    the cost model chooses (``gpu_plan.CUDA_MEMORY_BUDGET``)."""
    if device.type == "cuda":
        return gpu_plan.CUDA_MEMORY_BUDGET
    return CPU_MEMORY_BUDGET


def plan_chunks(tokens_per_sequence: list[int], max_rows: int) -> list[tuple[int, int, bool]]:
    """Group consecutive sequences into chunks of at most ``max_rows`` loss tokens.

    Returns ``(first_sequence, end_sequence, streamed)`` triples; a sequence alone longer than
    the budget forms its own chunk, marked to be streamed. Between streamed sequences, the
    fewest chunks that fit are formed and then evened out: cut at the sequence boundaries
    nearest to equal shares (when those cuts fit), so that no chunk is left with a thin tail of
    rows (a thin GEMM is a slow one).
    """
    plan, run = [], []
    for i, n in enumerate(tokens_per_sequence):
        if n > max_rows:
            plan += _even_chunks(run, tokens_per_sequence, max_rows)
            plan.append((i, i + 1, True))
            run = []
        else:
            run.append(i)
    return plan + _even_chunks(run, tokens_per_sequence, max_rows)


def _greedy_chunks(first: int, sizes: list[int], max_rows: int) -> list[tuple[int, int]]:
    cuts, rows = [], 0
    for j, n in enumerate(sizes):
        if rows + n > max_rows and j > 0 and rows > 0:
            cuts.append(j)
            rows = 0
        rows += n
    bounds = [0, *cuts, len(sizes)]
    return [(first + a, first + b) for a, b in itertools.pairwise(bounds)]


def _even_chunks(run: list[int], sizes_all: list[int], max_rows: int):
    """Consecutive sequences ``run`` (each within the budget) as evened-out chunks."""
    if not run:
        return []
    first, sizes = run[0], [sizes_all[i] for i in run]
    greedy = _greedy_chunks(first, sizes, max_rows)
    k = len(greedy)
    cum = [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    cuts, prev = [], 0
    for j in range(1, k):
        ideal = cum[-1] * j / k
        # the boundary nearest the ideal share, leaving a sequence for each later chunk
        best = min(range(prev + 1, len(sizes) - (k - j) + 1),
                   key=lambda c: abs(cum[c] - ideal))
        cuts.append(best)
        prev = best
    bounds = [0, *cuts, len(sizes)]
    if any(cum[b] - cum[a] > max_rows for a, b in itertools.pairwise(bounds)):
        chunks = greedy
    else:
        chunks = [(first + a, first + b) for a, b in itertools.pairwise(bounds)]
    return [(a, b, False) for a, b in chunks]


class _WeightGrad:
    """The fp32 weight-gradient accumulator, written (not added to) by its first chunk: zeroing
    ``[V, D]`` first would cost a pass over it (0.3 s at V=152k, D=1024 on CPU)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.t = torch.empty_like(weight, dtype=dtype)
        self.fresh = True

    def add_(self, g: torch.Tensor) -> None:
        if self.fresh:
            self.t.copy_(g)
        else:
            self.t += g
        self.fresh = False

    def buffer(self) -> tuple[torch.Tensor, float]:
        """The accumulator and the beta of a GEMM writing into it (0: the first write
        overwrites); the accumulator counts as written from here."""
        beta = 0.0 if self.fresh else 1.0
        self.fresh = False
        return self.t, beta

    def result(self) -> torch.Tensor:
        if self.fresh:  # no chunk's loss depended on the head
            self.t.zero_()
            self.fresh = False
        return self.t


class _StoredGradients(torch.autograd.Function):
    """The loss, whose backward scales gradients computed in the forward (once: see
    `fused_policy_loss`, "Backward")."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grads):
        ctx.grads = grads
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fused_policy_loss: backward(create_graph=True) is not supported: the chunked "
                "strategy computes its gradients in the forward, as plain tensors with no graph "
                "to differentiate again (a higher-order gradient needs the logits' graph: "
                "policy_loss on materialised logits).")
        if ctx.grads is None:
            raise RuntimeError(
                "fused_policy_loss: backward ran a second time through the same loss "
                "(retain_graph=True does not keep them): the chunked strategy computes its "
                "gradients in the forward and hands them over, scaled in place, to the first "
                "backward, keeping no copy of the [V, D] weight gradient. Call "
                "fused_policy_loss again for a second backward, or use strategy='streaming'.")
        d_hidden, d_weight, d_bias = ctx.grads
        ctx.grads = None  # handed over: autograd may keep d_weight as weight.grad itself

        def scale(x):  # in place: the stored gradients are ours, and [V, D] is large
            return None if x is None else x.mul_(g.to(x.dtype))

        return None, scale(d_hidden), scale(d_weight), scale(d_bias), None


def fused_policy_loss(
    hidden,
    weight,
    targets,
    old_logprobs,
    advantages,
    mask,
    config: PolicyLossConfig,
    *,
    bias=None,
    ref_logprobs=None,
    rollout_logprobs=None,
    token_weights=None,
    attention_entropy=None,
    cu_seqlens=None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    num_items_in_batch=None,
    global_batch_size=None,
    training_progress: float | None = None,
    entropy_coef: float | None = None,
    selection_entropy=None,
    memory_budget: int | None = None,
    strategy: str = "auto",
    ref_hidden=None,
    ref_weight=None,
    ref_bias=None,
):
    """The policy loss from hidden states and the LM head, without the full logits.

    Equal to ``policy_loss(linear_logprobs(hidden, weight, targets, ...).logprobs, ...,
    entropy=<its entropy>)``. The entropy selections (top-entropy quantile, ``|A| H``
    fraction, STAPO) read one tensor ``E``, for their thresholds and for the tokens they keep:
    ``selection_entropy`` when given (for example the old-policy pass's entropies), otherwise
    the current entropies, computed by a no-grad pass before the chunks when the config selects
    by entropy (each chunk uses that pass's selections, not its own recomputed entropies, which
    may differ by an ulp at a threshold). Gradients reach ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``[B, T, D]`` right-padded, or ``[N, D]`` packed with ``cu_seqlens [B + 1]``.
        weight, bias: the head, ``[V, D]`` and ``[V]``.
        targets: token ids like ``mask``; only positions where ``mask`` is nonzero are scored.
        old_logprobs, advantages, mask, config, ref_logprobs, rollout_logprobs, token_weights,
        attention_entropy, num_items_in_batch, global_batch_size, training_progress,
            entropy_coef: as in :func:`policy_loss`.
        temperature, softcap, logit_scale: the logit transform, as in :func:`linear_logprobs`.
        memory_budget: bytes (an integer > 0) of temporary logits a chunk may use (default:
            512 MiB on CUDA, chosen by the cost model in ``gpu_plan``; 256 MiB on CPU). On CUDA
            a chunk row counts its stored logits and its hidden and hidden-gradient rows.
        strategy: ``"auto"`` (chunks, streaming where needed), ``"chunked"`` or ``"streaming"``.
        ref_hidden, ref_weight, ref_bias: the reference model's hidden states (``hidden``'s
            token shape, its own hidden size) and head (``[V, D_ref]``, ``[V]``), for
            ``kl_estimator="exact"`` only (needed there when ``beta != 0``): each chunk computes
            the full-vocabulary KL(policy || reference) of its rows by the two-head divergence
            passes (`linear_divergence` with ``beta=1``, temperature and logit scale of the
            policy head applied to both; no softcap), and its gradient
            ``p (log p - log q - KL)`` reaches ``hidden``, ``weight`` and ``bias``; the
            reference gets none. Same loss and gradients as ``policy_loss(..., kl=
            linear_divergence(hidden, weight, ref_hidden, ref_weight, mask, beta=1))``.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`.

    Backward: the chunked strategy computes the gradients of ``hidden``, ``weight`` and ``bias``
    during the forward (a buffer of each, the memory the backward would use anyway) and the
    loss's backward hands them over scaled by the incoming gradient, in place. So the loss
    supports exactly one backward, without ``create_graph``: a second backward (after
    ``retain_graph=True``) and ``create_graph=True`` raise ``RuntimeError`` rather than
    return gradients that are wrong or have no graph; keeping a copy for a second backward
    would double the weight gradient's memory. ``strategy="streaming"`` recomputes in its
    backward, so a retained graph backpropagates again there (neither strategy gives
    higher-order gradients).

    Under ``torch.compile`` (and for meta or fake tensors) the call is one custom op,
    ``logitless::fused_policy_loss`` (`custom_ops`): the checks that read no values run while
    tracing, and the op runs this same eager code (plan, chunks, or the whole batch streamed)
    with every argument, the exact KL's reference head and ``selection_entropy`` included.
    It computes the gradients in its forward whichever the strategy (the streamed batch's by
    its graph, at once), and its backward scales them, out of place: a backward of a
    compiled loss may run again after ``retain_graph=True``. The metrics' names come from
    the objective and ``rollout_is`` (`metric_names`); an objective whose clip flags depend on
    other fields raises ``RuntimeError`` there rather than mislabel them.
    """
    head = _Head(hidden, weight, bias, temperature, softcap, logit_scale)
    tensors = dict(ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                   token_weights=token_weights, attention_entropy=attention_entropy)
    loss_args = dict(num_items_in_batch=num_items_in_batch, global_batch_size=global_batch_size,
                     training_progress=training_progress, entropy_coef=entropy_coef)
    ref_args = (ref_hidden, ref_weight, ref_bias)
    if _as_op(hidden):
        return _op_call(head, targets, old_logprobs, advantages, mask, config, strategy,
                        cu_seqlens, selection_entropy, memory_budget, tensors, loss_args,
                        ref_args)
    need = _Need.of(hidden, weight, bias)
    loss, metrics, grads = _fused(head, need, targets, old_logprobs, advantages, mask, config,
                                  strategy, cu_seqlens, selection_entropy, memory_budget,
                                  tensors, loss_args, ref_args)
    if grads is None or not need.any:  # the whole batch streamed: the loss has its graph
        return loss, metrics
    return _StoredGradients.apply(loss, hidden, weight, bias, grads), metrics


def _fused(head, need, targets, old_logprobs, advantages, mask, config, strategy, cu_seqlens,
           selection_entropy, memory_budget, tensors, loss_args, ref_args) -> tuple:
    """The eager call: ``(loss, metrics, grads)``, ``grads`` the ``(d_hidden, d_weight,
    d_bias)`` the chunks computed in the forward (None where not ``need``-ed), or None when
    the whole batch streamed (the loss then carries its autograd graph)."""
    call = _checked_call(head, targets, old_logprobs, advantages, mask, config, strategy,
                         cu_seqlens, selection_entropy, memory_budget, **tensors)
    call.ref = _checked_ref(head, config, *ref_args)
    if call.whole:
        return (*_streamed_whole(call, loss_args), None)

    glob, masks = _globals_and_masks(call.globals_batch(_selection_entropy(call)), config)
    check_global_counts(loss_args["num_items_in_batch"], loss_args["global_batch_size"],
                        glob.loss)
    plan = _plan(call, memory_budget)
    grads = _Grads(need, head, call.batch.adv.dtype)
    store = _new_store(head.vocab, plan.dense_rows, head.dtype, head.hidden.device,
                       head.softcap)
    runner = _ChunkRunner(call, glob, masks, loss_args, need, grads, store)
    for chunk in plan.chunks:
        runner.run(chunk)

    # The loss value and metrics: the one copy of the objective on the collected (lp, H).
    with torch.no_grad():
        loss, metrics = _policy_loss(call.with_logprobs(runner.lp, runner.ent, runner.kl),
                                     config, glob, masks=masks, **loss_args)
    return loss, metrics, grads.result(head.hidden, head.weight, head.bias)


# --- checks ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Head:
    """The LM head of one call: inputs as given, their compute dtype, the logit transform."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    temperature: float
    softcap: float | None
    logit_scale: float
    compute: torch.dtype | None = None  # the compute dtype when given (inside the op)

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return compute_dtype(self.hidden) if self.compute is None else self.compute

    def transform(self) -> dict:
        return dict(temperature=self.temperature, softcap=self.softcap,
                    logit_scale=self.logit_scale)

    def detached(self):
        """``(hidden [rows, D], weight, bias)`` in the compute dtype, detached."""
        dtype = self.dtype
        h = self.hidden.detach().to(dtype).reshape(-1, self.hidden.shape[-1])
        b = None if self.bias is None else self.bias.detach().to(dtype)
        return h, self.weight.detach().to(dtype), b


@dataclasses.dataclass
class _Call:
    """A validated call: the head, its loss rows (flat token indices where the mask is set, in
    sequence order) with their targets and grid positions, and the batch on the grid."""

    head: _Head
    config: PolicyLossConfig
    batch: _Batch  # in the loss's dtype (the accumulation dtype of the head)
    full: _Batch  # in the wider of the loss's and the globals' dtypes (globals are cast from it)
    globals_dtype: torch.dtype
    rows: torch.Tensor
    targets: torch.Tensor
    where: tuple[torch.Tensor, torch.Tensor]
    packed: bool
    cu_seqlens: torch.Tensor | None
    strategy: str
    selection_entropy: bool
    ref: _RefHead | None = None  # the reference head of the exact KL

    @functools.cached_property
    def detached(self):
        """The head detached (`_Head.detached`), once: the chunks compute their gradients
        themselves, and an autograd graph over the logits would keep every chunk's tiles alive
        until the backward."""
        return self.head.detached()

    @property
    def whole(self) -> bool:
        """The batch streams in one call: asked for, or the objective needs the whole batch."""
        return self.strategy == "streaming" or needs_whole_batch(self.config.objective)

    def grid(self, per_row: torch.Tensor) -> torch.Tensor:
        """Values of the loss rows on the batch grid (zero elsewhere; differentiable)."""
        return per_row.new_zeros(self.batch.m.shape).index_put(self.where, per_row)

    def with_logprobs(self, lp_rows, ent_rows, kl_rows=None) -> _Batch:
        kl = {} if kl_rows is None else {"kl": self.grid(kl_rows)}
        return self.batch.with_tensors(logprobs=self.grid(lp_rows), entropy=self.grid(ent_rows),
                                       **kl)

    def globals_batch(self, entropy) -> _Batch:
        """The batch `BatchGlobals` are computed from (old logprobs' dtype, as
        `policy_loss_globals`), with the entropies the selections use."""
        entropy = None if entropy is None else entropy.to(self.globals_dtype)
        return self.full.to(self.globals_dtype).with_tensors(entropy=entropy)


# --- the op ----------------------------------------------------------------------------------


def _as_op(hidden) -> bool:
    """Whether the call goes through the op ``logitless::fused_policy_loss``: while dynamo
    traces (one graph node), and for meta or fake tensors (its fake implementation gives the
    outputs' shapes). An eager call on real tensors runs `_fused` itself: the same code the op
    runs, with the backward that scales the stored gradients in place (`_StoredGradients`)
    and the streaming strategy's recomputing backward."""
    if is_compiling():
        return True
    return isinstance(hidden, torch.Tensor) and (hidden.device.type == "meta" or is_fake(hidden))


def _op_call(head, targets, old_logprobs, advantages, mask, config, strategy, cu_seqlens,
             selection_entropy, memory_budget, tensors, loss_args, ref_args) -> tuple:
    """The call as the op: the checks that read no tensor's values here (so that they raise
    while tracing), everything else inside the op (`op_forward`), which returns the loss, the
    metrics as one tensor in the order of `metric_names`, and the gradients it computed."""
    _check_static(head, targets, mask, strategy, cu_seqlens, memory_budget)
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if old_logprobs is None:
        raise ValueError("old_logprobs: required (pass logprobs.detach() when on-policy)")
    for name, t in (("advantages", advantages), ("cu_seqlens", cu_seqlens),
                    ("selection_entropy", selection_entropy), ("old_logprobs", old_logprobs),
                    *tensors.items()):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    _check_shapes(mask, advantages, cu_seqlens, False,
                  dict(old_logprobs=old_logprobs, selection_entropy=selection_entropy, **tensors))
    _checked_ref(head, config, *ref_args)
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
    need = _Need.of(head.hidden, head.weight, head.bias)
    names = metric_names(config.objective, config.rollout_is)
    loss, values, *_ = torch.ops.logitless.fused_policy_loss(
        head.hidden, head.weight, head.bias, targets, old_logprobs, advantages, mask,
        tensors["ref_logprobs"], tensors["rollout_logprobs"], tensors["token_weights"],
        tensors["attention_entropy"], cu_seqlens, selection_entropy, *ref_args,
        *(c if isinstance(c, torch.Tensor) else None for c in counts),
        float(head.temperature), None if head.softcap is None else float(head.softcap),
        float(head.logit_scale), *(None if isinstance(c, torch.Tensor) else c for c in counts),
        loss_args["training_progress"], loss_args["entropy_coef"], memory_budget, strategy,
        head.dtype, *need, list(names), *custom_ops.config_args(config))
    return loss, dict(zip(names, values.unbind()))


def op_forward(hidden, weight, bias, targets, old_logprobs, advantages, mask, ref_logprobs,
               rollout_logprobs, token_weights, attention_entropy, cu_seqlens,
               selection_entropy, ref_hidden, ref_weight, ref_bias, num_items_tensor,
               global_batch_size_tensor, temperature, softcap, logit_scale, num_items_in_batch,
               global_batch_size, training_progress, entropy_coef, memory_budget, strategy,
               dtype, need_hidden, need_weight, need_bias, names, config) -> tuple:
    """The op's implementation: `_fused` (every check, the plan, the chunks, or the whole
    batch streamed), the gradients computed now where needed (the streamed batch's by its
    graph), returned as plain tensors: ``(loss, metrics [len(names)], d_hidden, d_weight,
    d_bias)``, an empty tensor for a gradient not needed."""
    need = _Need(need_hidden, need_weight, need_bias)
    leaves = [None if x is None else x.detach().requires_grad_(n)
              for x, n in zip((hidden, weight, bias), need)]
    head = _Head(*leaves, temperature, softcap, logit_scale, dtype)
    tensors = dict(ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                   token_weights=token_weights, attention_entropy=attention_entropy)
    loss_args = dict(
        num_items_in_batch=num_items_in_batch if num_items_tensor is None else num_items_tensor,
        global_batch_size=(global_batch_size if global_batch_size_tensor is None
                           else global_batch_size_tensor),
        training_progress=training_progress, entropy_coef=entropy_coef)
    with _autograd_inside_op(need.any), torch.autocast(hidden.device.type, enabled=False):
        loss, metrics, grads = _fused(head, need, targets, old_logprobs, advantages, mask,
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
        if not n:  # as the fake implementation (`custom_ops._fpl_forward_fake`)
            outs.append((hidden if x is hidden else weight).new_empty(0))
        else:  # contiguous, as the fake implementation says, whatever x's strides
            outs.append(x.new_zeros(x.shape) if d is None else d.contiguous())
    return custom_ops._distinct(outs)


def _grads_of(loss, leaves, need: _Need) -> tuple:
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
def metric_names(objective: str, rollout_is: str | None) -> tuple[str, ...]:
    """The names, in order, of the metrics `fused_policy_loss` returns for ``objective`` with
    ``rollout_is``: those of `policy_loss` given the entropies, found once by running it on a
    two-token batch (the objective decides whether there are clip metrics, ``rollout_is``
    whether there are IS-weight metrics). Under dynamo a constant of the graph: the op
    returns the metrics as one tensor and the wrapper names its entries."""
    key = (objective, rollout_is)
    if key not in _METRIC_NAMES:
        cfg = PolicyLossConfig(objective=objective, rollout_is=rollout_is)
        lp = torch.tensor([[-1.0, -2.0]])
        with torch.no_grad():
            _, metrics = policy_loss(lp, lp - 0.1, torch.ones(1), torch.ones(1, 2), cfg,
                                     entropy=-lp, rollout_logprobs=lp - 0.2)
        _METRIC_NAMES[key] = tuple(metrics)
    return _METRIC_NAMES[key]


def _check_static(head, targets, mask, strategy, cu_seqlens, memory_budget) -> None:
    """The checks that read no tensor's values: arguments, shapes, dtypes."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_byte_budget("memory_budget", memory_budget)
    if not isinstance(mask, torch.Tensor) or tuple(targets.shape) != tuple(mask.shape):
        raise ValueError(f"targets must be shaped like mask {tuple(getattr(mask, 'shape', ()))},"
                         f" got {tuple(targets.shape)}")
    packed = cu_seqlens is not None
    expected_dims = 1 if packed else 2
    if mask.dim() != expected_dims or head.hidden.dim() != expected_dims + 1:
        raise ValueError(
            "hidden must be [B, T, D] with mask [B, T], or [N, D] with mask [N] and cu_seqlens; "
            f"got hidden {tuple(head.hidden.shape)}, mask {tuple(mask.shape)}")
    check_head_args(head.hidden, head.weight, targets, head.bias, head.temperature, head.softcap,
                    head.logit_scale, ())


def _checked_call(head, targets, old_logprobs, advantages, mask, config, strategy, cu_seqlens,
                  selection_entropy, memory_budget, **tensors) -> _Call:
    """Every check of the call, once, here: arguments, head, targets (one host sync), and the
    policy inputs (`policy_loss`'s checks); the batch laid out on the grid once."""
    _check_static(head, targets, mask, strategy, cu_seqlens, memory_budget)
    packed = cu_seqlens is not None
    m_flat = mask.reshape(-1) != 0
    t_flat = targets.reshape(-1).long()
    bad = m_flat & ((t_flat < 0) | (t_flat >= head.vocab))
    if bool(bad.any()):
        raise ValueError(f"targets must lie in [0, {head.vocab}) wherever mask is set; found "
                         f"{t_flat[bad][:5].tolist()}")
    if old_logprobs is None:
        raise ValueError("old_logprobs: required (pass logprobs.detach() when on-policy)")
    loss_dtype = tiles.acc_dtype(head.dtype)
    globals_dtype = _dtype(old_logprobs)
    full = _to_batch(mask, advantages, cu_seqlens, torch.promote_types(loss_dtype, globals_dtype),
                     True, config, old_logprobs=old_logprobs, selection_entropy=selection_entropy,
                     **tensors)
    rows = torch.nonzero(m_flat).squeeze(1)
    return _Call(head, config, full.to(loss_dtype), full, globals_dtype, rows,
                 t_flat.index_select(0, rows), full.positions(rows), packed, cu_seqlens,
                 strategy, selection_entropy is not None)


@dataclasses.dataclass(frozen=True)
class _RefHead:
    """The reference head of the exact KL: hidden rows ``[rows, D_ref]``, weight and bias,
    detached in their compute dtype, and the temperature both heads' logits are divided by."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    temperature: float

    def kl_forward(self, rows, hidden, weight, bias):
        """The KL of the loss rows ``rows`` without a graph, and what `kl_backward` needs."""
        ref = self.hidden.index_select(0, rows)
        kl, lse_s, lse_t, aux = divergence_torch.divergence_forward(
            hidden, weight, bias, ref, self.weight, self.bias, beta=1.0,
            temperature=self.temperature)
        return kl, (ref, lse_s, lse_t, aux)

    def kl_backward(self, saved, grad, hidden, weight, bias, grads: _Grads, need: _Need):
        """The KL's gradients from the per-row upstream ``grad``: the weight's and the bias's
        added to the call's fp32 accumulators in place (no ``[V, D]`` temporary), the hidden
        rows returned (or None)."""
        ref, lse_s, lse_t, aux = saved
        d_weight = grads.weight.t if need.weight else None
        if need.weight and grads.weight.fresh:  # nothing written yet: the GEMMs add
            d_weight.zero_()
            grads.weight.fresh = False
        d_hidden, _, _ = divergence_torch.divergence_backward(
            hidden, weight, bias, ref, self.weight, self.bias, lse_s, lse_t, aux,
            grad.contiguous(), beta=1.0, temperature=self.temperature, need_hidden=need.hidden,
            need_weight=need.weight, need_bias=need.bias, d_weight=d_weight, d_bias=grads.bias)
        return d_hidden

    def kl(self, rows, hidden, weight, bias):
        """KL(policy || reference) of the loss rows ``rows`` (indices into the flattened tokens)
        from the policy's ``hidden [len(rows), D]``, ``weight`` and ``bias``, differentiable in
        those where they require grad (fp32; fp64 for fp64 inputs)."""
        return exact_kl_rows(hidden, weight, bias, self.hidden.index_select(0, rows),
                             self.weight, self.bias, self.temperature)


def _checked_ref(head: _Head, config, ref_hidden, ref_weight, ref_bias) -> _RefHead | None:
    """The exact KL's reference head checked (`check_exact_kl`, `reference_head`): None
    without ``kl_estimator="exact"``."""
    given = any(x is not None for x in (ref_hidden, ref_weight, ref_bias))
    check_exact_kl(config, given, "ref_hidden/ref_weight", "ref_hidden and ref_weight (the "
                   "reference model's hidden states and head)")
    if not given:
        return None
    if head.softcap is not None:
        raise ValueError("softcap: the exact KL (ref_hidden/ref_weight) supports temperature "
                         "and logit_scale, not a soft-capped head")
    h, w, b = reference_head(head.hidden, head.weight, ref_hidden, ref_weight, ref_bias)
    return _RefHead(h.detach().reshape(-1, h.shape[-1]), w.detach(),
                    None if b is None else b.detach(), head.temperature / head.logit_scale)


# --- the whole batch streamed --------------------------------------------------------------


def _streamed_whole(call: _Call, loss_args) -> tuple:
    """``policy_loss`` on the streamed op's (lp, H): the vocabulary streamed forward and
    recomputed backward, for the whole batch in one call. With ``selection_entropy`` the
    selections (thresholds and the tokens they keep) come from it, as in the chunked path."""
    head, dtype = call.head, call.head.dtype
    hidden = head.hidden.to(dtype).reshape(-1, head.hidden.shape[-1]).index_select(0, call.rows)
    weight, bias = head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)
    lp, ent = _rows_logprobs(hidden, weight, call.targets, bias=bias, **head.transform())
    kl = None if call.ref is None else call.ref.kl(call.rows, hidden, weight, bias)
    batch = call.with_logprobs(lp, ent, kl)
    if not call.selection_entropy:
        return _loss_of_batch(batch, call.config, None, validate=True, **loss_args)
    glob, masks = _globals_and_masks(call.globals_batch(call.full["selection_entropy"]),
                                     call.config)
    check_global_counts(loss_args["num_items_in_batch"], loss_args["global_batch_size"],
                        glob.loss)
    return _policy_loss(batch, call.config, glob, masks=masks, **loss_args)


# --- plan ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Sequences ``s0:s1``, their loss rows ``a:b`` (of the call's), the chunk's grid width."""

    s0: int
    s1: int
    a: int
    b: int
    width: int
    streamed: bool


@dataclasses.dataclass(frozen=True)
class _Plan:
    chunks: list[_Chunk]
    dense_rows: int  # the largest dense chunk's rows: what the store holds


def _selection_entropy(call: _Call):
    """The entropies the selections use: the caller's, or (when the config selects by entropy)
    the current ones by a no-grad pass, on the grid; None when not needed."""
    if call.selection_entropy:
        return call.full["selection_entropy"]
    if not _selects_by_entropy(call.config):
        return None
    h, w, b = call.detached
    with torch.no_grad():
        _, ent = _rows_logprobs(h.index_select(0, call.rows), w, call.targets, bias=b,
                                **call.head.transform())
    return call.grid(ent)


def _selects_by_entropy(cfg: PolicyLossConfig) -> bool:
    return (cfg.top_entropy_quantile < 1 or cfg.adv_entropy_top_fraction < 1
            or cfg.stapo_prob_threshold is not None)


def _plan(call: _Call, memory_budget) -> _Plan:
    """Chunks of whole sequences within the memory budget (`plan_chunks`). The only host
    synchronisation besides the checks: the loss tokens and lengths of the sequences."""
    m = call.batch.m
    if call.packed:
        lengths = call.cu_seqlens[1:] - call.cu_seqlens[:-1]
    else:
        lengths = torch.full((m.shape[0],), m.shape[1], device=m.device)
    per_seq, widths = torch.stack([m.sum(1), lengths.to(m.device)]).tolist()
    device = call.head.hidden.device
    budget = memory_budget if memory_budget is not None else _default_budget(device)
    head = call.head
    row_bytes = _store_type(device, head.dtype).bytes_per_row(
        head.vocab, head.dtype, head.softcap, hidden_size=head.weight.shape[1])
    starts = list(itertools.accumulate(per_seq, initial=0))
    chunks = [_Chunk(s0, s1, starts[s0], starts[s1], max(widths[s0:s1], default=0), streamed)
              for s0, s1, streamed in plan_chunks(per_seq, max(1, budget // row_bytes))]
    dense = max((c.b - c.a for c in chunks if not c.streamed), default=0)
    return _Plan(chunks, dense)


# --- the chunk store -----------------------------------------------------------------------


class ChunkStore(Protocol):
    """Where a dense chunk's logits live between its forward statistics and its gradient.

    Two implementations, chosen by `_store_type`: `stored_logits.StoredLogits` (torch, any
    device: fp32 exponentials in vocabulary blocks) and `stored_logits_triton.StoredLogitsTriton`
    (when Triton is selected, i.e. on CUDA: the logits once in the input dtype, Triton passes
    for the statistics and for ``dz``)."""

    @staticmethod
    def bytes_per_row(vocab: int, dtype: torch.dtype, softcap: float | None, *,
                      hidden_size: int) -> int:
        """Bytes one token row of a chunk needs (sizes the chunks within the budget);
        ``hidden_size`` is D, for a store that counts the chunk's hidden rows."""

    def forward(self, hidden, weight, bias, targets, *, temperature, softcap, logit_scale):
        """Keep the logits of ``hidden [rows, D]``; return per-token ``(logprobs, entropy,
        lse)`` (fp32; fp64 for fp64 inputs). ``targets`` lie in ``[0, V)``."""

    def backward_(self, hidden, weight, lse, entropy, g_lp, g_entropy, d_weight, d_bias,
                  want_hidden: bool, weight_beta: float = 1.0):
        """Turn the kept logits into their gradient: add to ``d_weight`` (``weight_beta=0``:
        overwrite it) and ``d_bias`` (either may be None); return the hidden-gradient rows
        when ``want_hidden``."""


def _store_type(device: torch.device, dtype: torch.dtype) -> type[ChunkStore]:
    """The chunk store for tensors of ``device`` and compute ``dtype``: the Triton one where
    `triton_selected` picks Triton (CUDA; ``LOGITLESS_BACKEND=triton`` under the
    interpreter), else the torch one (CPU, fp64)."""
    if triton_selected(device, dtype):
        from logitless.kernels import stored_logits_triton  # imports triton

        return stored_logits_triton.StoredLogitsTriton
    return stored_logits.StoredLogits


def _new_store(vocab, max_rows, dtype, device, softcap) -> ChunkStore | None:
    """A store for chunks of up to ``max_rows`` rows (None when no chunk is dense)."""
    if not max_rows:
        return None
    return _store_type(device, dtype)(vocab, max_rows, dtype, device, softcap)


# --- the chunk loop ------------------------------------------------------------------------


class _Need(NamedTuple):
    """The gradients a call computes (grad mode on and the input requires one)."""

    hidden: bool
    weight: bool
    bias: bool

    @classmethod
    def of(cls, hidden, weight, bias) -> _Need:
        on = torch.is_grad_enabled()
        return cls(on and hidden.requires_grad, on and weight.requires_grad,
                   on and bias is not None and bias.requires_grad)

    @property
    def any(self) -> bool:
        return self.hidden or self.weight or self.bias


class _Grads:
    """The call's gradient accumulators (None where not needed): hidden rows in the compute
    dtype, weight and bias in the accumulation dtype."""

    def __init__(self, need: _Need, head: _Head, acc: torch.dtype):
        h, w = head.hidden, head.weight
        rows = h.reshape(-1, h.shape[-1]).shape
        self.hidden = (torch.zeros(rows, dtype=head.dtype, device=h.device) if need.hidden
                       else None)
        self.weight = _WeightGrad(w, acc) if need.weight else None
        self.bias = torch.zeros(head.vocab, dtype=acc, device=w.device) if need.bias else None

    def weight_buffer(self):
        """``(buffer, beta)`` for a GEMM writing the weight gradient, or ``(None, 1.0)``."""
        return (None, 1.0) if self.weight is None else self.weight.buffer()

    def add(self, gw, gb) -> None:
        if self.weight is not None and gw is not None:
            self.weight.add_(gw)
        if self.bias is not None and gb is not None:
            self.bias += gb

    def set_hidden(self, rows, gh) -> None:
        if self.hidden is not None and gh is not None:
            self.hidden.index_copy_(0, rows, gh.to(self.hidden.dtype))

    def result(self, hidden, weight, bias):
        return (
            None if self.hidden is None else self.hidden.view(hidden.shape).to(hidden.dtype),
            None if self.weight is None else self.weight.result().to(weight.dtype),
            None if self.bias is None else self.bias.to(bias.dtype),
        )


class _ChunkRunner:
    """Runs the chunks of one call: each chunk's ``lp`` and ``H`` into ``self.lp`` /
    ``self.ent`` (per loss row), its share of the loss differentiated, its gradients into the
    accumulators. Dense chunks keep their logits in the store (3 GEMMs); a streamed chunk goes
    through the op's private path (4 GEMMs). Nothing here checks an input."""

    def __init__(self, call: _Call, glob, masks: _Masks, loss_args, need: _Need, grads: _Grads,
                 store):
        self.call, self.glob, self.masks, self.loss_args = call, glob, masks, loss_args
        self.need, self.grads, self.store = need, grads, store
        self.h, self.w, self.b = call.detached
        self.transform = call.head.transform()
        acc = call.batch.adv.dtype
        self.lp = torch.zeros(call.rows.shape, dtype=acc, device=self.h.device)
        self.ent = torch.zeros_like(self.lp)
        self.kl = None if call.ref is None else torch.zeros_like(self.lp)

    def run(self, chunk: _Chunk) -> None:
        if chunk.a == chunk.b:
            return
        rows = self.call.rows[chunk.a:chunk.b]
        h, t = self.h.index_select(0, rows), self.call.targets[chunk.a:chunk.b]
        gh = (self._streamed if chunk.streamed else self._dense)(chunk, h, t)
        self.grads.set_hidden(rows, gh)

    def _record(self, chunk, lp, ent, kl=None) -> None:
        self.lp[chunk.a:chunk.b] = lp.detach()
        self.ent[chunk.a:chunk.b] = ent.detach()
        if kl is not None:
            self.kl[chunk.a:chunk.b] = kl.detach()

    def _kl(self, chunk: _Chunk, leaves):
        """The chunk's exact KL from the policy ``leaves`` (hidden rows, weight, bias), or
        None without a reference head."""
        if self.call.ref is None:
            return None
        return self.call.ref.kl(self.call.rows[chunk.a:chunk.b], *leaves)

    def _loss(self, chunk: _Chunk, lp, ent, kl=None):
        """The chunk's share of the loss, from its loss rows' ``lp`` and ``H``."""
        sub = self.call.batch.rows(chunk.s0, chunk.s1, chunk.width)
        row, col = (x[chunk.a:chunk.b] for x in self.call.where)
        where = (row - chunk.s0, col)

        def grid(x):
            return x.new_zeros(sub.m.shape).index_put(where, x)

        # the whole batch's masks, sliced: the selections of the thresholds' own comparisons
        masks = self.masks.rows(chunk.s0, chunk.s1, chunk.width)
        exact = {} if kl is None else {"kl": grid(kl)}
        loss, _ = _policy_loss(sub.with_tensors(logprobs=grid(lp), entropy=grid(ent), **exact),
                               self.call.config, self.glob, masks=masks, compute_metrics=False,
                               **self.loss_args)
        return loss

    def _dense(self, chunk, h, t):
        """One chunk at the 3-GEMM floor; returns its hidden-gradient rows (or None)."""
        lp, ent, lse = self.store.forward(h, self.w, self.b, t, **self.transform)  # GEMM 1
        ref = self.call.ref
        kl = saved = None
        if ref is not None:  # the exact KL's own passes over both heads' tiles
            kl, saved = ref.kl_forward(self.call.rows[chunk.a:chunk.b], h, self.w, self.b)
        self._record(chunk, lp, ent, kl)
        if not self.need.any:
            return None
        leaves = [x.detach().requires_grad_(True) for x in (lp, ent)]
        leaves += [] if kl is None else [kl.detach().requires_grad_(True)]
        with torch.enable_grad():
            loss = self._loss(chunk, *leaves)
            g_lp, g_ent, *g_kl = torch.autograd.grad(loss, leaves, allow_unused=True)
        gh = None
        if g_lp is not None or g_ent is not None:
            # The stored logits become dz in place, each vocabulary block feeding GEMMs 2, 3.
            d_weight, beta = self.grads.weight_buffer()
            gh = self.store.backward_(h, self.w, lse, ent, g_lp, g_ent, d_weight,
                                      self.grads.bias, want_hidden=self.need.hidden,
                                      weight_beta=beta)
        if g_kl and g_kl[0] is not None:  # the KL's backward pass, into the same accumulators
            gh_kl = ref.kl_backward(saved, g_kl[0], h, self.w, self.b, self.grads, self.need)
            gh = gh_kl if gh is None else gh + gh_kl
        return gh



    def _streamed(self, chunk, h, t):
        """A sequence longer than the budget: its vocabulary streamed (4 GEMMs), never the
        logits; returns its hidden-gradient rows (or None)."""
        leaves = [None if x is None else x.detach().requires_grad_(flag)
                  for x, flag in zip((h, self.w, self.b), self.need)]
        with torch.enable_grad() if self.need.any else torch.no_grad():
            lp, ent = _rows_logprobs(leaves[0], leaves[1], t, bias=leaves[2], **self.transform)
            kl = self._kl(chunk, leaves)
            self._record(chunk, lp, ent, kl)
            if not self.need.any:
                return None
            loss = self._loss(chunk, lp, ent, kl)
            wanted = [x for x in leaves if x is not None and x.requires_grad]
            if not loss.requires_grad:
                return None
            got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
        gh, gw, gb = (next(got) if x is not None and x.requires_grad else None for x in leaves)
        self.grads.add(gw, gb)
        return gh
