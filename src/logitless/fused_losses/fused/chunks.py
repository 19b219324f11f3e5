"""`fused_policy_loss`'s chunk loop: the eager call (`run_call`) runs the plan's chunks, each
chunk's share of the loss differentiated and its gradients accumulated (`ChunkRunner`), or the
whole batch streamed in one call; then the one copy of the objective on the collected
per-token values gives the loss and the metrics."""

from __future__ import annotations

import dataclasses
import math

import torch

from logitless.fused_losses.backend import triton_selected
from logitless.fused_losses.fused.chunk_objective import ChunkObjective
from logitless.fused_losses.fused.grads import Grads, Need
from logitless.fused_losses.fused.plan import Chunk, make_plan, new_store
from logitless.fused_losses.fused.validation import (
    Call,
    Request,
    check_shard_kl,
    check_sharded,
    checked_call,
    checked_globals,
    checked_ref,
    checked_truncation,
    placed_shard,
)
from logitless.fused_losses.head.dtensor import is_dtensor
from logitless.fused_losses.head.logprobs import linear_logprobs, rows_logprobs
from logitless.fused_losses.head.sampled import drop_outside_kept
from logitless.fused_losses.objectives.aggregation import check_global_counts
from logitless.fused_losses.objectives.config import PolicyLossConfig
from logitless.fused_losses.objectives.context_parallel import chunked_group
from logitless.fused_losses.objectives.policy_loss import (
    Masks,
    batch_policy_loss,
    globals_and_masks,
    globals_read_old_logprobs,
    loss_of_batch,
)
from logitless.fused_losses.oplib import under_head_precision


class OutsideKept(Exception):
    """A loss token whose target the current kept set leaves out (logprob -inf), found by a
    chunk: the call runs again without it (`run_call`)."""

    def __init__(self, tokens: torch.Tensor):
        super().__init__("a target outside the kept set")
        self.tokens = tokens  # indices into the flattened mask


@under_head_precision  # every GEMM of the call's forward in the head's precision
def run_call(req: Request, shared: dict | None = None) -> tuple:
    """The eager call: ``(loss, metrics, grads)``, ``grads`` the ``(d_hidden, d_weight,
    d_bias)`` the chunks computed in the forward (None where not needed), or None when
    the whole batch streamed (the loss then carries its autograd graph). ``shared``: weight
    and bias accumulators shared with other calls over the same head (`Grads`).

    With a truncation, a loss token whose target lies outside the kept set of the current
    policy or whose old logprob is -inf leaves the loss, as `drop_outside_kept` has it in the
    trainers (its logprob reads -inf in ``out_logprobs``). Those of ``kept_ids`` and of the old
    logprobs are known before the chunks; a chunk that finds another (its logprob -inf) stops
    the call, a no-grad pass of the head finds every such token, and the call runs again
    without them."""
    if not req.truncates:
        return run_chunks(req, shared)
    req, outside = _drop_known_outside(req)
    searched = False
    while True:
        try:
            result = run_chunks(req, shared)
            break
        except OutsideKept as found:
            if not searched:
                outside |= _outside_current(req)
                searched = True
            outside.view(-1)[found.tokens] = True
            req = _without(req, outside)
    if req.out_logprobs is not None:
        req.out_logprobs.masked_fill_(outside.view(req.out_logprobs.shape), -math.inf)
    return result


def _without(req: Request, outside: torch.Tensor) -> Request:
    """``req`` with the tokens ``outside`` out of the loss (`drop_outside_kept`: the old
    logprobs read 0 there)."""
    lp = torch.zeros(outside.shape, device=outside.device).masked_fill(outside, -math.inf)
    given = req.old_logprobs
    _, old, mask, _ = drop_outside_kept(lp, lp if given is None else given, req.mask)
    return dataclasses.replace(req, mask=mask, old_logprobs=None if given is None else old)


def _drop_known_outside(req: Request) -> tuple[Request, torch.Tensor]:
    """The tokens known outside before the chunks run out of the loss: an old logprob of
    -inf, and with ``kept_ids`` a target not in its set. Returns the request and the mask of
    the latter (the current policy's outside tokens found so far)."""
    outside = torch.zeros(req.mask.shape, dtype=torch.bool, device=req.mask.device)
    if req.kept_ids is not None and req.kept_ids.shape[:-1] == req.targets.shape:
        hit = (req.kept_ids == req.targets.unsqueeze(-1).long()).any(-1)
        outside = (req.mask != 0) & ~hit
    return _without(req, outside), outside


