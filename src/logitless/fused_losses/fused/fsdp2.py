"""`fused_policy_loss` over an FSDP2 head (a ``Shard(0)`` DTensor) at three GEMM passes, the
head kept sharded.

Under FSDP2 the ranks are data parallel: each holds its own batch and one slice of the head's
rows, a different slice on every rank. A vocabulary-parallel call (``vocab_parallel``) needs
the same tokens on every rank, so the ranks take the batches in turn: for each rank ``r`` of the
mesh, rank r's batch (its hidden rows and every per-token input) is broadcast, and every rank
runs the sequence-aligned chunks on it with its own slice (`run_call` with a placed
`VocabShard`, the hidden gradient ``"partial"``). Each chunk's statistics are all-reduced once;
each rank's stored logits give its slice's gradients. Rank r keeps the loss and metrics of its
own batch, and its hidden gradient is the sum of every slice's partials (one reduce to rank r).
The weight and bias gradients of every batch add into one accumulator (fp32), scaled by
``1 / world``: the mean over the ranks of each rank's loss gradient, what FSDP2's reduce-scatter
(an average) gives a head unsharded in a module forward, and what the streamed DTensor head
(`logitless.fused_losses.head.dtensor`) gives. So every rank runs three GEMM passes over the
whole data-parallel batch with its ``1 / world`` of the vocabulary, as the streamed head runs
four, and no rank ever holds more than its slice of the weight or of its gradient.

The ranks must agree on which of ``hidden``, ``weight`` and ``bias`` require a gradient, and on
every non-tensor argument (they run the same collectives); tensors may differ in shape from
rank to rank (each its own batch). Streamed instead (`run_call`, as before): ``strategy=
"streaming"``, and the objectives that need the whole batch (``clip_cov``, ``kl_cov``).
"""

from __future__ import annotations

import dataclasses

import torch

from logitless.fused_losses.fused.chunks import run_call
from logitless.fused_losses.fused.validation import Request, check_sharded_ref, placed_shard
from logitless.fused_losses.head.dtensor import is_dtensor, sharded_head
from logitless.fused_losses.head.shards import VocabShard
from logitless.fused_losses.objectives.catalog import needs_whole_batch
from logitless.fused_losses.objectives.config import PolicyLossConfig

__all__ = ["run_sharded", "runs_in_chunks"]

# The request's tensors that are rank r's batch: broadcast from rank r in turn.
_BATCH = ("hidden", "targets", "old_logprobs", "advantages", "mask", "ref_logprobs",
          "rollout_logprobs", "token_weights", "attention_entropy", "cu_seqlens",
          "selection_entropy", "topk_logprobs", "old_topk_logprobs", "num_items_in_batch",
          "global_batch_size", "entropy_coef", "training_progress")


def runs_in_chunks(req: Request) -> bool:
    """Whether the call has an FSDP2 (DTensor) head that runs here, in chunks: not streamed,
    by ``strategy`` or by an objective that needs the whole batch."""
    return (is_dtensor(req.weight) and req.strategy != "streaming"
            and isinstance(req.config, PolicyLossConfig)
            and not needs_whole_batch(req.config.objective))


def run_sharded(req: Request) -> tuple:
    """``(loss, metrics, grads)`` of this rank's batch, ``grads`` the gradients of ``hidden``
    and of the local slices of ``weight`` and ``bias`` (None where not needed)."""
    if is_dtensor(req.hidden):
        raise ValueError("hidden must be a plain tensor (each rank's own tokens) with a DTensor "
                         "head, got a DTensor")
    check_sharded_ref(req.ref_args)
    placed_shard(req)  # refuses vocab_parallel beside a DTensor head
    head = sharded_head(req.weight, req.bias)  # checks the placements
    group, world, rank = head.group, head.world, head.rank
    need = req.needs
    weight = req.weight.to_local().detach()
    bias = None if req.bias is None else req.bias.to_local().detach()
    shard = VocabShard(group, "partial")
    shared = {}  # the weight and bias accumulators, shared by the ranks' batches
    own = d_hidden = None
    for source in range(world):
        mine = source == rank
        batch = _broadcast_batch(req, source, group)
        sub = dataclasses.replace(
            req, **batch, weight=weight, bias=bias, need=need, vocab_parallel=shard,
            out_logprobs=req.out_logprobs if mine else None,
            out_entropy=req.out_entropy if mine else None)
        loss, metrics, grads = run_call(sub, shared=shared)
        if need.hidden:
            partial = grads[0].contiguous()
            torch.distributed.reduce(partial, torch.distributed.get_global_rank(group, source),
                                     group=group)
            if mine:
                d_hidden = partial
        if mine:
            own = loss, metrics
        del grads
    # the mean over the ranks, in the fp32 accumulators, then in the head's dtypes
    acc_weight, acc_bias = shared.get("weight"), shared.get("bias")
    d_weight = None if acc_weight is None else acc_weight.result().div_(world).to(weight.dtype)
    d_bias = None if acc_bias is None else acc_bias.div_(world).to(bias.dtype)
    return (*own, (d_hidden, d_weight, d_bias))


def _broadcast_batch(req: Request, source: int, group) -> dict:
    """Rank ``source``'s batch (`_BATCH`) on every rank: its own on ``source``, a copy
    elsewhere. Numbers travel with the shapes (a per-rank ``num_items_in_batch`` given as a
    float is the source's, not this rank's), tensors by one broadcast each."""
    dist = torch.distributed
    src = dist.get_global_rank(group, source)
    mine = dist.get_rank(group) == source
    given = {name: getattr(req, name) for name in _BATCH}
    meta = [{name: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
             for name, v in given.items()}]
    dist.broadcast_object_list(meta, src=src, group=group)
    device = req.hidden.device
    out = {}
    for name, value in given.items():
        sent = meta[0][name]
        tensor = isinstance(sent, tuple)
        if tensor != isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: {'a' if tensor else 'not a'} tensor on rank "
                             f"{source} of the head's mesh, {type(value).__name__} on rank "
                             f"{dist.get_rank(group)}; with a DTensor head every rank passes "
                             f"the same kinds of arguments")
        if not tensor:
            out[name] = sent  # None or a number: the source rank's
            continue
        shape, dtype = sent
        wire = (value.detach().to(device).contiguous() if mine
                else torch.empty(shape, dtype=dtype, device=device))
        if dtype == torch.bool:  # gloo broadcasts no bool
            wire = wire.view(torch.uint8)
        dist.broadcast(wire, src=src, group=group)
        out[name] = wire.view(torch.bool) if dtype == torch.bool else wire
    return out
