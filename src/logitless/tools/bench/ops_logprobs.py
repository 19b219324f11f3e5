"""Op ``logprobs``: per-token logprob (and entropy) of targets under an LM head ``[V, D]``.

With ``--top-k/--top-p/--min-p`` (the op's options) the logprobs are sampler-matched (vLLM's
truncations, ``docs/sampler.md``): targets are drawn from the truncated distribution, and only
logitless and the naive provider (full logits, vLLM's sort) compute them.

Providers: logitless, naive torch (materialised logits), TRL's ``ChunkedLogProbFunction``,
Liger's fused linear cross entropy, Cut Cross-Entropy, verl's ``linear_cross_entropy``,
PyTorch's chunked ``F.linear_cross_entropy`` and the plain GEMMs floor. Cross-entropy
libraries (Liger, CCE, PyTorch) return ``-logprob`` and no entropy; their rows say so
(``computes`` column), and their backward carries the logprob term only.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil

import torch

from logitless import reference
from logitless.tools.bench.registry import (
    Inputs,
    Op,
    Outputs,
    Provider,
    register_op,
    register_provider,
)


class LogprobsOp(Op):
    name = "logprobs"
    dims = ("tokens", "hidden", "vocab")
    x_dims = ("tokens", "vocab", "hidden")
    grad_inputs = ("hidden", "weight")
    row_separable = True

    def make_inputs(self, shape, dtype, device, seed=0, **sampler):
        """``sampler``: any of ``top_k``, ``top_p``, ``min_p``, given to the providers as
        per-token tensors, the targets then drawn from the truncated distribution."""
        n, d, v = shape["tokens"], shape["hidden"], shape["vocab"]
        gen = torch.Generator(device=device).manual_seed(seed)
        # Unit hidden states and a head scaled to logits of std ~2: entropies of a few nats,
        # like a trained model's, so that no provider wins by a degenerate softmax.
        hidden = torch.randn(n, d, generator=gen, device=device, dtype=dtype)
        weight = torch.randn(v, d, generator=gen, device=device, dtype=dtype)
        weight.mul_(2.0 / d**0.5)
        targets = torch.randint(0, v, (n,), generator=gen, device=device)
        inputs = {"hidden": hidden, "weight": weight, "targets": targets}
        if sampler:
            inputs.update(_per_token_settings(sampler, n, device))
            inputs["targets"] = _draw_targets(inputs, gen)
        return inputs

    def first_block(self, inputs, rows):
        return {k: v if k == "weight" else v[:rows] for k, v in inputs.items()}

    def reference(self, inputs, quantities):
        settings = _settings(inputs)
        if settings:
            stats = reference.sampler_logprobs(inputs["hidden"], inputs["weight"],
                                               inputs["targets"], **settings)
        else:
            stats = reference.linear_softmax_stats(inputs["hidden"], inputs["weight"],
                                                   inputs["targets"])
        return {q: stats[q] for q in quantities}

    def floor_flops(self, shape, mode):
        gemm = 2.0 * shape["tokens"] * shape["hidden"] * shape["vocab"]
        return gemm if mode == "fwd" else 3 * gemm


register_op(LogprobsOp())

_SAMPLER = ("top_k", "top_p", "min_p")


def _per_token_settings(sampler: dict, n: int, device) -> dict[str, torch.Tensor]:
    unknown = set(sampler) - set(_SAMPLER)
    if unknown:
        raise ValueError(f"logprobs options must be drawn from {_SAMPLER}, got {sorted(unknown)}")
    return {k: torch.full((n,), v, device=device,
                          dtype=torch.int64 if k == "top_k" else torch.float32)
            for k, v in sampler.items()}


def _settings(inputs) -> dict[str, torch.Tensor]:
    return {k: inputs[k] for k in _SAMPLER if k in inputs}


def _draw_targets(inputs, gen, rows: int = 64) -> torch.Tensor:
    """Tokens drawn (Gumbel-max) from the sampler's truncated distribution, ``rows`` at a time
    so the fp32 logits never exist whole."""
    h, w, settings = inputs["hidden"], inputs["weight"], _settings(inputs)
    out = []
    for r0 in range(0, h.shape[0], rows):
        z = (h[r0:r0 + rows] @ w.t()).float()
        kept = reference.sampler_kept_mask(z, **{k: t[r0:r0 + rows] for k, t in settings.items()})
        u = torch.rand(z.shape, generator=gen, device=z.device).clamp_min(1e-20)
        out.append(torch.where(kept, z - torch.log(-torch.log(u)), -torch.inf).argmax(1))
    return torch.cat(out)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module.split(".")[0]) is not None


def trl_missing(module: str, name: str) -> str | None:
    """Why TRL's ``module.name`` cannot be used here, or None when it can."""
    if not installed("trl"):
        return "trl is not installed (pip install 'logitless[trl]')"
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        return f"trl has no {name}: {err}"
    return None


