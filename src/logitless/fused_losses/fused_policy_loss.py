"""``fused_policy_loss``: from hidden states to the policy loss at the 3-GEMM floor.

Two strategies (docs/design.md, "Op 4"):

- **Sequence-aligned chunks** (gradient in the forward). Whole sequences are grouped up to a
  token budget. For each group the logits are computed once (GEMM 1), reduced to per-token
  ``lp`` and ``H``, and the objective runs on that group through :func:`policy_loss` with the
  batch's :class:`BatchGlobals`, so autograd on the small per-token graph gives
  ``d loss / d lp`` and ``d loss / d H``. The logits buffer then becomes ``dz`` in place and two
  GEMMs give the group's hidden gradient and add to the weight gradient (fp32). The backward of
  the returned loss only scales the stored gradients. 6 N D V FLOPs, memory one group: its
  logits, vocab-major, in one buffer reused by every group (``kernels/stored_logits.py``).
- **Streaming**: ``policy_loss(linear_logprobs(...))``, the vocabulary streamed forward and
  recomputed backward (8 N D V FLOPs), never the full logits. Used when asked for, for
  objectives that select tokens from statistics of the whole batch's current logprobs
  (``clip_cov``, ``kl_cov``), and for a single sequence longer than the budget.

Either way the loss math is :func:`policy_loss`, run once more on the collected per-token
``lp`` and ``H`` (O(N), no vocabulary) for the loss value and the metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import torch

from logitless.fused_losses import gpu_plan
from logitless.fused_losses.aggregation import check_global_counts
from logitless.fused_losses.config import PolicyLossConfig
from logitless.fused_losses.logprobs import check_head_args, compute_dtype, linear_logprobs
from logitless.fused_losses.policy_loss import (
    NON_GLOBAL_OBJECTIVES,
    check_policy_inputs,
    policy_loss,
    policy_loss_globals,
)
from logitless.kernels import linear_softmax_torch as tiles
from logitless.kernels import stored_logits
from logitless.kernels.segments_torch import packed_index

__all__ = ["CPU_MEMORY_BUDGET", "fused_policy_loss", "plan_chunks"]

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


class _Layout:
    """Where each sequence's tokens live in the flattened inputs, known on the host.

    Planning reads ``cu_seqlens`` once; afterwards every chunk is cut and laid out as a
    right-padded ``[sequences, width]`` grid without reading anything back from the device.
    """

    def __init__(self, mask: torch.Tensor, cu_seqlens: torch.Tensor | None):
        self.packed = cu_seqlens is not None
        self.device = mask.device
        if self.packed:
            self.cu = [int(c) for c in cu_seqlens.tolist()]
        else:
            self.width = mask.shape[1]

    def token_range(self, s0: int, s1: int) -> tuple[int, int]:
        if self.packed:
            return self.cu[s0], self.cu[s1]
        return s0 * self.width, s1 * self.width

    def chunk_index(self, s0: int, s1: int):
        """For a packed chunk: its `PackedIndex` (row and column in its padded grid of each of
        its tokens, and the grid's shape). For a padded batch the chunk already is a grid: None."""
        if not self.packed:
            return None
        lengths = [self.cu[i + 1] - self.cu[i] for i in range(s0, s1)]
        offsets = torch.tensor([c - self.cu[s0] for c in self.cu[s0:s1 + 1]], device=self.device)
        return packed_index(offsets, sum(lengths), max(lengths, default=0))

    def grid(self, x, s0: int, s1: int, index, fill=0.0):
        """Per-token ``x`` (``[B, T]`` or packed ``[N]``) of sequences ``s0:s1`` as a grid."""
        if x is None or not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if index is None:
            return x[s0:s1]
        a, b = self.token_range(s0, s1)
        return index.pad(x[a:b], fill)


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
):
    """The policy loss from hidden states and the LM head, without the full logits.

    Equal to ``policy_loss(linear_logprobs(hidden, weight, targets, ...).logprobs, ...,
    entropy=<its entropy>, batch_globals=policy_loss_globals(..., entropy=E))`` where ``E`` is
    ``selection_entropy`` when given (the old-policy pass's entropies, for entropy quantile
    thresholds and STAPO) and otherwise the current entropies (computed by a no-grad pass only
    when the config selects by entropy). Gradients reach ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``[B, T, D]`` right-padded, or ``[N, D]`` packed with ``cu_seqlens [B + 1]``.
        weight, bias: the head, ``[V, D]`` and ``[V]``.
        targets: token ids like ``mask``; only positions where ``mask`` is nonzero are scored.
        old_logprobs, advantages, mask, config, ref_logprobs, rollout_logprobs, token_weights,
        attention_entropy, num_items_in_batch, global_batch_size, training_progress,
            entropy_coef: as in :func:`policy_loss`.
        temperature, softcap, logit_scale: the logit transform, as in :func:`linear_logprobs`.
        memory_budget: bytes of temporary logits a chunk may use (default: 512 MiB on CUDA,
            chosen by the cost model in ``gpu_plan``; 256 MiB on CPU).
        strategy: ``"auto"`` (chunks, streaming where needed), ``"chunked"`` or ``"streaming"``.

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
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(mask, torch.Tensor) or tuple(targets.shape) != tuple(mask.shape):
        raise ValueError(f"targets must be shaped like mask {tuple(getattr(mask, 'shape', ()))},"
                         f" got {tuple(targets.shape)}")
    packed = cu_seqlens is not None
    expected_dims = 1 if packed else 2
    if mask.dim() != expected_dims or hidden.dim() != expected_dims + 1:
        raise ValueError(
            "hidden must be [B, T, D] with mask [B, T], or [N, D] with mask [N] and cu_seqlens; "
            f"got hidden {tuple(hidden.shape)}, mask {tuple(mask.shape)}")
    check_head_args(hidden, weight, targets, bias, temperature, softcap, logit_scale, ())
    m_flat = mask.reshape(-1) != 0
    t_flat = targets.reshape(-1).long()
    vocab = weight.shape[0]
    bad = m_flat & ((t_flat < 0) | (t_flat >= vocab))
    if bool(bad.any()):
        raise ValueError(f"targets must lie in [0, {vocab}) wherever mask is set; found "
                         f"{t_flat[bad][:5].tolist()}")
    head = dict(bias=bias, temperature=temperature, softcap=softcap, logit_scale=logit_scale)
    loss_kw = dict(ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                   token_weights=token_weights, attention_entropy=attention_entropy,
                   cu_seqlens=cu_seqlens, num_items_in_batch=num_items_in_batch,
                   global_batch_size=global_batch_size, training_progress=training_progress,
                   entropy_coef=entropy_coef)
    scored = torch.where(m_flat, t_flat, torch.full_like(t_flat, -100)).view(targets.shape)

    if strategy == "streaming" or config.objective in NON_GLOBAL_OBJECTIVES:
        globals_ = None
        if selection_entropy is not None and config.objective not in NON_GLOBAL_OBJECTIVES:
            globals_ = policy_loss_globals(mask, advantages, config, old_logprobs=old_logprobs,
                                           rollout_logprobs=rollout_logprobs,
                                           entropy=selection_entropy,
                                           attention_entropy=attention_entropy,
                                           cu_seqlens=cu_seqlens)
        out = linear_logprobs(hidden, weight, scored, return_entropy=True, **head)
        return policy_loss(out.logprobs, old_logprobs, advantages, mask, config,
                           entropy=out.entropy, batch_globals=globals_, **loss_kw)

    # Validated once here; the chunks below skip the checks (they synchronise with the device).
    check_policy_inputs(mask, advantages, cu_seqlens=cu_seqlens, old_logprobs=old_logprobs,
                        ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                        token_weights=token_weights, attention_entropy=attention_entropy,
                        selection_entropy=selection_entropy)
    dtype = compute_dtype(hidden)
    # Detached: the chunks compute their gradients themselves, and an autograd graph over the
    # logits would keep every chunk's tiles alive until the backward.
    h_all = hidden.detach().to(dtype).reshape(-1, hidden.shape[-1])
    w = weight.detach().to(dtype)
    b = None if bias is None else bias.detach().to(dtype)
    layout = _Layout(mask, cu_seqlens)

    if selection_entropy is None and _selects_by_entropy(config):
        with torch.no_grad():
            selection_entropy = linear_logprobs(hidden, weight, scored, return_entropy=True,
                                                **head).entropy
    globals_ = policy_loss_globals(mask, advantages, config, old_logprobs=old_logprobs,
                                   rollout_logprobs=rollout_logprobs, entropy=selection_entropy,
                                   attention_entropy=attention_entropy, cu_seqlens=cu_seqlens)
    check_global_counts(num_items_in_batch, global_batch_size, globals_.loss)

    # Planning: the only host synchronisation besides the input checks.
    rows = torch.nonzero(m_flat).squeeze(1)
    if packed:
        per_seq = torch.zeros(cu_seqlens.numel() - 1, dtype=torch.long, device=mask.device)
        seq_of_token = torch.searchsorted(cu_seqlens[1:].to(mask.device), rows, right=True)
        per_seq.index_add_(0, seq_of_token, torch.ones_like(rows))
    else:
        per_seq = m_flat.view(mask.shape).sum(1)
    per_seq = per_seq.tolist()
    budget = memory_budget if memory_budget is not None else _default_budget(hidden.device)
    max_rows = max(1, budget // stored_logits.bytes_per_row(vocab, dtype, softcap))
    plan = plan_chunks(per_seq, max_rows)
    starts = [0]
    for n in per_seq:
        starts.append(starts[-1] + n)
    dense_rows = max((starts[s1] - starts[s0] for s0, s1, streamed in plan if not streamed),
                     default=0)
    store = (stored_logits.StoredLogits(vocab, dense_rows, dtype, hidden.device, softcap)
             if dense_rows else None)

    need = (torch.is_grad_enabled(), hidden.requires_grad, weight.requires_grad,
            bias is not None and bias.requires_grad)
    want_grad = need[0] and any(need[1:])
    acc = tiles.acc_dtype(dtype)
    d_hidden = torch.zeros_like(h_all) if want_grad and need[1] else None
    d_weight = _WeightGrad(w, acc) if want_grad and need[2] else None
    d_bias = torch.zeros(vocab, dtype=acc, device=w.device) if want_grad and need[3] else None
    lp_all = torch.zeros(m_flat.shape, dtype=acc, device=hidden.device)
    h_ent_all = torch.zeros_like(lp_all)
    num_seqs = cu_seqlens.numel() - 1 if packed else mask.shape[0]
    # The same rule as policy_loss: [B] or [B, 1] is one advantage per sequence.
    adv_per_sequence = tuple(advantages.shape) in ((num_seqs,), (num_seqs, 1))

    for s0, s1, streamed in plan:
        grows = rows[starts[s0]:starts[s1]]
        if grows.numel() == 0:
            continue
        h_g = h_all.index_select(0, grows)
        t_g = t_flat.index_select(0, grows)
        sub = _SubBatch(layout, s0, s1, grows, mask, advantages, old_logprobs, config, loss_kw,
                        adv_per_sequence, globals_)
        run = _streamed_chunk if streamed else _dense_chunk
        gh = run(sub, h_g, w, b, t_g, head, want_grad, need, lp_all, h_ent_all, d_weight, d_bias,
                 store)
        if d_hidden is not None and gh is not None:
            d_hidden.index_copy_(0, grows, gh.to(d_hidden.dtype))

    # The loss value and metrics: the one copy of the objective on the collected (lp, H).
    with torch.no_grad():
        lp_view, ent_view = lp_all.view(mask.shape), h_ent_all.view(mask.shape)
        loss, metrics = policy_loss(lp_view, old_logprobs, advantages, mask, config,
                                    entropy=ent_view, batch_globals=globals_, validate=False,
                                    **loss_kw)
    if not want_grad:
        return loss, metrics
    grads = (
        None if d_hidden is None else d_hidden.view(hidden.shape).to(hidden.dtype),
        None if d_weight is None else d_weight.result().to(weight.dtype),
        None if d_bias is None else d_bias.to(bias.dtype),
    )
    return _StoredGradients.apply(loss, hidden, weight, bias, grads), metrics


def _selects_by_entropy(cfg: PolicyLossConfig) -> bool:
    return (cfg.top_entropy_quantile < 1 or cfg.adv_entropy_top_fraction < 1
            or cfg.stapo_prob_threshold is not None)


class _SubBatch:
    """The sequences ``s0:s1`` of the batch as a right-padded grid `policy_loss` takes."""

    def __init__(self, layout, s0, s1, grows, mask, advantages, old_logprobs, config, loss_kw,
                 adv_per_sequence, globals_):
        self.layout, self.s0, self.s1 = layout, s0, s1
        index = layout.chunk_index(s0, s1)
        a, _ = layout.token_range(s0, s1)
        local = grows - a
        if index is None:  # padded: flat position in the [s1 - s0, T] slice
            self.shape = (s1 - s0, layout.width)
            self.where = (local // layout.width, local % layout.width)
        else:
            row, col, self.shape = index
            self.where = (row[local], col[local])
        self.local_rows = local
        self.mask = layout.grid(mask, s0, s1, index, fill=False)
        self.advantages = (advantages[s0:s1] if adv_per_sequence
                           else layout.grid(advantages, s0, s1, index))
        self.old = layout.grid(old_logprobs, s0, s1, index)
        self.config = _config_slice(config, layout, s0, s1, index, mask.shape)
        scalars = ("num_items_in_batch", "global_batch_size", "training_progress",
                   "entropy_coef")
        self.kw = {k: v if k in scalars else layout.grid(v, s0, s1, index)
                   for k, v in loss_kw.items() if k != "cu_seqlens"}
        self.globals = globals_

    def loss(self, lp_g, ent_g):
        """This chunk's share of the loss, from its loss tokens' ``lp`` and ``H``."""
        lp = lp_g.new_zeros(self.shape).index_put(self.where, lp_g)
        ent = ent_g.new_zeros(self.shape).index_put(self.where, ent_g)
        loss, _ = policy_loss(lp, self.old, self.advantages, self.mask, self.config,
                              entropy=ent, batch_globals=self.globals, validate=False,
                              compute_metrics=False, **self.kw)
        return loss


def _config_slice(config, layout, s0, s1, index, shape):
    """The config with per-token tensor knobs (clip bounds, beta) cut to the chunk's grid."""
    changes = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape:
            changes[f.name] = layout.grid(value, s0, s1, index)
    if not changes:
        return config
    # A shallow copy, not dataclasses.replace: the knobs were validated once, and validating
    # tensors again would read them back from the device for every chunk.
    sliced = copy.copy(config)
    for name, value in changes.items():
        setattr(sliced, name, value)
    return sliced


