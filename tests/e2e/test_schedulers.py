"""Scheduler replicas share the request stream: each request is dispatched exactly once (on a
single Redis and on a cluster); Ctrl-C stops every process."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import openai

from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import start_system, stop_system


def test_two_replicas_dispatch_each_of_200_requests_once(tmp_path: Path, bus_environ: dict[str, str]) -> None:
    """Then Ctrl-C stops every process, says so and exits 0 (this was a test of its own, with a
    start of its own: a CI-time cut; every other test's ``stop_system`` checks that no part
    outlives `up` as well)."""
    system = start_system(tmp_path, "--schedulers", "2", environ=bus_environ)
    try:
        # the embedded Redis (not on a cluster), 2 schedulers, a prefill and a decode worker, the API
        assert len(system.descendants()) >= (5 if bus_environ else 6)

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
    assert "stopped (SIGINT)" in "".join(system.output)
    assert system.proc.returncode == 0
