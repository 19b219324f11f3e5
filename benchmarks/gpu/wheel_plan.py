"""Which wheels the GPU machine needs, grouped by what they are for; read by download_wheels.sh.

    python benchmarks/gpu/wheel_plan.py [--device-packages FILE]

Prints one line per wheel, ``GROUP NAME==VERSION``, groups in the order they are worth carrying:
``base`` (what logitless and the bench need), then one group per peer (``trl``, ``liger``,
``cce``, ``verl``). Each group is the dependency closure of its roots, pinned to the versions
installed in this Python's environment (the versions the test suite ran against), minus
torch, triton and NVIDIA's wheels, minus every package the GPU machine already has
(``device_packages.txt``), minus what an earlier group already carries. A group is useful only
whole: download_wheels.sh keeps or leaves out each one as a unit.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# The GPU machine's Python (3.12, Linux x86_64) evaluates the markers.
ENV = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
NEVER = re.compile(r"^(torch|triton|nvidia-.*|pytorch-triton.*)$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_names(path: Path) -> set[str]:
    return {norm(ln.split("#")[0].strip()) for ln in path.read_text().splitlines()
            if ln.split("#")[0].strip()}


def verl_packages() -> list[str]:
    """scripts/install_verl.sh's list (verl goes in with --no-deps plus exactly these)."""
    text = (ROOT / "scripts/install_verl.sh").read_text()
    body = text.split("PACKAGES=(", 1)[1].split("\n)", 1)[0]
    words = " ".join(ln.split("#")[0] for ln in body.splitlines()).split()
    return [w.split("==")[0] for w in words]


def groups() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    bench = [r for r in extras["bench"] if not r.startswith(("liger", "cut-cross"))]
    return {
        "base": [*project["dependencies"], *bench],
        "trl": extras["trl"],
        "liger": [r for r in extras["bench"] if r.startswith("liger")],
        "cce": [r for r in extras["bench"] if r.startswith("cut-cross")],
        "verl": verl_packages(),
    }


def closure(roots: list[str], skip: set[str], flat: bool) -> dict[str, str]:
    """name -> installed version over the roots' requirements (``flat``: the roots alone)."""
    seen: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = norm(req.name)
        if NEVER.match(name) or name in skip or name in seen or (
                req.marker and not req.marker.evaluate(ENV)):
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            print(f"# not installed here, skipped: {req}", file=sys.stderr)
            continue
        seen[name] = dist.version
        if flat:
            continue
        reqs = [Requirement(r) for r in dist.requires or []]
        for extra in req.extras:
            with_extra = dict(ENV, extra=extra)
            todo += [r for r in reqs if r.marker and r.marker.evaluate(with_extra)
                     and not r.marker.evaluate(ENV)]
        todo += [r for r in reqs if not r.marker or r.marker.evaluate(ENV)]
    return seen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device-packages", type=Path, default=HERE / "device_packages.txt")
    args = p.parse_args()
    carried = read_names(args.device_packages)
    for group, roots in groups().items():
        pins = closure(roots, carried, flat=group == "verl")
        carried |= set(pins)
        for name, ver in sorted(pins.items()):
            print(f"{group} {name}=={ver}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
