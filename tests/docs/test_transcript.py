"""The docs check itself: it reads blocks as the pages write them, and fails when a command's
output no longer matches the page (the pages' own run is test_pages.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from unittest import SkipTest

import pytest
from sybil import Document
from sybil.example import SybilFailure
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from tests.docs.transcript import Command, Shell, evaluate, mismatch, parse


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Shell]:
    running = Shell(tmp_path, dict(os.environ), api_port=54321)
    yield running
    running.close()


def _page(tmp_path: Path, text: str) -> Document:
    (tmp_path / "page.md").write_text(text)
    return Document.parse(str(tmp_path / "page.md"), CodeBlockParser("console", evaluate), SkipParser())


def test_parse_joins_continuations_and_here_documents() -> None:
    source = "$ echo a \\\n  b\na b\n$ cat <<'EOF'\nx\n$ y\nEOF\nx\n$ true\n"
    assert parse(source, 10) == [
        Command("echo a \\\n  b", "a b", 10),
        Command("cat <<'EOF'\nx\n$ y\nEOF", "x", 13),
        Command("true", "", 18),
    ]


def test_parse_refuses_a_block_that_is_not_a_transcript() -> None:
    with pytest.raises(ValueError, match="line 3: a console block starts with"):
        parse("output without a command\n", 3)


def test_the_placeholder_stands_for_text_in_a_line_and_for_lines() -> None:
    command = Command("x", '{"id":"cmpl-...","n":1}\n...\nlast', 1)
    assert mismatch(command, '{"id":"cmpl-42ab","n":1}\none\ntwo\nlast\n\n') is None
    assert mismatch(command, '{"id":"cmpl-42ab","n":2}\nlast') is not None


def test_a_changed_output_fails_with_a_diff_naming_the_line(shell: Shell) -> None:
    failure = mismatch(Command("echo hello", "goodbye", 7), shell.run("echo hello"))
    assert failure is not None
    assert failure == "line 7: $ echo hello\nExpected:\n    goodbye\nGot:\n    hello\n"


def test_the_shell_keeps_variables_and_merges_stderr(shell: Shell) -> None:
    assert shell.run("X=5") == ""
    assert shell.run("echo $X; echo oops >&2") == "5\noops\n"
    assert shell.run("printf 'no newline'") == "no newline"


def test_the_api_address_is_the_systems_and_prints_as_the_pages(shell: Shell) -> None:
    assert shell.run("echo http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1\n"
    assert shell.run('echo "$(echo 127.0.0.1:8000 | tr -d .)"') == "127001:54321\n"
    assert shell.run("python3 -c \"print(('127.0.0.1', 8000)[1])\"") == "54321\n"


def test_a_command_that_hangs_times_out(shell: Shell) -> None:
    with pytest.raises(TimeoutError, match="no end of output within 0.5s"):
        shell.run("sleep 5", timeout_s=0.5)


def test_a_page_block_fails_when_its_output_changed_and_skips_with_its_reason(tmp_path: Path, shell: Shell) -> None:
    document = _page(
        tmp_path,
        (
            "```console\n$ echo one\none\n```\n\n"
            "```console\n$ echo two\nthree\n```\n\n"
            '<!-- skip: next "needs a GPU" -->\n\n```console\n$ false\nnever run\n```\n'
        ),
    )
    examples = list(document)
    for example in examples:
        example.namespace["shell"] = shell
    examples[0].evaluate()
    with pytest.raises(SybilFailure, match=r"page.md, line 7: \$ echo two"):
        examples[1].evaluate()
    examples[2].evaluate()
    with pytest.raises(SkipTest, match="needs a GPU"):
        examples[3].evaluate()
