"""An API process stops non-zero when one of its background loops fails: the loops of
splitbus/api/state.py run under splitbus/bus/core/loops.py, whose policy stops the process on a
loop's bug (SIGTERM at itself: uvicorn's graceful shutdown), and cli/api_cmd.py returns the
exit code the app kept. The failure is a real one, as tests/faults/test_fatal_exit.py makes
for the scheduler and the worker: the request stream replaced by a string, so the backlog
loop's XLEN fails with WRONGTYPE, which no retry can fix (it is no entry to dead-letter)."""

from __future__ import annotations

import signal
import subprocess
import uuid
from pathlib import Path

import httpx
import redis as sync_redis

from splitbus.bus.core.loops import EXIT_FATAL
from splitbus.redis_server import EmbeddedRedis
from tests.api.conftest import start_api, stop_api


def test_api_exits_non_zero_when_a_background_loop_fails(
    redis_server: EmbeddedRedis, redis_admin: sync_redis.Redis, tiny_model: Path, tmp_path: Path
) -> None:
    prefix = f"apifatal{uuid.uuid4().hex[:6]}"  # its own keys: the module's API is not touched
    log = tmp_path / "api.log"
    api = start_api(redis_server.url, prefix, [tiny_model], stderr=log)
    try:
        assert httpx.get(api.url + "/health", timeout=5).status_code == 200
        redis_admin.set(api.config.keys.requests, "not a stream")
        code = api.proc.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the API did not stop on its loop's failure:\n{log.read_text()}") from None
    finally:
        stop_api(api)
        redis_admin.delete(api.config.keys.requests)
    text = log.read_text()
    assert code == EXIT_FATAL, text
    assert ": read_backlog failed; stopping the API" in text and "WRONGTYPE" in text, text


def test_api_stopped_from_outside_still_ends_by_its_signal(redis_server: EmbeddedRedis, tiny_model: Path) -> None:
    # The other side of cli/api_cmd.py's handling of uvicorn's repeated SIGTERM: only the API's
    # own SIGTERM (after a loop's failure) is dropped.
    api = start_api(redis_server.url, f"apistop{uuid.uuid4().hex[:6]}", [tiny_model])
    try:
        api.proc.send_signal(signal.SIGTERM)
        assert api.proc.wait(30) == -signal.SIGTERM
    finally:
        stop_api(api)
