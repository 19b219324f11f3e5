"""The package's import graph, read from the source: no circles between its modules (imports
inside functions and under ``TYPE_CHECKING`` count; a package ``__init__``'s re-exports do
not), and the arrows run one way between the rooms (issue 23)."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# Each room may import only the rooms after it in this order (and itself). The oracle,
# `logitless.reference`, stands beside the rooms: only tools import it, and it reads nothing of
# the library but the objective registry's flags and the leaf helpers (REFERENCE_READS).
LAYERS = (
    ("logitless.tools", "logitless.integrations", "logitless.cli", "logitless.__main__"),
    ("logitless.fused_losses.fused",),
    ("logitless.fused_losses.objectives", "logitless.fused_losses.head"),
    ("logitless.fused_losses.oplib", "logitless.fused_losses.backend"),
    ("logitless.kernels",),
    ("logitless.reference",),
)
REFERENCE_READS = ("logitless.fused_losses.objectives.catalog", "logitless.fused_losses.oplib")


def _modules(src: pathlib.Path = SRC) -> dict[str, tuple[pathlib.Path, bool]]:
    mods = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        if is_init:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_init)
    return mods


def _resolve(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(src: pathlib.Path = SRC) -> dict[str, set[str]]:
    """``module -> modules it imports`` within logitless; a package ``__init__`` is a node
    with no edges (its re-exports are the allowed exception), and an import of a package
    names the package's ``__init__``, which imports nothing."""
    mods = _modules(src)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_init) in mods.items():
        if is_init:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = mod.split(".")[: -node.level]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                if not target.startswith("logitless"):
                    continue
                found = _resolve(target, mods)
                if found and found != mod and not mods[found][1]:
                    edges[mod].add(found)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _layer(mod: str) -> int | None:
    for i, rooms in enumerate(LAYERS):
        if any(mod == r or mod.startswith(r + ".") for r in rooms):
            return i
    return None


def test_the_circle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    edges = import_graph()
    assert len(edges) > 50  # the whole package was read
    assert circles(edges) == []


def test_arrows_run_one_way_between_rooms():
    wrong = []
    for mod, targets in import_graph().items():
        here = _layer(mod)
        for target in targets:
            there = _layer(target)
            allowed = mod.startswith("logitless.reference") and target in REFERENCE_READS
            if here is not None and there is not None and there < here and not allowed:
                wrong.append(f"{mod} -> {target}")
    assert wrong == []


def test_only_tools_read_the_oracle():
    readers = [m for m, targets in import_graph().items()
               if not m.startswith(("logitless.reference", "logitless.tools"))
               and any(t.startswith("logitless.reference") for t in targets)]
    assert readers == []


def test_every_module_is_in_a_room():
    """A new module must be placed in the layering above (or be a package ``__init__``)."""
    mods = _modules()
    homeless = [m for m, (_, is_init) in mods.items()
                if not is_init and _layer(m) is None]
    assert homeless == []


def test_oplib_is_a_leaf_above_kernels():
    """The shared op helpers import nothing of logitless but kernels (and reference)."""
    targets = import_graph()["logitless.fused_losses.oplib"]
    assert all(_layer(t) >= _layer("logitless.kernels") for t in targets), targets
