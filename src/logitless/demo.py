"""``logitless demo`` (after ``logitless check``): linear_logprobs beside plain PyTorch.

Forward+backward with entropy on a Qwen2.5-0.5B-sized head (D=896, V=151936) for 512 tokens,
fp32 on CPU: time and peak memory beyond the inputs and their gradients, each measured by
``logitless bench``'s machinery in a process of its own, and their ratios.
"""

from __future__ import annotations

from logitless.tools.bench.runner import Settings, run_sweep

SHAPE = {"tokens": 512, "hidden": 896, "vocab": 151936}
_MB = 2**20


def side_by_side(records: list[dict]) -> str:
    """Table of the naive and logitless rows of one shape, with logitless / naive ratios."""
    by = {r["provider"]: r for r in records}
    ours, naive = by["logitless"], by["naive"]
    lines = [f"{'':<16}{'time (median)':>16}{'peak MB':>12}{'max err vs fp64':>18}"]
    for name, r in (("naive PyTorch", naive), ("logitless", ours)):
        if r["status"] != "ok":
            lines.append(f"{name:<16}{r['status']}: {r['reason']}")
            continue
        err = max(r["errors"].values()) if r["errors"] else float("nan")
        lines.append(f"{name:<16}{r['time_ms']['median'] / 1e3:>15.2f}s"
                     f"{r['peak_bytes'] / _MB:>12.1f}{err:>18.1e}")
    if ours["status"] == naive["status"] == "ok":
        t = ours["time_ms"]["median"] / naive["time_ms"]["median"]
        m = ours["peak_bytes"] / max(naive["peak_bytes"], 1)
        lines.append(f"{'logitless/naive':<16}{t:>15.2f}x{m:>11.3f}x")
    return "\n".join(lines)


def run_demo() -> int:
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    print(f"\nlinear_logprobs forward+backward with entropy vs naive PyTorch (materialised "
          f"logits), fp32, CPU, {shape}\npeak MB: above the inputs and their gradients, each "
          f"provider in its own process (about a minute)")
    records = run_sweep(Settings(op="logprobs", shapes=[SHAPE], modes=["fwd-bwd"],
                                 providers=["naive", "logitless"], warmup=0, repeats=2))
    print(side_by_side(records))
    print("more: logitless bench --op logprobs --device cpu --preset qwen-small")
    status = 0 if all(r["status"] == "ok" for r in records) else 1
    from logitless.demo_trl import run_trl_demo

    return run_trl_demo() or status
