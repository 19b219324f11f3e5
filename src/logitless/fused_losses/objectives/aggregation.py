"""Aggregation of per-token losses (docs/objectives.md, section 7) and the batch-global quantities.

Everything that depends on the whole batch rather than on one sequence lives in `BatchGlobals`:
token and sequence counts, L_max, the positive/negative counts of balanced aggregation, the
length-power denominator, and the thresholds of batch-level token selections. `policy_loss`
computes them from its own inputs unless it is given them; computing them once for the whole
batch and passing them to `policy_loss` on any subset of whole sequences gives that subset's
exact share of the full loss (the shares of a partition sum to the full loss).
"""

import dataclasses
import math
from dataclasses import dataclass

import torch

from logitless.fused_losses.objectives import context_parallel as cp
from logitless.fused_losses.objectives import segments
from logitless.fused_losses.oplib import is_compiling


@dataclass(frozen=True)
class AggCounts:
    """Counts one aggregation needs, over the tokens it aggregates: floats, or 0-d tensors
    under ``torch.compile`` (reading them on the host would break the graph)."""

    num_tokens: float
    num_sequences: float
    num_pos_sequences: float
    num_neg_sequences: float
    num_pos_tokens: float
    num_neg_tokens: float
    length_power_denominator: float
    # [B] valid tokens per sequence over every rank; only under cp_group (else the local mask
    # gives them, so that a chunk of sequences needs no slicing)
    lengths: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchGlobals:
    """Batch-global quantities of one loss call (see the module docstring for the contract).

    ``loss`` counts the tokens of the policy term (mask after rollout rejection and STAPO);
    ``entropy`` those of the entropy bonus (further narrowed by the entropy-quantile selection).
    """

    loss: AggCounts
    entropy: AggCounts
    max_response_length: float
    # Floats in eager mode; 0-d tensors under torch.compile (`host_value`).
    entropy_threshold: float | None = None
    adv_entropy_threshold: float | None = None
    attn_stats: tuple[float, float] | None = None
    attn_thresholds: tuple[float, float] | None = None
    is_weight_mean: float | None = None  # batch mean of the rollout IS weights (normalising)
    num_prompts: float | None = None  # prompt-mean's groups in the whole batch

    def rows(self, s0: int, s1: int) -> "BatchGlobals":
        """The globals of sequences ``s0:s1`` (a chunk of whole sequences): the same, but the
        per-sequence lengths (`AggCounts.lengths`, under ``cp_group``) cut to the chunk's."""
        if self.loss.lengths is None and self.entropy.lengths is None:
            return self

        def cut(counts: AggCounts) -> AggCounts:
            if counts.lengths is None:
                return counts
            return dataclasses.replace(counts, lengths=counts.lengths[s0:s1])

        return dataclasses.replace(self, loss=cut(self.loss), entropy=cut(self.entropy))


def agg_counts(m, adv, seq_count: str, length_power_alpha: float, group=None) -> AggCounts:
    """Counts of a bool mask ``m [B, T]`` with advantages ``adv [B, T]`` (over every rank of
    the context-parallel ``group`` when given, one ``all_reduce``)."""
    if group is None:
        lengths = m.sum(-1)
        seq_adv = segments.segment_mean(adv.detach(), m)
        pos_tokens, neg_tokens = (m & (adv > 0)).sum(), (m & (adv < 0)).sum()
    else:
        lengths, seq_adv, pos_tokens, neg_tokens = _cp_sequence_counts(m, adv, group)
    nonempty = lengths > 0
    lf = lengths.to(torch.float64)
    denominator = torch.where(nonempty, lf.clamp(min=1) ** (1 - length_power_alpha), 0.0).sum()
    count = _count_of(adv.dtype)
    return AggCounts(
        num_tokens=count(lengths.sum()),
        num_sequences=float(m.shape[0]) if seq_count == "all" else count(nonempty.sum()),
        num_pos_sequences=count((nonempty & (seq_adv > 0)).sum()),
        num_neg_sequences=count((nonempty & (seq_adv < 0)).sum()),
        num_pos_tokens=count(pos_tokens),
        num_neg_tokens=count(neg_tokens),
        length_power_denominator=count(denominator),
        lengths=None if group is None else lengths,
    )


