"""The fused loss: `fused_policy_loss`, its argument checks, chunk plan, GPU cost model, chunk
loop, gradient accumulators and custom op."""