def _needs_interpreter(device: str) -> str | None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return ("Triton kernels only: on CPU they need TRITON_INTERPRET=1 set before the "
                "process starts (the runner does this in its child processes)")
    return None


@register_provider
class Logitless(Provider):
    op, name, package = "logprobs", "logitless", "logitless"
    quantities = ("logprobs", "entropy")
    takes_options = True

    def forward(self, x: Inputs) -> Outputs:
        from logitless import linear_logprobs

        out = linear_logprobs(x["hidden"], x["weight"], x["targets"], return_entropy=True,
                              **_settings(x))
        return {"logprobs": out.logprobs, "entropy": out.entropy}

    def note(self, device):
        return "chunked torch" if device == "cpu" else "triton"


@register_provider
class Naive(Provider):
    """What a trainer does without a fused head: full logits, fp32 log-softmax, entropy; with
    the sampler's settings, vLLM's way on the full logits: a sort of every row for the kept set
    (``reference.sampler_kept_mask``), the rest masked to -inf."""

    op, name, package = "logprobs", "naive", "torch"
    quantities = ("logprobs", "entropy")
    takes_options = True

    def forward(self, x):
        logits = (x["hidden"] @ x["weight"].t()).float()
        settings = _settings(x)
        if settings:
            kept = reference.sampler_kept_mask(logits.detach(), **settings)
            logits = logits.masked_fill(~kept, -torch.inf)
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(1, x["targets"].unsqueeze(1)).squeeze(1)
        entropy = -(logp.exp() * logp.masked_fill(logp == -torch.inf, 0.0)).sum(-1)
        return {"logprobs": lp, "entropy": entropy}


@register_provider
class TRLChunked(Provider):
    """``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` with the chunk TRL's trainer uses.

    On CPU TRL folds its tiles with torch ops (its Triton kernels are for CUDA/XPU only).
    """

    op, name, package = "logprobs", "trl", "trl"
    quantities = ("logprobs", "entropy")

    def unavailable(self, device, dtype, mode):
        return trl_missing("trl.kernels.chunked_logprob", "ChunkedLogProbFunction")

    def forward(self, x):
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        lp, entropy, *_ = ChunkedLogProbFunction.apply(
            x["hidden"], x["weight"], None, x["targets"], 1.0, _trl_chunk_size(), None, 1.0,
            ("entropy",))
        return {"logprobs": lp, "entropy": entropy}

    def note(self, device):
        return "torch fold" if device == "cpu" else "triton"


def _trl_chunk_size() -> int:
    try:
        from trl.trainer import utils
    except ImportError:
        return 32768
    return int(getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768))


@register_provider
class Liger(Provider):
    """Liger's fused linear cross entropy, per token (``reduction="none"``), fp32 accumulation
    of the weight gradient (as logitless and TRL do)."""

    op, name, package = "logprobs", "liger", "liger-kernel"
    quantities = ("logprobs",)
    interpreted_on_cpu = True

    def unavailable(self, device, dtype, mode):
        if not installed("liger_kernel"):
            return "liger-kernel is not installed (pip install liger-kernel)"
        return _needs_interpreter(device)

    def forward(self, x):
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )

        loss, *_ = LigerFusedLinearCrossEntropyFunction.apply(
            x["hidden"], x["weight"], x["targets"], None, None, -100, 0.0, 0.0, "none", None,
            False, torch.float32)
        return {"logprobs": -loss}


