"""The embedded redis-server: start, stop, data-folder lock, no orphans; locked down (passwords,
the splitbus ACL user, file modes, nothing secret on argv); ready only once loaded; an AOF that
follows its dataset over many restarts."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from splitbus.redis_server import (
    AOF_REWRITE_MIN_BYTES,
    EmbeddedRedis,
    RedisServerError,
    embedded_url,
    find_redis_cli,
    find_redis_server,
    server_version,
)
from tests.modes import folder_modes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split()[2] != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_found_server_is_recent_enough() -> None:
    assert server_version(find_redis_server())[:2] >= (6, 2)


def test_start_writes_aof_and_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path)
    url = server.start()
    pid = server.pid
    assert pid is not None
    client = redis.Redis.from_url(url)
    assert client.ping()
    assert server.admin_client().config_get("appendonly")["appendonly"] == "yes"
    client.set("k", "v")
    client.close()
    server.stop()
    assert _wait_gone(pid)
    with EmbeddedRedis(tmp_path) as again:  # the AOF brings the data back
        assert redis.Redis.from_url(again.url).get("k") == b"v"


def test_data_folder_is_locked(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path):
        with pytest.raises(RedisServerError, match="in use"):
            EmbeddedRedis(tmp_path).start()


def test_port_in_use_gives_a_clear_error(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a") as first:
        with pytest.raises(RedisServerError, match="exited at start"):
            EmbeddedRedis(tmp_path / "b", port=first.port).start()


def test_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from splitbus.redis_server import EmbeddedRedis\n"
        f"s = EmbeddedRedis({str(tmp_path)!r}); s.start()\n"
        "print(s.pid, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    redis_pid = int(parent.stdout.readline())
    assert _pid_alive(redis_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _wait_gone(redis_pid), "redis-server outlived its killed parent"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_are_private_and_no_secret_is_on_argv(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    data.mkdir(mode=0o755)
    (data / "appendonly.aof").write_bytes(b"")  # an AOF an older splitbus left world-readable
    os.chmod(data / "appendonly.aof", 0o644)
    with EmbeddedRedis(data) as server:
        server.admin_client().set("k", "v" * 1000)
        assert _mode(data) == 0o700
        for path in data.rglob("*"):  # Redis 7 keeps its AOF in parts, in appendonlydir/
            assert _mode(path) == (0o700 if path.is_dir() else 0o600), path.relative_to(data)
        names = {p.name for p in data.iterdir()}
        assert {"redis.conf", "splitbus.password", "admin.password", "redis.log"} <= names
        assert {"appendonly.aof", "appendonlydir"} & names
        argv = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
        conf = server.config_path.read_text()
        for secret in (server.password_path.read_text().strip(), server.admin_password_path.read_text().strip()):
            assert secret not in argv and secret not in conf  # the config holds hashes only
        assert server.url in (embedded_url(data),) and server.admin_url == embedded_url(data, admin=True)


def test_the_splitbus_user_cannot_write_files_or_reconfigure(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = redis.Redis.from_url(server.url)
        for command in (
            ("CONFIG", "SET", "dir", str(target)),
            ("SAVE",),
            ("BGSAVE",),
            ("BGREWRITEAOF",),
            ("CONFIG", "GET", "*"),
            ("MODULE", "LOAD", "/tmp/x.so"),
            ("DEBUG", "SLEEP", "0"),
            ("SHUTDOWN", "NOSAVE"),
            ("FLUSHALL",),
            ("FLUSHDB",),
            ("MONITOR",),
            ("KEYS", "*"),
            ("ACL", "SETUSER", "splitbus", "+@all"),
            ("SLAVEOF", "127.0.0.1", "1"),
            ("CLIENT", "KILL", "TYPE", "normal"),
            ("INFO",),
            ("CLIENT", "LIST"),
        ):
            # Redis 7 refuses MODULE and DEBUG to every user unless enabled in its config, before the ACL
            refusal = (
                redis.exceptions.ResponseError
                if command[0] in ("MODULE", "DEBUG")
                else redis.exceptions.NoPermissionError
            )
            with pytest.raises(refusal, match=r"(?i)permission|not allowed"):
                client.execute_command(*command)
        assert client.ping() and server.alive()
        assert list(target.iterdir()) == []  # the attack wrote nothing
        assert server.admin_client().config_get("dir")["dir"] == str((tmp_path / "redis").resolve())


def test_without_a_password_every_command_is_refused(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        # No retries: redis-py 8 retries a refused command with backoff (17 s for these five).
        once = Retry(NoBackoff(), 0)
        anonymous = redis.Redis(host=server.host, port=server.port, protocol=2, retry=once)
        for command in (("PING",), ("GET", "k"), ("CONFIG", "SET", "dir", "/tmp"), ("XADD", "s", "*", "a", "b")):
            with pytest.raises(redis.exceptions.AuthenticationError):
                anonymous.execute_command(*command)
        wrong = redis.Redis.from_url(
            server.url.replace(server.url.split(":")[2].split("@")[0], "guess" * 8), retry=once
        )
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong.ping()


def test_redis_cli_works_with_the_password_from_the_environment(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        env = {**os.environ, "REDISCLI_AUTH": server.password_path.read_text().strip()}
        cli = [find_redis_cli(server.executable), "--user", "splitbus", "-h", server.host, "-p", str(server.port)]
        out = subprocess.run([*cli, "XADD", "s", "*", "a", "b"], capture_output=True, text=True, env=env, timeout=10)
        assert re.fullmatch(r"\d+-\d+\n", out.stdout), out
        out = subprocess.run([*cli, "CONFIG", "GET", "dir"], capture_output=True, text=True, env=env, timeout=10)
        assert "NOPERM" in out.stdout + out.stderr


def test_maxmemory_fails_writes_instead_of_evicting(tmp_path: Path) -> None:
    with pytest.raises(RedisServerError, match="maxmemory"):
        EmbeddedRedis(tmp_path, maxmemory="lots")
    with EmbeddedRedis(tmp_path, maxmemory="3mb") as server:
        assert server.admin_client().config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        client = redis.Redis.from_url(server.url)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(100):
                client.set(f"k{i}", "x" * 100_000)
        assert client.exists("k0") and client.ping()  # nothing evicted, and it still answers


def _fill(client: redis.Redis, keys: int, size: int, prefix: str = "big") -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        pipe.set(f"{prefix}:{i}", os.urandom(size // 2).hex())
    pipe.execute()


def write_plain_aof(folder: Path, keys: int) -> None:
    """An AOF of ``keys`` SET commands, as Redis writes one without the RDB preamble: loading it
    takes ~2 µs a command, and Redis answers every client LOADING meanwhile (every 1000 commands:
    the RDB preamble would be read in one go, with no answer at all)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(folder / "appendonly.aof", "wb") as f:
        f.write(b"*2\r\n$6\r\nSELECT\r\n$1\r\n0\r\n")
        for start in range(0, keys, 100_000):
            names = (b"load:%d" % i for i in range(start, min(keys, start + 100_000)))
            f.write(b"".join(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\nv\r\n" % (len(k), k) for k in names))


def test_ready_only_once_the_dataset_is_loaded(tmp_path: Path) -> None:
    write_plain_aof(tmp_path, 500_000)  # about 1 s of LOADING
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0))  # LOADING would raise
        assert client.exists("load:499999")  # the first command after start() gets data, not LOADING
        assert server.admin_client().info("persistence")["loading"] == 0


