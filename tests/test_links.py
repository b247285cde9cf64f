"""Every link in the project's Markdown stays inside the repository and reaches what it names.

A user has the repository and nothing beside it: a relative link that climbs out of it (the
``../shared/...`` notes the project was built from) or names a file that is not there is a dead
end. Links are read with markdown-it-py (what CommonMark calls a link or an image), so a path
shown as code is not taken for one; mentions of the ``shared/`` notes are refused in code too.
Anchors (``page.md#heading``) are checked against the page's headings, slugged as GitHub does.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {"venv", "tests", "node_modules", "bench-results", "build", "dist"}
OUTSIDE_NOTES = re.compile(r"(?<![\w/.-])(?:\.\./)*shared/[\w.-]+")
"""A path into the notes kept beside the repository (``../shared/DESIGN.md``, ``shared/NOTES-x.md``)."""
PARSER = MarkdownIt("commonmark").enable("table")


def markdown_files(root: Path = ROOT) -> list[Path]:
    """The repository's Markdown files, outside hidden folders (``.venv``, ``.git``, data folders),
    build output and tests; skipped folders are not walked (a venv holds thousands of files)."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in SKIPPED_DIRS]
        found += [Path(folder) / name for name in files if name.endswith(".md")]
    return sorted(found)


def _walk(tokens: list[Token]) -> list[Token]:
    return [t for token in tokens for t in (token, *_walk(token.children or []))]


def link_targets(text: str) -> list[str]:
    """The targets of the links and images in a Markdown text."""
    attribute = {"link_open": "href", "image": "src"}
    targets = [t.attrGet(attribute[t.type]) for t in _walk(PARSER.parse(text)) if t.type in attribute]
    return [t for t in targets if isinstance(t, str)]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (repeats get -1, -2, ... as on GitHub)."""
    tokens = PARSER.parse(text)
    counts: dict[str, int] = {}
    found = set()
    for opening, inline in itertools.pairwise(tokens):
        if opening.type == "heading_open":
            slug = github_slug("".join(c.content for c in inline.children or [] if c.type in ("text", "code_inline")))
            found.add(f"{slug}-{counts[slug]}" if slug in counts else slug)
            counts[slug] = counts.get(slug, 0) + 1
    return found


def link_problem(page: Path, target: str, root: Path = ROOT) -> str | None:
    """Why ``target`` (a link on ``page``) is a dead end for a user of the repository, or None."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return None  # a web address (https:, mailto:): not a file of the repository
    if not parts.path:
        dest = page
    else:
        dest = (root / parts.path.lstrip("/")) if parts.path.startswith("/") else (page.parent / unquote(parts.path))
        dest = dest.resolve()
        if not dest.is_relative_to(root.resolve()):
            return "leaves the repository"
        if not dest.exists():
            return "names a file that does not exist"
    if parts.fragment and dest.suffix == ".md" and parts.fragment not in anchors(dest.read_text(encoding="utf-8")):
        return f"names no heading of {dest.name}"
    return None


def page_problems(page: Path, root: Path = ROOT) -> list[str]:
    text = page.read_text(encoding="utf-8")
    problems = [f"link {target!r} {why}" for target in link_targets(text) if (why := link_problem(page, target, root))]
    problems += [f"mentions {m.group(0)!r}, outside the repository" for m in OUTSIDE_NOTES.finditer(text)]
    return problems


def test_the_repository_has_markdown_pages() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/benchmarks.md", "docs/architecture.md", "docs/engine.md"} <= names


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_stay_in_the_repository_and_resolve(page: Path) -> None:
    assert page_problems(page) == []


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("See [notes](../../elsewhere/NOTES.md).", ["link '../../elsewhere/NOTES.md' leaves the repository"]),
        ("See [root](/../x.md).", ["link '/../x.md' leaves the repository"]),
        ("![plot](img/missing.png)", ["link 'img/missing.png' names a file that does not exist"]),
        ("See [gone](gone.md).", ["link 'gone.md' names a file that does not exist"]),
        (
            "See [a heading](other.md#no-such-heading).",
            ["link 'other.md#no-such-heading' names no heading of other.md"],
        ),
        ("See [here](#nowhere).", ["link '#nowhere' names no heading of page.md"]),
        (
            "See [the brief](../shared/DESIGN.md).",
            [
                "link '../shared/DESIGN.md' names a file that does not exist",
                "mentions '../shared/DESIGN.md', outside the repository",
            ],
        ),
        ("The brief (`../shared/DESIGN.md`) says so.", ["mentions '../shared/DESIGN.md', outside the repository"]),
        (
            "The notes in `shared/NOTES-redis.md` measured it.",
            ["mentions 'shared/NOTES-redis.md', outside the repository"],
        ),
    ],
)
def test_a_dead_end_is_reported(tmp_path: Path, line: str, why: list[str]) -> None:
    docs = tmp_path / "repo" / "docs"
    docs.mkdir(parents=True)
    (docs / "other.md").write_text("# Other\n\n## A `code` heading: here\n", encoding="utf-8")
    page = docs / "page.md"
    page.write_text(f"# Page\n\n{line}\n", encoding="utf-8")
    assert page_problems(page, tmp_path / "repo") == why


def test_only_the_projects_own_pages_are_read(tmp_path: Path) -> None:
    for page in ("README.md", "docs/a.md", ".venv/lib/x/README.md", "tests/fixture.md", ".splitbus/n.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("# x\n", encoding="utf-8")
    assert [p.relative_to(tmp_path).as_posix() for p in markdown_files(tmp_path)] == ["README.md", "docs/a.md"]


def test_good_links_pass(tmp_path: Path) -> None:
    docs = tmp_path / "repo" / "docs"
    (docs / "img").mkdir(parents=True)
    (docs / "img" / "plot.png").write_bytes(b"")
    (docs / "other.md").write_text("# Other\n\n## A `code` heading: here\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    page = docs / "page.md"
    page.write_text(
        "# Page\n\n[o](other.md#a-code-heading-here) [t](other.md#twice-1) ![p](img/plot.png) "
        "[web](https://example.com/x.md) [self](#page) [up](../docs/other.md) `a shared/ folder`\n",
        encoding="utf-8",
    )
    assert page_problems(page, tmp_path / "repo") == []
