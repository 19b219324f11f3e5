"""Plain-PyTorch specification of everything logitless computes: the test oracle.

Every function here materialises what the fast paths avoid (the ``[N, V]`` logits, the
``T x T`` attention probabilities, explicit per-sequence loops) and is meant to run in fp64.
Nothing here is fast; everything here is obviously the formula. One file per op; the public
ops' names (``linear_logprobs``, ``policy_loss``, ``fused_policy_loss``, ``linear_divergence``,
``linear_topk_distill``, ``attention_entropy``) take the fast ops' arguments.
"""

from logitless.reference.attention import attention_entropy, attention_visibility
from logitless.reference.divergence import (
    generalized_jsd,
    linear_divergence,
    linear_topk_distill,
    mtp_draft_loss,
    topk_forward_kl,
    topk_reverse_kl,
)
from logitless.reference.linear_softmax import linear_logits, linear_softmax_stats, softcap
from logitless.reference.objectives import (
    aggregate_loop,
    kl_loop,
    policy_loss_reference,
    quantile_loop,
    ratio_loop,
    rollout_rejection_keep_loop,
)
from logitless.reference.public import fused_policy_loss, linear_logprobs, policy_loss
from logitless.reference.sampler import kept_set_logprobs, sampler_kept_mask, sampler_logprobs
from logitless.reference.segments import (
    prefix_min_loop,
    prefix_sum_loop,
    segment_sum_loop,
    suffix_sum_loop,
)

__all__ = [
    "aggregate_loop",
    "attention_entropy",
    "attention_visibility",
    "fused_policy_loss",
    "generalized_jsd",
    "kept_set_logprobs",
    "kl_loop",
    "linear_divergence",
    "linear_logits",
    "linear_logprobs",
    "linear_softmax_stats",
    "linear_topk_distill",
    "mtp_draft_loss",
    "policy_loss",
    "policy_loss_reference",
    "prefix_min_loop",
    "prefix_sum_loop",
    "quantile_loop",
    "ratio_loop",
    "rollout_rejection_keep_loop",
    "sampler_kept_mask",
    "sampler_logprobs",
    "segment_sum_loop",
    "softcap",
    "suffix_sum_loop",
    "topk_forward_kl",
    "topk_reverse_kl",
]
