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
  (``kernels/stored_logits_torch.py``, vocab-major fp32 exponentials, on CPU;
  ``kernels/stored_logits.py``, the logits in the input dtype with Triton passes,
  wherever Triton is selected, i.e. on CUDA).
- **Streaming**: ``policy_loss(linear_logprobs(...))``, the vocabulary streamed forward and
  recomputed backward (8 N D V FLOPs), never the full logits. Used when asked for, for
  objectives that select tokens from statistics of the whole batch's current logprobs
  (``clip_cov``, ``kl_cov``), under ``cp_group`` for terms that read a whole sequence's
  current logprobs (`cp_sequence_terms`), and for a single sequence longer than the budget.

Either way the loss math is :func:`policy_loss`, run once more on the collected per-token
``lp`` and ``H`` (O(N), no vocabulary) for the loss value and the metrics.

The code, by stage: the checks (``validation.py``, once for the whole call), the plan (``plan.py``:
chunks within the memory budget, and the `ChunkStore` that keeps a dense chunk's logits), the
chunk loop (``chunks.py``), and the op (``op.py``): under ``torch.compile`` the whole call is the
one custom op ``logitless::fused_policy_loss`` (the config crossing as four lists), whose
implementation runs this eager code, the plan from the mask and ``cu_seqlens`` included, and
returns the loss, the metrics as one tensor (named by `metric_names`) and the gradients it
computed. This module holds the public function and the eager backward.
"""

from __future__ import annotations

import dataclasses

import torch

from logitless.fused_losses.fused.chunks import run_call
from logitless.fused_losses.fused.fsdp2 import run_sharded, runs_in_chunks
from logitless.fused_losses.fused.op import as_op, metric_names, op_call
from logitless.fused_losses.fused.plan import CPU_MEMORY_BUDGET, ChunkStore, plan_chunks
from logitless.fused_losses.fused.validation import (
    Request,
    check_out_buffers,
    check_truncation_static,
)
from logitless.fused_losses.head.dtensor import sharded_head
from logitless.fused_losses.head.logprobs import (
    check_byte_budget,
    check_ignore_index,
    check_kept_args,
)
from logitless.fused_losses.head.sampled import check_sampler, sampler_settings
from logitless.fused_losses.head.shards import VocabShard, check_vocab_parallel
from logitless.fused_losses.objectives.config import PolicyLossConfig
from logitless.fused_losses.objectives.policy_loss import (
    check_cp_config,
    check_topk_inputs,
    cp_loss_value,
    cp_sequence_terms,
)
from logitless.fused_losses.oplib import check_head_dtype, renamed_keyword

__all__ = ["CPU_MEMORY_BUDGET", "ChunkStore", "fused_policy_loss", "metric_names", "plan_chunks"]


class _StoredGradients(torch.autograd.Function):
    """The loss, whose backward scales gradients computed in the forward (once: see
    `fused_policy_loss`, "Backward")."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grads, group=None):
        ctx.grads, ctx.group = grads, group
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
        if ctx.group is not None:
            check_same_upstream(g, ctx.group)

        def scale(x):  # in place: the stored gradients are ours, and [V, D] is large
            return None if x is None else x.mul_(g.to(x.dtype))

        return None, scale(d_hidden), scale(d_weight), scale(d_bias), None, None


def check_same_upstream(g: torch.Tensor, group) -> None:
    """An FSDP2 head's stored slice gradients hold every rank's batch (`fused.fsdp2`), so they
    are scaled by this rank's incoming gradient only where every rank's is the same (a loss
    scaled alike on every rank, as the trainers do): ``RuntimeError`` on every rank otherwise,
    rather than a silently wrong weight gradient (one ``all_gather`` of the scalar)."""
    mine = g.detach().reshape(1).to(torch.float64)
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(every, mine, group=group)
    if not all(torch.equal(x, every[0]) for x in every):
        raise RuntimeError(
            "fused_policy_loss with an FSDP2 (DTensor) head: the loss's incoming gradient "
            f"differs across the ranks ({[float(x) for x in every]}); each rank's slice of the "
            "weight gradient holds every rank's batch, so scale the loss alike on every rank "
            "(or pass strategy='streaming')")


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
    ignore_index: int = -100,
    num_items_in_batch=None,
    global_batch_size=None,
    training_progress: float | None = None,
    entropy_coef: float | None = None,
    selection_entropy=None,
    batch_globals=None,
    max_tile_bytes: int | None = None,
    strategy: str = "auto",
    ref_hidden=None,
    ref_weight=None,
    ref_bias=None,
    cp_group=None,
    topk_logprobs=None,
    old_topk_logprobs=None,
    memory_budget: int | None = None,
    out_logprobs=None,
    out_entropy=None,
    head_dtype: str | None = None,
    vocab_parallel=None,
    hidden_grad: str = "sum",
    top_k=None,
    top_p=None,
    min_p=None,
    sampler: str = "vllm",
    kept_ids=None,
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
        weight, bias: the head, ``[V, D]`` and ``[V]``; or FSDP2's (``fully_shard``: DTensors
            ``Shard(0)`` over the vocabulary on a 1-D mesh, every other input this rank's own
            batch), kept sharded: the ranks' batches broadcast in turn, each run in chunks over
            every rank's slice (three GEMM passes; streamed, four, where the batch streams),
            the loss and metrics this rank's batch's, the weight and bias gradients the mean
            over the ranks of each rank's loss gradient (FSDP2's average; `fused.fsdp2`). The
            ranks must agree on which inputs require a gradient. Not with the exact KL.
        targets: token ids like ``mask``; only positions where ``mask`` is nonzero and the
            target is not ``ignore_index`` are scored (a target of ``ignore_index`` drops its
            token whatever ``mask`` holds there).
        old_logprobs: as in :func:`policy_loss`, or None on-policy: the old policy is the
            current one (TRL's ``num_iterations=1``, which has no old-policy pass), so each
            chunk's old logprobs are its own current logprobs, detached: every ratio is 1, the
            gradients and metrics those of ``policy_loss(lp, lp.detach(), ...)``, still three
            GEMM passes. Where the batch's globals read the old logprobs (``rollout_rs``,
            STAPO, ``rollout_is_batch_normalize``) a no-grad pass before the chunks computes
            them (the pass the entropy selections make anyway: one for both).
        advantages, mask, config, ref_logprobs, rollout_logprobs, token_weights,
        attention_entropy, num_items_in_batch, global_batch_size, training_progress,
            entropy_coef: as in :func:`policy_loss`.
        batch_globals: `BatchGlobals` of the whole batch, computed by the caller (as
            ``policy_loss``'s ``batch_globals``): the call's counts, thresholds and other
            batch statistics are these instead of its own batch's, for example a
            top-entropy threshold taken over every data-parallel process's tokens (TRL's
            ``get_high_entropy_mask``). The selections compare ``selection_entropy`` (give
            the entropies the threshold was taken from) or, without it, the current
            entropies with its thresholds. Not for ``clip_cov`` / ``kl_cov``, ``cp_group``
            or under ``torch.compile`` (``ValueError``).
        temperature, softcap, logit_scale: the logit transform, as in :func:`linear_logprobs`.
        ignore_index: the target id of tokens out of the loss, as in :func:`linear_logprobs`
            (-100, PyTorch's and TRL's label padding).
        max_tile_bytes: bytes (an integer > 0) of temporary logits a chunk may use (default:
            512 MiB on CUDA, chosen by the cost model in ``gpu_plan``; 256 MiB on CPU). On CUDA
            a chunk row counts its stored logits and its hidden and hidden-gradient rows.
            ``memory_budget`` is its deprecated name (docs/api-changes.md).
        strategy: ``"auto"`` (chunks, streaming where needed), ``"chunked"`` or ``"streaming"``.
        head_dtype: the precision of the head's GEMMs, as in :func:`linear_logprobs`: None
            (the compute dtype), ``"float32"`` (16-bit inputs upcast, fp32 logits, gradients
            in the inputs' dtypes; TRL's ``cast_lm_head_to_fp32``) or ``"tf32"`` (as
            ``"float32"``, the GEMMs under torch's fp32 matmul precision ``"high"``: TF32 on
            CUDA, fp32 on a CPU). The exact KL's reference head runs in it too.
        ref_hidden, ref_weight, ref_bias: the reference model's hidden states (``hidden``'s
            token shape, its own hidden size) and head (``[V, D_ref]``, ``[V]``), for
            ``kl_estimator="exact"`` only (needed there when ``beta != 0``): each chunk computes
            the full-vocabulary KL(policy || reference) of its rows by the two-head divergence
            passes (`linear_divergence` with ``beta=1``, temperature and logit scale of the
            policy head applied to both; no softcap), and its gradient
            ``p (log p - log q - KL)`` reaches ``hidden``, ``weight`` and ``bias``; the
            reference gets none. Same loss and gradients as ``policy_loss(..., kl=
            linear_divergence(hidden, weight, ref_hidden, ref_weight, mask, beta=1).divergence)``.
        cp_group: context parallelism, as in :func:`policy_loss` (each rank its contiguous
            piece of every sequence: ``hidden`` and every per-token input the rank's tokens).
            The batch's globals (counts, whole sequences' lengths, rejections, IS batch mean)
            are reduced over the group first; then, where every token's term needs only the
            rank's own logits and those globals (a token-level ratio, any aggregation CP
            accepts, entropy bonus, estimated or exact KL, token-level rollout IS), the rank's
            tokens run in chunks of its own, 3 GEMM passes, with no collective inside a chunk.
            Where a term reads a whole sequence's logprobs inside the loss (a sequence-level
            ratio, ``vespo`` / ``dhpo``, ``future_kl_coef``, OPSM, sequence-level rollout IS:
            `cp_sequence_terms`) the batch streams (``"auto"``; ``"chunked"`` raises
            ``ValueError`` naming the option): the vocabulary streamed forward and recomputed
            backward, the loss run once over the rank's tokens with the sequence-level
            reductions over the group. Either way the loss is the whole sequences' on every
            rank (its value all-reduced); ``hidden``'s gradient is the whole loss's for the
            rank's tokens, and ``weight``'s and ``bias``'s are the rank's tokens' part of it
            (summed over the group they are the whole loss's, as for any sequence-split
            model); the metrics are the rank's tokens'. Not under ``torch.compile``.
        topk_logprobs, old_topk_logprobs: ``[*mask.shape, K]``, for ``dppo_topk_tv`` and
            ``dppo_topk_kl`` only, as in :func:`policy_loss`. They select tokens and get no
            gradient, so the caller computes the trainer's (e.g. ``linear_logprobs`` at the
            rollout's top-k ids under ``torch.no_grad()``, same head and temperature). Not
            under ``torch.compile``.
        out_logprobs, out_entropy: optional floating tensors shaped like ``mask`` (on its
            device, no graph), filled in place, as torch's ``out=``, with the per-token
            logprobs and entropies the loss was computed from, detached (0 at tokens out of
            the loss): what a trainer logs per sequence, with no other pass. Their dtype is
            the caller's (values cast). Not under ``torch.compile`` or for meta/fake tensors
            (``ValueError``).

        vocab_parallel: a ``torch.distributed`` process group over which the head's
            vocabulary is sharded in rank order, as in :func:`linear_logprobs`: ``weight``
            (and ``bias``, ``ref_weight``, ``ref_bias``) this rank's slice, slices of any
            sizes, every other input the same on every rank, ``targets`` global ids. Each
            chunk's per-token statistics (and the exact KL's) are all-reduced once; the
            objective then runs on the whole vocabulary's values on every rank, each rank's
            logits slice gives its slice's weight and bias gradients, and ``hidden``'s is
            summed over the group (``hidden_grad``). Every rank gets the same loss and
            metrics. The ranks must agree on which inputs require a gradient (they run the
            same collectives). Not with a DTensor head, ``cp_group`` or under
            ``torch.compile``; the exact KL only where the batch runs in chunks (not
            ``strategy="streaming"``, not ``clip_cov`` / ``kl_cov``).
        hidden_grad: with ``vocab_parallel``, ``"sum"`` (the hidden gradient summed over the
            group) or ``"partial"`` (this rank's slice's share, for callers whose own
            communication sums it, e.g. Megatron's sequence-parallel reduce-scatter).
        top_k, top_p, min_p, sampler, kept_ids: the sampler's truncation or the kept sets an
            engine recorded, exactly as :func:`linear_logprobs` takes them (its checks; no-op
            settings leave the plain path): the loss is that of the truncated, renormalised
            distribution's logprobs and entropy, ``policy_loss(linear_logprobs(...,
            top_k=..., return_entropy=True))``, with the trainers' rule for a token whose
            target lies outside the kept set of the current policy, or whose old logprob is
            -inf (`drop_outside_kept`): it leaves the loss (``out_logprobs`` reads -inf
            there when the current policy left it out). ``kept_ids`` sets may be empty at
            tokens out of the loss. Dense chunks keep their logits and select the kept set
            from them with the sampler's own passes (three GEMM passes); where Triton is
            selected (CUDA) the batch streams (four). Not with ``vocab_parallel``,
            ``cp_group``, a DTensor head or the exact KL (``ValueError``); see
            ``docs/sampler.md``, "The fused loss".

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
    ``logitless::fused_policy_loss`` (`fused.op`): the checks that read no values run while
    tracing, and the op runs this same eager code (plan, chunks, or the whole batch streamed)
    with every argument, the exact KL's reference head and ``selection_entropy`` included.
    It computes the gradients in its forward whichever the strategy (the streamed batch's by
    its graph, at once), and its backward scales them, out of place: a backward of a
    compiled loss may run again after ``retain_graph=True``. The metrics' names come from
    the objective and ``rollout_is`` (`metric_names`); an objective whose clip flags depend on
    other fields raises ``RuntimeError`` there rather than mislabel them.
    """
    memory_budget = renamed_keyword("memory_budget", memory_budget, "max_tile_bytes",
                                    max_tile_bytes)
    check_byte_budget("max_tile_bytes", memory_budget)
    check_out_buffers(mask, out_logprobs=out_logprobs, out_entropy=out_entropy)
    check_head_dtype(head_dtype)
    check_vocab_parallel(vocab_parallel, hidden_grad)
    mask = _drop_ignored(targets, mask, ignore_index)
    truncation = _truncation_args(weight, targets, temperature, top_k, top_p, min_p, sampler,
                                  kept_ids, vocab_parallel)
    req = Request(
        hidden=hidden, weight=weight, bias=bias, targets=targets, old_logprobs=old_logprobs,
        advantages=advantages, mask=mask, config=config, ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs, token_weights=token_weights,
        attention_entropy=attention_entropy, cu_seqlens=cu_seqlens,
        selection_entropy=selection_entropy, ref_hidden=ref_hidden, ref_weight=ref_weight,
        ref_bias=ref_bias, num_items_in_batch=num_items_in_batch,
        global_batch_size=global_batch_size, temperature=temperature, softcap=softcap,
        logit_scale=logit_scale, training_progress=training_progress,
        entropy_coef=entropy_coef, memory_budget=memory_budget, strategy=strategy,
        cp_group=cp_group, head_dtype=head_dtype, out_logprobs=out_logprobs,
        out_entropy=out_entropy, batch_globals=batch_globals,
        vocab_parallel=None if vocab_parallel is None else VocabShard(vocab_parallel, hidden_grad),
        **truncation, **check_topk_inputs(config, topk_logprobs=topk_logprobs,
                                          old_topk_logprobs=old_topk_logprobs))
    check_truncation_static(req)
    if cp_group is not None:
        return _context_parallel(req)
    if as_op(hidden):
        if vocab_parallel is not None:
            raise ValueError("vocab_parallel: not supported under torch.compile or for "
                             "meta/fake tensors")
        if batch_globals is not None:
            raise ValueError("batch_globals: not supported under torch.compile or for "
                             "meta/fake tensors")
        if req.topk_logprobs is not None or req.old_topk_logprobs is not None:
            raise ValueError("topk_logprobs: the DPPO top-k objectives are not supported under "
                             "torch.compile or for meta/fake tensors")
        if out_logprobs is not None or out_entropy is not None:
            raise ValueError("out_logprobs/out_entropy: not supported under torch.compile or "
                             "for meta/fake tensors (the op returns no per-token values)")
        return op_call(req)
    return _eager(req)


def _eager(req: Request):
    """The eager call (`run_call`; an FSDP2 head's ranks' batches in turn, `run_sharded`);
    under ``cp_group`` the loss's value the group's."""
    weight, bias, group = req.weight, req.bias, None
    if runs_in_chunks(req):  # an FSDP2 head, sharded: the ranks' batches in turn
        loss, metrics, grads = run_sharded(req)
        group = sharded_head(weight, bias).group
        weight, bias = weight.to_local(), None if bias is None else bias.to_local()
    else:
        loss, metrics, grads = run_call(req)
    loss = cp_loss_value(loss, req.cp_group)
    if grads is None or not req.needs.any:  # the whole batch streamed: the loss has its graph
        return loss, metrics
    return _StoredGradients.apply(loss, req.hidden, weight, bias, grads, group), metrics


def _truncation_args(weight, targets, temperature, top_k, top_p, min_p, sampler, kept_ids,
                     vocab_parallel) -> dict:
    """The truncation's `Request` fields, checked statically as `linear_logprobs` checks
    them (`check_kept_args`, `sampler_settings`: no-op settings dropped)."""
    check_sampler(sampler)
    if kept_ids is not None:
        check_kept_args(top_k, top_p, min_p, vocab_parallel)
        return dict(kept_ids=kept_ids, sampler=sampler)
    vocab = weight.shape[0] if isinstance(weight, torch.Tensor) else None
    settings = sampler_settings(targets, vocab, temperature, top_k, top_p, min_p, sampler)
    if settings is None:
        return dict(sampler=sampler)
    if vocab_parallel is not None:
        raise ValueError("top_k/top_p/min_p: not supported with vocab_parallel in "
                         "fused_policy_loss (linear_logprobs takes them)")
    return dict(top_k=settings.top_k, top_p=settings.top_p, min_p=settings.min_p,
                sampler=sampler)


def _drop_ignored(targets, mask, ignore_index):
    """``mask`` with 0 (False) where ``targets`` is ``ignore_index``, the ignore rule of every
    op with targets; arguments of the wrong type or shape are left to `check_static`."""
    check_ignore_index(ignore_index)
    if not (isinstance(targets, torch.Tensor) and isinstance(mask, torch.Tensor)
            and targets.shape == mask.shape):
        return mask
    return mask.masked_fill(targets == ignore_index, 0)


def _context_parallel(req: Request):
    """`fused_policy_loss` under ``cp_group``: the rank's tokens in chunks of its own where
    no term of the loss reads a whole sequence's current logprobs (`cp_sequence_terms`),
    else streamed; the loss's value over the group."""
    if not isinstance(req.config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(req.config).__name__}")
    check_cp_config(req.config, req.cp_group, req.batch_globals)
    if as_op(req.hidden):
        raise ValueError("cp_group: not supported under torch.compile or for meta/fake tensors")
    sequence_terms = cp_sequence_terms(req.config)
    if sequence_terms is not None:
        if req.strategy == "chunked":
            raise ValueError(f"strategy: 'chunked' is not supported with cp_group and "
                             f"{sequence_terms} (a token's term reads its whole sequence, the "
                             "other ranks' tokens of the same chunk); use 'auto' or "
                             "'streaming'")
        req = dataclasses.replace(req, strategy="streaming")
    return _eager(req)