def live_aof(folder: Path) -> Path:
    """The AOF file that takes new writes: ``appendonly.aof`` on Redis 6.2; from 7.0 the last
    incremental part its manifest lists (``appendonlydir/appendonly.aof.<n>.incr.aof``)."""
    manifest = folder / "appendonlydir" / "appendonly.aof.manifest"
    if not manifest.exists():
        return folder / "appendonly.aof"
    parts = [line.split()[1] for line in manifest.read_text().splitlines() if line.endswith("type i")]
    assert parts, f"no incremental AOF in {manifest}"
    return manifest.with_name(parts[-1])


def aof_bytes(folder: Path) -> int:
    """The AOF's size: one file on Redis 6.2, parts in ``appendonlydir/`` from 7.0."""
    size = sum(p.stat().st_size for p in folder.rglob("*.aof*") if p.is_file())
    assert size > 0, f"no AOF under {folder}"
    return size


def test_many_restarts_keep_the_aof_and_the_keys_bounded(tmp_path: Path) -> None:
    """12 start/stop cycles on one folder, each writing and deleting 3 MB (36 MB in all) and
    leaving keys with a TTL: every start succeeds, the AOF stays near its dataset and the key
    count stays flat. Before, the AOF was never rewritten below 64 MB."""
    sizes, counts = [], []
    for cycle in range(12):
        with EmbeddedRedis(tmp_path) as server:
            client = redis.Redis.from_url(server.url)
            _fill(client, 1500, 2048, prefix=f"churn{cycle}")
            client.delete(*[f"churn{cycle}:{i}" for i in range(1500)])
            client.set(f"kept{cycle % 3}", "v")
            client.set(f"expiring{cycle}", "v", px=100)
            time.sleep(0.2)
            counts.append(sum(1 for _ in server.admin_client().scan_iter(count=1000)))
        sizes.append(aof_bytes(tmp_path))
    print(f"AOF bytes after each of 12 cycles: {sizes}; keys: {counts}")
    assert counts[-1] == 3 and max(counts) <= 3
    assert max(sizes) < 2.5 * AOF_REWRITE_MIN_BYTES, sizes  # 36 MB were written through it
    with EmbeddedRedis(tmp_path) as server:
        left = redis.Redis.from_url(server.url).execute_command("SCAN", 0, "COUNT", 100)[1]
        assert sorted(left) == [b"kept0", b"kept1", b"kept2"]


