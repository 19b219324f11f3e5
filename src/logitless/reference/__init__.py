"""Plain-PyTorch specification of everything logitless computes: the test oracle.

Every function here materialises what the fast paths avoid (the ``[N, V]`` logits, the
``T x T`` attention probabilities, explicit per-sequence loops) and is meant to run in fp64.
Nothing here is fast; everything here is obviously the formula. One file per op.
"""

from logitless.reference.attention import attention_entropy, attention_visibility
from logitless.reference.linear_softmax import linear_logits, linear_softmax_stats, softcap

__all__ = [
    "attention_entropy",
    "attention_visibility",
    "linear_logits",
    "linear_softmax_stats",
    "softcap",
]
