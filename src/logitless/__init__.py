"""logitless: RL post-training losses from the LM head without the full-vocabulary logits."""

__version__ = "0.1.0"

from logitless.fused_losses.attention_entropy import attention_entropy
from logitless.fused_losses.config import PolicyLossConfig
from logitless.fused_losses.divergence import linear_divergence, linear_topk_distill
from logitless.fused_losses.entropy_control import AdaptiveEntropyCoef
from logitless.fused_losses.fused_policy_loss import fused_policy_loss
from logitless.fused_losses.logprobs import LogprobOutput, linear_logprobs
from logitless.fused_losses.objectives import register_objective
from logitless.fused_losses.policy_loss import policy_loss, policy_loss_globals

__all__ = [
    "AdaptiveEntropyCoef",
    "LogprobOutput",
    "PolicyLossConfig",
    "attention_entropy",
    "fused_policy_loss",
    "linear_divergence",
    "linear_logprobs",
    "linear_topk_distill",
    "policy_loss",
    "policy_loss_globals",
    "register_objective",
]
