"""Adapters for trainers (TRL, verl) and models (transformers). They call fused_losses only."""
