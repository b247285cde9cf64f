"""The pieces of ``splitbus api --workers N`` (splitbus/api/procs.py): the default count, the node
ids, the shared port and its check, and the parent that runs the group."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import uvicorn
from starlette.applications import Starlette

from splitbus.api import procs
from splitbus.api.procs import (
    Ending,
    NoReusePort,
    cgroup_cpus,
    check_port,
    default_workers,
    node_ids,
    reuse_port_socket,
    run_group,
    usable_cpus,
)
from splitbus.cli.api_cmd import GRACEFUL_SHUTDOWN_S, LISTEN_BACKLOG
from splitbus.cli.supervisor import Supervisor
from splitbus.redis_server import free_port


def test_the_default_count_is_the_cores_from_one_to_the_cap() -> None:
    assert [default_workers(n) for n in (1, 2, 8, 9, 128)] == [1, 2, 8, 8, 8]
    assert default_workers(0) == 1


def test_the_cores_are_this_process_s_own_lowered_to_its_cgroup_s_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    monkeypatch.setattr(procs, "cgroup_cpus", lambda: None)
    assert usable_cpus() == 4
    monkeypatch.setattr(procs, "cgroup_cpus", lambda: 2)
    assert usable_cpus() == default_workers() == 2
    monkeypatch.setattr(sys, "platform", "darwin")
    assert usable_cpus() == 1  # SO_REUSEPORT spreads connections over processes on Linux only


@pytest.mark.parametrize(("cpu_max", "cores"), [("250000 100000\n", 3), ("50000 100000\n", 1), ("max 100000\n", None)])
def test_a_cgroup_quota_is_rounded_up_to_whole_cores(tmp_path: Path, cpu_max: str, cores: int | None) -> None:
    (tmp_path / "cgroup").write_text("0::/box/api\n")
    (tmp_path / "box" / "api").mkdir(parents=True)
    (tmp_path / "box" / "api" / "cpu.max").write_text(cpu_max)
    assert cgroup_cpus(tmp_path / "cgroup", tmp_path) == cores


def test_without_a_cgroup_v2_quota_there_is_none(tmp_path: Path) -> None:
    (tmp_path / "cgroup").write_text("12:cpu,cpuacct:/box\n")  # cgroup v1 only
    assert cgroup_cpus(tmp_path / "cgroup", tmp_path) is None
    (tmp_path / "cgroup").write_text("0::/absent\n")
    assert cgroup_cpus(tmp_path / "cgroup", tmp_path) is None


def test_each_process_is_a_node_named_after_the_given_one() -> None:
    assert node_ids("api-7f", 3) == ["api-7f-0", "api-7f-1", "api-7f-2"]


def test_several_sockets_share_one_port_and_each_accepts() -> None:
    port = free_port()
    first, second = reuse_port_socket("127.0.0.1", port), reuse_port_socket("127.0.0.1", port)
    try:
        assert first.getsockname() == second.getsockname() == ("127.0.0.1", port)
        first.listen(16)
        second.listen(16)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # one of the two queues holds it
    finally:
        first.close()
        second.close()


def test_a_bound_socket_takes_no_connection_until_it_listens() -> None:
    """A process does not listen before it can serve: until then the kernel gives its socket no
    connection (here, with no other socket on the port, the client is refused)."""
    sock = reuse_port_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        sock.listen(16)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        sock.close()


def test_uvicorn_listens_on_a_given_socket_only_once_the_app_has_started() -> None:
    """``serve`` hands uvicorn a bound socket (its loop as the API runs it: uvloop here): no
    connection is queued for a process whose startup is still running, or failing."""
    sock = reuse_port_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    starting, release = threading.Event(), threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        starting.set()
        await anyio.to_thread.run_sync(release.wait)
        yield

    options = {"log_level": "warning", "loop": "auto", "backlog": LISTEN_BACKLOG}
    server = uvicorn.Server(uvicorn.Config(Starlette(lifespan=lifespan), **options))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        assert starting.wait(30)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        release.set()
        _connect_when_listening(port)
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
        sock.close()


def _connect_when_listening(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "uvicorn never listened"
            time.sleep(0.05)


def test_a_port_another_group_listens_on_is_found_in_use() -> None:
    """The other group's sockets have SO_REUSEPORT, so this group's would join them: the check
    binds without it."""
    other = reuse_port_socket("127.0.0.1", 0)
    other.listen(16)
    try:
        with pytest.raises(OSError, match="Address already in use"):
            check_port("127.0.0.1", other.getsockname()[1])
    finally:
        other.close()


def test_a_port_left_in_time_wait_by_a_stopped_group_is_free() -> None:
    listener = reuse_port_socket("127.0.0.1", 0)
    listener.listen(16)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    accepted, _ = listener.accept()
    accepted.close()  # the server side closes first: its end waits in TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    check_port("127.0.0.1", port)
    reuse_port_socket("127.0.0.1", port).close()


def test_a_port_held_without_reuse_port_is_refused() -> None:
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(1)
    try:
        with pytest.raises(OSError) as failed:
            reuse_port_socket("127.0.0.1", plain.getsockname()[1])
        assert not isinstance(failed.value, NoReusePort)  # EADDRINUSE, said as such
        with pytest.raises(OSError) as failed:
            check_port("127.0.0.1", plain.getsockname()[1])
        assert not isinstance(failed.value, NoReusePort)
    finally:
        plain.close()


def test_a_system_without_reuse_port_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(socket, "SO_REUSEPORT")
    with pytest.raises(NoReusePort, match="no SO_REUSEPORT: run the API with --workers 1"):
        reuse_port_socket("127.0.0.1", 0)
    with pytest.raises(NoReusePort, match="no SO_REUSEPORT: run the API with --workers 1"):
        check_port("127.0.0.1", 0)


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def _exit_with(code: int) -> None:
    sys.exit(code)


def _pid_then_sleep(path: str) -> None:
    Path(path).write_text(str(os.getpid()))
    _sleep_forever()


def _deaf_then_sleep(path: str) -> None:
    """A process that ignores SIGTERM, and says so (its pid in ``path``) once it does."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _pid_then_sleep(path)


