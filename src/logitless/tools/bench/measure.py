"""One measurement: a provider's time, peak memory and error on one shape, in this process.

Memory is the peak above the inputs. On CUDA it is the allocator's peak
(``torch.cuda.max_memory_allocated``) minus what was allocated before the step. On CPU it is
the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` after the
warm-up, so compilation and first-call caches do not count) minus the resident set before the
step, after returning freed heap memory to the system (``malloc_trim``) so that memory kept by
the allocator from the warm-up cannot hide the step's own allocations. Gradients of the inputs
are the same size for every provider; they are reported separately and subtracted from the
headline figure ("beyond inputs and gradients").
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from logitless.tools.bench.registry import Inputs, Op, Provider


@dataclass
class Figures:
    status: str = "ok"  # ok | unavailable | failed
    reason: str = ""
    time_ms: dict[str, float] | None = None  # median, p20, p80
    # CPU only: process CPU time (all threads) per call, median/p20/p80; on a machine shared
    # with other jobs it moves less than the wall-clock time.
    cpu_ms: dict[str, float] | None = None
    peak_bytes: int | None = None  # above inputs, beyond the inputs' gradients
    above_inputs_bytes: int | None = None  # above inputs, gradients included
    grad_bytes: int = 0
    errors: dict[str, float] = field(default_factory=dict)
    timer: str = ""
    memory_probe: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def quantiles(samples_ms: list[float]) -> dict[str, float]:
    """Median, 20th and 80th percentile (linear interpolation) of the samples."""
    xs = sorted(samples_ms)
    if len(xs) == 1:
        return {"median": xs[0], "p20": xs[0], "p80": xs[0]}
    cuts = statistics.quantiles(xs, n=10, method="inclusive")
    return {"median": statistics.median(xs), "p20": cuts[1], "p80": cuts[7]}


class CpuMemory:
    """Peak resident memory of this process around one call."""

    def __init__(self):
        self.resettable = _reset_peak_rss()
        self.name = "VmHWM after clear_refs" if self.resettable else "ru_maxrss"

    def start(self) -> None:
        gc.collect()
        _malloc_trim()
        if self.resettable:
            _reset_peak_rss()
            self.base = _status_bytes("VmRSS")
        else:
            # No reset available: the high-water mark so far is the baseline, so the step only
            # shows when it goes above everything before it (an underestimate, said in the JSON).
            self.base = _maxrss_bytes()

    def peak(self) -> int:
        now = _status_bytes("VmHWM") if self.resettable else _maxrss_bytes()
        return max(0, now - self.base)


class _CudaMemory:
    name = "torch.cuda.max_memory_allocated"

    def __init__(self, device):
        self.device = device

    def start(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        # Rows share the process on CUDA: hand back what earlier rows left cached, so that
        # every row starts from the same allocator state.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") > 0
    except OSError:
        return False


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def prepare(op: Op, provider: Provider, inputs: Inputs, mode: str):
    """Leaves that take gradients, and the op's fixed upstream gradients."""
    leaves = []
    if mode == "fwd-bwd" and not provider.is_floor:
        for name in op.grad_inputs:
            inputs[name].requires_grad_(True)
            leaves.append(inputs[name])
    upstream = op.upstream(inputs, provider.quantities) if mode == "fwd-bwd" else {}
    return leaves, upstream


def _clear(leaves) -> None:
    for t in leaves:
        t.grad = None


def _time_cpu(run) -> tuple[float, float]:
    """Wall-clock and process CPU time of one call, in ms."""
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def _time_cuda(run, repeats: int, leaves) -> tuple[dict[str, float], str]:
    try:
        from triton.testing import do_bench
    except ImportError:
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        return quantiles(samples), "cuda events"
    # do_bench flushes L2 between calls and sizes its loop to `rep` milliseconds.
    med, p20, p80 = do_bench(run, warmup=25, rep=max(100, 20 * repeats), grad_to_none=leaves,
                             quantiles=[0.5, 0.2, 0.8])
    return {"median": med, "p20": p20, "p80": p80}, "triton.testing.do_bench"


def measure(op: Op, provider: Provider, shape: dict[str, int], mode: str, dtype: torch.dtype,
            device: str, *, warmup: int, repeats: int, block_rows: int,
            seed: int = 0, options: dict | None = None) -> Figures:
    """Time, memory and error of ``provider`` on ``shape``; never raises for provider errors.
    ``options``: the op's options (``make_inputs`` keywords), which a provider must support."""
    why = provider.unavailable(device, dtype, mode)
    if why is None and options and not (provider.is_floor or provider.takes_options):
        why = f"does not compute with the options {options}"
    if why is None and provider.interpreted_on_cpu and device == "cpu" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        why = ("Triton kernels only: on CPU they need TRITON_INTERPRET=1 set before the process "
               "starts (the runner sets it in its child processes)")
    if why is None and mode not in op.modes:
        why = f"op {op.name!r} has no {mode!r} mode"
    if why is not None:
        return Figures(status="unavailable", reason=why)
    try:
        return _measure(op, provider, shape, mode, dtype, device, warmup=warmup,
                        repeats=repeats, block_rows=block_rows, seed=seed,
                        options=options or {})
    except Exception as err:  # a peer failing on this device is a result, not a crash
        msg = " ".join(str(err).split())
        return Figures(status="failed", reason=f"{type(err).__name__}: {msg[:300]}")


