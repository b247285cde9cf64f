"""``python -m splitbus.bench.dispatch_calls``: what a dispatch costs Redis, by dispatches a turn."""

from __future__ import annotations

from splitbus.bench.dispatch_calls import measure, table
from splitbus.redis_server import EmbeddedRedis


async def test_every_dispatch_is_written_and_timed(redis_server: EmbeddedRedis) -> None:
    rows = await measure(redis_server.admin_url, 40, per_turn=(1, 8, 32))
    assert [(r["per_turn"], r["dispatches"], r["script_calls"]) for r in rows] == [
        (1, 40, 40),
        (8, 40, 40),
        (32, 40, 40),
    ]
    assert all(r["redis_us_per_dispatch"] > 0 and r["wall_us_per_dispatch"] > 0 for r in rows)
    assert "Redis µs/dispatch" in table(rows).splitlines()[0]
