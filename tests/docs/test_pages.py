"""The console transcripts of README.md and docs/*.md, run against one live
``splitbus up --engine sim`` (a fresh data folder) and compared with what the pages show.

Each ```` ```console ```` block is one test, named ``PAGE:LINE``; a block marked
``<!-- skip: next "why" -->`` is reported as skipped with its reason. The syntax of a block (its
``...`` placeholder, the API shown as ``127.0.0.1:8000``) is in ``transcript.py``.

The commands run in a folder whose ``.splitbus`` is the system's data folder (so
``.splitbus/redis/…`` and ``splitbus status`` / ``splitbus redis-cli`` find it, as they do for a
user who ran ``up`` there), with ``SPLITBUS_DATA_DIR`` pointing at it, ``.venv`` linked to the
virtual environment that runs the tests (first on ``PATH``), and ``$KEY`` the system's API key.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import SkipTest

import pytest
from sybil import Document, Example
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

from tests.docs.transcript import Shell, evaluate
from tests.e2e.conftest import System, start_system, stop_system

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", *sorted(str(page.relative_to(ROOT)) for page in (ROOT / "docs").glob("*.md")))
"""Every page: one with no transcript has nothing to run, and a new page is checked unasked."""
API_KEY = "docs-test-key"


def _documents() -> list[Document]:
    return [Document.parse(str(ROOT / page), CodeBlockParser("console", evaluate), SkipParser()) for page in PAGES]


def _groups() -> Iterator[pytest.param]:
    """Each console block with the skip markers before it (they set whether it runs), in page order."""
    for document in _documents():
        page = Path(document.path).relative_to(ROOT)
        pending: list[Example] = []
        for example in document:
            pending.append(example)
            if example.region.evaluator is evaluate:
                yield pytest.param(pending, id=f"{page}:{example.line}")
                pending = []
        assert not any(e.parsed[0] != "end" for e in pending), f"{page}: a skip marker with no block after it"


class Pages:
    """The running system and one shell per page."""

    def __init__(self, system: System, folder: Path) -> None:
        self.system, self.folder = system, folder
        self.shells: dict[str, Shell] = {}

    def shell(self, page: str) -> Shell:
        if page not in self.shells:
            port = int(self.system.base_url.rsplit(":", 1)[1])
            self.shells[page] = Shell(self.folder, _shell_env(self.folder), port)
        return self.shells[page]


def _shell_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPLITBUS_", "REDISCLI_"))}
    bin_dir = str(folder / ".venv" / "bin")
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", SPLITBUS_DATA_DIR=str(folder / ".splitbus"), KEY=API_KEY)
    return env


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pages]:
    folder = tmp_path_factory.mktemp("docs")
    (folder / ".venv").symlink_to(Path(sys.prefix))
    # docs/redis-cli.md inspects a finished request's stream: kept 120 s, not the default 5 s. One
    # API process: docs/api.md shows its per-process bounds (the 9th large body of one process).
    system = start_system(
        folder / ".splitbus",
        "--result-grace",
        "120",
        "--api-workers",
        "1",
        environ={"SPLITBUS_API_KEYS": API_KEY},
    )
    running = Pages(system, folder)
    yield running
    for shell in running.shells.values():
        shell.close()
    assert stop_system(system) == []


@pytest.mark.parametrize("examples", list(_groups()))
def test_console_block(examples: list[Example], pages: Pages) -> None:
    page = str(Path(examples[0].path).relative_to(ROOT))
    for example in examples:
        example.namespace["shell"] = pages.shell(page)
        try:
            example.evaluate()  # a mismatch raises SybilFailure with the diff
        except SkipTest as marked:  # the page's skip marker: the summary names the block and says why
            pytest.skip(f"{page}:{examples[-1].line}: {marked}")


@pytest.mark.parametrize("page", PAGES)
def test_every_transcript_is_a_console_block(page: str) -> None:
    """A block that shows ``$ command`` is checked, or skipped with a reason: never silently
    left out because of its language tag."""
    document = Document(Path(ROOT / page).read_text(), str(ROOT / page))
    lexer = FencedCodeBlockLexer(language=r"[\w-]*")
    wrong = [
        document.line_column(region.start)
        for region in lexer(document)
        if region.lexemes["language"] != "console" and str(region.lexemes["source"]).startswith("$ ")
    ]
    assert wrong == [], f"{page}: transcripts not tagged console at {wrong}"
