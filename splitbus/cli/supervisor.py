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
from typing import IO

from splitbus.redis_server import _die_with_parent


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self._print_lock = threading.Lock()

    def start(self, name: str, args: list[str]) -> Child:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitbus.cli.main", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"},
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
        """Why the system cannot go on: a child that exited by itself."""
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                return f"{child.name} exited with code {code}"
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
