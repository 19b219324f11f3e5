"""`fused_policy_loss`'s checks: every argument, the head and the policy inputs checked once
for the whole call, and the call laid out on the batch grid (`Call`), with the exact KL's
reference head (`RefHead`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from logitless.fused_losses.fused.grads import Need
from logitless.fused_losses.head.divergence import (
    divergence_kernels,
    exact_kl_rows,
    reference_head,
)
from logitless.fused_losses.head.dtensor import is_dtensor
from logitless.fused_losses.head.kept import check_kept_ids
from logitless.fused_losses.head.logprobs import check_byte_budget, check_head_args
from logitless.fused_losses.head.sampled import SamplerSettings, check_values, per_token
from logitless.fused_losses.head.shards import VocabShard
from logitless.fused_losses.objectives.aggregation import BatchGlobals
from logitless.fused_losses.objectives.catalog import needs_whole_batch
from logitless.fused_losses.objectives.config import PolicyLossConfig
from logitless.fused_losses.objectives.policy_inputs import Batch, promoted_dtype, to_batch
from logitless.fused_losses.objectives.policy_loss import check_exact_kl
from logitless.fused_losses.oplib import compute_dtype
from logitless.kernels import divergence_torch
from logitless.kernels import linear_softmax_torch as tiles
from logitless.kernels.sampler_torch import RowParams

if TYPE_CHECKING:
    from logitless.fused_losses.fused.grads import Grads


STRATEGIES = ("auto", "chunked", "streaming")


@dataclasses.dataclass(frozen=True)
class Head:
    """The LM head of one call: inputs as given, their compute dtype, the logit transform."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    temperature: float
    softcap: float | None
    logit_scale: float
    compute: torch.dtype | None = None  # the compute dtype when given (inside the op)
    head_dtype: str | None = None  # the GEMMs' precision (`oplib.compute_dtype`)

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return (compute_dtype(self.hidden, self.head_dtype) if self.compute is None
                else self.compute)

    def transform(self) -> dict:
        return dict(temperature=self.temperature, softcap=self.softcap,
                    logit_scale=self.logit_scale)

    def detached(self):
        """``(hidden [rows, D], weight, bias)`` in the compute dtype, detached."""
        dtype = self.dtype
        h = self.hidden.detach().to(dtype).reshape(-1, self.hidden.shape[-1])
        b = None if self.bias is None else self.bias.detach().to(dtype)
        return h, self.weight.detach().to(dtype), b