def _dense_chunk(sub, h_g, w, b, t_g, head, want_grad, need, lp_all, ent_all, d_weight,
                 d_bias, store):
    """One chunk at the 3-GEMM floor: adds to the weight and bias gradients, returns the
    chunk's hidden-gradient rows (or None)."""
    lp, ent, lse = store.forward(h_g, w, b, t_g, **_transform(head))  # GEMM 1
    lp_all.index_copy_(0, _global_rows(sub), lp)
    ent_all.index_copy_(0, _global_rows(sub), ent)
    if not want_grad:
        return None
    lp_leaf = lp.detach().requires_grad_(True)
    ent_leaf = ent.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = sub.loss(lp_leaf, ent_leaf)
        g_lp, g_ent = torch.autograd.grad(loss, (lp_leaf, ent_leaf), allow_unused=True)
    if g_lp is None and g_ent is None:
        return None  # the chunk's loss does not depend on the head (e.g. all advantages 0)
    # The stored logits become dz in place, each vocabulary block feeding GEMMs 2 and 3.
    gh = store.backward_(h_g, w, lse, ent, g_lp, g_ent, None if d_weight is None else d_weight.t,
                         d_bias, want_hidden=need[1],
                         weight_beta=0.0 if d_weight is not None and d_weight.fresh else 1.0)
    if d_weight is not None:
        d_weight.fresh = False
    return gh


