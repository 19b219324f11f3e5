"""logitless: RL post-training losses from the LM head without the full-vocabulary logits."""

__version__ = "0.1.0"