_NOT_AN_OP_ARGUMENT = {"op": False}  # a field the op refuses (raising), so never crossing


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One `fused_policy_loss` call as given, built once by it: every tensor and scalar of the
    call, unchecked. The eager path and the op's implementation read it; the op crosses it as
    flat arguments (`oplib.Record`: the order of the fields is the op's schema)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    targets: torch.Tensor
    old_logprobs: torch.Tensor | None  # None: on-policy (each chunk's own logprobs, detached)
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None
    attention_entropy: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    selection_entropy: torch.Tensor | None = None
    ref_hidden: torch.Tensor | None = None
    ref_weight: torch.Tensor | None = None
    ref_bias: torch.Tensor | None = None
    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0
    num_items_in_batch: torch.Tensor | float | None = None
    global_batch_size: torch.Tensor | float | None = None
    training_progress: float | None = None
    entropy_coef: float | None = None
    memory_budget: int | None = None
    strategy: str = "auto"
    dtype: torch.dtype | None = None  # the compute dtype (None: `compute_dtype` of hidden)
    need: Need | None = None  # the gradients computed (None: `Need.of` the head)
    metric_names: tuple[str, ...] = ()  # the op's metrics, in order (`op.metric_names`)
    config: PolicyLossConfig
    head_dtype: str | None = None  # the head's GEMM precision (`linear_logprobs`'s)
    # the sampler's truncation (`sampled.sampler_settings`: None where a no-op) or the
    # recorded kept sets, as `linear_logprobs` takes them (`Truncation`)
    top_k: torch.Tensor | int | None = None
    top_p: torch.Tensor | float | None = None
    min_p: torch.Tensor | float | None = None
    sampler: str = "vllm"
    kept_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = dataclasses.field(default=None,
                                                          metadata=_NOT_AN_OP_ARGUMENT)
    old_topk_logprobs: torch.Tensor | None = dataclasses.field(default=None,
                                                              metadata=_NOT_AN_OP_ARGUMENT)
    cp_group: object = dataclasses.field(default=None, metadata=_NOT_AN_OP_ARGUMENT)
    out_logprobs: torch.Tensor | None = dataclasses.field(default=None,
                                                         metadata=_NOT_AN_OP_ARGUMENT)
    out_entropy: torch.Tensor | None = dataclasses.field(default=None,
                                                        metadata=_NOT_AN_OP_ARGUMENT)
    vocab_parallel: VocabShard | None = dataclasses.field(default=None,
                                                          metadata=_NOT_AN_OP_ARGUMENT)
    batch_globals: BatchGlobals | None = dataclasses.field(default=None,
                                                          metadata=_NOT_AN_OP_ARGUMENT)

    @property
    def head(self) -> Head:
        return Head(self.hidden, self.weight, self.bias, self.temperature, self.softcap,
                    self.logit_scale, self.dtype, self.head_dtype)

    @property
    def needs(self) -> Need:
        return Need.of(self.hidden, self.weight, self.bias) if self.need is None else self.need

    @property
    def tensors(self) -> dict:
        """The per-token inputs of the objective beyond the policy's, the top-k ones when
        given."""
        topk = {k: getattr(self, k) for k in ("topk_logprobs", "old_topk_logprobs")
                if getattr(self, k) is not None}
        return dict(ref_logprobs=self.ref_logprobs, rollout_logprobs=self.rollout_logprobs,
                    token_weights=self.token_weights, attention_entropy=self.attention_entropy,
                    **topk)

    @property
    def loss_args(self) -> dict:
        """The keywords of `policy_loss` the chunks pass on."""
        return dict(num_items_in_batch=self.num_items_in_batch,
                    global_batch_size=self.global_batch_size,
                    training_progress=self.training_progress, entropy_coef=self.entropy_coef)

    @property
    def ref_args(self) -> tuple:
        return self.ref_hidden, self.ref_weight, self.ref_bias

    @property
    def truncates(self) -> bool:
        """A sampler truncation or recorded kept sets: the kept distribution's logprobs."""
        return self.kept_ids is not None or any(
            x is not None for x in (self.top_k, self.top_p, self.min_p))

    def head_kwargs(self) -> dict:
        """The truncation as `linear_logprobs`'s keywords (empty without one)."""
        if self.kept_ids is not None:
            return dict(kept_ids=self.kept_ids)
        on = {k: getattr(self, k) for k in ("top_k", "top_p", "min_p")
              if getattr(self, k) is not None}
        return {**on, "sampler": self.sampler} if on else {}


@dataclasses.dataclass(frozen=True)
class Truncation:
    """A call's truncation on its loss rows: the sampler's settings per row (`RowParams`)
    or the recorded kept sets ``[rows, K]``."""

    params: RowParams | None
    kept_ids: torch.Tensor | None

    def select(self, a: int, b: int):
        """What the store selects rows ``a:b`` by (`StoredSampled.forward`'s ``select``)."""
        if self.kept_ids is not None:
            return self.kept_ids[a:b]
        return self.params.rows(slice(a, b), b - a)

    def kwargs(self, a: int | None = None, b: int | None = None) -> dict:
        """`linear_logprobs`'s keywords for loss rows ``a:b``."""
        if self.kept_ids is not None:
            return dict(kept_ids=self.kept_ids[a:b])
        p = self.params
        on = {k: getattr(p, k)[a:b] for k in ("top_k", "top_p", "min_p")
              if getattr(p, k) is not None}
        return dict(on, sampler=p.engine)


def checked_truncation(req: Request, call: Call) -> Truncation | None:
    """The truncation's values checked as `linear_logprobs` checks them (`check_values`,
    `check_kept_ids`: tokens out of the loss may keep nothing), on the call's loss rows;
    None without one."""
    if not req.truncates:
        return None
    rows = call.rows
    if req.kept_ids is not None:
        live = torch.where(req.mask != 0, req.targets, -1)
        check_kept_ids(req.kept_ids, live, call.head.vocab, -1)
        return Truncation(None, req.kept_ids.reshape(-1, req.kept_ids.shape[-1])[rows])
    settings = SamplerSettings(None, req.top_k, req.top_p, req.min_p, req.sampler)
    per = per_token(settings, req.targets, float(req.temperature), call.head.dtype)
    check_values(*per, call.head.dtype)
    return Truncation(RowParams(*(None if x is None else x.reshape(-1)[rows] for x in per),
                                engine=req.sampler), None)


def check_truncation_static(req: Request) -> None:
    """What `fused_policy_loss` takes a truncation with: one process holding a plain (not
    DTensor) head, no ``cp_group``, no exact KL (``ValueError`` naming the argument)."""
    if not req.truncates:
        return
    name = "kept_ids" if req.kept_ids is not None else "top_k/top_p/min_p"
    if is_dtensor(req.weight):
        raise ValueError(f"{name}: not supported with a DTensor (FSDP2) head in "
                         "fused_policy_loss")
    if req.cp_group is not None:
        raise ValueError(f"{name}: not supported with cp_group in fused_policy_loss")
    if any(x is not None for x in req.ref_args):
        raise ValueError(f"{name}: not supported with the exact KL (ref_hidden/ref_weight) "
                         "in fused_policy_loss")


@dataclasses.dataclass
class Call:
    """A validated call: the head, its loss rows (flat token indices where the mask is set, in
    sequence order) with their targets and grid positions, and the batch on the grid."""

    head: Head
    config: PolicyLossConfig
    batch: Batch  # in the loss's dtype (the accumulation dtype of the head)
    full: Batch  # in the wider of the loss's and the globals' dtypes (globals are cast from it)
    globals_dtype: torch.dtype
    rows: torch.Tensor
    targets: torch.Tensor
    where: tuple[torch.Tensor, torch.Tensor]
    packed: bool
    cu_seqlens: torch.Tensor | None
    strategy: str
    selection_entropy: bool
    ref: RefHead | None = None  # the reference head of the exact KL
    truncation: Truncation | None = None  # the sampler's truncation or recorded kept sets
    given_globals: BatchGlobals | None = None  # the caller's `BatchGlobals` (`batch_globals`)
    # the caller's buffers for the per-token logprobs and entropies (`hand_back`)
    out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    @property
    def on_policy(self) -> bool:
        """No old logprobs given: the old policy is the current one (`current_tensors`)."""
        return self.full["old_logprobs"] is None
    shard: VocabShard | None = None  # the vocabulary's slice (placed) with vocab_parallel

    @functools.cached_property
    def detached(self):
        """The head detached (`Head.detached`), once: the chunks compute their gradients
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

    def with_logprobs(self, lp_rows, ent_rows, kl_rows=None) -> Batch:
        return current_tensors(self.batch, self.grid(lp_rows), self.grid(ent_rows),
                               None if kl_rows is None else self.grid(kl_rows))

    def globals_batch(self, entropy, old_logprobs=None) -> Batch:
        """The batch `BatchGlobals` are computed from (old logprobs' dtype, as
        `policy_loss_globals`), with the entropies the selections use (and, on-policy, the
        current logprobs as the old ones where the globals read them)."""
        old = {} if old_logprobs is None else {"old_logprobs": old_logprobs}
        given = dict(entropy=entropy, **old)
        return self.full.to(self.globals_dtype).with_tensors(
            **{k: None if t is None else t.to(self.globals_dtype) for k, t in given.items()})

    def hand_back(self, lp_rows, ent_rows) -> None:
        """The per-token logprobs and entropies into the caller's ``out_logprobs`` and
        ``out_entropy`` (mask-shaped), detached; 0 at the tokens out of the loss."""
        for out, rows in zip(self.out, (lp_rows, ent_rows)):
            if out is not None:
                flat = rows.new_zeros(out.numel()).index_copy_(0, self.rows, rows.detach())
                out.copy_(flat.view(out.shape))


def current_tensors(batch: Batch, lp, ent, kl=None) -> Batch:
    """``batch`` with the current policy's per-token tensors on its grid: ``logprobs``,
    ``entropy`` (and the exact ``kl``); on-policy (``batch`` holds no old logprobs) the old
    logprobs are ``logprobs`` detached, so every ratio is 1 and the gradients flow as through
    ``policy_loss(lp, lp.detach(), ...)``."""
    extra = {} if kl is None else {"kl": kl}
    if batch["old_logprobs"] is None:
        extra["old_logprobs"] = lp.detach()
    return batch.with_tensors(logprobs=lp, entropy=ent, **extra)


def check_out_buffers(mask, **outs) -> None:
    """``out_logprobs`` / ``out_entropy``: None, or a floating tensor shaped like ``mask``, on
    its device, without a graph."""
    for name, out in outs.items():
        if out is None:
            continue
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got "
                             f"{getattr(out, 'dtype', type(out).__name__)}")
        if not isinstance(mask, torch.Tensor) or out.shape != mask.shape \
                or out.device != mask.device:
            raise ValueError(f"{name}: expected shape {tuple(getattr(mask, 'shape', ()))} on "
                             f"{getattr(mask, 'device', None)} like mask, got "
                             f"{tuple(out.shape)} on {out.device}")
        if out.requires_grad:
            raise ValueError(f"{name}: expected a tensor without a graph (it is filled in "
                             "place with detached values)")


@dataclasses.dataclass(frozen=True)
class RefHead:
    """The reference head of the exact KL: hidden rows ``[rows, D_ref]``, weight and bias,
    detached in their compute dtype, and the temperature both heads' logits are divided by."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    temperature: float
    head_dtype: str | None = None  # the policy head's (`Head.head_dtype`)

    def kl_forward(self, rows, hidden, weight, bias, shard: VocabShard | None = None):
        """The KL of the loss rows ``rows`` without a graph, and what `kl_backward` needs.
        With ``shard`` (both heads this rank's vocabulary slice), the whole vocabulary's KL and
        normalisers, reduced over its group (`VocabShard.kl`): each rank's backward then
        gives its slice's gradient."""
        ref = self.hidden.index_select(0, rows)
        kernels = divergence_kernels(hidden.device, hidden.dtype, ref.dtype)
        kl, *norm = kernels.divergence_forward(
            hidden, weight, bias, ref, self.weight, self.bias, beta=1.0,
            temperature=self.temperature)
        if shard is not None:  # beta = 1: the last of the norms is the KL itself
            unit = 1.0 if kernels is divergence_torch else 1.0 / self.temperature
            kl, *norm = shard.kl(kl, *norm[:4], unit=unit)
            norm.append(kl)
        return kl, (kernels, ref, *norm)

    def kl_backward(self, saved, grad, hidden, weight, bias, grads: Grads, need: Need):
        """The KL's gradients from the per-row upstream ``grad``: the weight's and the bias's
        added to the call's fp32 accumulators in place (no ``[V, D]`` temporary), the hidden
        rows returned (or None)."""
        kernels, ref, *norm = saved  # (top_s, log_l_s, top_t, log_l_t, aux)
        d_weight = grads.weight.t if need.weight else None
        if need.weight and grads.weight.fresh:  # nothing written yet: the GEMMs add
            d_weight.zero_()
            grads.weight.fresh = False
        d_hidden, _, _ = kernels.divergence_backward(
            hidden, weight, bias, ref, self.weight, self.bias, *norm,
            grad.contiguous(), beta=1.0, temperature=self.temperature, need_hidden=need.hidden,
            need_weight=need.weight, need_bias=need.bias, d_weight=d_weight, d_bias=grads.bias)
        return d_hidden

    def kl(self, rows, hidden, weight, bias):
        """KL(policy || reference) of the loss rows ``rows`` (indices into the flattened tokens)
        from the policy's ``hidden [len(rows), D]``, ``weight`` and ``bias``, differentiable in
        those where they require grad (fp32; fp64 for fp64 inputs)."""
        return exact_kl_rows(hidden, weight, bias, self.hidden.index_select(0, rows),
                             self.weight, self.bias, self.temperature, self.head_dtype)


def check_static(head, targets, mask, strategy, cu_seqlens, memory_budget) -> None:
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


def placed_shard(req: Request) -> VocabShard | None:
    """The call's vocabulary slice placed in the whole vocabulary (`VocabShard.place`, one
    all-gather), or None without ``vocab_parallel``. Refused (``ValueError``): a DTensor head
    (its mesh shards it already) and ``cp_group``."""
    shard = req.vocab_parallel
    if shard is None:
        return None
    if is_dtensor(req.weight):
        raise ValueError("vocab_parallel: not with a DTensor (FSDP2) weight, whose mesh gives "
                         "the group")
    if req.cp_group is not None:
        raise ValueError("vocab_parallel: not supported together with cp_group")
    return shard.place(req.weight.shape[0], req.hidden.device)


def check_shard_kl(call: Call) -> None:
    """The exact KL over a vocab-parallel head runs in the sequence-aligned chunks only (their
    two-head passes reduce over the group): refused (``ValueError``) where the batch streams,
    ``strategy="streaming"`` or an objective that needs the whole batch."""
    if call.shard is not None and call.ref is not None and call.whole:
        raise ValueError("vocab_parallel: the exact KL (ref_hidden/ref_weight) runs in the "
                         "sequence-aligned chunks only; use strategy='auto' or 'chunked' and "
                         "an objective that does not need the whole batch")


def check_sharded(head: Head, strategy: str, ref_args) -> bool:
    """Whether the head is an FSDP2 DTensor (`head.dtensor`) that runs here streamed, its
    vocabulary shards a vocabulary-parallel head over the mesh (``strategy="streaming"``, an
    objective that needs the whole batch; otherwise `fused.fsdp2` runs it in chunks before
    this): ``strategy="chunked"`` (for such an objective) and the exact KL (the two-head
    passes) are refused (``ValueError``)."""
    if not is_dtensor(head.weight):
        return False
    if strategy == "chunked":
        raise ValueError("strategy: a DTensor (FSDP2) head runs this objective streamed, "
                         "vocabulary-parallel over its mesh; pass strategy='auto' or "
                         "'streaming', not 'chunked'")
    check_sharded_ref(ref_args)
    return True


def check_sharded_ref(ref_args) -> None:
    """The exact KL's reference head refused (``ValueError``) beside a DTensor head."""
    if any(x is not None for x in ref_args):
        raise ValueError("ref_hidden/ref_weight: the exact KL is unsupported with a DTensor "
                         "(FSDP2) head; use a sampled kl_estimator with ref_logprobs")


def checked_call(head, targets, old_logprobs, advantages, mask, config, strategy, cu_seqlens,
                  selection_entropy, memory_budget, *, cp_group=None, shard=None,
                  **tensors) -> Call:
    """Every check of the call, once, here: arguments, head, targets (one host sync), and the
    policy inputs (`policy_loss`'s checks); the batch laid out on the grid once. With
    ``shard`` (placed) the targets are global ids, and the call's are local to the slice."""
    check_static(head, targets, mask, strategy, cu_seqlens, memory_budget)
    packed = cu_seqlens is not None
    m_flat = mask.reshape(-1) != 0
    t_flat = targets.reshape(-1).long()
    vocab = head.vocab if shard is None else shard.total
    bad = m_flat & ((t_flat < 0) | (t_flat >= vocab))
    if bool(bad.any()):
        raise ValueError(f"targets must lie in [0, {vocab}) wherever mask is set; found "
                         f"{t_flat[bad][:5].tolist()}")
    loss_dtype = tiles.acc_dtype(head.dtype)
    # on-policy the old logprobs are the current ones: the loss's dtype
    globals_dtype = loss_dtype if old_logprobs is None else promoted_dtype(old_logprobs)
    full = to_batch(mask, advantages, cu_seqlens, torch.promote_types(loss_dtype, globals_dtype),
                     True, config, cp_group=cp_group, old_logprobs=old_logprobs,
                     selection_entropy=selection_entropy, **tensors)
    rows = torch.nonzero(m_flat).squeeze(1)
    local = t_flat.index_select(0, rows) - (0 if shard is None else shard.offset)
    return Call(head, config, full.to(loss_dtype), full, globals_dtype, rows, local,
                 full.positions(rows), packed, cu_seqlens, strategy, selection_entropy is not None,
                 shard=shard)


def checked_globals(glob, config: PolicyLossConfig) -> BatchGlobals | None:
    """The caller's ``batch_globals``: None, or a `BatchGlobals` for an objective whose
    globals do not read the current logprobs (``ValueError`` otherwise)."""
    if glob is None:
        return None
    if not isinstance(glob, BatchGlobals):
        raise ValueError(f"batch_globals: expected a BatchGlobals (e.g. from "
                         f"policy_loss_globals), got {type(glob).__name__}")
    if needs_whole_batch(config.objective):
        raise ValueError(f"batch_globals: {config.objective} selects tokens from statistics of "
                         "the whole batch's current logprobs, which the call computes itself")
    return glob


def checked_ref(head: Head, config, ref_hidden, ref_weight, ref_bias) -> RefHead | None:
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
    h, w, b = reference_head(head.hidden, head.weight, ref_hidden, ref_weight, ref_bias,
                             head.head_dtype)
    return RefHead(h.detach().reshape(-1, h.shape[-1]), w.detach(),
                    None if b is None else b.detach(), head.temperature / head.logit_scale,
                    head.head_dtype)
