"""``logitless check``: every op against the fp64 reference on each device present.

Each check yields rows ``(op, backend, device, dtype, shape, quantity, max_abs, max_rel, ok)``.
fp32 must match the fp64 reference to a fixed tolerance; bf16/fp16 pass the three-way test
(``|ours - fp64| <= |same-dtype torch - fp64| + tol``), so a reduced-precision result is held
to exactly the standard of the plain PyTorch computation it replaces.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from logitless import reference
from logitless.fused_losses.logprobs import linear_logprobs


@dataclass
class CheckRow:
    op: str
    backend: str
    device: str
    dtype: str
    shape: str
    quantity: str
    max_abs: float
    max_rel: float
    ok: bool


# fp32 verdict: max |ours - fp64| <= FP32_TOL * (1 + max |fp64|), normwise over the tensor.
FP32_TOL = 2e-5
# Added to the same-dtype error in the three-way test, relative to the quantity's scale.
REDUCED_TOL = 1e-2


def devices() -> list[str]:
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


def backends(device: str) -> list[str]:
    if device != "cpu":
        return ["triton"]
    found = ["torch"]
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        found.append("triton")
    return found


def dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16, torch.float16]


def compare(ours, oracle, same, dtype) -> tuple[float, float, bool]:
    """Errors of ``ours`` against the fp64 ``oracle``, and the verdict for ``dtype``."""
    ours, oracle = ours.detach().double().cpu(), oracle.detach().double().cpu()
    err = (ours - oracle).abs()
    scale = oracle.abs().max().clamp_min(1e-30)
    max_abs = float(err.max()) if err.numel() else 0.0
    max_rel = float((err / oracle.abs().clamp_min(float(scale) * 1e-3)).max()) if err.numel() \
        else 0.0
    if dtype == torch.float32:
        ok = max_abs <= FP32_TOL * (1.0 + float(scale))
    else:
        bound = (same.detach().double().cpu() - oracle).abs() + REDUCED_TOL * float(scale)
        ok = bool((err <= bound).all())
    return max_abs, max_rel, ok


def check_linear_logprobs(device: str, backend: str, dtype: torch.dtype) -> Iterator[CheckRow]:
    """Forward and backward of ``linear_logprobs`` with every statistic and transform on."""
    for n, d, v in ((37, 96, 1007), (5, 64, 4099)):
        yield from _check_linear_logprobs_shape(device, backend, dtype, n, d, v)


def _check_linear_logprobs_shape(device, backend, dtype, n, d, v) -> Iterator[CheckRow]:
    gen = torch.Generator().manual_seed(n * 1000 + v)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5 * 2
    bias = torch.randn(v, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::7] = -100
    up = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(3)]
    opts = dict(temperature=0.9, softcap=8.0)

    def run(h, w, b, fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
        vals = fn(*leaves)
        loss = sum((x.double() * u).sum() for x, u in zip(vals, up))
        return vals, torch.autograd.grad(loss, leaves)

    def ours(h, w, b):
        o = linear_logprobs(h, w, targets.to(device), bias=b, return_entropy=True,
                            stats=("sum_p_sq",), **opts)
        return o.logprobs, o.entropy, o.sum_p_sq

    def plain(h, w, b):
        r = reference.linear_softmax_stats(h, w, targets.to(device), b, **opts)
        return r["logprobs"], r["entropy"], r["sum_p_sq"]

    to = lambda t, dt: t.to(device=device, dtype=dt)
    args = [to(t, dtype) for t in (hidden, weight, bias)]
    previous = os.environ.get("LOGITLESS_BACKEND")
    os.environ["LOGITLESS_BACKEND"] = backend
    try:
        got, got_g = run(*args, ours)
    finally:
        if previous is None:
            os.environ.pop("LOGITLESS_BACKEND")
        else:
            os.environ["LOGITLESS_BACKEND"] = previous
    same, same_g = run(*args, plain)
    exact, exact_g = run(*(to(t, torch.float64) for t in (hidden, weight, bias)), plain)
    names = ("logprobs", "entropy", "sum_p_sq", "d_hidden", "d_weight", "d_bias")
    for name, a, e, s in zip(names, (*got, *got_g), (*exact, *exact_g), (*same, *same_g)):
        max_abs, max_rel, ok = compare(a, e, s, dtype)
        yield CheckRow("linear_logprobs", backend, device, str(dtype).replace("torch.", ""),
                       f"N={n} D={d} V={v}", name, max_abs, max_rel, ok)


CHECKS: list[Callable[[str, str, torch.dtype], Iterator[CheckRow]]] = [check_linear_logprobs]


def run_checks() -> list[CheckRow]:
    rows = []
    for device in devices():
        for backend in backends(device):
            for dtype in dtypes(device):
                for check in CHECKS:
                    rows.extend(check(device, backend, dtype))
    return rows


def format_table(rows: list[CheckRow]) -> str:
    head = ("op", "backend", "device", "dtype", "shape", "quantity", "max abs err",
            "max rel err", "verdict")
    body = [(r.op, r.backend, r.device, r.dtype, r.shape, r.quantity, f"{r.max_abs:.2e}",
             f"{r.max_rel:.2e}", "ok" if r.ok else "FAIL") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])