def _outside_current(req: Request) -> torch.Tensor:
    """The loss tokens whose target the current policy's kept set leaves out: one no-grad
    `linear_logprobs` pass under the truncation."""
    keep = req.mask != 0
    head = req.head
    with torch.no_grad():
        lp = linear_logprobs(
            head.hidden, head.weight, req.targets.masked_fill(~keep, -100), bias=head.bias,
            head_dtype=head.head_dtype, ignore_index=-100, **head.transform(),
            **req.head_kwargs()).logprobs
    return torch.isneginf(lp) & keep


def run_chunks(req: Request, shared: dict | None = None) -> tuple:
    """`run_call` on a request whose loss tokens all lie in their kept sets as far as is
    known: raises `OutsideKept` when a chunk finds one that does not."""
    head, need, config, loss_args = req.head, req.needs, req.config, req.loss_args
    if req.truncates and triton_selected(head.hidden.device, head.dtype):
        # the Triton store has no truncation: the batch streams (docs/sampler.md)
        req = dataclasses.replace(req, strategy="streaming")
    sharded = check_sharded(head, req.strategy, req.ref_args)
    shard = placed_shard(req)
    call = checked_call(head, req.targets, req.old_logprobs, req.advantages, req.mask, config,
                        req.strategy, req.cu_seqlens, req.selection_entropy, req.memory_budget,
                        cp_group=req.cp_group, shard=shard, **req.tensors)
    call.ref = checked_ref(head, config, *req.ref_args)
    call.truncation = checked_truncation(req, call)
    call.given_globals = checked_globals(req.batch_globals, config)
    call.out = (req.out_logprobs, req.out_entropy)
    check_shard_kl(call)
    if call.whole or sharded:
        return (*streamed_whole(call, loss_args), None)
    if call.batch.cp_group is not None:
        # each rank its own chunks: the loss's terms (the chunks' and the collected rows')
        # refuse a collective over the group; the globals below reduce over it (`call.full`)
        call.batch = dataclasses.replace(call.batch, cp_group=chunked_group(config.objective))

    glob, masks = globals_and_masks(call.globals_batch(*globals_inputs(call)), config,
                                    call.given_globals)
    check_global_counts(loss_args["num_items_in_batch"], loss_args["global_batch_size"],
                        glob.loss)
    plan = make_plan(call, req.memory_budget)
    grads = Grads(need, head, call.batch.adv.dtype, shared)
    store = new_store(head.vocab, plan.dense_rows, head.dtype, head.hidden.device,
                       head.softcap, call.truncation is not None)
    runner = ChunkRunner(call, glob, masks, loss_args, need, grads, store)
    for chunk in plan.chunks:
        runner.run(chunk)

    # The loss value and metrics: the one copy of the objective on the collected (lp, H).
    collected = runner.collected()
    call.hand_back(*collected[:2])
    with torch.no_grad():
        loss, metrics = batch_policy_loss(call.with_logprobs(*collected),
                                     config, glob, masks=masks, **loss_args)
    return loss, metrics, grads.result(head.hidden, head.weight, head.bias)


def streamed_whole(call: Call, loss_args) -> tuple:
    """``policy_loss`` on the streamed op's (lp, H): the vocabulary streamed forward and
    recomputed backward, for the whole batch in one call. With ``selection_entropy`` the
    selections (thresholds and the tokens they keep) come from it, as in the chunked path."""
    head, dtype = call.head, call.head.dtype
    hidden = head.hidden.to(dtype).reshape(-1, head.hidden.shape[-1]).index_select(0, call.rows)
    if is_dtensor(head.weight):  # FSDP2: every rank's loss rows over the vocabulary shards
        out = linear_logprobs(hidden, head.weight, call.targets, bias=head.bias,
                              return_entropy=True, head_dtype=head.head_dtype,
                              **head.transform())
        lp, ent = out.logprobs, out.entropy
        weight = bias = None  # no exact KL with a sharded head (`check_sharded`)
    else:
        weight, bias = head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)
        lp, ent = head_rows(call, hidden, weight, bias, head_dtype=head.head_dtype)
        check_kept(call, lp, call.rows)
    kl = None if call.ref is None else call.ref.kl(call.rows, hidden, weight, bias)
    call.hand_back(lp, ent)
    batch = call.with_logprobs(lp, ent, kl)
    if not call.selection_entropy:
        return loss_of_batch(batch, call.config, call.given_globals, validate=True, **loss_args)
    old = batch["old_logprobs"] if call.on_policy else None
    glob, masks = globals_and_masks(call.globals_batch(call.full["selection_entropy"], old),
                                     call.config, call.given_globals)
    check_global_counts(loss_args["num_items_in_batch"], loss_args["global_batch_size"],
                        glob.loss)
    return batch_policy_loss(batch, call.config, glob, masks=masks, **loss_args)


