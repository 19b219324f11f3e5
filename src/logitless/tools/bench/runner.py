"""The sweep: every (shape, mode, provider), measured side by side, into one record per row.

On CPU each measurement runs in a child process (``child.py``) so that peak resident memory is
the provider's own; on CUDA they share this process (the allocator's peak is reset per row).
Providers that run their Triton kernels under the CPU interpreter get ``TRITON_INTERPRET=1`` in
their child, no warm-up (there is nothing to compile) and one repeat, and are skipped above a
token budget because the interpreter is orders of magnitude slower than the hardware.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

import torch

from logitless.tools.bench.child import MARKER
from logitless.tools.bench.measure import Figures, measure
from logitless.tools.bench.registry import Provider, get_op, get_providers
from logitless.tools.bench.shapes import label


@dataclass
class Settings:
    op: str
    shapes: list[dict[str, int]]
    modes: list[str]
    dtype: str = "float32"
    device: str = "cpu"
    providers: list[str] | None = None
    warmup: int = 1
    repeats: int = 3
    block_rows: int = 32
    isolate: bool | None = None  # default: on CPU
    interpret_max_tokens: int = 64
    timeout_s: float = 1800.0
    progress: bool = True
    #: op options passed to ``make_inputs`` (logprobs: the sampler's top_k/top_p/min_p)
    options: dict = field(default_factory=dict)


def versions(packages: list[str]) -> dict[str, str]:
    """The versions a record carries; torch's as torch reports it, with its build suffix
    (``2.11.0+cu130``): the distribution's metadata can leave the suffix out."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "logitless", *packages):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         platform.processor())
    except OSError:
        model = platform.processor()
    return f"{model} ({torch.get_num_threads()} threads)"


def run_sweep(settings: Settings, on_record=None) -> list[dict]:
    """Measure every row and return the records (see ``report.py`` for their fields).

    ``on_record(records_so_far)`` is called after each row (the CLI rewrites its JSON there, so
    a sweep cut short by a time limit still leaves its finished rows)."""
    op = get_op(settings.op)
    providers = get_providers(settings.op, settings.providers)
    isolate = settings.device == "cpu" if settings.isolate is None else settings.isolate
    common = {
        "op": op.name, "dtype": settings.dtype, "device": settings.device,
        "device_name": device_name(settings.device), "host": platform.node(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if settings.options:
        common["options"] = dict(settings.options)
    pkgs = sorted({p.package for p in providers if p.package})
    common["versions"] = versions([p for p in pkgs if p not in ("torch", "logitless")])
    rows = [(shape, mode, p) for shape in settings.shapes for mode in settings.modes
            for p in providers]
    records = []
    with _progress(len(rows), settings.progress) as bar:
        for shape, mode, provider in rows:
            bar.set_description(f"{provider.name} {label(shape)} {mode}")
            figures, warmup, repeats = _one(settings, provider, shape, mode, isolate)
            records.append({
                **common, "provider": provider.name, "mode": mode, "shape": dict(shape),
                "quantities": list(provider.quantities), "note": provider.note(settings.device),
                "warmup": warmup, "repeats": repeats, **figures.to_dict(),
            })
            bar.update(1)
            _floor_ratios(records, providers)
            if on_record is not None:
                on_record(records)
    return records


def _one(settings: Settings, provider: Provider, shape, mode, isolate):
    warmup, repeats = settings.warmup, settings.repeats
    interpreted = provider.interpreted_on_cpu and settings.device == "cpu"
    if interpreted:
        tokens = shape.get("tokens", 0)
        if tokens > settings.interpret_max_tokens:
            return Figures(status="skipped", reason=(
                f"Triton interpreter on CPU: runs only up to {settings.interpret_max_tokens} "
                f"tokens (--interpret-max-tokens)")), 0, 0
        warmup, repeats = 0, 1
    spec = {"op": settings.op, "provider": provider.name, "shape": shape, "mode": mode,
            "dtype": settings.dtype, "device": settings.device, "warmup": warmup,
            "repeats": repeats, "block_rows": settings.block_rows, "options": settings.options}
    if not isolate:
        op = get_op(settings.op)
        return measure(op, provider, shape, mode, getattr(torch, settings.dtype),
                       settings.device, warmup=warmup, repeats=repeats,
                       block_rows=settings.block_rows, options=settings.options), warmup, repeats
    env = dict(os.environ)
    if interpreted:
        env["TRITON_INTERPRET"] = "1"
    return _in_child(spec, env, settings.timeout_s), warmup, repeats


def _in_child(spec: dict, env: dict[str, str], timeout_s: float) -> Figures:
    cmd = [sys.executable, "-m", "logitless.tools.bench.child", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Figures(status="failed", reason=f"timed out after {timeout_s:.0f} s")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARKER):
            return Figures(**json.loads(line[len(MARKER):]))
    tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    return Figures(status="failed", reason=f"child exited {done.returncode}: {tail[-300:]}")


def _floor_ratios(records: list[dict], providers: list[Provider]) -> None:
    """Each row's median time over the plain GEMMs' median on the same shape and mode, by wall
    clock (``floor_ratio``) and, on CPU, by process CPU time (``floor_ratio_cpu``)."""
    floors = {p.name for p in providers if p.is_floor}
    for key, ratio in (("time_ms", "floor_ratio"), ("cpu_ms", "floor_ratio_cpu")):
        base = {(json.dumps(r["shape"], sort_keys=True), r["mode"]): r[key]["median"]
                for r in records if r["provider"] in floors and r.get(key)}
        for r in records:
            t = base.get((json.dumps(r["shape"], sort_keys=True), r["mode"]))
            r[ratio] = r[key]["median"] / t if t and r.get(key) else None


class _Plain:
    """A progress line on stderr for when tqdm is not installed (``show=False``: silent)."""

    def __init__(self, total: int, show: bool = True):
        self.total, self.done, self.desc, self.show = total, 0, "", show

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self._draw()

    def update(self, n: int) -> None:
        self.done += n
        self._draw()

    def _draw(self) -> None:
        if not self.show:
            return
        width = 24
        fill = width * self.done // max(1, self.total)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                         f"{self.desc:<60.60}")
        sys.stderr.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.show:
            sys.stderr.write("\n")


def _progress(total: int, show: bool):
    if not show:
        return _Plain(total, show=False)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(total)
    return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