@register_provider
class CutCrossEntropy(Provider):
    """Cut Cross-Entropy: its Triton kernels on CUDA; on CPU its ``torch_compile`` impl (the
    Triton kernels fail under the interpreter, and CCE ships that impl for such devices)."""

    op, name, package = "logprobs", "cce", "cut-cross-entropy"
    quantities = ("logprobs",)

    def unavailable(self, device, dtype, mode):
        if not installed("cut_cross_entropy"):
            return "cut-cross-entropy is not installed (pip install cut-cross-entropy)"
        if device == "cpu" and not (shutil.which("g++") or shutil.which("c++")):
            return "CPU impl is torch.compile, which needs a C++ compiler (none on PATH)"
        return None

    def forward(self, x):
        from cut_cross_entropy import linear_cross_entropy

        impl = "torch_compile" if x["hidden"].device.type == "cpu" else "cce"
        loss = linear_cross_entropy(x["hidden"], x["weight"], x["targets"], reduction="none",
                                    impl=impl)
        return {"logprobs": -loss.float()}

    def note(self, device):
        return "torch.compile impl" if device == "cpu" else "triton"


@register_provider
class Verl(Provider):
    op, name, package = "logprobs", "verl", "verl"
    quantities = ("logprobs", "entropy")

    def unavailable(self, device, dtype, mode):
        if not installed("verl"):
            return "verl is not installed (pip install 'logitless[verl]')"
        if device != "cuda":
            return "verl's linear_cross_entropy kernels assert CUDA tensors"
        return None

    def forward(self, x):
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        lp, entropy = linear_cross_entropy(x["hidden"], x["weight"], x["targets"], 1.0, "none")
        return {"logprobs": lp, "entropy": entropy}


def torch_linear_logprobs(hidden, weight, targets, temperature: float = 1.0):
    """Per-token logprobs from PyTorch's own chunked ``F.linear_cross_entropy``: the loss with
    ``reduction="none"`` is ``-logprob``; the temperature divides the hidden states, which
    divides the logits (no bias here)."""
    if temperature != 1.0:
        hidden = hidden / temperature
    loss = torch.nn.functional.linear_cross_entropy(
        hidden, weight, targets, reduction="none",
        options=torch.nn.LinearCrossEntropyOptions())
    return -loss.float()


@register_provider
class TorchLinearCrossEntropy(Provider):
    """What a user who never heard of logitless tries first: PyTorch's chunked
    ``torch.nn.functional.linear_cross_entropy`` with ``LinearCrossEntropyOptions()`` (its
    automatic chunking and accumulation policy). Logprobs only: it computes no entropy."""

    op, name, package = "logprobs", "torch", "torch"
    quantities = ("logprobs",)

    def unavailable(self, device, dtype, mode):
        # Probe the API rather than the version string (it landed in torch 2.13).
        if not (hasattr(torch.nn.functional, "linear_cross_entropy")
                and hasattr(torch.nn, "LinearCrossEntropyOptions")):
            return (f"torch {torch.__version__} has no chunked "
                    "torch.nn.functional.linear_cross_entropy (LinearCrossEntropyOptions "
                    "needs torch >= 2.13)")
        return None

    def forward(self, x):
        return {"logprobs": torch_linear_logprobs(x["hidden"], x["weight"], x["targets"])}

    def note(self, device):
        return "chunked, auto"


@register_provider
class PlainGemms(Provider):
    """The floor: forward ``Z = H W^T``; forward+backward adds ``dH = dZ W`` and
    ``dW = dZ^T H`` (with ``dZ`` stood in for by ``Z``): 2 N D V and 6 N D V FLOPs."""

    op, name, package = "logprobs", "gemm", "torch"
    is_floor = True

    def step(self, inputs, mode, upstream):
        with torch.no_grad():
            h, w = inputs["hidden"], inputs["weight"]
            z = h @ w.t()
            if mode == "fwd-bwd":
                d_hidden, d_weight = z @ w, z.t() @ h
                del d_hidden, d_weight
