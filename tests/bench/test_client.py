"""``splitbus bench client``: the redis-py clients' side, a tiny run on a real Redis."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from splitbus.bench import client
from splitbus.bench.client import OPS, ClientBenchConfig, measure, on_plain_pool, table
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.pool import BusPool
from splitbus.bus.core.wire import BusConnection
from splitbus.redis_server import EmbeddedRedis

REDIS_PY = ("bus-connect", "bus-settings", "redis-py", "redis-py-pure")
TINY = ClientBenchConfig(rounds=2, calls=6, wakes=3, pipeline=4, step_streams=3, clients=REDIS_PY)


async def test_every_operation_is_timed_per_call_for_each_client(redis_server: EmbeddedRedis) -> None:
    lines: list[str] = []
    report = await measure(redis_server.admin_url, TINY, lines.append)
    assert list(report["clients"]) == list(REDIS_PY) and report["skipped"] == {}
    expected = {"ping": 12, "xadd": 12, "wake_xreadgroup": 6, "wake_xread": 6, "evalsha": 12, "pipeline": 2}
    for summary in report["clients"].values():
        assert {op: summary["ops"][op]["n"] for op in OPS} == expected  # two rounds pooled
        for op in OPS:
            row = summary["ops"][op]
            assert 0 < row["p50_us"] <= row["p99_us"]
            assert row["round_p50_us"][0] <= row["round_p50_us"][1]
            assert len(row["p50_by_round_us"]) == TINY.rounds
            assert row["round_p50_us"] == [min(row["p50_by_round_us"]), max(row["p50_by_round_us"])]
    assert len(lines) == 2 * len(REDIS_PY) and "wake_xread" in lines[0]


async def test_the_parser_each_client_reads_replies_with(redis_server: EmbeddedRedis) -> None:
    """hiredis is a dependency (``redis[hiredis]``): redis-py picks it for the bus's own
    connections too; the pure client is on redis-py's Python parser."""
    report = await measure(redis_server.admin_url, ClientBenchConfig.quick(REDIS_PY), lambda _: None)
    parsers = {name: c["parser"] for name, c in report["clients"].items()}
    assert parsers == {
        "bus-connect": "_AsyncHiredisParser",
        "bus-settings": "_AsyncHiredisParser",
        "redis-py": "_AsyncHiredisParser",
        "redis-py-pure": "_AsyncRESP2Parser",
    }


async def test_bus_settings_are_connects_on_a_pool_that_never_waits(redis_server: EmbeddedRedis) -> None:
    bus = connect(BusConfig(redis_url=redis_server.url), name="bench-client")
    plain = on_plain_pool(bus)
    try:
        assert isinstance(bus.connection_pool, BusPool)
        assert type(plain.connection_pool) is aioredis.ConnectionPool  # redis-py's own, which never waits
        assert plain.connection_pool.connection_class is bus.connection_pool.connection_class is BusConnection
        assert plain.connection_pool.connection_kwargs == bus.connection_pool.connection_kwargs
        assert plain.connection_pool.max_connections == bus.connection_pool.max_connections
        assert await plain.ping()
    finally:
        await plain.aclose()
        await bus.aclose()


async def test_what_the_operations_write_is_real_and_deleted_after(redis_server: EmbeddedRedis) -> None:
    admin = redis_server.admin_client()
    try:
        commands_before = _calls(admin)
        await measure(redis_server.admin_url, TINY, lambda _: None)
        calls = {name: n - commands_before.get(name, 0) for name, n in _calls(admin).items()}
        assert not list(admin.scan_iter(match="bench-client-*"))
    finally:
        admin.close()
    rounds = TINY.rounds * len(REDIS_PY)
    assert calls["xreadgroup"] >= TINY.wakes * rounds and calls["xread"] >= TINY.wakes * rounds
    # The write_step script: its warm-up calls and the timed ones, each writing every step stream.
    assert calls["evalsha"] == (TINY.calls + 2) * rounds
    # Each XADD timed, one per wake, the pipeline's, and one per step stream in each script call.
    assert (
        calls["xadd"] >= (TINY.calls + TINY.wakes * 2 + TINY.pipeline + (TINY.calls + 2) * TINY.step_streams) * rounds
    )


