"""Console transcripts in the docs, run as tests.

Sybil (its markdown ``CodeBlockParser`` and ``SkipParser``) finds the blocks of a page; this module
is the evaluator for the ```` ```console ```` ones: it runs each command in the page's one bash
session and compares what it printed with the lines the page shows under it, with doctest's
``OutputChecker`` (``ELLIPSIS``).

The syntax of a checked block (also in README.md, "Docs that are tests"):

- ``$ COMMAND`` starts a command. A line ending in ``\\`` continues it; a command with a
  here-document (``<<'EOF'``) takes the lines up to ``EOF``.
- The lines up to the next ``$ `` are what it prints, stdout and stderr together. Trailing spaces
  and the blank lines at the end of an output are not compared.
- ``...`` is the placeholder: it stands for any text, in a line (an id, a port, a timestamp, a
  timing, a secret) or alone on a line (any number of lines).
- ``127.0.0.1:8000`` (in Python, ``('127.0.0.1', 8000)``) is the API of the system under test: its
  real address in a command, and its real address printed is compared as ``127.0.0.1:8000``.

A block whose output cannot be checked (a real checkpoint, Docker, a long-running server) has
Sybil's skip marker above it, ``<!-- skip: next "why" -->`` (or ``skip: start`` ... ``skip: end``),
and a visible sentence saying so; the test reports it as skipped, with the reason.
"""

from __future__ import annotations

import doctest
import queue
import re
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from sybil import Example

DOC_API = "127.0.0.1:8000"
DOC_API_PAIR = "('127.0.0.1', 8000)"
SENTINEL = "__splitbus_docs_done__"
COMMAND_TIMEOUT_S = 30.0
_HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")
_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS


@dataclass(frozen=True)
class Command:
    """One ``$`` command of a block: its text, the output the page shows, its line in the page."""

    text: str
    expected: str
    line: int


def parse(source: str, first_line: int = 1) -> list[Command]:
    """The commands of a console block (``first_line``: the page's line of its first line)."""
    lines = source.splitlines()
    if lines and not lines[0].startswith("$ "):
        raise ValueError(f"line {first_line}: a console block starts with a '$ ' command")
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        start = i
        text, i = _command_text(lines, i)
        output_start = i
        while i < len(lines) and not lines[i].startswith("$ "):
            i += 1
        commands.append(Command(text, "\n".join(lines[output_start:i]), first_line + start))
    return commands


def _command_text(lines: list[str], i: int) -> tuple[str, int]:
    """The command that starts at line ``i`` (continuations and here-documents joined), and the
    index of the line after it."""
    text = [lines[i][2:]]
    i += 1
    while text[-1].endswith("\\") and i < len(lines):
        text.append(lines[i])
        i += 1
    heredoc = _HEREDOC.search(text[0])
    if heredoc:
        while i < len(lines) and lines[i] != heredoc.group(1):
            text.append(lines[i])
            i += 1
        text.append(lines[i] if i < len(lines) else heredoc.group(1))
        i += 1
    return "\n".join(text), i


def normalize(output: str) -> str:
    """Trailing spaces and the trailing blank lines dropped: neither is visible on a page."""
    return "\n".join(line.rstrip() for line in output.splitlines()).rstrip("\n") + "\n"


def mismatch(command: Command, got: str) -> str | None:
    """None when ``got`` matches the page, else a diff that names the page's line."""
    want, got = normalize(command.expected), normalize(got)
    if _CHECKER.check_output(want, got, _FLAGS):
        return None
    example = doctest.Example(command.text, want)
    diff = _CHECKER.output_difference(example, got, _FLAGS | doctest.REPORT_UDIFF)
    return f"line {command.line}: $ {command.text}\n{diff}"


class Shell:
    """One bash for a whole page, so a variable set by one command is there for the next."""

    def __init__(self, cwd: Path, env: dict[str, str], api_port: int) -> None:
        self.api, self.api_pair = f"127.0.0.1:{api_port}", f"('127.0.0.1', {api_port})"
        self._proc = subprocess.Popen(
            ["bash", "--norc", "--noprofile"],
            cwd=cwd,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def run(self, command: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        """What ``command`` printed, stdout and stderr together; its stdin is empty. Raises
        TimeoutError past ``timeout_s`` (the shell is then closed)."""
        assert self._proc.stdin is not None
        script = command.replace(DOC_API, self.api).replace(DOC_API_PAIR, self.api_pair)
        self._proc.stdin.write(f"{{ {script}\n}} </dev/null 2>&1\nprintf '\\n{SENTINEL}\\n'\n")
        self._proc.stdin.flush()
        return self._collect(timeout_s).replace(self.api, DOC_API)

    def _collect(self, timeout_s: float) -> str:
        out: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"no end of output within {timeout_s}s; so far:\n{''.join(out)}") from None
            if line is None:
                raise RuntimeError("the shell exited; it printed:\n" + "".join(out))
            if line.rstrip("\n") == SENTINEL:
                return "".join(out)[:-1]  # the newline printed before the sentinel
            out.append(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(10)


def evaluate(example: Example) -> str | None:
    """Sybil's evaluator for a console block: None if every command printed what the page shows."""
    shell: Shell = example.namespace["shell"]
    for command in parse(example.parsed, example.line + 1):
        failed = mismatch(command, shell.run(command.text))
        if failed:
            return f"{example.path}, {failed}"
    return None
