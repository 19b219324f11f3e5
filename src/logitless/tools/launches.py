"""What a region of eager code would launch on CUDA, counted on any device: `LaunchCount`, a
``TorchDispatchMode`` that counts the compute aten ops and the Triton kernel launches of the
code run under it, and flags what reads a value back to the host or makes a tensor from Python
data (on CUDA: a stream synchronisation, or a host-to-device copy the stream waits for).

Used by the fused loss's chunk-loop tests and by ``benchmarks/chunk_ops.py`` (the figure
``gpu_plan.OBJECTIVE_LAUNCHES`` comes from). Under ``TRITON_INTERPRET=1`` each Triton kernel
call counts as one launch and the interpreter's own copies of its arguments are left out: on
CUDA they do not exist.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READS", "PYTHON_DATA", "LaunchCount"]

# Ops that launch nothing: views, allocations, metadata.
_FREE = frozenset((
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
    "alias", "lift_fresh", "lift_fresh_copy", "set_", "resize_", "_unsafe_view",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
))
# Ops that read a tensor's value on the host: on CUDA each waits for the stream.
HOST_READS = frozenset(("_local_scalar_dense", "item", "is_nonzero", "equal"))
# Ops that make a tensor from Python data (``torch.tensor(...)``, an index by a Python list):
# on CUDA a host-to-device copy.
PYTHON_DATA = frozenset(("lift_fresh", "lift_fresh_copy"))


def _packet(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


class LaunchCount(TorchDispatchMode):
    """Counts, while active: ``ops`` (compute aten ops by name, views, allocations and
    metadata excluded), ``triton`` (Triton kernel launches by kernel, when they run under the
    interpreter), ``host`` (host reads) and ``python_data`` (tensors made from Python data).
    `launches` is ``ops`` and ``triton`` together: on CUDA, one kernel launch each."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.triton = collections.Counter()
        self.host = collections.Counter()
        self.python_data = collections.Counter()
        self._inside_kernel = 0
        self._patch = contextlib.ExitStack()

    @property
    def launches(self) -> int:
        return sum(self.ops.values()) + sum(self.triton.values())

    def __enter__(self):
        self._patch.__enter__()
        self._patch_interpreter()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patch.__exit__(*exc)

    def _patch_interpreter(self) -> None:
        """Each interpreted Triton kernel call: one launch, its argument copies not counted."""
        try:
            from triton.runtime import interpreter
        except ImportError:
            return
        executor = interpreter.GridExecutor
        run = executor.__call__
        counter = self

        def counted(grid_executor, *args, **kwargs):
            counter.triton[getattr(grid_executor.fn, "__name__", "kernel")] += 1
            counter._inside_kernel += 1
            try:
                return run(grid_executor, *args, **kwargs)
            finally:
                counter._inside_kernel -= 1

        executor.__call__ = counted
        self._patch.callback(setattr, executor, "__call__", run)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside_kernel:
            name = _packet(func)
            if name in HOST_READS:
                self.host[str(func)] += 1
            if name in PYTHON_DATA:
                self.python_data[str(func)] += 1
            is_view = getattr(func, "is_view", False)
            if not (is_view or name in _FREE or name in HOST_READS):
                self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        return {"launches": self.launches, "host_reads": sum(self.host.values()),
                "python_data": sum(self.python_data.values()), "ops": dict(self.ops),
                "triton": dict(self.triton)}

    def __sub__(self, other: LaunchCount) -> dict:
        """What this count has beyond ``other``'s (e.g. a run with one chunk more)."""
        return {"launches": self.launches - other.launches,
                "host_reads": sum(self.host.values()) - sum(other.host.values()),
                "python_data": sum(self.python_data.values()) - sum(other.python_data.values()),
                "ops": dict((self.ops - other.ops).most_common()),
                "triton": dict(self.triton - other.triton)}


# --- the fused loss's chunk loop ------------------------------------------------------------

CHUNK_CONFIGS = {  # the configurations `extra_chunk` is measured on
    "grpo": dict(objective="grpo"),
    "grpo-kl-entropy": dict(objective="grpo", beta=0.04, entropy_coef=0.01),
}


