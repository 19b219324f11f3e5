"""Batch invariance on the device: a block of rows gives the same bits wherever it sits.

    python benchmarks/gpu/invariance.py [--device cuda] [--tokens 3072] [--hidden 4096]
        [--vocab 151936] [--dtype bfloat16]

A probe block of 64 rows is run alone (one GEMM of 128 rows, the granule), then placed at other
offsets inside batches of other random rows: at the start of a row chunk, one row in, in the
middle, straddling the boundary between two 1024-row chunks, and in a later chunk; then at the
end of batches whose last, partial chunk is padded to each height a head GEMM can have (128,
256, ..., 1024 rows: `constants.row_blocks`), so that every height of the family is compared
with the lone run's. For each placement, `linear_logprobs` (logprob and entropy, then the
hidden-gradient rows of a backward with per-token upstream gradients) and its top-p variant
(whose chunks are padded the same way) must return the probe's rows bitwise equal to the lone
run.
One line per op and placement, then `ok` or the number of rows that differ and the largest
difference; exit status 1 on any difference.

On CUDA this is the claim of docs/gpu.md ("Determinism and batch invariance") for the shapes
that cuBLAS actually gets: every head GEMM is 1024 rows or, for a call's last chunk, a
multiple of 128, and a row's bits must not depend on which of these eight heights computed
it. On CPU it runs the same code on small shapes (tests/tools/test_gpu_scripts.py).
"""

from __future__ import annotations

import argparse
import sys

import torch

import logitless

PROBE = 64


def _placements(n: int, chunk: int, granule: int) -> dict[str, tuple[int, int]]:
    """``(rows of the batch, first probe row)`` by name: in a batch of ``n`` rows (``n >= 2 *
    chunk + PROBE + 3``), then last in batches of two chunks and a last one of ``h - 1`` rows,
    padded to ``h``, for each GEMM height ``h`` of the granule's family."""
    at = {"chunk start": 0, "one row in": 1, "mid chunk": chunk // 2 - 7,
          "across chunks": chunk - PROBE // 2, "later chunk": 2 * chunk + 3}
    out = {name: (n, a) for name, a in at.items()}
    granule = min(granule, chunk)
    for h in range(max(granule, 2), chunk + 1, granule):
        rows = 2 * chunk + h - 1
        out[f"last chunk {h}"] = (rows, rows - PROBE)
    return out


def _run(op: str, hidden, weight, targets, upstream):
    h = hidden.detach().requires_grad_(True)
    kwargs = dict(return_entropy=True)
    if op == "top-p":
        kwargs.update(top_p=0.9, temperature=0.8)
    out = logitless.linear_logprobs(h, weight, targets, **kwargs)
    lp = torch.where(torch.isfinite(out.logprobs), out.logprobs, 0.0)
    (lp * upstream[0] + out.entropy * upstream[1]).sum().backward()
    return {"logprobs": out.logprobs.detach(), "entropy": out.entropy.detach(), "d_hidden": h.grad}


def check(device: str, n: int, d: int, v: int, dtype: torch.dtype, chunk: int,
          seed: int = 0, ops=("plain", "top-p"),
          granule: int | None = None) -> list[tuple[str, str, str, int, float]]:
    """``(op, placement, output, rows that differ, largest difference)`` per comparison;
    ``granule``: the last chunk's (default: the head's, ``linear_softmax.ROW_GRANULE``)."""
    if granule is None:
        from logitless.kernels import linear_softmax

        granule = linear_softmax.ROW_GRANULE
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    weight = rand(v, d, scale=d**-0.5)
    probe_h = rand(PROBE, d)
    probe_t = torch.randint(0, v, (PROBE,), generator=g).to(device)
    probe_up = [torch.randn(PROBE, generator=g).to(device) for _ in range(2)]
    results = []
    for op in ops:
        alone = _run(op, probe_h, weight, probe_t, probe_up)
        for name, (rows_n, at) in _placements(n, chunk, granule).items():
            hidden = rand(rows_n, d)
            targets = torch.randint(0, v, (rows_n,), generator=g).to(device)
            upstream = [torch.randn(rows_n, generator=g).to(device) for _ in range(2)]
            rows = slice(at, at + PROBE)
            hidden[rows], targets[rows] = probe_h, probe_t
            for u, p in zip(upstream, probe_up):
                u[rows] = p
            got = _run(op, hidden, weight, targets, upstream)
            for key, ref in alone.items():
                a, b = got[key][rows], ref
                same = (a == b) | (torch.isnan(a) & torch.isnan(b))
                bad = (~same).reshape(PROBE, -1).any(1)
                diff = (a.float() - b.float()).abs().nan_to_num(0.0)
                results.append((op, name, key, int(bad.sum()),
                                float(diff.max()) if bad.any() else 0.0))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=3072)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--chunk", type=int, default=None,
                   help="the row chunk of the head's GEMMs (default: the CUDA launcher's)")
    p.add_argument("--granule", type=int, default=None,
                   help="the last chunk's row granule (default: the CUDA launcher's)")
    a = p.parse_args(argv)
    from logitless.kernels import linear_softmax

    chunk = a.chunk or linear_softmax.ROW_CHUNK
    granule = a.granule or linear_softmax.ROW_GRANULE
    if chunk < PROBE:
        p.error(f"--chunk must be at least {PROBE} (the probe straddles a chunk boundary)")
    if a.tokens < 2 * chunk + PROBE + 3:
        p.error(f"--tokens must be at least {2 * chunk + PROBE + 3} (two chunks and the probe)")
    print(f"batch invariance: {PROBE} probe rows in batches of {a.tokens}, D={a.hidden}, "
          f"V={a.vocab}, {a.dtype}, {a.device}, row chunk {chunk}, granule {granule}",
          flush=True)
    failed = 0
    for op, where, key, rows, diff in check(a.device, a.tokens, a.hidden, a.vocab,
                                            getattr(torch, a.dtype), chunk, granule=granule):
        verdict = "ok" if rows == 0 else f"DIFFERS in {rows} rows (max |diff| {diff:.3g})"
        failed += rows > 0
        print(f"{op:6s} {where:16s} {key:9s} {verdict}", flush=True)
    print("batch invariance: " + ("all bitwise equal" if not failed else f"{failed} failures"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
