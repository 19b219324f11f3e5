"""The head ops: autograd functions and custom ops over `kernels/` (logprobs and softmax
statistics, the sampler-matched logprobs, divergences, attention entropy)."""