def _transform(head):
    """The logit transform's arguments."""
    return dict(temperature=head["temperature"], softcap=head["softcap"],
                logit_scale=head["logit_scale"])


def _streamed_chunk(sub, h_g, w, b, t_g, head, want_grad, need, lp_all, ent_all, d_weight,
                    d_bias, store):
    """A sequence longer than the budget: stream its vocabulary (4 GEMMs), never the logits.

    Adds to the weight and bias gradients, returns the hidden-gradient rows (or None)."""
    leaves = [None if x is None else x.detach().requires_grad_(want_grad and flag)
              for x, flag in ((h_g, need[1]), (w, need[2]), (b, need[3]))]
    with torch.enable_grad() if want_grad else torch.no_grad():
        out = linear_logprobs(leaves[0], leaves[1], t_g, bias=leaves[2], return_entropy=True,
                              **_transform(head))
        lp_all.index_copy_(0, _global_rows(sub), out.logprobs.detach().to(lp_all.dtype))
        ent_all.index_copy_(0, _global_rows(sub), out.entropy.detach().to(ent_all.dtype))
        if not want_grad:
            return None
        loss = sub.loss(out.logprobs, out.entropy)
        wanted = [x for x in leaves if x is not None and x.requires_grad]
        if not loss.requires_grad:
            return None
        got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    gh, gw, gb = (next(got) if x is not None and x.requires_grad else None for x in leaves)
    if d_weight is not None and gw is not None:
        d_weight.add_(gw)
    if d_bias is not None and gb is not None:
        d_bias += gb
    return gh


def _global_rows(sub) -> torch.Tensor:
    a, _ = sub.layout.token_range(sub.s0, sub.s1)
    return sub.local_rows + a