def _cp_sequence_counts(m, adv, group):
    """Per sequence over every rank (one ``all_reduce`` of ``[4, B]`` in fp64, exact for
    counts): valid tokens (int64), mean advantage (``adv``'s dtype); and the valid tokens of
    A > 0 and of A < 0 in the batch."""
    a = adv.detach().to(torch.float64)
    local = torch.stack([m.sum(-1).to(torch.float64), torch.where(m, a, 0.0).sum(-1),
                         (m & (a > 0)).sum(-1).to(torch.float64),
                         (m & (a < 0)).sum(-1).to(torch.float64)])
    lengths, adv_sum, pos, neg = cp.all_reduce(local, group).unbind()
    seq_adv = (adv_sum / lengths.clamp(min=1)).to(adv.dtype)
    return lengths.long(), seq_adv, pos.sum().long(), neg.sum().long()


def prompt_weights(m, group_size: int, num_prompts: float | None = None) -> torch.Tensor:
    """``prompt-mean``'s per-token weights ``[B, T]``: ``1 / (P n_g)`` at every position of
    the sequences of group ``g``, the groups ``group_size`` consecutive sequences (one
    prompt's responses), ``n_g`` the valid tokens of ``m`` in the group (at least 1), ``P``
    the batch's groups (``num_prompts``, from `BatchGlobals` for a part of whole groups;
    default: ``m``'s). ``sum m l w`` is then the mean over groups of each group's token mean
    (AReaL, SkyRL, miles ``prompt_mean``)."""
    b = m.shape[0]
    if b % group_size:
        raise ValueError(f"prompt_group_size: the batch's {b} sequences are not whole groups "
                         f"of {group_size}")
    groups = b // group_size
    per_group = m.reshape(max(groups, 1), -1).sum(-1).clamp(min=1).to(torch.float64)
    p = groups if num_prompts is None else num_prompts
    w = (1.0 / (max(p, 1) * per_group)).repeat_interleave(group_size)
    return w[:b, None].expand(m.shape)


def host_value(t):
    """A batch-global value as `BatchGlobals` keeps it: a float in eager mode, the 0-d tensor
    itself under ``torch.compile`` (reading it on the host would break the graph); None
    stays None."""
    if t is None or is_compiling():
        return t
    return float(t)


def _count_of(dtype):
    """How a count leaves its tensor: a float in eager mode, a 0-d ``dtype`` tensor under
    ``torch.compile``."""
    return (lambda t: t.to(dtype)) if is_compiling() else float


def _div(x, n):
    if isinstance(n, torch.Tensor):  # a count under torch.compile: no host read
        positive = n > 0
        return torch.where(positive, x / torch.where(positive, n, 1), x * 0.0)
    return x / n if n > 0 else x * 0.0


def check_global_counts(num_items_in_batch, global_batch_size, counts: AggCounts) -> None:
    """``ValueError`` naming the argument unless each given global count is a finite number
    > 0; 0 is accepted for a batch without loss tokens (its loss is 0, as TRL's clamp of the
    count at 1 gives). ``counts``: the loss tokens of the whole batch."""
    for name, value in (("num_items_in_batch", num_items_in_batch),
                        ("global_batch_size", global_batch_size)):
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"{name}: expected a number, got a tensor of shape "
                                 f"{tuple(value.shape)}")
            if is_compiling():
                continue  # its value is not read under torch.compile (docs/compile.md)
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        # Under torch.compile the loss tokens are a tensor, and a count of 0 is not checked.
        empty = isinstance(counts.num_tokens, torch.Tensor) or counts.num_tokens == 0
        if not math.isfinite(value) or value < 0 or (value == 0 and not empty):
            raise ValueError(f"{name}: must be > 0 (a count over the whole optimizer step), "
                             f"got {value}")


