"""The pieces of ``splitbus api --workers N`` (splitbus/api/procs.py): the default count, the node
ids, the shared port, and the parent that runs the group."""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
import time

import pytest

from splitbus.api import procs
from splitbus.api.procs import Ending, NoReusePort, default_workers, node_ids, reuse_port_socket, run_group
from splitbus.redis_server import free_port


def test_the_default_count_is_the_cores_from_one_to_the_cap() -> None:
    assert [default_workers(n) for n in (1, 2, 8, 9, 128)] == [1, 2, 8, 8, 8]
    assert default_workers(0) == 1


def test_each_process_is_a_node_named_after_the_given_one() -> None:
    assert node_ids("api-7f", 3) == ["api-7f-0", "api-7f-1", "api-7f-2"]


def test_several_sockets_share_one_port_and_each_accepts() -> None:
    port = free_port()
    first, second = reuse_port_socket("127.0.0.1", port, 16), reuse_port_socket("127.0.0.1", port, 16)
    try:
        assert first.getsockname() == second.getsockname() == ("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # one of the two queues holds it
    finally:
        first.close()
        second.close()


def test_a_port_held_without_reuse_port_is_refused() -> None:
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(1)
    try:
        with pytest.raises(OSError) as failed:
            reuse_port_socket("127.0.0.1", plain.getsockname()[1], 16)
        assert not isinstance(failed.value, NoReusePort)  # EADDRINUSE, said as such
    finally:
        plain.close()


def test_a_system_without_reuse_port_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(socket, "SO_REUSEPORT")
    with pytest.raises(NoReusePort, match="no SO_REUSEPORT: run the API with --workers 1"):
        reuse_port_socket("127.0.0.1", 0, 16)


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def _exit_with(code: int) -> None:
    sys.exit(code)


def test_a_process_that_ends_stops_the_group_as_failed() -> None:
    said: list[str] = []
    ending = run_group([_sleep_forever, functools.partial(_exit_with, 3), _sleep_forever], said.append)
    assert ending is Ending.FAILED
    assert said == [said[0]] and "api-1" in said[0] and "exited with code 3: stopping the others" in said[0]


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
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # the parent's own are back


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