class _Closed:
    """A side that notes its close, and nothing else."""

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_a_client_whose_second_connection_fails_closes_its_first(monkeypatch: pytest.MonkeyPatch) -> None:
    writer = _Closed()
    opened: list[object] = [writer, ConnectionError("refused")]

    async def open_side(name: str, url: str) -> object:
        side = opened.pop(0)
        if isinstance(side, Exception):
            raise side
        return side

    monkeypatch.setattr(client, "open_side", open_side)
    with pytest.raises(ConnectionError, match="refused"):
        await client._client_round("redis-py", "redis://unused", None, TINY)  # type: ignore[arg-type]
    assert writer.closed


async def test_a_read_that_never_blocks_is_cancelled_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Admin:
        async def info(self, section: str) -> dict[str, int]:
            return {"blocked_clients": 0}  # the read never arrives

    monkeypatch.setattr(client, "BLOCKED_WAIT_S", 0.05)
    reading = asyncio.ensure_future(asyncio.sleep(3600))
    with pytest.raises(RuntimeError, match="did not block within"):
        await client._until_blocked(Admin(), 1, reading)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert reading.cancelled()


def test_the_admin_connection_has_a_socket_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, object]] = []

    def from_url(url: str, **settings: object) -> aioredis.Redis:
        made.append(settings)
        raise ConnectionError("noted")

    monkeypatch.setattr(aioredis.Redis, "from_url", from_url)
    with pytest.raises(ConnectionError, match="noted"):
        asyncio.run(measure("redis://unused", ClientBenchConfig.quick(("redis-py",)), lambda _: None))
    assert made == [{"protocol": 2, "socket_timeout": client.ADMIN_TIMEOUT_S}]


def _calls(admin: sync_redis.Redis) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


async def test_glide_not_importable_is_reported_not_measured(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "glide_module", lambda: (None, "not importable (no module named 'glide')"))
    config = ClientBenchConfig.quick(("redis-py", "glide"))
    report = await measure(redis_server.admin_url, config, lambda _: None)
    assert list(report["clients"]) == ["redis-py"]
    assert report["skipped"] == {"glide": "not importable (no module named 'glide')"}
    assert "glide: not measured, not importable" in table(report)


@pytest.mark.parametrize(
    "options",
    [
        {"rounds": 0},
        {"calls": 0},
        {"wakes": 0},
        {"pipeline": 0},
        {"step_streams": 0},
        {"clients": ("redis-py", "jedis")},
    ],
)
def test_bad_settings_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ClientBenchConfig(**options)  # type: ignore[arg-type]


def test_the_table_has_a_row_per_operation_and_the_parsers() -> None:
    row = {"n": 1, "p50_us": 41.6, "p99_us": 1234.0, "round_p50_us": [41.6, 41.6]}
    report = {"clients": {"redis-py": {"parser": "_AsyncHiredisParser", "ops": dict.fromkeys(OPS, row)}}, "skipped": {}}
    lines = table(report).splitlines()
    assert [line.split()[0] for line in lines[2 : 2 + len(OPS)]] == list(OPS)
    assert "42 / 1,234" in lines[2] and "_AsyncHiredisParser" in lines[-1]


def test_the_cli_runs_and_writes_json_and_png(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    argv = ("--quick", "--clients", "redis-py", "glide", "--redis-url", redis_server.admin_url, "--out", str(tmp_path))
    proc = _cli(*argv, "--glide-path", str(tmp_path / "no-glide-here"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench_client.json").read_text())
    assert report["config"]["clients"] == ["redis-py", "glide"] and report["machine"]["cpus"]
    assert "redis-py" in report["clients"]
    assert ("glide" in report["clients"]) != ("glide" in report["skipped"])  # measured where installed, else why not
    assert (tmp_path / "bench_client.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wake_xreadgroup" in proc.stdout


def test_the_cli_refuses_an_unknown_client(tmp_path: Path) -> None:
    proc = _cli("--clients", "jedis", "--out", str(tmp_path))
    assert proc.returncode == 2 and "splitbus bench client:" in proc.stdout + proc.stderr
    assert not (tmp_path / "bench_client.json").exists()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "splitbus.cli.main", "bench", "client", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)