def globals_inputs(call: Call) -> tuple:
    """``(entropy, old_logprobs)`` on the grid for the batch's globals, beyond the call's own:
    the entropies the selections use (the caller's ``selection_entropy``, or, when the config
    selects by entropy, the current ones), and on-policy the current logprobs as the old ones
    where the globals read them (`globals_read_old_logprobs`). The current values come from
    one no-grad pass before the chunks; None where not needed."""
    want_entropy = not call.selection_entropy and selects_by_entropy(call.config)
    want_old = call.on_policy and globals_read_old_logprobs(call.config)
    entropy = call.full["selection_entropy"] if call.selection_entropy else None
    if not (want_entropy or want_old):
        return entropy, None
    h, w, b = call.detached
    with torch.no_grad():
        lp, ent = head_rows(call, h.index_select(0, call.rows), w, b)
    check_kept(call, lp, call.rows)
    return (call.grid(ent) if want_entropy else entropy), (call.grid(lp) if want_old else None)


def head_rows(call: Call, hidden, weight, bias, a: int | None = None, b: int | None = None,
              head_dtype=None) -> tuple:
    """``(logprobs, entropy)`` of the loss rows ``a:b`` (all when None) from their ``hidden``
    rows, streamed (`rows_logprobs`; `linear_logprobs` under the call's truncation)."""
    targets, transform = call.targets[a:b], call.head.transform()
    if call.truncation is None:
        return rows_logprobs(hidden, weight, targets, bias=bias, shard=call.shard,
                             head_dtype=head_dtype, **transform)
    out = linear_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                          head_dtype=head_dtype, **transform, **call.truncation.kwargs(a, b))
    return out.logprobs, out.entropy


def check_kept(call: Call, lp: torch.Tensor, rows: torch.Tensor) -> None:
    """Under a truncation, raise `OutsideKept` with the loss rows ``rows`` whose logprob
    ``lp`` is -inf (a target outside the kept set)."""
    if call.truncation is None:
        return
    outside = torch.isneginf(lp.detach())
    if bool(outside.any()):
        raise OutsideKept(rows[outside])


def selects_by_entropy(cfg: PolicyLossConfig) -> bool:
    return (cfg.top_entropy_quantile < 1 or cfg.adv_entropy_top_fraction < 1
            or cfg.stapo_prob_threshold is not None)


