"""The documentation stays inside the repository.

Every relative link (and image) in README.md and docs/*.md must name a file of the repository,
and an anchor must name a heading of that file; every ``*.md`` a module of ``src/`` cites must
be a file of the repository. README.md is also the package's long description, so a link out
of the checkout would be broken for every user.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# Not inside a longer token: a web address ending in .md is not a repository path.
_CITED_MD = re.compile(r"(?<![\w./:-])[\w./-]*[\w-]\.md\b")


def _prose(text: str) -> str:
    """Markdown without fenced blocks and code spans (their brackets are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(0)[1:-1], heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {_anchor(h) for h in _HEADING.findall(_FENCE.sub("", text))}


def broken_links(text: str, base: Path, root: Path = ROOT) -> list[str]:
    """Links of the markdown ``text`` (in folder ``base``) that leave ``root`` or name no file
    or heading there; web and mail links are not checked."""
    bad, root = [], root.resolve()
    for target in _LINK.findall(_prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        file_part, _, anchor = target.partition("#")
        path = (base / file_part).resolve() if file_part else None
        if path is not None and (not path.is_relative_to(root) or not path.is_file()):
            bad.append(f"{target}: no such file in the repository")
        elif anchor and path is None and anchor not in _anchors(text):
            bad.append(f"{target}: no such heading")
        elif anchor and path is not None and path.suffix == ".md" \
                and anchor not in _anchors(path.read_text()):
            bad.append(f"{target}: no such heading in {path.name}")
    return bad


def cited_markdown(source: str) -> list[str]:
    """``*.md`` paths a Python source cites (in docstrings or comments)."""
    return _CITED_MD.findall(source)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve_inside_the_repository(path):
    assert broken_links(path.read_text(), path.parent) == []


def test_the_docs_exist():
    names = {p.name for p in MARKDOWN}
    assert {"README.md", "objectives.md", "trl.md", "verl.md", "benchmarks.md",
            "design.md"} <= names


@pytest.mark.parametrize("module", sorted((ROOT / "src").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT / "src")))
def test_markdown_cited_by_the_sources_is_in_the_repository(module):
    missing = [c for c in cited_markdown(module.read_text()) if not (ROOT / c).is_file()]
    assert missing == []


def test_the_checks_catch_links_and_citations_out_of_the_repository(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "design.md").write_text("# Design\n\n## Op 4: `fused_policy_loss`\n")
    (tmp_path / "outside.md").write_text("# Outside\n")
    text = ("See [OBJECTIVES.md](../shared/OBJECTIVES.md), [outside](../outside.md), "
            "[a heading](#nowhere), [design](docs/design.md#no-such-section), "
            "[ok](docs/design.md#op-4-fused_policy_loss) and [here](#usage); "
            "`[code](../not/a/link.md)` and [the web](https://example.org) are not checked.\n"
            "## Usage\n")
    assert broken_links(text, root, root) == [
        "../shared/OBJECTIVES.md: no such file in the repository",
        "../outside.md: no such file in the repository",
        "#nowhere: no such heading",
        "docs/design.md#no-such-section: no such heading in design.md",
    ]
    cited = cited_markdown('"""Ratios (OBJECTIVES.md section 1); see docs/objectives.md, not '
                           'https://github.com/o/r/blob/main/README.md."""')
    assert cited == ["OBJECTIVES.md", "docs/objectives.md"]
