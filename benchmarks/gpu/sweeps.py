"""The dry run's bench sweeps, one after the other in one process (run.sh --dry-run).

    python benchmarks/gpu/sweeps.py OUTDIR NAME COUNT ARG... [NAME COUNT ARG...]...

Each sweep is ``logitless bench`` with the device run's arguments for it (``COUNT`` of them,
from ``bench``), run through the CLI's ``main``; its output goes to the console and to
``OUTDIR/NAME.log`` as run.sh's steps do, and a sweep that fails or raises does not stop the
next. One process instead of one per sweep: the dry run checks the plumbing at tiny shapes,
where starting Python and importing torch and logitless cost more than the sweep itself.
Exit status: 0 when every sweep exited 0, else 1.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from pathlib import Path


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()


def parse(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``[(name, bench arguments), ...]`` from ``NAME COUNT ARG...`` groups."""
    sweeps, i = [], 0
    while i < len(argv):
        name, count = argv[i], int(argv[i + 1])
        sweeps.append((name, argv[i + 2:i + 2 + count]))
        i += 2 + count
    return sweeps


def main(argv: list[str]) -> int:
    from logitless.tools.cli import main as cli

    out, start, status = Path(argv[0]), time.monotonic(), 0
    for name, args in parse(argv[1:]):
        print(f"== {name} (in one process, at {time.monotonic() - start:.0f}s)", flush=True)
        with open(out / f"{name}.log", "w") as log, \
                contextlib.redirect_stdout(_Tee(sys.__stdout__, log)), \
                contextlib.redirect_stderr(_Tee(sys.__stderr__, log)):
            try:
                rc = cli(args)
            except SystemExit as stop:  # argparse refusing an argument
                rc = stop.code if isinstance(stop.code, int) else 1
            except Exception:
                traceback.print_exc()
                rc = 1
        print(f"== {name}: exit {rc} after {time.monotonic() - start:.0f}s", flush=True)
        status = status or int(rc != 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
