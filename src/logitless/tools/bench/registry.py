"""What a benchmark op and a provider are, and the registries that hold them.

An :class:`Op` knows its inputs (built from a shape), which of them take gradients, how to cut
the first token block out of them and how to compute its fp64 reference. A :class:`Provider`
computes that op one way (logitless, naive torch, a peer library, the plain GEMMs floor); the
measurement code in ``measure.py`` is the same for all of them. New ops and providers register
themselves here from their own modules (``ops_*.py``), so the CLI and the runner never change
when one lands.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable

import torch

Inputs = dict[str, torch.Tensor]
Outputs = dict[str, torch.Tensor]


class Op(abc.ABC):
    """One benchmarked operation. Subclasses set the class attributes and the methods."""

    name: str = ""
    #: names of the shape's dimensions, in the order they are printed
    dims: tuple[str, ...] = ()
    #: the dimension the plot puts on its x axis when it varies
    x_dims: tuple[str, ...] = ()
    #: inputs that receive gradients in ``fwd-bwd`` mode
    grad_inputs: tuple[str, ...] = ()
    modes: tuple[str, ...] = ("fwd", "fwd-bwd")
    #: tokens are independent and every input but ``weight`` is indexed by token along dim 0,
    #: so the fp64 reference can run a chunk of rows at a time (see ``measure.block_errors``)
    row_separable: bool = False

    @abc.abstractmethod
    def make_inputs(self, shape: dict[str, int], dtype: torch.dtype, device: str,
                    seed: int = 0) -> Inputs:
        """Fresh random inputs of ``shape`` (never zeros)."""

    @abc.abstractmethod
    def first_block(self, inputs: Inputs, rows: int) -> Inputs:
        """The inputs restricted to the first ``rows`` tokens (the correctness check's block)."""

    @abc.abstractmethod
    def reference(self, inputs: Inputs, quantities: tuple[str, ...]) -> Outputs:
        """The fp64 reference of ``quantities`` on (fp64 copies of) ``inputs``."""

    def upstream(self, inputs: Inputs, quantities: tuple[str, ...]) -> Outputs:
        """Fixed upstream gradients for ``fwd-bwd``: one per token of each quantity."""
        first = inputs[self.grad_inputs[0]]
        gen = torch.Generator(device=first.device).manual_seed(1234)
        return {q: torch.randn(first.shape[:-1], generator=gen, device=first.device)
                for q in quantities}

    def floor_flops(self, shape: dict[str, int], mode: str) -> float:
        """FLOPs of the plain GEMMs that bound this op from below (0 when there is none)."""
        return 0.0


class Provider:
    """One way of computing an op.

    ``forward`` returns per-token quantities (``logprobs``, ``entropy``, ...); in ``fwd-bwd``
    mode the harness back-propagates ``sum_k <upstream_k, out_k>`` into ``op.grad_inputs``.
    Providers whose step is not "forward then autograd" (the GEMM floor) override ``step``.
    """

    op: str = ""
    name: str = ""
    #: per-token quantities ``forward`` returns (keys of its output dict)
    quantities: tuple[str, ...] = ()
    #: runs its Triton kernels under ``TRITON_INTERPRET=1`` on CPU (slow; budgeted)
    interpreted_on_cpu: bool = False
    #: the floor row: no correctness check, and the ratio column's denominator
    is_floor: bool = False
    #: the distribution whose version the records carry
    package: str | None = None
    #: computes with the op's options (``Settings.options``); others are unavailable then
    takes_options: bool = False

    def unavailable(self, device: str, dtype: torch.dtype, mode: str) -> str | None:
        """Why this provider cannot run here, or None when it can."""
        return None

    def note(self, device: str) -> str:
        """Which implementation runs on ``device`` when that is worth saying (table, JSON)."""
        return "triton-interpret" if self.interpreted_on_cpu and device == "cpu" else ""

    def forward(self, inputs: Inputs) -> Outputs:
        """Per-token quantities; providers that time something else override ``step``."""
        raise TypeError(f"provider {self.name!r} has no forward: it computes through step()")

    def step(self, inputs: Inputs, mode: str, upstream: Outputs) -> None:
        """One timed unit of work: the forward, and in ``fwd-bwd`` mode its backward."""
        if mode == "fwd":
            with torch.no_grad():
                self.forward(inputs)
            return
        out = self.forward(inputs)
        loss = sum((out[k].float() * upstream[k]).sum() for k in out)
        loss.backward()


#: What each provider name computes, as the table's legend and ``--help`` say it.
DESCRIPTIONS = {
    "logitless": "logitless's op (linear_logprobs, policy_loss over it, linear_divergence, "
                 "attention_entropy)",
    "logitless-fused": "logitless.fused_policy_loss: the loss from hidden states, in chunks",
    "naive": "plain PyTorch: the full [N, V] logits (or T x T scores) materialised, then the "
             "formulas",
    "gemm": "the plain GEMMs of the same shapes and nothing else: the floor (1 GEMM forward, "
            "3 forward+backward)",
    "torch": "PyTorch's F.linear_cross_entropy (chunked): the logprob only, no entropy",
    "trl": "TRL's chunked fused head (logprobs, entropy) or chunked divergence",
    "liger": "Liger-Kernel's fused linear loss (cross-entropy, GRPO or JSD)",
    "cce": "Cut Cross-Entropy's linear_cross_entropy: the logprob only",
    "verl": "verl's fused linear_cross_entropy kernel (CUDA only)",
}


def describe_provider(name: str) -> str:
    return DESCRIPTIONS.get(name, "")


OPS: dict[str, Op] = {}
PROVIDERS: dict[str, list[Provider]] = {}
#: ops whose public API has not landed yet: name -> reason shown by the CLI
MISSING_OPS: dict[str, str] = {}

# Modules that register ops and providers, imported lazily so that `logitless check` does not
# pay for them.
_OP_MODULES = (
    "logitless.tools.bench.ops_logprobs",
    "logitless.tools.bench.ops_attention",
    "logitless.tools.bench.ops_policy",
    "logitless.tools.bench.ops_divergence",
)


def register_op(op: Op) -> Op:
    OPS[op.name] = op
    PROVIDERS.setdefault(op.name, [])
    return op


def register_provider(cls: Callable[[], Provider]) -> Callable[[], Provider]:
    provider = cls()
    PROVIDERS.setdefault(provider.op, []).append(provider)
    return cls


def load() -> None:
    for module in _OP_MODULES:
        importlib.import_module(module)


def get_op(name: str) -> Op:
    load()
    if name in MISSING_OPS:
        raise ValueError(f"op {name!r} is not available: {MISSING_OPS[name]}")
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; choose from {sorted(OPS) + sorted(MISSING_OPS)}")
    return OPS[name]


def get_providers(op: str, names: list[str] | None = None) -> list[Provider]:
    load()
    found = PROVIDERS.get(op, [])
    if names is None:
        return list(found)
    by_name = {p.name: p for p in found}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(
            f"unknown providers {unknown} for op {op!r}; choose from {sorted(by_name)}")
    return [by_name[n] for n in names]