def fused_call_count(chunks: int, config: str = "grpo", compiled: bool = True, b: int = 6,
                     t: int = 16, d: int = 32, v: int = 500) -> LaunchCount:
    """`LaunchCount` of one ``fused_policy_loss`` forward and backward on a ``[b, t]`` batch
    split into ``chunks`` chunks (the memory budget set to fit ``ceil(b / chunks)`` sequences
    on the store ``fused_policy_loss`` picks for CPU tensors: the Triton one under
    ``LOGITLESS_BACKEND=triton TRITON_INTERPRET=1``, the path that runs on CUDA).

    ``compiled``: the chunk objective compiled as on CUDA (``fused.chunk_objective.COMPILE``, here
    with inductor's C++ backend); a ``TorchDispatchMode`` cannot see into compiled code (and
    torch.compile runs eagerly under one), so each compiled call runs with the mode set aside
    and counts as the kernels inductor generated for its graph (``chunk_objective.KERNELS``).
    Otherwise the eager objective, op by op."""
    import logitless
    from logitless.fused_losses.fused.plan import store_type

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, t, d, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    old = -torch.rand(b, t, generator=g) * 3
    ref = old - 0.1 * torch.rand(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    rows_per_chunk = -(-b // chunks) * t
    budget = rows_per_chunk * store_type(hidden.device, hidden.dtype).bytes_per_row(
        v, torch.bfloat16, None, hidden_size=d)
    cfg = logitless.PolicyLossConfig(**CHUNK_CONFIGS[config])
    count = LaunchCount()
    with _objective_compiled(compiled, count), count:
        loss, _ = logitless.fused_policy_loss(hidden, weight, targets, old, adv, mask, cfg,
                                              ref_logprobs=ref if cfg.beta else None,
                                              max_tile_bytes=budget, strategy="chunked")
        loss.backward()
    return count


@contextlib.contextmanager
def _objective_compiled(on: bool, count: LaunchCount):
    from torch.utils._python_dispatch import _disable_current_modes

    from logitless.fused_losses.fused import chunk_objective

    run, forced = chunk_objective.run_compiled, chunk_objective.COMPILE

    def counted(args, leaves):
        with _disable_current_modes():
            out = run(args, leaves)
        count.ops["inductor kernels (compiled chunk objective)"] += chunk_objective.KERNELS
        count.ops["autograd's seed of the compiled backward (ones_like)"] += 1
        return out

    chunk_objective.COMPILE, chunk_objective.run_compiled = on, counted
    try:
        yield
    finally:
        chunk_objective.COMPILE, chunk_objective.run_compiled = forced, run


def extra_chunk(config: str = "grpo", compiled: bool = True, chunks: int = 2) -> dict:
    """What one more chunk of the same batch adds (`LaunchCount.__sub__`): ``chunks + 1``
    chunks against ``chunks``, after a first call that does what is done once per process
    (compiling, a device probe)."""
    fused_call_count(chunks, config, compiled)
    return (fused_call_count(chunks + 1, config, compiled)
            - fused_call_count(chunks, config, compiled))


# --- the sampler's forward ------------------------------------------------------------------

def sampler_call_count(chunks: int, rows: int = 2, d: int = 16, v: int = 300) -> LaunchCount:
    """`LaunchCount` of the sampler's top-p forward (``kernels.sampler.forward``, vLLM's rules,
    top-p 0.9, bf16 as at the reference shape) over ``chunks`` chunks of ``rows`` rows: the
    CUDA path's passes and merges, run under ``TRITON_INTERPRET=1`` on CPU tensors."""
    from logitless.kernels import sampler
    from logitless.kernels.sampler_torch import RowParams

    g = torch.Generator().manual_seed(0)
    n = chunks * rows
    hidden = torch.randn(n, d, generator=g).bfloat16()
    weight = (torch.randn(v, d, generator=g) / d**0.5).bfloat16()
    targets = torch.randint(0, v, (n,), generator=g)
    params = RowParams(torch.ones(n), top_p=torch.full((n,), 0.9, dtype=torch.float64))
    # the chunk's logits and their tempered fp32 copy: 6 bytes a column
    budget = rows * 6 * v
    assert sampler.rows_per_chunk(v, budget, hidden.dtype, None) == rows
    with LaunchCount() as count:
        sampler.forward(hidden, weight, None, targets, params, softcap=None, logit_scale=1.0,
                        tile_bytes=budget)
    return count


def sampler_extra_chunk(chunks: int = 2) -> dict:
    """What one more chunk of the sampler's top-p forward adds (``chunks + 1`` chunks against
    ``chunks``): the figure ``gpu_plan.SAMPLER_ROW_OPS`` (its torch ops and the merge launch)
    comes from."""
    return sampler_call_count(chunks + 1) - sampler_call_count(chunks)
