"""Child processes of ``splitbus up``: started with their logs prefixed, stopped together.

Each child gets PR_SET_PDEATHSIG, so a ``kill -9`` of the supervisor still ends it, and its own
session, so a terminal's Ctrl-C reaches only the supervisor, which then stops the children in
order (API first, Redis last).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Mapping

from splitbus.redis_server import die_with_parent


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self._print_lock = threading.Lock()
        self._reported: set[str] = set()

    def start(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> Child:
        """Start ``splitbus ARGS``; ``env`` adds to (or overrides) this process's environment:
        secrets go there, never in ``args`` (which ``ps`` shows to every user)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitbus.cli.main", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
        child = Child(name, proc)
        self.children.append(child)
        threading.Thread(target=self._relay, args=(name, proc.stdout), daemon=True).start()
        return child

    def _relay(self, name: str, stream: IO[bytes] | None) -> None:
        assert stream is not None
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            with self._print_lock:
                print(f"{name:<10}| {line}", flush=True)

    def failed(self) -> str | None:
        """Why the system cannot go on: the API exited, or every scheduler did. A worker that
        exits is reported once and the rest go on serving (its requests fail or move)."""
        for child in self.children:
            code = child.proc.poll()
            if code is not None and child.name not in self._reported:
                self._reported.add(child.name)
                print(f"{child.name} exited with code {code}", flush=True)
        if any(c.name == "api" and c.proc.poll() is not None for c in self.children):
            return "the API exited"
        schedulers = [c for c in self.children if c.name.startswith("scheduler")]
        if schedulers and all(c.proc.poll() is not None for c in schedulers):
            return "every scheduler exited"
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            try:
                child.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
