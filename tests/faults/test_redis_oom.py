"""Redis at maxmemory (noeviction) refuses every write that needs memory with OOM. The attack:
a decode worker logged "publisher failed; stopping" and exited, and a scheduler died on its
first refused write. Now both wait it out, keep what they could not write, and finish the work
once Redis has memory again."""

from __future__ import annotations

import time

import orjson
import pytest

from splitbus.bus.core import codec
from splitbus.bus.messages import Finished, TokenDelta
from splitbus.worker.engines.sim import sim_text
from tests.faults.conftest import READER, Bus, request, wait_until

OOM_S = 1.5
"""How long Redis refuses writes: under the worker's lease (3 s), so the reaper has no cause to
move its work (a refused heartbeat cannot renew the lease)."""


@pytest.mark.timeout(120)
def test_worker_and_scheduler_wait_out_oom_and_finish_the_work(bus: Bus) -> None:
    worker = bus.worker("w-oom", "--sim-decode-step-ms", "20")
    scheduler = bus.scheduler()
    bus.send(bus.keys.requests, request("r-long", max_tokens=80, seed=11))  # ~1.6 s of decoding
    assert wait_until(lambda: any(isinstance(e, TokenDelta) for e in bus.results("r-long")), 30)
    poison = orjson.loads(orjson.dumps(request("r-poison")))
    poison["prompt_token_ids"] = [4294967296]
    bus.r.config_set("maxmemory-policy", "noeviction")
    try:
        # In one transaction, so the scheduler reads these only once Redis refuses writes: it
        # must dispatch one and dead-letter (a refused write) the other.
        pipe = bus.r.pipeline(transaction=True)
        pipe.xadd(bus.keys.requests, codec.encode(request("r-late", max_tokens=10, seed=12)))
        pipe.xadd(bus.keys.requests, {b"type": b"request", b"data": orjson.dumps(poison)})
        pipe.config_set("maxmemory", 1)  # below what is used: every write needing memory is refused
        pipe.execute()
        written = bus.r.xlen(bus.keys.out(READER, "r-long"))
        time.sleep(OOM_S)
        assert worker.proc.poll() is None and scheduler.proc.poll() is None  # neither stopped
        assert bus.r.xlen(bus.keys.out(READER, "r-long")) == written  # Redis did refuse the results...
        assert not bus.r.exists(bus.keys.dead)  # ...and the dead letter
    finally:
        bus.r.config_set("maxmemory", 0)
    assert isinstance(bus.outcome("r-long"), Finished) and bus.text("r-long") == sim_text(11, 80)  # nothing lost
    assert isinstance(bus.outcome("r-late"), Finished) and bus.text("r-late") == sim_text(12, 10)
    [letter] = bus.wait_for_dead(1)
    assert letter.reason.startswith("undecodable: request: prompt_token_ids must hold integers")
    assert "maxmemory" in worker.log() and "maxmemory" in scheduler.log()  # both met the refusals
    assert "stopping" not in worker.log()
    assert worker.stop() == 0 and scheduler.stop() == 0
