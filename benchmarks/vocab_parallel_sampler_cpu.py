"""``linear_logprobs`` with a truncation and ``vocab_parallel`` on CPU gloo ranks, beside one
process on the whole head: wall time of one forward and of one forward+backward (logprob and
entropy, then their sum's gradient to hidden, weight and bias), the median of ``--repeats``.

Each rank holds an (uneven) contiguous slice of the vocabulary; rank 0 prints one JSON line
per world size (``world`` 1: one process, no group). On a shared CPU the ranks compete for
the same cores, so the figures show the distributed select's overhead (its histogram
all-reduces and extra tie pass), not a speed-up.

Usage: ``python benchmarks/vocab_parallel_sampler_cpu.py [--n 256] [--d 256] [--v 151936]
[--worlds 1 2] [--top-p 0.9] [--top-k 0]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist

    import logitless

    group = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.n, args.d, generator=g)
    weight = torch.randn(args.v, args.d, generator=g) / args.d**0.5 * 3
    targets = torch.randint(0, args.v, (args.n,), generator=g)
    # uneven slices: rank r holds a share proportional to r + 1
    shares = [r + 1 for r in range(world)]
    bounds = [args.v * sum(shares[:r]) // sum(shares) for r in range(world + 1)]
    w = weight[bounds[rank]:bounds[rank + 1]].clone()
    kw = dict(temperature=0.8, top_p=args.top_p, top_k=args.top_k or None)

    def step(backward: bool):
        h = hidden.clone().requires_grad_(backward)
        ww = w.clone().requires_grad_(backward)
        t0 = time.perf_counter()
        out = logitless.linear_logprobs(h, ww, targets, return_entropy=True,
                                        vocab_parallel=group, **kw)
        if backward:
            lp = torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0)
            (lp.sum() + out.entropy.sum()).backward()
        if group is not None:
            dist.barrier()
        return time.perf_counter() - t0

    res = {}
    for mode in ("fwd", "fwd+bwd"):
        step(mode != "fwd")  # warm-up
        res[mode] = statistics.median(step(mode != "fwd") for _ in range(args.repeats))
    if rank == 0:
        print(json.dumps(dict(world=world, n=args.n, d=args.d, v=args.v, slices=[
            bounds[r + 1] - bounds[r] for r in range(world)], **kw,
            seconds={k: round(x, 3) for k, x in res.items()})), flush=True)
    if group is not None:
        dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    for world in args.worlds:
        mp.spawn(_run, args=(world, _port(), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
