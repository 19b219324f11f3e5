"""Op ``divergence``: the per-token generalized JSD between a student and a teacher head.

Student ``(hidden [N, D], weight [V, D])``, teacher ``(teacher_hidden [N, D], teacher_weight
[V, D])`` (the same hidden size here), ``beta = 0.5`` (TRL's GKD default; 0 and 1 are the
forward and reverse KL), temperature 1; gradients to the student only.

Providers: logitless (``linear_divergence``), naive torch (both heads' logits materialised,
then TRL's ``GKDTrainer.generalized_jsd_loss`` per element when TRL is installed, else the same
formula in plain torch), TRL's ``ChunkedDivergenceFunction`` (the kernel of its
``DistillationTrainer``), Liger's ``LigerFusedLinearJSD`` (a mean over the tokens, not a
per-token value; Triton only, interpreted on CPU) and the plain GEMMs floor.
"""

from __future__ import annotations

import warnings

import torch

from logitless import reference
from logitless.tools.bench import ops_logprobs
from logitless.tools.bench.ops_logprobs import installed
from logitless.tools.bench.registry import Op, Provider, register_op, register_provider

BETA = 0.5


class DivergenceOp(Op):
    name = "divergence"
    dims = ("tokens", "hidden", "vocab")
    x_dims = ("tokens", "vocab", "hidden")
    grad_inputs = ("hidden", "weight")
    row_separable = False  # the teacher's head is not the "weight" the row split spares

    def make_inputs(self, shape, dtype, device, seed=0):
        n, d, v = shape["tokens"], shape["hidden"], shape["vocab"]
        gen = torch.Generator(device=device).manual_seed(seed)

        def head():  # unit hidden states, logits of std ~2, as the logprobs op
            h = torch.randn(n, d, generator=gen, device=device, dtype=dtype)
            w = torch.randn(v, d, generator=gen, device=device, dtype=dtype).mul_(2.0 / d**0.5)
            return h, w

        (hidden, weight), (t_hidden, t_weight) = head(), head()
        return {"hidden": hidden, "weight": weight, "teacher_hidden": t_hidden,
                "teacher_weight": t_weight}

    def first_block(self, inputs, rows):
        return {k: v if k.endswith("weight") else v[:rows] for k, v in inputs.items()}

    def reference(self, inputs, quantities):
        div = reference.linear_divergence(inputs["hidden"], inputs["weight"],
                                          inputs["teacher_hidden"], inputs["teacher_weight"],
                                          beta=BETA).divergence
        return {q: div.mean() if q == "loss" else div for q in quantities}

    def upstream(self, inputs, quantities):
        """One upstream gradient per token for ``divergence``, 1 for a mean ``loss``."""
        out = super().upstream(inputs, tuple(q for q in quantities if q != "loss"))
        if "loss" in quantities:
            out["loss"] = torch.ones((), device=inputs["hidden"].device)
        return out

    def floor_flops(self, shape, mode):
        """Both heads' logits; with the backward, the student's two gradient GEMMs."""
        gemm = 2.0 * shape["tokens"] * shape["hidden"] * shape["vocab"]
        return 2 * gemm if mode == "fwd" else 4 * gemm


register_op(DivergenceOp())


@register_provider
class Logitless(Provider):
    op, name, package = "divergence", "logitless", "logitless"
    quantities = ("divergence",)

    def forward(self, x):
        from logitless import linear_divergence

        return {"divergence": linear_divergence(x["hidden"], x["weight"], x["teacher_hidden"],
                                                x["teacher_weight"], beta=BETA).divergence}

    def note(self, device):
        return "chunked torch"


def _jsd_per_token(student_logits, teacher_logits):
    """TRL's ``generalized_jsd_loss`` elementwise (``reduction="none"``) summed over the
    vocabulary, or the same formula in plain torch without TRL."""
    try:
        with warnings.catch_warnings():  # TRL warns on any import from trl.experimental
            warnings.simplefilter("ignore")
            from trl.experimental.gkd.gkd_trainer import GKDTrainer
    except ImportError:
        s = torch.log_softmax(student_logits, -1)
        t = torch.log_softmax(teacher_logits, -1)
        m = torch.logaddexp(s + torch.log1p(torch.tensor(-BETA)), t + torch.log(torch.tensor(BETA)))
        return BETA * (t.exp() * (t - m)).sum(-1) + (1 - BETA) * (s.exp() * (s - m)).sum(-1)
    return GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, beta=BETA,
                                           reduction="none").sum(-1)


@register_provider
class Naive(Provider):
    """What a distillation trainer does without a fused head: both heads' full fp32 logits."""

    op, name, package = "divergence", "naive", "torch"
    quantities = ("divergence",)

    def forward(self, x):
        student = (x["hidden"] @ x["weight"].t()).float()
        with torch.no_grad():
            teacher = (x["teacher_hidden"] @ x["teacher_weight"].t()).float()
        return {"divergence": _jsd_per_token(student, teacher)}

    def note(self, device):
        return "TRL generalized_jsd_loss" if installed("trl") else "plain torch"


@register_provider
class TRLChunked(Provider):
    """``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``, called as TRL's
    ``DistillationTrainer`` calls it (on CPU its tiles are folded by torch ops)."""

    op, name, package = "divergence", "trl", "trl"
    quantities = ("divergence",)

    def unavailable(self, device, dtype, mode):
        return ops_logprobs.trl_missing("trl.kernels.chunked_divergence",
                                        "ChunkedDivergenceFunction")

    def forward(self, x):
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        div, _entropy = ChunkedDivergenceFunction.apply(
            x["hidden"], x["weight"], None, x["teacher_hidden"].detach(),
            x["teacher_weight"].detach(), None, BETA, 1.0)
        return {"divergence": div}

    def note(self, device):
        return "torch fold" if device == "cpu" else "triton"


@register_provider
class Liger(ops_logprobs.Liger):
    """``liger_kernel.transformers.LigerFusedLinearJSD``: the mean divergence over the tokens
    (its only output), fp32 accumulation of the weight gradient. Available where Liger's
    cross entropy is (Triton only)."""

    op = "divergence"
    quantities = ("loss",)

    def forward(self, x):
        from liger_kernel.transformers import LigerFusedLinearJSD

        loss_fn = LigerFusedLinearJSD(jsd_beta=BETA, accum_dtype=torch.float32)
        loss = loss_fn(x["hidden"], x["weight"], x["teacher_hidden"].detach(),
                       x["teacher_weight"].detach(), None)
        return {"loss": loss.float()}


@register_provider
class DivergenceGemms(ops_logprobs.PlainGemms):
    """The floor: the teacher's logits ``Z_t = H_t W_t^T``, then the student's GEMMs as the
    logprobs floor (``Z = H W^T``; with the backward ``dH = dZ W``, ``dW = dZ^T H``)."""

    op = "divergence"

    def step(self, inputs, mode, upstream):
        with torch.no_grad():
            z_t = inputs["teacher_hidden"] @ inputs["teacher_weight"].t()
            del z_t
        super().step(inputs, mode, upstream)
