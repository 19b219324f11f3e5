"""Merge run.sh's sweeps into ``OUTDIR/<tag>.json`` and print the short summary table.

    python benchmarks/gpu/summary.py OUTDIR TAG

One line per row: sweep, shape, mode, provider, median ms, multiple of the GEMM floor, peak MB
beyond inputs and gradients, the largest error against the fp64 reference, and the status
(with the reason when a row did not run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def merge(out: Path, tag: str) -> list[dict]:
    records = []
    for path in sorted(out.glob(f"{tag}-*.json")):
        for r in json.loads(path.read_text()):
            r["sweep"] = path.stem[len(tag) + 1:]
            records.append(r)
    (out / f"{tag}.json").write_text(json.dumps(records, indent=1) + "\n")
    return records


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(records: list[dict]) -> str:
    head = ("sweep", "shape", "mode", "provider", "ms", "x GEMMs", "peak MB", "max err", "status")
    rows = [head]
    for r in records:
        shape = " ".join(f"{k[0].upper()}={v}" for k, v in r["shape"].items())
        errs = r.get("errors") or {}
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason'][:60]}"
        rows.append((
            r["sweep"], shape, r["mode"], r["provider"],
            _num((r.get("time_ms") or {}).get("median"), ".1f"),
            _num(r.get("floor_ratio"), ".2f"),
            _num(None if r.get("peak_bytes") is None else r["peak_bytes"] / 2**20, ".0f"),
            _num(max(errs.values()) if errs else None, ".1e"), status,
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in rows)


def main(argv: list[str]) -> int:
    out, tag = Path(argv[1]), argv[2]
    records = merge(out, tag)
    print(f"== summary: {len(records)} rows in {out / f'{tag}.json'}")
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
