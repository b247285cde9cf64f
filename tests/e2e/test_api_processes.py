"""``splitbus up --api-workers 2``: two API processes on the port, placing requests themselves
(``--dispatch api``) side by side, and restarted whole when one of them is killed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from splitbus.bus.core.keys import Keys
from tests.e2e.conftest import start_system, stop_system
from tests.e2e.test_splitwise import _fifty_concurrent_requests


def test_two_api_processes_place_fifty_requests_themselves(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--dispatch", "api", "--api-workers", "2")
    try:
        system.wait_output(r"API on \S+ \(2 processes, nodes \S+-0\.\.\S+-1,")
        _fifty_concurrent_requests(system)
        assert system.redis().xlen(Keys().requests) == 0  # every request placed by an API process
    finally:
        assert stop_system(system) == []


def test_a_killed_api_process_has_up_restart_the_api_whole(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--api-workers", "2")
    try:
        parent = system.pid_of(r"main api ")
        processes = [pid for pid in system.descendants() if _parent(pid) == parent and _spawned(pid)]
        assert len(processes) == 2
        mark = len(system.output)
        os.kill(processes[1], signal.SIGKILL)
        system.wait_output(
            r"^api\s+\| API process api-1 \(pid \d+\) was killed by SIGKILL: stopping the others", 30, mark
        )
        system.wait_output(r"^api exited with code 1 after", 30, mark)
        system.wait_output(r"^api restarted \(pid \d+\)", 30, mark)
        restarted = next(i for i in range(mark, len(system.output)) if system.output[i].startswith("api restarted"))
        # a ready line of the new processes: the old ones may have printed theirs after the kill
        system.wait_output(r"^api\s+\| .* api\d\s+INFO .* ready; models: tiny", 60, restarted)
        _fifty_concurrent_requests(system)  # the restarted processes answer, exactly
    except BaseException:
        print("".join(system.output))  # the parts' own lines say what went wrong
        raise
    finally:
        assert stop_system(system) == []


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def _spawned(pid: int) -> bool:
    try:
        return "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False
