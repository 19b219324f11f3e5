"""The gradients of one `fused_policy_loss` call: which ones it computes (`Need`) and their
accumulators over the chunks (`Grads`, with the weight's written by its first chunk)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class WeightGrad:
    """The fp32 weight-gradient accumulator, written (not added to) by its first chunk: zeroing
    ``[V, D]`` first would cost a pass over it (0.3 s at V=152k, D=1024 on CPU)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.t = torch.empty_like(weight, dtype=dtype)
        self.fresh = True

    def add_(self, g: torch.Tensor) -> None:
        if self.fresh:
            self.t.copy_(g)
        else:
            self.t += g
        self.fresh = False

    def buffer(self) -> tuple[torch.Tensor, float]:
        """The accumulator and the beta of a GEMM writing into it (0: the first write
        overwrites); the accumulator counts as written from here."""
        beta = 0.0 if self.fresh else 1.0
        self.fresh = False
        return self.t, beta

    def result(self) -> torch.Tensor:
        if self.fresh:  # no chunk's loss depended on the head
            self.t.zero_()
            self.fresh = False
        return self.t


class Need(NamedTuple):
    """The gradients a call computes (grad mode on and the input requires one)."""

    hidden: bool
    weight: bool
    bias: bool

    @classmethod
    def of(cls, hidden, weight, bias) -> Need:
        on = torch.is_grad_enabled()
        return cls(on and hidden.requires_grad, on and weight.requires_grad,
                   on and bias is not None and bias.requires_grad)

    @property
    def any(self) -> bool:
        return self.hidden or self.weight or self.bias


class Grads:
    """The call's gradient accumulators (None where not needed): hidden rows in the compute
    dtype, weight and bias in the accumulation dtype. ``shared``: a dict holding the weight
    and bias accumulators of several calls over one head (`fused.fsdp2`, one call a rank's
    batch), filled by the first."""

    def __init__(self, need: Need, head, acc: torch.dtype, shared: dict | None = None):
        h, w = head.hidden, head.weight
        rows = h.reshape(-1, h.shape[-1]).shape
        self.hidden = (torch.zeros(rows, dtype=head.dtype, device=h.device) if need.hidden
                       else None)
        if shared:  # an earlier call's weight and bias accumulators, added to
            self.weight, self.bias = shared["weight"], shared["bias"]
            return
        self.weight = WeightGrad(w, acc) if need.weight else None
        self.bias = torch.zeros(head.vocab, dtype=acc, device=w.device) if need.bias else None
        if shared is not None:  # the first of the calls that share them
            shared.update(weight=self.weight, bias=self.bias)

    def weight_buffer(self):
        """``(buffer, beta)`` for a GEMM writing the weight gradient, or ``(None, 1.0)``."""
        return (None, 1.0) if self.weight is None else self.weight.buffer()

    def add(self, gw, gb) -> None:
        if self.weight is not None and gw is not None:
            self.weight.add_(gw)
        if self.bias is not None and gb is not None:
            self.bias += gb

    def set_hidden(self, rows, gh) -> None:
        if self.hidden is not None and gh is not None:
            self.hidden.index_copy_(0, rows, gh.to(self.hidden.dtype))

    def result(self, hidden, weight, bias):
        return (
            None if self.hidden is None else self.hidden.view(hidden.shape).to(hidden.dtype),
            None if self.weight is None else self.weight.result().to(weight.dtype),
            None if self.bias is None else self.bias.to(bias.dtype),
        )
