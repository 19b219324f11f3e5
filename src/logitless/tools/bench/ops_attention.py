"""Op ``attention-entropy``: per-query entropy of causal attention, forward only.

Providers: logitless (flash-style, O(T) memory), naive torch (materialised ``[B, H, T, T]``
probabilities) and the plain ``Q K^T`` GEMM as the floor. No peer library computes it.
"""

from __future__ import annotations

import torch

from logitless import reference
from logitless.tools.bench.registry import Op, Provider, register_op, register_provider


class AttentionEntropyOp(Op):
    name = "attention-entropy"
    dims = ("batch", "heads", "kv_heads", "seq", "head_dim")
    x_dims = ("seq", "heads", "head_dim", "batch")
    modes = ("fwd",)

    def make_inputs(self, shape, dtype, device, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        b, t, d = shape["batch"], shape["seq"], shape["head_dim"]
        q = torch.randn(b, shape["heads"], t, d, generator=gen, device=device, dtype=dtype)
        k = torch.randn(b, shape["kv_heads"], t, d, generator=gen, device=device, dtype=dtype)
        return {"q": q, "k": k}

    def first_block(self, inputs, rows):
        # Causal: the first `rows` queries see only the first `rows` keys.
        return {"q": inputs["q"][:, :, :rows], "k": inputs["k"][:, :, :rows]}

    def reference(self, inputs, quantities):
        return {"entropy": reference.attention_entropy(inputs["q"], inputs["k"], causal=True)}

    def floor_flops(self, shape, mode):
        return 2.0 * shape["batch"] * shape["heads"] * shape["seq"] ** 2 * shape["head_dim"]


register_op(AttentionEntropyOp())


@register_provider
class Logitless(Provider):
    op, name, package = "attention-entropy", "logitless", "logitless"
    quantities = ("entropy",)

    def forward(self, x):
        from logitless import attention_entropy

        return {"entropy": attention_entropy(x["q"], x["k"], causal=True)}

    def note(self, device):
        return "chunked torch" if device == "cpu" else "triton"


@register_provider
class Naive(Provider):
    """Scores, causal mask, fp32 softmax, ``sum -p log p``: what eager attention would give."""

    op, name, package = "attention-entropy", "naive", "torch"
    quantities = ("entropy",)

    def forward(self, x):
        q, k = x["q"], x["k"]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        t = q.shape[2]
        scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
        hidden = torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(hidden, float("-inf"))
        return {"entropy": torch.special.entr(torch.softmax(scores, dim=-1)).sum(-1)}


@register_provider
class ScoresGemm(Provider):
    """The floor: the ``Q K^T`` scores GEMM alone (2 B H T^2 d FLOPs)."""

    op, name, package = "attention-entropy", "gemm", "torch"
    is_floor = True

    def step(self, inputs, mode, upstream):
        with torch.no_grad():
            q, k = inputs["q"], inputs["k"]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = q @ k.transpose(-1, -2)
            del scores
