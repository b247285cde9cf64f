"""What one placement decision costs in the process, by how it reads the candidates.

Part of ``splitbus bench scheduler``: no Redis, no I/O. For each worker count, the ``splitwise``
policy (with the default cache-aware cost over an empty ``KvIndex``) places a stream of requests
(each with a prompt of its own and the hash chain the API sends with it)
on a hand-made snapshot of that many workers (half prefill, half decode, varied loads), as a
scheduler does between its reads: each decision's reservations are added to the replica's
``Local`` (as its ``Ledger`` does), and every ``REFRESH_EVERY`` decisions a new snapshot comes
with ``CHANGED_ROWS`` rows changed and the ledger forgets all but the reservations of the last
``KEEP_RESERVATIONS`` decisions (what a registry view's read does). Two placers, side by side:

- **columns**: the policy as it is (``placement/columns.py``: numpy columns per role, following
  the snapshot's changed rows and the ``Local``'s journal);
- **rows**: the same rules through ``costs``'s per-worker functions (``decode_worker``,
  ``choose`` over ``prefill_cost``), which scan every candidate and every reservation per
  decision: how splitwise decided before the columns.

Both draw from one seeded ``random.Random`` each and must choose the same workers
(``tests/placement/test_columns.py`` checks the rules; here the choices are compared too).
Timed with ``time.perf_counter_ns`` per decision, the garbage collector off.

``measure_stages`` times the rest of a scheduler's own work on one request, stage by stage, with
no I/O either (issue 40: where a decision's time goes besides the policy): decoding its entry,
the decision and its reservations, its tasks, the dispatch script's arguments (the tasks' JSON:
``DispatchScript.write`` with its call kept, not sent) and the packing of the script call, as
redis-py packs each command of a pipeline.

    python -m splitbus.bench.decisions [--workers 256] [--requests 5000]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from splitbus.bus.blocks import chain_hex
from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.dispatch import DispatchOutcome, DispatchScript, Key
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.bus.registry import WorkerInfo, WorkerRecord
from splitbus.bus.roles import Phase, Role
from splitbus.placement import policies
from splitbus.placement.costs import Eligible, blocks_needed, choose, decode_worker, prefill_cost
from splitbus.placement.decision import Placed, Placement
from splitbus.placement.dispatcher import task_writes
from splitbus.placement.kv_index import KvIndex
from splitbus.placement.ledger import Ledger, Local
from splitbus.placement.policies.base import PolicyOptions
from splitbus.placement.prefixes import Candidates, IndexPrefixes

BLOCK_SIZE = 16
"""The workers' block size (``WorkerRecord``'s default), and the API's chain's."""
REFRESH_EVERY = 8
CHANGED_ROWS = 4
KEEP_RESERVATIONS = 4
Place = Callable[[GenerateRequest, Sequence[WorkerInfo], Local], tuple[Placement, ...]]


def snapshot(count: int, rng: random.Random) -> list[WorkerInfo]:
    return [_row(i, Role.PREFILL if i % 2 == 0 else Role.DECODE, rng) for i in range(count)]


def _row(i: int, role: str, rng: random.Random) -> WorkerInfo:
    load = WorkerLoad(
        running=rng.randrange(8),
        queued_prefill_tokens=rng.randrange(4000),
        free_kv_blocks=rng.randrange(2000, 4000),
        total_kv_blocks=4000,
    )
    return WorkerInfo(WorkerRecord(f"w{i:03d}", role, "tiny", "sim", load=load), 0, 3000)


def _request(i: int) -> GenerateRequest:
    """A prompt of its own, with the hash chain the API sends (the scheduler splits it, no hashing)."""
    tokens = [32 + i % 200, *[97] * 127]
    chain = chain_hex(tokens[:-1], BLOCK_SIZE)
    return GenerateRequest(
        f"r{i}",
        "tiny",
        tokens,
        SamplingParams(max_tokens=64),
        "bench",
        0,
        prefix_hashes=chain,
        prefix_block_size=BLOCK_SIZE,
    )


def columns_placer(seed: int) -> Place:
    policy = policies.create("splitwise", PolicyOptions(rng=random.Random(seed)), IndexPrefixes(KvIndex()))

    def place(request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> tuple[Placement, ...]:
        decision = policy.place(request, workers, local)
        assert isinstance(decision, Placed)
        return decision.placements

    return place


def rows_placer(seed: int) -> Place:
    """splitwise's rules (load and cache, conditional disaggregation off) through the per-worker
    functions."""
    rng, prefixes, eligible, cost = random.Random(seed), IndexPrefixes(KvIndex()), Eligible(), PolicyOptions().cost

    def place(request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> tuple[Placement, ...]:
        prefills, decodes = eligible(workers, "tiny", Role.PREFILL), eligible(workers, "tiny", Role.DECODE)
        cached = prefixes.cached(request, Candidates.of([*prefills, *decodes]))
        decode = decode_worker(request, decodes, local, rng)
        prefill = choose(prefills, prefill_cost(prefills, request, cached, local, cost), rng)
        assert decode is not None and prefill is not None
        blocks = blocks_needed(request, decode.record.block_size)
        tokens = len(request.prompt_token_ids) - cached.get(prefill.record.worker_id, 0)
        return (
            Placement(decode, Phase.DECODE, prefill.record.worker_id, Reserved(0, 1, blocks)),
            Placement(prefill, Phase.PREFILL, decode.record.worker_id, Reserved(tokens, 0, 0)),
        )

    return place


def run_placer(place: Place, count: int, decisions: int, seed: int) -> tuple[list[int], list[str]]:
    """Nanoseconds per decision, and the workers chosen."""
    rng, clock = random.Random(seed), [0.0]
    workers, local = snapshot(count, rng), Local()
    ledger = Ledger(local, clock=lambda: clock[0])
    requests = [_request(i) for i in range(decisions)]
    took, chosen = [], []
    gc.disable()
    try:
        for i, request in enumerate(requests):
            clock[0] = i
            if i and i % REFRESH_EVERY == 0:  # a registry read: rows changed, the older reservations in it
                workers = list(workers)
                for k in rng.sample(range(count), CHANGED_ROWS):
                    w = workers[k]
                    load = dataclasses.replace(w.record.load, queued_prefill_tokens=rng.randrange(4000))
                    workers[k] = dataclasses.replace(w, record=dataclasses.replace(w.record, load=load))
                ledger.view_refreshed(read_at=i - KEEP_RESERVATIONS)
            start = time.perf_counter_ns()
            placements = place(request, workers, local)
            took.append(time.perf_counter_ns() - start)
            for p in placements:
                ledger.reserve(p)
            ledger.written()
            chosen.append(",".join(p.worker.record.worker_id for p in placements))
    finally:
        gc.enable()
    return took, chosen


def measure_decisions(counts: Sequence[int], decisions: int, seed: int) -> list[dict[str, Any]]:
    results = []
    for count in counts:
        row: dict[str, Any] = {"workers": count}
        chosen: dict[str, list[str]] = {}
        for name, make in (("columns", columns_placer), ("rows", rows_placer)):
            took, chosen[name] = run_placer(make(seed), count, decisions, seed)
            us = np.array(took[decisions // 10 :]) / 1000  # the first tenth warms up
            row[name] = {q: round(float(np.percentile(us, p)), 1) for q, p in (("p50_us", 50), ("p99_us", 99))}
            row[name]["mean_us"] = round(float(us.mean()), 1)
        row["same_choices"] = chosen["columns"] == chosen["rows"]
        results.append(row)
    return results


STAGES = ("decode", "place", "tasks", "arguments", "pack")
"""A request's stages in a scheduler, in order (``measure_stages``)."""
Stage = Callable[[int], Any]
"""One stage of request ``i``, given what the stages before it made."""