def _exit_once_written(path: str, code: int) -> None:
    while not Path(path).exists():
        time.sleep(0.01)
    sys.exit(code)


def test_a_process_that_ends_stops_the_group_as_failed() -> None:
    said: list[str] = []
    ending = run_group([_sleep_forever, functools.partial(_exit_with, 3), _sleep_forever], said.append)
    assert ending is Ending.FAILED
    assert said == [said[0]] and "api-1" in said[0] and "exited with code 3: stopping the others" in said[0]
    assert Ending.FAILED.exit_code == 1


def test_a_process_that_refuses_to_start_makes_the_group_a_usage_error() -> None:
    """Exit code 2 (the port cannot be shared): ``splitbus up`` gives up on a 2, not on a 1."""
    ending = run_group([_sleep_forever, functools.partial(_exit_with, procs.EXIT_USAGE)], [].append)
    assert ending is Ending.REFUSED and ending.exit_code == 2


def test_each_stop_ends_before_the_one_above_kills() -> None:
    """Streams are cut before the parent kills a process, and the parent kills before ``splitbus
    up`` kills the parent: an orderly stop comes through the parent."""
    up_kills_after = inspect.signature(Supervisor.stop).parameters["timeout_s"].default
    assert GRACEFUL_SHUTDOWN_S < procs.STOP_TIMEOUT_S < up_kills_after


def test_a_process_deaf_to_sigterm_is_killed_after_the_stop_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(procs, "STOP_TIMEOUT_S", 0.5)
    deaf = str(tmp_path / "deaf")
    targets = [functools.partial(_deaf_then_sleep, deaf), functools.partial(_exit_once_written, deaf, 3)]
    with caplog.at_level(logging.WARNING, logger=procs.__name__):
        assert run_group(targets, [].append) is Ending.FAILED
    assert not _alive(int(Path(deaf).read_text()))
    assert "API process api-0 did not stop within 0.5 s of SIGTERM: killed" in caplog.text


def test_the_processes_die_with_a_killed_parent(tmp_path: Path) -> None:
    """SIGKILL to the parent leaves it no time to stop them: the kernel kills them (PR_SET_PDEATHSIG
    with SIGKILL: these ignore SIGTERM)."""
    script = (
        "import functools, sys\n"
        "from splitbus.api.procs import run_group\n"
        "from tests.api.test_procs import _deaf_then_sleep\n"
        "run_group([functools.partial(_deaf_then_sleep, f'{sys.argv[1]}/{i}') for i in range(2)], print)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
    try:
        pids = [int(_read_when_written(tmp_path / str(i), parent)) for i in range(2)]
    finally:
        parent.kill()
        parent.wait()
    assert _gone(pids) == pids


def _read_when_written(path: Path, parent: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text():
        assert parent.poll() is None and time.monotonic() < deadline, "the process never started"
        time.sleep(0.05)
    return path.read_text()


def _gone(pids: list[int], wait_s: float = 10.0) -> list[int]:
    """Those of ``pids`` that ended within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if not _alive(pid)]


def test_processes_started_before_one_fails_to_start_are_stopped(tmp_path: Path) -> None:
    with pytest.raises(Exception):  # noqa: B017  (a lambda cannot be pickled for a spawned process)
        run_group([functools.partial(_pid_then_sleep, str(tmp_path / "0")), lambda: None], [].append)
    assert multiprocessing.active_children() == []


def test_a_process_ending_as_the_parent_is_stopped_is_part_of_the_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM sent to every process at once (systemd) may end a process before the parent's
    handler runs: the group still ends as stopped, and nothing is said of a failure."""
    real_wait = procs._wait_first

    def ended_then_signalled(group: list, stop: procs._Stop):  # type: ignore[no-untyped-def,type-arg]
        ended = real_wait(group, stop)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before this returns
        return ended

    monkeypatch.setattr(procs, "_wait_first", ended_then_signalled)
    said: list[str] = []
    assert run_group([_sleep_forever, functools.partial(_exit_with, 0)], said.append) is Ending.STOPPED


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_parent_stops_every_process(signum: signal.Signals, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[int]] = []
    real_wait = procs._wait_first

    def wait_then_signal(group: list, stop: procs._Stop):  # type: ignore[no-untyped-def,type-arg]
        started.append([p.pid for p in group])
        threading.Thread(target=os.kill, args=(os.getpid(), signum)).start()
        return real_wait(group, stop)

    monkeypatch.setattr(procs, "_wait_first", wait_then_signal)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    said: list[str] = []
    assert run_group([_sleep_forever, _sleep_forever], said.append) is Ending.STOPPED
    assert said == []
    assert len(started[0]) == 2 and not any(_alive(pid) for pid in started[0])
    assert Ending.STOPPED.exit_code == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # the parent's own are back


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
