"""Per-rank peak memory of ``linear_logprobs`` forward + backward on an FSDP2 head, with and
without the weight gather, on gloo ranks on CPU (issue 26, item 1).

    python benchmarks/fsdp_memory.py [--n 2048] [--d 1024] [--v 151936] [--world 2]

Each rank holds ``n`` tokens and its ``Shard(0)`` slice of a ``[v, d]`` fp32 head
(``fully_shard`` of an ``nn.Linear`` built on the meta device, so no rank ever holds the whole
weight before the measurement). Modes, each in fresh processes:

- ``gather``: TRL's path, ``weight.full_tensor()`` then the kernel on the whole head (its
  backward materialises the whole ``[v, d]`` gradient before the shard keeps its slice);
- ``sharded``: logitless's DTensor path, the tokens all-gathered and each slice a
  vocabulary-parallel head, no gather of the weight.

Peak: ``ru_maxrss`` after the step minus the resident set just before it (``/proc/self/statm``),
per rank, in MiB; the resident set before holds the shard, the hidden states and the process.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _worker(rank, world, port, mode, n, d, v, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import logitless

        torch.manual_seed(rank)
        with torch.device("meta"):
            head = torch.nn.Linear(d, v, bias=False)
        fully_shard(head, mesh=init_device_mesh("cpu", (world,)))
        head.to_empty(device="cpu")
        with torch.no_grad():
            head.weight.to_local().normal_(0, d**-0.5)
        hidden = torch.randn(n, d, requires_grad=True)
        targets = torch.randint(0, v, (n,))
        dist.barrier()
        before = _rss_mib()
        weight = head.weight.full_tensor() if mode == "gather" else head.weight
        out = logitless.linear_logprobs(hidden, weight, targets, return_entropy=True)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        del weight, out
        peak = _maxrss_mib()
        assert type(head.weight.grad).__name__ == "DTensor"
        queue.put((rank, mode, before, peak))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(mode, n, d, v, world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, mode, n, d, v, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{mode}: a rank exited with {p.exitcode}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--modes", default="gather,sharded")
    args = parser.parse_args(argv)
    mib = 2**20
    print(f"N={args.n} per rank, D={args.d}, V={args.v}, {args.world} gloo ranks, fp32; "
          f"whole weight {args.v * args.d * 4 / mib:.0f} MiB, a shard "
          f"{-(-args.v // args.world) * args.d * 4 / mib:.0f} MiB")
    for mode in args.modes.split(","):
        for rank, _, before, peak in measure(mode, args.n, args.d, args.v, args.world):
            print(f"{mode:8s} rank {rank}: resident before {before:8.0f} MiB, peak "
                  f"{peak:8.0f} MiB, peak above before {peak - before:8.0f} MiB", flush=True)


if __name__ == "__main__":
    sys.exit(main())
