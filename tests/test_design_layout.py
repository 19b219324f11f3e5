"""docs/design.md's module list ("One line per module") names every module of
``src/logitless`` and nothing that is not there.

The list is a fenced block: a line ending its name in ``/`` opens a package (its depth by its
indentation, two spaces a level), a line naming ``*.py`` files lists modules of the package
above it. A package listed with no module under it stands for all of its modules (``bench/``).
A subpackage's ``__init__.py`` need not be listed.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "logitless"
_MODULE = re.compile(r"\b[\w]+\.py\b")


def listed_layout(text: str) -> tuple[set[str], set[str]]:
    """``(modules, whole_packages)`` of the module list in design.md's text, as paths relative
    to the package (``fused_losses/head/kept.py``; ``tools/bench/``)."""
    start = text.index("One line per module")
    body = text[text.index("```", start) + 3:]
    body = body[body.index("\n") + 1:body.index("```")]
    modules, packages, stack = set(), set(), []
    for line in body.splitlines():
        if not line.strip() or line.startswith(" " * 20):  # a description's continuation
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        first = line.split()[0]
        del stack[depth:]
        if first.endswith("/"):
            stack.append(first)
            packages.add("".join(stack))
            continue
        parent = "".join(stack)
        for name in _MODULE.findall(line):  # descriptions name no module
            modules.add(parent + name)
    listed = modules | set(packages)
    return modules, {p for p in packages if not any(x != p and x.startswith(p) for x in listed)}


def package_modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and rel != "__init__.py":
            continue
        found.add(rel)
    return found


def test_the_module_list_is_the_tree():
    modules, whole = listed_layout((ROOT / "docs" / "design.md").read_text())
    tree = package_modules()
    covered = {m for m in tree if any(m.startswith(p) for p in whole)}
    assert sorted(tree - modules - covered) == [], "modules missing from docs/design.md"
    assert sorted(modules - tree) == [], "docs/design.md lists modules that do not exist"


def test_the_reader_sees_a_missing_and_a_stale_module():
    text = """One line per module:

```
__init__.py                    the API
kernels/                       kernels
  gone.py                      removed
tools/
  bench/                       a whole package
```
"""
    modules, whole = listed_layout(text)
    assert modules == {"__init__.py", "kernels/gone.py"}
    assert whole == {"tools/bench/"}
