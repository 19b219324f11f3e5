"""Attention entropy on CPU: logitless' chunked torch path against the eager computation.

Side by side in one run, each method in a fresh child process (so one's high-water mark cannot
hide the other's): peak resident memory above the inputs (``ru_maxrss`` after vs before the
first call, inputs already allocated and touched) and the median wall time of a few calls.

- ``eager``: what one writes with materialised probabilities, as eager attention does:
  ``s = scale * q k^T`` (``[B, H, T, T]``), causal mask, ``p = softmax(s)`` in fp32, and
  ``H = sum entr(p)``.
- ``logitless``: ``logitless.attention_entropy`` with ``LOGITLESS_BACKEND=torch``.

Usage: ``python benchmarks/attention_entropy_cpu.py [--t 4096] [--heads 8] [--kv-heads 8]
[--dim 128] [--repeats 3]``. Inputs are fp32 (CPU bf16 matmuls are slow and not what the
comparison is about). The two results are checked against each other.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def _inputs(args) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, args.t, args.dim, generator=gen)
    k = torch.randn(1, args.kv_heads, args.t, args.dim, generator=gen)
    return q, k


def _eager(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool).triu_(1)
    s.masked_fill_(causal, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32)
    return torch.special.entr(p).sum(-1)


def _logitless(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    import logitless

    return logitless.attention_entropy(q, k, causal=True)


def _child(args) -> None:
    os.environ["LOGITLESS_BACKEND"] = "torch"
    fn = {"eager": _eager, "logitless": _logitless}[args.child]
    import logitless  # noqa: F401  (import cost outside the measurement)

    q, k = _inputs(args)
    q.add_(0), k.add_(0)  # touch the pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        t0 = time.perf_counter()
        out = fn(q, k)
        times = [time.perf_counter() - t0]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(args.repeats - 1):
            t0 = time.perf_counter()
            fn(q, k)
            times.append(time.perf_counter() - t0)
    torch.save(out, args.out)
    print(json.dumps({
        "method": args.child,
        "peak_mib": (peak - before) / 1024,  # ru_maxrss is in KiB on Linux
        "median_s": statistics.median(times),
        "times_s": times,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["eager", "logitless"])
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    shape = f"B=1 Hq={args.heads} Hk={args.kv_heads} T={args.t} d={args.dim} fp32 causal"
    print(f"attention entropy, CPU, {shape}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    inputs_mib = (args.heads + args.kv_heads) * args.t * args.dim * 4 / 2**20
    print(f"inputs q + k: {inputs_mib:.0f} MiB; one [H, T, T] fp32 tensor: "
          f"{args.heads * args.t * args.t * 4 / 2**20:.0f} MiB")
    results, outputs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("eager", "logitless"):
            path = os.path.join(tmp, f"{method}.pt")
            cmd = [sys.executable, __file__, "--child", method, "--out", path,
                   "--t", str(args.t), "--heads", str(args.heads),
                   "--kv-heads", str(args.kv_heads), "--dim", str(args.dim),
                   "--repeats", str(args.repeats)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            outputs[method] = torch.load(path)
    diff = (outputs["eager"].double() - outputs["logitless"].double()).abs().max().item()
    print(f"{'method':<10} {'peak MiB above inputs':>22} {'median s':>9}  all runs s")
    for r in results:
        runs = ", ".join(f"{x:.3f}" for x in r["times_s"])
        print(f"{r['method']:<10} {r['peak_mib']:>22.1f} {r['median_s']:>9.3f}  {runs}")
    eager, ours = results
    print(f"memory ratio eager/logitless: {eager['peak_mib'] / max(ours['peak_mib'], 1e-9):.1f}x;"
          f" time ratio eager/logitless: {eager['median_s'] / ours['median_s']:.2f}x;"
          f" max |H_eager - H_logitless| = {diff:.2e}")


if __name__ == "__main__":
    main()
