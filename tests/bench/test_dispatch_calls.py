"""``python -m splitbus.bench.dispatch_calls``: what a dispatch costs Redis, by dispatches a turn."""

from __future__ import annotations

from pathlib import Path

from splitbus.bench.dispatch_calls import measure, table
from splitbus.redis_server import EmbeddedRedis


async def test_every_dispatch_is_one_script_call_and_is_timed(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path, appendonly=False)  # its own: the counts are the server's, every client's
    server.start()
    try:
        rows = await measure(server.admin_url, 40, per_turn=(1, 8, 32))
    finally:
        server.stop()
    assert [(r["per_turn"], r["dispatches"], r["script_calls"]) for r in rows] == [
        (1, 40, 40),
        (8, 40, 40),
        (32, 40, 40),
    ]
    assert all(r["redis_us_per_dispatch"] > 0 and r["wall_us_per_dispatch"] > 0 for r in rows)
    assert "Redis µs/dispatch" in table(rows).splitlines()[0]