class ChunkRunner:
    """Runs the chunks of one call: each chunk's ``lp`` and ``H`` kept (`collected`: per loss
    row), its share of the loss differentiated, its gradients into the
    accumulators. Dense chunks keep their logits in the store (3 GEMMs); a streamed chunk goes
    through the op's private path (4 GEMMs). Nothing here checks an input."""

    def __init__(self, call: Call, glob, masks: Masks, loss_args, need: Need, grads: Grads,
                 store):
        self.call, self.glob, self.masks, self.loss_args = call, glob, masks, loss_args
        self.need, self.grads, self.store = need, grads, store
        self.objective = ChunkObjective(call, glob, masks, loss_args, call.head.hidden.device)
        self.h, self.w, self.b = call.detached
        self.transform = call.head.transform()
        self.shard = call.shard
        # each chunk's (lp, H[, KL]), in the order of its rows: the chunks cover the loss rows
        # in order, so one concatenation per call (`collected`) lays them out, no copy a chunk
        self._parts = ([], [], None if call.ref is None else [])

    def collected(self) -> tuple:
        """``(lp, H, KL)`` of every loss row (``KL`` None without a reference head)."""
        acc = self.call.batch.adv.dtype

        def cat(parts):
            if parts is None:
                return None
            if not parts:
                return torch.zeros(self.call.rows.shape, dtype=acc, device=self.h.device)
            return torch.cat(parts).to(acc)

        return tuple(cat(p) for p in self._parts)

    def run(self, chunk: Chunk) -> None:
        if chunk.a == chunk.b:
            return
        rows = self.call.rows[chunk.a:chunk.b]
        h, t = self.h.index_select(0, rows), self.call.targets[chunk.a:chunk.b]
        gh = (self._streamed if chunk.streamed else self._dense)(chunk, h, t)
        self.grads.set_hidden(rows, gh)

    def _record(self, chunk, lp, ent, kl=None) -> None:
        for parts, x in zip(self._parts, (lp, ent, kl)):
            if parts is not None:
                parts.append(x.detach())

    def _kl(self, chunk: Chunk, leaves):
        """The chunk's exact KL from the policy ``leaves`` (hidden rows, weight, bias), or
        None without a reference head."""
        if self.call.ref is None:
            return None
        if self.shard is not None:  # the streamed chunk's two-head passes see one slice
            raise ValueError("max_tile_bytes: a sequence longer than the budget streams, and "
                             "the exact KL with vocab_parallel runs in dense chunks only; "
                             "raise max_tile_bytes")
        return self.call.ref.kl(self.call.rows[chunk.a:chunk.b], *leaves)

    def _dense(self, chunk, h, t):
        """One chunk at the 3-GEMM floor; returns its hidden-gradient rows (or None)."""
        reduce = None if self.shard is None else self.shard.partials
        select = {} if self.call.truncation is None else dict(
            select=self.call.truncation.select(chunk.a, chunk.b))
        lp, ent, _ = self.store.forward(h, self.w, self.b, t, reduce=reduce,  # GEMM 1
                                        **self.transform, **select)
        check_kept(self.call, lp, self.call.rows[chunk.a:chunk.b])
        ref = self.call.ref
        kl = saved = None
        if ref is not None:  # the exact KL's own passes over both heads' tiles
            kl, saved = ref.kl_forward(self.call.rows[chunk.a:chunk.b], h, self.w, self.b,
                                       self.shard)
        self._record(chunk, lp, ent, kl)
        if not self.need.any:
            return None
        g_lp, g_ent, g_kl = self.objective.grads(chunk, lp, ent, kl)
        gh = None
        if g_lp is not None or g_ent is not None:
            # The stored logits become dz in place, each vocabulary block feeding GEMMs 2, 3.
            d_weight, beta = self.grads.weight_buffer()
            gh = self.store.backward_(h, self.w, ent, g_lp, g_ent, d_weight,
                                      self.grads.bias, want_hidden=self.need.hidden,
                                      weight_beta=beta)
        if g_kl is not None:  # the KL's backward pass, into the same accumulators
            gh_kl = ref.kl_backward(saved, g_kl, h, self.w, self.b, self.grads, self.need)
            gh = gh_kl if gh is None else gh + gh_kl
        return gh if self.shard is None else self.shard.hidden(gh)

    def _streamed(self, chunk, h, t):
        """A sequence longer than the budget: its vocabulary streamed (4 GEMMs), never the
        logits; returns its hidden-gradient rows (or None)."""
        leaves = [None if x is None else x.detach().requires_grad_(flag)
                  for x, flag in zip((h, self.w, self.b), self.need)]
        with torch.enable_grad() if self.need.any else torch.no_grad():
            lp, ent = head_rows(self.call, leaves[0], leaves[1], leaves[2], chunk.a, chunk.b)
            check_kept(self.call, lp, self.call.rows[chunk.a:chunk.b])
            kl = self._kl(chunk, leaves)
            self._record(chunk, lp, ent, kl)
            if not self.need.any:
                return None
            loss = self.objective.loss(chunk, lp, ent, kl)
            wanted = [x for x in leaves if x is not None and x.requires_grad]
            if not loss.requires_grad:
                return None
            got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
        gh, gw, gb = (next(got) if x is not None and x.requires_grad else None for x in leaves)
        self.grads.add(gw, gb)
        return gh
