"""Single parts (`splitbus worker`, `splitbus scheduler`) as real processes on the session Redis,
each test under a key prefix of its own, driven at the bus level: tests write tasks and
requests as a scheduler or an API node would, and read result streams and dead letters."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from splitbus.bus.core import codec
from splitbus.bus.core.keys import Keys
from splitbus.bus.messages import Failed, Finished, GenerateRequest, SamplingParams, Task, TokenDelta
from splitbus.redis_server import EmbeddedRedis


@dataclass
class Part:
    proc: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def log(self) -> str:
        return "".join(self.output)

    def wait_for_log(self, pattern: str, timeout_s: float = 60) -> bool:
        return wait_until(lambda: re.search(pattern, self.log()) is not None, timeout_s)

    def wait(self, timeout_s: float = 30) -> int:
        """The exit code, once the process has ended and all its output is read."""
        code = self.proc.wait(timeout_s)
        if self.reader is not None:
            self.reader.join(timeout_s)
        return code

    def stop(self, timeout_s: float = 30) -> int:
        """SIGINT, as Ctrl-C; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.wait(timeout_s)


def wait_until(check: Callable[[], Any], timeout_s: float, poll_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(poll_s)


@dataclass
class Bus:
    """One test's view of the bus: its prefix, a client with full rights, and the parts."""

    redis_url: str
    keys: Keys
    r: sync_redis.Redis
    model: Path
    parts: list[Part] = field(default_factory=list)

    def start(self, *args: str, ready: str) -> Part:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "SPLITBUS_PREFIX": self.keys.prefix,
            "SPLITBUS_REDIS_URL": self.redis_url,
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitbus.cli.main", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        part = Part(proc)
        self.parts.append(part)
        part.reader = threading.Thread(target=part.output.extend, args=(proc.stdout,), daemon=True)
        part.reader.start()
        assert part.wait_for_log(ready), part.log()
        return part

    def worker(self, worker_id: str, *args: str) -> Part:
        return self.start(
            "worker",
            "--role",
            "mixed",
            "--engine",
            "sim",
            "--model",
            str(self.model),
            "--served-model-name",
            "tiny",
            "--worker-id",
            worker_id,
            *args,
            ready=f"worker {worker_id} .* ready",
        )

    def scheduler(self, *args: str) -> Part:
        return self.start("scheduler", "--mode", "mixed", "--name", f"s-{uuid.uuid4().hex[:6]}", *args, ready="started")

    def send(self, stream: str, msg: Any) -> str:
        return self.r.xadd(stream, codec.encode(msg)).decode()

    def send_raw(self, stream: str, type_: str, data: bytes) -> str:
        fields = {b"type": type_.encode(), b"data": data, b"ts": str(codec.now_us()).encode()}
        return self.r.xadd(stream, fields).decode()

    def results(self, request_id: str) -> list[Any]:
        return [codec.decode(f) for _, f in self.r.xrange(self.keys.out(READER, request_id))]

    def outcome(self, request_id: str, timeout_s: float = 30) -> Any:
        """The terminal entry of a request (Finished or Failed), waiting for it; None if none came."""

        def terminal() -> Any:
            return next((e for e in self.results(request_id) if isinstance(e, (Finished, Failed))), None)

        return wait_until(terminal, timeout_s)

    def text(self, request_id: str) -> str:
        return "".join(e.text for e in self.results(request_id) if isinstance(e, (TokenDelta, Finished)))

    def dead_letters(self) -> list[Any]:
        return [codec.decode(f) for _, f in self.r.xrange(self.keys.dead)] if self.r.exists(self.keys.dead) else []

    def wait_for_dead(self, count: int, timeout_s: float = 30) -> list[Any]:
        wait_until(lambda: len(self.dead_letters()) >= count, timeout_s)
        return self.dead_letters()


READER = "api-test"
"""The API node the fault tests' requests name: their result streams are in its slot."""


def request(request_id: str, max_tokens: int = 5, seed: int = 1, prompt: list[int] | None = None) -> GenerateRequest:
    deadline_ms = int((time.time() + 120) * 1000)
    sampling = SamplingParams(max_tokens=max_tokens, seed=seed)
    return GenerateRequest(request_id, "tiny", prompt or [60, 61], sampling, READER, deadline_ms)


def task(request_id: str, **kwargs: Any) -> Task:
    reserved = kwargs.pop("reserved", [0, 0, 0])
    return Task("mixed", request(request_id, **kwargs), reserved=reserved)


@pytest.fixture
def bus(redis_server: EmbeddedRedis, tiny_model: Path) -> Iterator[Bus]:
    admin = redis_server.admin_client()  # bytes replies, unlike the shared ``redis_admin``
    state = Bus(redis_server.url, Keys(f"t{uuid.uuid4().hex[:10]}"), admin, tiny_model)
    try:
        yield state
    finally:
        for part in state.parts:
            if part.proc.poll() is None:
                part.proc.kill()
                part.proc.wait(10)
        admin.close()
