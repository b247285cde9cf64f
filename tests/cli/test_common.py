"""What every command shares (``splitbus/cli/common.py``)."""

from __future__ import annotations

import concurrent.futures
import random
import signal
import subprocess
import sys
import time

import pytest

from splitbus.cli import common


class _Writes:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_line_is_said_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """``up`` relays its parts' lines from threads while it speaks itself: a line written in two
    pieces (its text, then its newline) could take another line between them."""
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    common.say("the embedded Redis is back on port 6379")
    assert [c for c in out.calls if c] == ["the embedded Redis is back on port 6379\n"]


_WAITS = """
import sys
from splitbus.cli.common import wait_for_stop

def waiting(told=[]):
    if len(told) < turn:
        told.append(turn)
        print("waiting", flush=True)  # its handlers are in place: the parent may signal

for turn in range(1, int(sys.argv[1]) + 1):
    print(wait_for_stop(waiting, 0.0001), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_signal_always_ends_the_wait_for_stop() -> None:
    """Signals land anywhere in the wait's loop; none may leave it hung. (With the handler setting
    a ``threading.Event``, about 1 signal in 100 deadlocked on the event's lock.)"""
    signals, rng = 300, random.Random(0)
    child = subprocess.Popen([sys.executable, "-c", _WAITS, str(signals)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    reader = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for i in range(signals):
            assert reader.submit(child.stdout.readline).result(timeout=10) == "waiting\n"
            time.sleep(rng.random() * 0.002)  # anywhere in the loop: the sleep, the check, the loop's test
            line = reader.submit(child.stdout.readline)
            child.send_signal(signal.SIGTERM if i % 2 else signal.SIGINT)
            try:
                assert line.result(timeout=5) in ("SIGTERM\n", "SIGINT\n"), f"signal {i + 1}"
            except concurrent.futures.TimeoutError:
                pytest.fail(f"the wait for stop hung at signal {i + 1} of {signals}")
        assert child.wait(10) == 0
    finally:
        child.kill()
        child.wait()
        reader.shutdown()


_ONE_WAIT = """
import signal, sys
from splitbus.cli.common import wait_for_stop
checks = []
signal.signal(signal.SIGUSR1, lambda *_: None)  # a handler of the caller's own: its signal wakes the pipe too
print("ready", flush=True)
print(wait_for_stop(lambda: checks.append(1), float(sys.argv[1])), len(checks), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_signal_ends_a_long_wait_at_once_and_another_signal_does_not_spin_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", _ONE_WAIT, "5"], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGUSR1)
        time.sleep(1.0)  # with its byte left in the pipe, every select would return at once: check() spun
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        reason, checks = child.stdout.readline().split()
        assert reason == "SIGTERM" and time.monotonic() - started < 2.5  # not the rest of a 5 s poll
        assert int(checks) < 10
    finally:
        child.kill()
        child.wait()