def _global_count(value):
    """A global count as a float; a tensor stays a 0-d tensor under ``torch.compile``."""
    if isinstance(value, torch.Tensor) and is_compiling():
        return value.reshape(())
    return float(value)


def aggregate(
    loss,
    m,
    adv,
    mode,
    counts: AggCounts,
    cfg,
    *,
    max_response_length,
    num_items_in_batch=None,
    global_batch_size=None,
    prompt_weight=None,
):
    """Scalar from per-token ``loss [B, T]`` over bool ``m [B, T]``.

    Local normalisers (from ``counts``) average over micro-batches: divided by
    ``cfg.grad_accum_steps``. Global ones (``num_items_in_batch``: tokens of the optimizer step
    over every rank and micro-batch; ``global_batch_size``: its sequences; both > 0, see
    `check_global_counts`) are exact already; the loss is multiplied by ``cfg.dp_size`` because
    data parallelism averages gradients.

    ``prompt-mean`` weighs each token by ``prompt_weight [B, T]`` (`prompt_weights`: the
    whole batch's prompt groups, so that a chunk of whole sequences gets its exact share).
    """
    masked = torch.where(m, loss, torch.zeros_like(loss))
    seq_sum = masked.sum(-1)
    lengths = (m.sum(-1) if counts.lengths is None else counts.lengths).to(loss.dtype)
    dp, ga = cfg.dp_size, cfg.grad_accum_steps
    if mode == "token-mean":
        if num_items_in_batch is not None:
            return _div(seq_sum.sum() * dp, _global_count(num_items_in_batch))
        return _div(seq_sum.sum(), counts.num_tokens) / ga
    if mode == "token-sum":
        return seq_sum.sum() * dp
    if mode == "bnpo":
        return _div(seq_sum.sum(), counts.num_tokens) / ga
    if mode == "prompt-mean":
        if prompt_weight is None:
            raise ValueError("prompt_group_size: prompt-mean needs the batch's prompt weights")
        return torch.where(m, loss * prompt_weight, torch.zeros_like(loss)).sum() / ga
    if mode.startswith("seq-mean") or mode == "constant":
        if mode == "seq-mean-token-mean":
            per_seq = seq_sum / lengths.clamp(min=1)
        elif mode == "seq-mean-token-sum":
            per_seq = seq_sum
        elif mode == "constant":
            per_seq = seq_sum / cfg.loss_agg_divisor
        else:
            per_seq = seq_sum / max_response_length
        if global_batch_size is not None:
            return _div(per_seq.sum() * dp, _global_count(global_batch_size))
        return _div(per_seq.sum(), counts.num_sequences) / ga
    if mode == "balanced":
        # (n+/n) mean over tokens of A > 0 + (n-/n) mean over tokens of A < 0, n counting
        # sequences by the sign of their advantage and the means pooling tokens.
        n = counts.num_pos_sequences + counts.num_neg_sequences
        pos = torch.where(adv > 0, masked, torch.zeros_like(masked)).sum()
        neg = torch.where(adv < 0, masked, torch.zeros_like(masked)).sum()
        total = (
            _div(pos, counts.num_pos_tokens) * counts.num_pos_sequences
            + _div(neg, counts.num_neg_tokens) * counts.num_neg_sequences
        )
        return _div(total, n) / ga
    if mode == "length-power":
        # Delta-L: x_i = L_i^-alpha / sum_j L_j^(1 - alpha), unbiased for any alpha.
        x = torch.where(lengths > 0, lengths.clamp(min=1) ** (-cfg.length_power_alpha), 0.0)
        return _div((x * seq_sum).sum(), counts.length_power_denominator) / ga
    raise ValueError(f"loss_agg: unknown aggregation {mode!r}")
