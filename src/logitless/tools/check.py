"""``logitless check``: every public op against the fp64 reference, on each backend present.

Ops: ``linear_logprobs`` (every statistic and the gradients of hidden, weight and bias),
``sampled_logprobs`` (``linear_logprobs`` with vLLM's top-k, top-p, min-p truncations),
``policy_loss`` (loss, gradients of the logprobs and entropies), ``fused_policy_loss`` (loss,
gradients of the head) and ``attention_entropy``, each in a few cases that switch its options
on. Backends: the torch twins (``LOGITLESS_BACKEND=torch``) and the Triton kernels
(``LOGITLESS_BACKEND=triton``; on CPU under ``TRITON_INTERPRET=1``).

Every op runs on inputs drawn in fp64 and rounded to the dtype under test; the oracle is
``logitless.reference`` on those same rounded values in fp64. fp32 must match it to
``FP32_TOL * (1 + max |oracle|)``; bf16/fp16 pass the three-way test
(``|ours - fp64| <= |same-dtype reference - fp64| + REDUCED_TOL * max |oracle|``, elementwise),
so a reduced-precision result is held to the standard of the plain PyTorch it replaces.
Shapes are chosen to span several tiles of each implementation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace

import torch

from logitless.tools.check_cases import CASES, TILE_BYTES, Case, Shape  # noqa: F401

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# fp32 verdict: max |ours - fp64| <= FP32_TOL * (1 + max |fp64|), normwise over the tensor.
FP32_TOL = 2e-5
# Added to the same-dtype error in the three-way test, relative to the quantity's scale.
REDUCED_TOL = 1e-2


@dataclass
class CheckRow:
    op: str
    case: str
    backend: str
    device: str
    dtype: str
    shape: str
    quantity: str
    max_abs: float
    max_rel: float
    ok: bool
    error: str = ""  # the exception a case raised (its one row then fails)


def present_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def default_backends(device: str) -> list[str]:
    """The backends checked by default: both on CUDA; on CPU the torch twin, and the Triton
    kernels too when the interpreter is on (``TRITON_INTERPRET=1``)."""
    if device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return ["torch", "triton"]
    return ["torch"]


@contextmanager
def use_backend(backend: str):
    """``LOGITLESS_BACKEND=backend`` for the duration (the library reads it at each call)."""
    previous = os.environ.get("LOGITLESS_BACKEND")
    os.environ["LOGITLESS_BACKEND"] = backend
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LOGITLESS_BACKEND")
        else:
            os.environ["LOGITLESS_BACKEND"] = previous


def compare(ours, oracle, same, dtype) -> tuple[float, float, bool]:
    """Errors of ``ours`` against the fp64 ``oracle``, and the verdict for ``dtype`` (``same``,
    the same-dtype reference, is read for bf16/fp16 only)."""
    ours, oracle = ours.detach().double().cpu(), oracle.detach().double().cpu()
    if ours.shape != oracle.shape:
        return float("inf"), float("inf"), False
    err = (ours - oracle).abs()
    if not err.numel():
        return 0.0, 0.0, True
    scale = float(oracle.abs().max().clamp_min(1e-30))
    max_abs = float(err.max())
    max_rel = float((err / oracle.abs().clamp_min(scale * 1e-3)).max())
    if dtype == torch.float32:
        ok = max_abs <= FP32_TOL * (1.0 + scale)
    else:
        bound = (same.detach().double().cpu() - oracle).abs() + REDUCED_TOL * scale
        ok = bool((err <= bound).all())
    return max_abs, max_rel, ok


def _evaluate(fn, case: Case, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``fn``'s outputs and the gradients of its leaves (``d_<leaf>``) on the case's inputs in
    ``dtype`` on ``device``."""
    args = {}
    for key, value in case.inputs.items():
        value = value.to(device=device, dtype=dtype) if value.is_floating_point() else \
            value.to(device)
        args[key] = value.requires_grad_(True) if key in case.leaves else value
    outs = fn(**args)
    result = {k: v.detach() for k, v in outs.items()}
    if case.leaves:
        loss = sum((outs[k].double() * u.to(device)).sum() for k, u in case.upstream.items())
        leaves = [args[k] for k in case.leaves]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        for key, leaf, g in zip(case.leaves, leaves, grads):
            result[f"d_{key}"] = torch.zeros_like(leaf) if g is None else g
    return result


def run_case(case: Case, device: str, backend: str, dtype: torch.dtype) -> Iterator[CheckRow]:
    rounded = {k: v.to(dtype).double() if v.is_floating_point() else v
               for k, v in case.inputs.items()}
    rounded_case = replace(case, inputs=rounded)
    with use_backend(backend):
        got = _evaluate(case.ours, rounded_case, device, dtype)
    exact = _evaluate(case.plain, rounded_case, "cpu", torch.float64)
    same = None if dtype == torch.float32 else _evaluate(case.plain, rounded_case, device, dtype)
    for name, want in exact.items():
        ours = got.get(name, torch.full((), float("nan")))
        max_abs, max_rel, ok = compare(ours, want, None if same is None else same[name], dtype)
        yield CheckRow(case.op, case.name, backend, device, str(dtype).replace("torch.", ""),
                       case.shape, name, max_abs, max_rel, ok)


