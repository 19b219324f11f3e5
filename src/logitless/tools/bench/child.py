"""Child process of ``logitless bench``: one measurement, in a process of its own.

Run as ``python -m logitless.tools.bench.child '<json spec>'``; prints one line
``RESULT <json figures>``. A fresh process per provider keeps its peak resident memory, its
thread pools and its compiled-kernel caches from leaking into another provider's figures.
"""

from __future__ import annotations

import json
import sys

import torch

from logitless.tools.bench.measure import measure
from logitless.tools.bench.registry import get_op, get_providers

MARKER = "RESULT "


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    op = get_op(spec["op"])
    (provider,) = get_providers(spec["op"], [spec["provider"]])
    figures = measure(op, provider, spec["shape"], spec["mode"], getattr(torch, spec["dtype"]),
                      spec["device"], warmup=spec["warmup"], repeats=spec["repeats"],
                      block_rows=spec["block_rows"], seed=spec.get("seed", 0),
                      options=spec.get("options") or {})
    print(MARKER + json.dumps(figures.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