def measure_stages(count: int, requests: int, seed: int) -> dict[str, float]:
    """Mean µs per request of each of ``STAGES``, one stage over every request at a time (the
    garbage collector off): ``decode``, the request's stream entry to a ``GenerateRequest``;
    ``place``, splitwise's decision on ``count`` workers and its reservations (``run_placer``'s
    snapshot, never refreshed); ``tasks``, the decision's two ``Task``s; ``arguments``, the
    dispatch script's KEYS and ARGV (each task's JSON); ``pack``, the ``EVALSHA`` command's bytes."""
    entries = [codec.encode(_request(i)) for i in range(requests)]
    workers, local = snapshot(count, random.Random(seed)), Local()
    ledger, place = Ledger(local), columns_placer(seed)
    script = _Recorded(aioredis.Redis(), BusConfig(redis_url="redis://127.0.0.1:1"), 60)
    packer = aioredis.Connection()
    made: dict[str, list[Any]] = {}

    def placed(i: int) -> tuple[Placement, ...]:
        placements = place(made["decode"][i], workers, local)
        for p in placements:
            ledger.reserve(p)
        return placements

    def arguments(i: int) -> tuple[Sequence[Key], list[Any]]:
        entry = script.request_entry(f"{i}-0", f"r{i}")
        _finish(script.write(entry, f"r{i}", "0" * 16, made["tasks"][i], consumer="bench"))
        return script.calls.pop()

    def pack(i: int) -> Any:
        keys, args = made["arguments"][i]
        return packer.pack_command("EVALSHA", "0" * 40, len(keys), *keys, *args)

    stages: dict[str, Stage] = {
        "decode": lambda i: codec.decode(entries[i]),
        "place": placed,
        "tasks": lambda i: task_writes(made["decode"][i], made["place"][i], "0" * 16),
        "arguments": arguments,
        "pack": pack,
    }
    return {name: _timed(stages[name], requests, made.setdefault(name, [])) for name in STAGES}


class _Recorded(DispatchScript):
    """The dispatch script's calls kept, not sent: ``write`` makes its arguments and returns."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[tuple[Sequence[Key], list[Any]]] = []

    async def _run(self, keys: Sequence[Key], args: list[Any], script: Any) -> int:
        self.calls.append((keys, args))
        return int(DispatchOutcome.DISPATCHED)


def _finish(call: Coroutine[Any, Any, Any]) -> None:
    """Run a coroutine that never waits (``_Recorded.write``) to its end, with no event loop."""
    try:
        call.send(None)
    except StopIteration:
        return
    raise RuntimeError("the recorded write waited")


def _timed(stage: Stage, requests: int, out: list[Any]) -> float:
    """Mean µs of ``stage`` over every request, its results kept in ``out``."""
    gc.disable()
    try:
        start = time.perf_counter_ns()
        out.extend(stage(i) for i in range(requests))
        return round((time.perf_counter_ns() - start) / requests / 1000, 1)
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description="a scheduler's own work on one request, by stage (no I/O)")
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stages = measure_stages(args.workers, args.requests, args.seed)
    for name, us in stages.items():
        print(f"{name:>10} {us:8.1f} µs")
    print(f"{'total':>10} {sum(stages.values()):8.1f} µs")


if __name__ == "__main__":
    main()