def iter_checks(
    *,
    devices: list[str] | None = None,
    backends: list[str] | None = None,
    dtypes: list[str] | None = None,
    ops: list[str] | None = None,
    shape: Shape | None = None,
) -> Iterator[CheckRow]:
    """Rows of every case of ``ops`` (default all) on each device, backend and dtype (defaults:
    :func:`present_devices`, :func:`default_backends`, all of ``DTYPES``), each case's rows
    as soon as it is done. A case that raises gives one failing row naming the exception, and
    the cases after it still run."""
    shape = shape or Shape()
    for device in devices or present_devices():
        for backend in backends or default_backends(device):
            for dtype in dtypes or list(DTYPES):
                for op in ops or list(CASES):
                    for case in CASES[op](shape):
                        if case.dtypes is not None and dtype not in case.dtypes:
                            continue
                        try:
                            rows = list(run_case(case, device, backend, DTYPES[dtype]))
                        except Exception as err:
                            rows = [CheckRow(case.op, case.name, backend, device, dtype,
                                             case.shape, "(case)", float("nan"), float("nan"),
                                             False, f"{type(err).__name__}: {err}")]
                        yield from rows


def run_checks(**kwargs) -> list[CheckRow]:
    """All of :func:`iter_checks`'s rows, as a list."""
    return list(iter_checks(**kwargs))


_COLUMNS = (("op", 20), ("case", 26), ("backend", 7), ("device", 6), ("dtype", 8),
            ("shape", 22), ("quantity", 16), ("max abs err", 11), ("max rel err", 11),
            ("verdict", 7))


def _cells(r: CheckRow) -> tuple:
    verdict = "ERROR" if r.error else ("ok" if r.ok else "FAIL")
    cells = (r.op, r.case, r.backend, r.device, r.dtype, r.shape, r.quantity,
             f"{r.max_abs:.2e}", f"{r.max_rel:.2e}", verdict)
    return (*cells, r.error.splitlines()[0][:200] if r.error else "")


def format_row(r: CheckRow) -> str:
    """One row in the streamed table's fixed columns (a longer cell widens its own line)."""
    cells = _cells(r)
    text = "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, _COLUMNS))
    return (text + ("  " + cells[-1] if cells[-1] else "")).rstrip()


def format_header() -> str:
    head = "  ".join(name.ljust(w) for name, w in _COLUMNS).rstrip()
    return head + "\n" + "  ".join("-" * w for _, w in _COLUMNS)


def format_table(rows: list[CheckRow]) -> str:
    head = ("op", "case", "backend", "device", "dtype", "shape", "quantity", "max abs err",
            "max rel err", "verdict")
    body = [_cells(r)[:-1] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", nargs="+", choices=("cpu", "cuda"),
                   help="default: cpu, and cuda when present")
    p.add_argument("--backend", nargs="+", choices=("torch", "triton"),
                   help="default: both on CUDA; on CPU torch (and triton when TRITON_INTERPRET=1 "
                   "is set); triton on CPU runs under the Triton interpreter (slow: minutes)")
    p.add_argument("--dtype", nargs="+", choices=tuple(DTYPES), help="default: all three")
    p.add_argument("--op", nargs="+", choices=tuple(CASES), help="default: every op")
    for f in fields(Shape):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default,
                       dest=f.name, help=f"default {f.default}")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")


def _interpreted_rows(args: argparse.Namespace) -> Iterator[CheckRow]:
    """The CPU Triton rows, from a child process started with ``TRITON_INTERPRET=1`` (Triton
    reads it when the kernels are first imported), each as the child prints it."""
    argv = [sys.executable, "-m", "logitless.tools.cli", "check", "--device", "cpu", "--backend",
            "triton", "--json"]
    for name in ("dtype", "op"):
        if getattr(args, name):
            argv += [f"--{name}", *getattr(args, name)]
    for f in fields(Shape):
        argv += [f"--{f.name.replace('_', '-')}", str(getattr(args, f.name))]
    with subprocess.Popen(argv, env={**os.environ, "TRITON_INTERPRET": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        for line in child.stdout:
            if line.startswith("{"):
                yield CheckRow(**json.loads(line))
        err = child.stderr.read()
    if child.returncode not in (0, 1):
        raise RuntimeError(f"the Triton interpreter's check failed to run:\n{err}")


def run(args: argparse.Namespace) -> int:
    """``logitless check``: the table (or JSON rows) and the exit status, 1 on any failure."""
    try:
        shape = Shape(**{f.name: getattr(args, f.name) for f in fields(Shape)})
    except ValueError as err:
        print(f"logitless check: {err}", file=sys.stderr)
        return 2
    devices = args.device or present_devices()
    if "cuda" in devices and not torch.cuda.is_available():
        print("logitless check: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if not args.json:
        print(format_header(), flush=True)
    passed = failed = 0
    for device in devices:
        for backend in args.backend or default_backends(device):
            if backend == "triton" and importlib.util.find_spec("triton") is None:
                print("logitless check: --backend triton, but Triton is not installed",
                      file=sys.stderr)
                return 2
            if device == "cpu" and backend == "triton" and \
                    os.environ.get("TRITON_INTERPRET") != "1":
                rows = _interpreted_rows(args)
            else:
                rows = iter_checks(devices=[device], backends=[backend], dtypes=args.dtype,
                                   ops=args.op, shape=shape)
            for row in rows:
                passed, failed = passed + row.ok, failed + (not row.ok)
                print(json.dumps(asdict(row)) if args.json else format_row(row), flush=True)
    if not args.json:
        print(f"\n{passed} passed, {failed} failed")
    return 1 if failed else 0
