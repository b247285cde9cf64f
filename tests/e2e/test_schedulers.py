"""Scheduler replicas share the request stream: each request is dispatched exactly once (on a
single Redis and on a cluster)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import openai

from splitbus.bus.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import start_system, stop_system


def test_two_replicas_dispatch_each_of_200_requests_once(tmp_path: Path, bus_environ: dict[str, str]) -> None:
    system = start_system(tmp_path, "--schedulers", "2", environ=bus_environ)
    try:

        async def run() -> list[str]:
            client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=120)
            sem = asyncio.Semaphore(64)

            async def one(i: int) -> str:
                async with sem:
                    reply = await client.completions.create(model="tiny", prompt=f"r{i}", max_tokens=4, seed=i)
                    return reply.choices[0].text

            try:
                return await asyncio.gather(*(one(i) for i in range(200)))
            finally:
                await client.close()

        assert asyncio.run(run()) == [sim_text(i, 4) for i in range(200)]
        r = system.redis()
        tasks: Counter[tuple[str, str]] = Counter()
        for worker in r.zrange(Keys().workers, 0, -1):
            for _, fields in r.xrange(Keys().tasks(worker)):
                import orjson

                task = orjson.loads(fields["data"])
                tasks[(task["request"]["request_id"], task["phase"])] += 1
        requests = {rid for rid, _ in tasks}
        assert len(requests) == 200
        assert all(tasks[(rid, phase)] == 1 for rid in requests for phase in ("prefill", "decode"))
        consumers = r.xinfo_consumers(Keys().requests, "schedulers")
        assert len(consumers) == 2 and all(c["pending"] == 0 for c in consumers)
    finally:
        assert stop_system(system) == []


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--prefill", "2", "--decode", "2")
    children = system.descendants()
    assert len(children) >= 6  # redis, scheduler, 2 prefill, 2 decode, api
    assert stop_system(system) == []
    assert "stopped (SIGINT)" in "".join(system.output)
    assert system.proc.returncode == 0