def _measure(op, provider, shape, mode, dtype, device, *, warmup, repeats, block_rows, seed,
             options):
    inputs = op.make_inputs(shape, dtype, device, seed, **options)
    leaves, upstream = prepare(op, provider, inputs, mode)

    def run():
        provider.step(inputs, mode, upstream)
        _clear(leaves)

    is_cuda = device.startswith("cuda")
    for _ in range(warmup):
        run()
    probe = _CudaMemory(device) if is_cuda else CpuMemory()
    figures = Figures(memory_probe=probe.name)
    if mode == "fwd-bwd":
        figures.grad_bytes = sum(inputs[k].nbytes for k in op.grad_inputs)
    # The memory step: one call, leaving the gradients in place so that the peak includes them
    # exactly as a trainer sees it.
    probe.start()
    first = _time_cpu(lambda: provider.step(inputs, mode, upstream))
    figures.above_inputs_bytes = probe.peak()
    figures.peak_bytes = max(0, figures.above_inputs_bytes - figures.grad_bytes)
    _clear(leaves)
    if is_cuda:
        figures.time_ms, figures.timer = _time_cuda(run, repeats, leaves)
    else:
        # The memory step was a full call after warm-up: it counts as the first repeat.
        samples = [first, *(_time_cpu(run) for _ in range(repeats - 1))]
        figures.time_ms = quantiles([wall for wall, _ in samples])
        figures.cpu_ms = quantiles([cpu for _, cpu in samples])
        figures.timer = "time.perf_counter (cpu_ms: time.process_time)"
    if not provider.is_floor:
        figures.errors = block_errors(op, provider, inputs, mode, block_rows)
    return figures


#: rows of the fp64 reference at a time, for ops whose tokens are independent
REF_CHUNK_ROWS = 1024


def block_errors(op: Op, provider: Provider, inputs: Inputs, mode: str, rows: int,
                 ref_chunk_rows: int = REF_CHUNK_ROWS) -> dict[str, float]:
    """Max abs error of each quantity (and, in fwd-bwd, each input gradient) against the fp64
    reference, on the first ``rows`` tokens (all of them when ``rows`` covers the shape).

    For ops whose tokens are independent (``op.row_separable``) the reference runs over
    ``ref_chunk_rows`` rows at a time, summing the weight gradient over chunks, so the error
    can be measured at a timed shape whose fp64 logits would not fit at once."""
    block = {k: v.detach() for k, v in op.first_block(inputs, rows).items()}
    grads = mode == "fwd-bwd"
    got_leaves = [block[k].clone().requires_grad_(grads) for k in op.grad_inputs]
    block.update(zip(op.grad_inputs, got_leaves))
    with torch.set_grad_enabled(grads):
        got = provider.forward(block)
    up = op.upstream(block, tuple(got)) if grads else {}
    if op.row_separable:  # every input but the head is indexed by token along dim 0
        n = next(iter(got.values())).shape[0]
        chunks = [slice(lo, lo + ref_chunk_rows) for lo in range(0, n, ref_chunk_rows)]
    else:
        chunks = [None]

    def rows(t, chunk, name=""):
        return t.detach() if chunk is None or name == "weight" else t.detach()[chunk]

    ref_out: dict[str, list[torch.Tensor]] = {q: [] for q in got}
    ref_grads: dict[str, list[torch.Tensor] | torch.Tensor] = {}
    for chunk in chunks:
        part = {k: rows(v, chunk, k) for k, v in block.items()}
        exact = {k: v.double() if v.is_floating_point() else v for k, v in part.items()}
        leaves = [exact[k].requires_grad_(grads) for k in op.grad_inputs]
        with torch.set_grad_enabled(grads):
            ref = op.reference(exact, tuple(got))
        for q in got:
            ref_out[q].append(ref[q].detach())
        if grads:
            g = torch.autograd.grad(
                sum((ref[q] * rows(up[q], chunk).double()).sum() for q in ref), leaves)
            for name, gi in zip(op.grad_inputs, g):
                if name == "weight":  # shared by every row: summed over the chunks
                    ref_grads[name] = gi if name not in ref_grads else ref_grads[name] + gi
                else:
                    ref_grads.setdefault(name, []).append(gi)
    def join(parts):  # one chunk: as it is (a scalar loss cannot be concatenated)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    errors = {q: _max_abs(got[q], join(ref_out[q])) for q in got}
    if grads:
        got_g = torch.autograd.grad(sum((got[q].float() * up[q]).sum() for q in got), got_leaves)
        for name, a in zip(op.grad_inputs, got_g):
            b = ref_grads[name]
            errors[f"d_{name}"] = _max_abs(a, b if name == "weight" else join(b))
    return errors


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())