def test_a_killed_server_keeps_every_write_it_acknowledged(tmp_path: Path) -> None:
    """kill -9 under a write load (4 writers, pipelines of 32 XADDs), restart from the AOF: every
    acknowledged entry is there. Redis writes the AOF before it replies, and the page cache
    outlives the process (``appendfsync everysec`` only delays the fsync): a process crash is not
    an OS crash (docs/reliability.md, "Writes Redis loses")."""
    server = EmbeddedRedis(tmp_path)
    server.start()
    acked: list[tuple[int, bytes]] = []
    stop = threading.Event()

    def write(stream: int) -> None:
        client = redis.Redis.from_url(server.url, socket_timeout=1, retry=None)
        sent = 0
        while not stop.is_set():
            try:
                pipe = client.pipeline(transaction=False)
                for i in range(32):
                    pipe.xadd(f"sb:w{stream}", {"v": sent + i})
                acked.extend((stream, entry) for entry in pipe.execute())
                sent += 32
            except redis.RedisError:
                return

    writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for w in writers:
        w.start()
    time.sleep(0.5)
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    stop.set()
    for w in writers:
        w.join(10)
    server.stop()
    server.start()
    try:
        with server.admin_client() as client:
            kept = {(n, entry) for n in range(4) for entry, _ in client.xrange(f"sb:w{n}")}
        assert len(acked) > 1000
        assert [a for a in acked if a not in kept] == []
    finally:
        server.stop()


@pytest.mark.usefixtures("umask_022")
def test_a_data_folder_it_makes_is_0700(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "d" / "redis"):  # started first: it makes the data folder too
        modes = folder_modes(tmp_path / "d")
    assert {".", "redis"} <= modes.keys() and set(modes.values()) == {0o700}
