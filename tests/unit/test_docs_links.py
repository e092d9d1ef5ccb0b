"""Every relative link in the documentation names a file or folder that exists in the repository.

Checked: README.md, docs/*.md, benchmarks/README.md and recipes/*/README.md. A link's #anchor is
dropped; web (http, https) and mailto links are not followed. Links inside code (fenced blocks and
`inline code`) are not links, so paths written as code are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def _repo_root() -> Path:
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise RuntimeError(f"no pyproject.toml above {__file__}")


REPO = _repo_root()

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target may be <bracketed> and may carry a "title"
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
# [label]: target
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
EXTERNAL = re.compile(r"^(?:https?:|mailto:)", re.IGNORECASE)


def documentation_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "benchmarks" / "README.md"]
    files += sorted((REPO / "docs").glob("*.md"))
    files += sorted((REPO / "recipes").glob("*/README.md"))
    return [f for f in files if f.is_file()]


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    found = []
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
            continue
        if opening:
            fence = opening.group(1)
            continue
        prose = CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in INLINE_LINK.finditer(prose)]
        definition = REFERENCE_DEFINITION.match(prose)
        if definition:
            targets.append(definition.group(1))
        for target in targets:
            found.append((number, target.strip("<>")))
    return found


def dangling_links(markdown: Path, root: Path = REPO) -> list[str]:
    """The links of a markdown file whose target does not exist, as 'file:line: target'."""
    problems = []
    for number, target in link_targets(markdown.read_text(encoding="utf-8")):
        if not target or EXTERNAL.match(target):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path:  # a link to an anchor of the same page
            continue
        resolved = (root / path.lstrip("/")) if path.startswith("/") else (markdown.parent / path)
        if not resolved.exists():
            problems.append(f"{markdown.relative_to(root)}:{number}: {target}")
    return problems


def test_the_documentation_files_are_found():
    names = {f.relative_to(REPO).as_posix() for f in documentation_files()}
    assert "README.md" in names
    assert "benchmarks/README.md" in names


@pytest.mark.parametrize("markdown", documentation_files(), ids=lambda f: f.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(markdown):
    problems = dangling_links(markdown)
    assert not problems, "links to files or folders that do not exist:\n" + "\n".join(problems)


def test_a_dangling_link_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "here.md").write_text("")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n"
        "[fine](../here.md#a-heading) [also fine](../docs/) [web](https://example.org/x) [anchor](#page)\n"
        "[gone](missing.md) and ![image](../img/none.png)\n"
        "`[code](not-a-link.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[ref]: ../absent/\n",
        encoding="utf-8",
    )
    assert dangling_links(page, root=tmp_path) == [
        "docs/page.md:3: missing.md",
        "docs/page.md:3: ../img/none.png",
        "docs/page.md:8: ../absent/",
    ]
