"""The end-of-run table and the JSON file of records.

A record (one per provider x shape x mode) holds: ``op, provider, mode, shape, dtype, device,
device_name, host, date, versions, quantities, note, warmup, repeats, status`` (ok |
unavailable | skipped | failed), ``reason``, ``time_ms`` (median, p20, p80), ``floor_ratio``
(median time / the plain GEMMs' median on the same shape and mode; ``floor_ratio_cpu`` the
same by process CPU time), ``peak_bytes`` (peak above
the inputs, beyond their gradients), ``above_inputs_bytes`` (gradients included),
``grad_bytes``, ``cpu_ms`` (CPU: process CPU time per call), ``errors`` (max abs error per
quantity and input gradient against the fp64 reference on the first token block), ``timer``
and ``memory_probe``.
"""

from __future__ import annotations

import json
from pathlib import Path

from logitless.tools.bench.shapes import label

_MB = 2**20


def _time(r: dict) -> str:
    t = r["time_ms"]
    return f"{t['median']:.1f} ({t['p20']:.1f}-{t['p80']:.1f})"


def _errors(r: dict, grads: bool) -> str:
    errs = {k: v for k, v in r["errors"].items() if k.startswith("d_") == grads}
    return f"{max(errs.values()):.1e}" if errs else "-"


def _computes(r: dict) -> str:
    names = {"logprobs": "lp", "entropy": "H", "entropy_attn": "H"}
    q = r.get("quantities") or []
    return "+".join(names.get(x, x) for x in q) if q else "GEMMs"


def format_table(records: list[dict]) -> str:
    """Rows grouped by shape and mode; unavailable providers listed with their reason."""
    head = ("shape", "mode", "provider", "computes", "time ms (p20-p80)", "x GEMMs",
            "x 4 GEMMs", "cpu ms", "x GEMMs cpu", "peak MB", "err out", "err grad", "note")
    body = []
    for r in records:
        base = (label(r["shape"]), r["mode"], r["provider"], _computes(r))
        if r["status"] != "ok":
            body.append((*base, *"-" * 8, f"{r['status']}: {r['reason']}"))
            continue
        ratio, ratio_cpu = (f"{r[k]:.2f}" if r.get(k) is not None else "-"
                            for k in ("floor_ratio", "floor_ratio_cpu"))
        cpu = f"{r['cpu_ms']['median']:.1f}" if r.get("cpu_ms") else "-"
        body.append((*base, _time(r), ratio, four_gemms(r), cpu, ratio_cpu,
                     f"{r['peak_bytes'] / _MB:.1f}",
                     _errors(r, False), _errors(r, True), r.get("note") or ""))
    widths = [max(len(str(row[i])) for row in (head, *body)) for i in range(len(head) - 1)]
    line = lambda cells: "  ".join(
        [str(c).ljust(w) for c, w in zip(cells[:-1], widths)] + [str(cells[-1])]).rstrip()
    sep = line(["-" * w for w in widths] + ["----"])
    return "\n".join([line(head), sep, *map(line, body), "", legend(records)])


def four_gemms(r: dict) -> str:
    """The time over four GEMMs' worth, for the head's forward+backward, which recomputes its
    logits in the backward (the docs' and the cost model's measure): the three measured GEMMs
    scaled by 4/3. '-' elsewhere."""
    if r["op"] != "logprobs" or r["mode"] != "fwd-bwd" or r.get("floor_ratio") is None:
        return "-"
    return f"{r['floor_ratio'] * 3 / 4:.2f}"


def skipped(records: list[dict]) -> dict[str, str]:
    """Providers that measured nothing, with the first reason given."""
    ran = {r["provider"] for r in records if r["status"] == "ok"}
    out: dict[str, str] = {}
    for r in records:
        if r["provider"] not in ran and r["provider"] not in out:
            out[r["provider"]] = f"{r['status']}: {r['reason']}"
    return out


def legend(records: list[dict]) -> str:
    """What each provider of the table is, and the ones that did not run, with why."""
    from logitless.tools.bench.registry import describe_provider

    names = list(dict.fromkeys(r["provider"] for r in records))
    lines = ["providers:"] + [f"  {n:<16}{describe_provider(n)}" for n in names]
    gone = skipped(records)
    if gone:
        lines += ["not run:"] + [f"  {n:<16}{why}" for n, why in gone.items()]
    return "\n".join(lines)


def describe(records: list[dict]) -> str:
    """One line on where the figures come from."""
    if not records:
        return ""
    r = next((x for x in records if x["status"] == "ok"), records[0])
    vers = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
    return (f"{r['op']} on {r['device']} ({r['device_name']}), {r['dtype']}, {r['date']}; "
            f"peak MB: above inputs and their gradients ({r['memory_probe'] or 'n/a'}); "
            f"errors: max abs vs fp64 on the first token block; {vers}")


def write_json(records: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")


def read_json(path: str | Path) -> list[dict]:
    return json.loads(Path(path).read_text())
