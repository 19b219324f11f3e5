"""``linear_logprobs(kept_ids=...)`` on CPU beside the materialising path: wall time and peak
memory of one forward+backward (logprob and entropy over a recorded kept set of K ids per
token, then their sum's gradient to hidden, weight and bias).

Each provider runs in a child process of its own; its peak memory is the rise of the process's
peak resident set (``VmHWM``) over its resident set after the inputs are made, so the inputs
and the weight gradient's [V, D] buffer, which both paths allocate, are counted alike.
Providers: ``kept`` (the gather of K weight rows per token, in bounded chunks) and
``materialised`` (the full ``[N, V]`` logits, masked to the set, log-softmax).

Usage: ``python benchmarks/kept_ids_cpu.py [--n 256] [--d 1024] [--v 151936] [--k 64 2048]``.
Prints one JSON line per (provider, K).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def child(provider: str, n: int, d: int, v: int, k: int, repeats: int) -> dict:
    import torch

    import logitless
    from logitless import reference

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d**0.5).requires_grad_()
    bias = torch.zeros(v).requires_grad_()
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    targets = ids[:, 0].clone()

    def step():
        if provider == "kept":
            out = logitless.linear_logprobs(hidden, weight, targets, bias=bias, kept_ids=ids,
                                            return_entropy=True)
            lp, ent = out.logprobs, out.entropy
        else:
            out = reference.linear_logprobs(hidden, weight, targets, bias, kept_ids=ids)
            lp, ent = out["logprobs"], out["entropy"]
        (lp.sum() + ent.sum()).backward()
        hidden.grad = weight.grad = bias.grad = None

    base = _vm("VmRSS")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"provider": provider, "n": n, "d": d, "v": v, "k": k,
            "seconds": sorted(times)[len(times) // 2],
            "peak_mb_over_inputs": round((_vm("VmHWM") - base) / 2**20, 1),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--k", type=int, nargs="+", default=[64, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs=2, metavar=("PROVIDER", "K"))
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.n, a.d, a.v, int(a.child[1]), a.repeats)))
        return
    for k in a.k:
        for provider in ("kept", "materialised"):
            cmd = [sys.executable, __file__, "--n", str(a.n), "--d", str(a.d), "--v", str(a.v),
                   "--repeats", str(a.repeats), "--child", provider, str(k)]
            print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip(),
                  flush=True)


if __name__ == "__main__":
    main()
