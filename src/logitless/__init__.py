"""logitless: RL post-training losses from the LM head without the full-vocabulary logits."""

__version__ = "0.1.0"

from logitless.fused_losses.attention_entropy import attention_entropy
from logitless.fused_losses.logprobs import LogprobOutput, linear_logprobs

__all__ = ["LogprobOutput", "attention_entropy", "linear_logprobs"]
