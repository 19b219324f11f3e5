"""No module of the package (nor a benchmark script) reaches into another module's private
names (issue 39): a name one module imports from another, or reads as an attribute of an
imported module, is public. What several rooms share (the batch on the grid, the head's tiles,
a kernel's launch shapes) has a public name in the module that owns it. Tests may still read
private names."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = (ROOT / "src", ROOT / "benchmarks")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_of(path: pathlib.Path, base: pathlib.Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_crossings(source: str, module: str = "", is_package: bool = False) -> list[str]:
    """``"line: what"`` for each private name of another ``logitless`` module that ``source``
    (the text of ``module``; of its ``__init__`` when ``is_package``) imports, or reads as an
    attribute of an imported module or of a name imported from one (``sampler._SLICE``,
    ``logitless.kernels.sampler._SLICE``)."""
    tree = ast.parse(source)
    found, imported = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: from the package that holds ``module``
                package = module.split(".")
                package = package[:len(package) + is_package - node.level]
                target = ".".join([*package, *([target] if target else [])])
            if not target.startswith("logitless"):
                continue
            for alias in node.names:
                if target == module:
                    continue
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {target} import {alias.name}")
                else:
                    imported[alias.asname or alias.name] = f"{target}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("logitless"):
                    key = alias.asname or alias.name.split(".")[0]
                    imported[key] = alias.name if alias.asname else key
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        base = ast.unparse(node.value)
        head = base.split(".")[0]
        if head in imported and f"{imported[head]}{base[len(head):]}" != module:
            found.append(f"{node.lineno}: {base}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module_boundary():
    found = []
    for base in CHECKED:
        for path in sorted(base.rglob("*.py")):
            module = _module_of(path, base)
            hits = private_crossings(path.read_text(), module, path.name == "__init__.py")
            found += [f"{path.relative_to(ROOT)}:{hit}" for hit in hits]
    assert found == [], "private names used across modules:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_crossing():
    """The check finds a private name imported, read from an imported module, read through a
    dotted import, and read from a relative import; a module's own names and public names
    pass."""
    source = (
        "import logitless.kernels.sampler\n"
        "from logitless.kernels import linear_softmax as head\n"
        "from logitless.fused_losses.objectives.policy_inputs import _Batch, to_batch\n"
        "from .segments import launch_blocks\n"
        "from . import sampler_torch\n"
        "from logitless.kernels.divergence import _own\n"
        "x = head._tile_stats_kernel, head.VOCAB_TILE, to_batch._cache\n"
        "y = logitless.kernels.sampler._SLICE, launch_blocks.__name__\n"
        "z = sampler_torch._ordered_keys\n"
    )
    found = private_crossings(source, "logitless.kernels.divergence")
    assert sorted(found) == [
        "3: from logitless.fused_losses.objectives.policy_inputs import _Batch",
        "7: head._tile_stats_kernel",
        "7: to_batch._cache",
        "8: logitless.kernels.sampler._SLICE",
        "9: sampler_torch._ordered_keys",
    ]
