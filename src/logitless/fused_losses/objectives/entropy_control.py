"""Adaptive entropy-bonus coefficient (docs/objectives.md, section 5), as TRL's controller behaves.

The bonus applies only while the entropy measured over the last optimizer step is at or below
the target; the coefficient then moves by ``delta`` each step, up while the entropy stays at or
below the target, down otherwise, within ``[coef_min, coef_max]``. Every micro-batch of one
step uses the coefficient fixed at the end of the previous step.
"""

import math

import torch


class AdaptiveEntropyCoef:
    """Usage per micro-batch::

    loss, metrics = policy_loss(..., entropy_coef=controller.current())
    controller.observe(metrics)
    if last_micro_batch_of_step:
        controller.step(reduce=all_reduce_sum)  # reduce: sums a [2] tensor over ranks
    """

    def __init__(
        self,
        coef: float,
        target: float,
        delta: float,
        coef_min: float = 0.0,
        coef_max: float = math.inf,
    ):
        if delta < 0 or coef_min > coef_max:
            raise ValueError("AdaptiveEntropyCoef: needs delta >= 0 and coef_min <= coef_max")
        self.coef = coef
        self.target = target
        self.delta = delta
        self.coef_min = coef_min
        self.coef_max = coef_max
        self.last_entropy = math.inf
        self._window = None

    def current(self) -> float:
        """The coefficient to apply in this step (0 while the entropy is above the target)."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, metrics: dict):
        """Accumulate the entropy sum and token count of the bonus's tokens of one micro-batch."""
        stats = torch.stack([metrics["entropy/bonus_sum"], metrics["entropy/bonus_tokens"]])
        self._window = stats if self._window is None else self._window + stats

    def step(self, reduce=None) -> float:
        """Close the optimizer step: the window's mean entropy moves the coefficient."""
        if self._window is None:
            return self.coef
        window = reduce(self._window) if reduce is not None else self._window
        entropy = float(window[0] / window[1].clamp(min=1.0))
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy
        self._window = None
        return self.coef
