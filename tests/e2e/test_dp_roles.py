"""A prefill group of 2 sim ranks and a decode group of 2 under `splitbus up`: streamed requests
come out exact, over the P -> D transfer path, rank to rank, and each group steps together."""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import openai
import orjson

from splitbus.api.protocol import choice_seed
from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system

SEEDS = (3, 4, 5, 6)


def _streamed(system: System, seed: int) -> str:
    client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
    chunks = client.completions.create(model="tiny", prompt="hi", max_tokens=12, seed=seed, stream=True)
    return "".join(chunk.choices[0].text for chunk in chunks)


def _records(system: System) -> list[dict[str, str]]:
    r = system.redis()  # decodes: every reply is str
    return [cast(dict[str, str], r.hgetall(Keys().worker(w))) for w in cast(list[str], r.zrange(Keys().workers, 0, -1))]


def _settled(system: System) -> list[dict[str, str]]:
    """The records once the heartbeats (every 0.5 s) have published every request and each
    group's ranks agree on their steps; as they are after 5 s otherwise (the asserts then say what
    is off). A bounded wait, not a fixed sleep."""
    deadline = time.monotonic() + 5
    while True:
        records = _records(system)
        done = {"prefill": 0, "decode": 0}
        for h in records:
            done[h["role"]] += int(h["prefills_done" if h["role"] == "prefill" else "decodes_done"])
        steps = {role: {h["steps"] for h in records if h["role"] == role} for role in done}
        if (done == {"prefill": len(SEEDS), "decode": len(SEEDS)} and all(len(s) == 1 for s in steps.values())) or (
            time.monotonic() > deadline
        ):
            return records
        time.sleep(0.1)


def _assert_lock_step(system: System, group: str) -> None:
    """In the group's stream, no rank posts step s+1 before both posted step s."""
    posted: dict[int, set[int]] = defaultdict(set)
    for _, fields in cast(list[tuple[str, dict[str, str]]], system.redis().xrange(Keys().dp(group))):
        if "plan" in fields:
            step, rank = int(fields["step"]), orjson.loads(fields["plan"])["rank"]
            assert step == 0 or posted[step - 1] == {0, 1}, f"{group}: rank {rank} ran ahead to step {step}"
            posted[step].add(rank)
    assert posted, f"{group} never stepped"


def test_prefill_and_decode_groups_serve_streamed_requests(tmp_path: Path, bus_environ: dict[str, str]) -> None:
    # On a single Redis and on a cluster (each group's barrier stream in a slot of its own, off the cell's).
    args = ("--prefill", "1", "--prefill-dp", "2", "--decode", "1", "--decode-dp", "2")
    system = start_system(tmp_path, *args, environ=bus_environ)
    try:
        with ThreadPoolExecutor(len(SEEDS)) as pool:
            texts = list(pool.map(lambda seed: _streamed(system, seed), SEEDS))
        assert texts == [sim_text(seed, 12) for seed in SEEDS]
        system.wait_output(r"^p0-r1 .*rank 1 of 2 in step with the others")
        system.wait_output(r"^d0-r1 .*rank 1 of 2 in step with the others")
        records = _settled(system)
        groups = sorted((h["role"], h["dp_group"], h["dp_rank"], h["dp_size"]) for h in records)
        assert groups == [("decode", "d0", "0", "2"), ("decode", "d0", "1", "2")] + [
            ("prefill", "p0", "0", "2"),
            ("prefill", "p0", "1", "2"),
        ]
        for role in ("prefill", "decode"):  # every rank of a group ran each of its steps (some as idle forwards)
            assert len({int(h["steps"]) for h in records if h["role"] == role}) == 1, records
        assert sum(int(h["prefills_done"]) for h in records if h["role"] == "prefill") == len(SEEDS)
        assert sum(int(h["decodes_done"]) for h in records if h["role"] == "decode") == len(SEEDS)
        for group in ("p0", "d0"):
            _assert_lock_step(system, group)
        _assert_choices(system)
    finally:
        assert stop_system(system) == []


def _assert_choices(system: System) -> None:
    """``n`` > 1 through the groups (its choices written by one script: on a cluster too), each
    choice drawing from (seed, index)."""
    client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
    reply = client.completions.create(model="tiny", prompt="hi", max_tokens=12, seed=9, n=3)
    expected = [sim_text(choice_seed(9, i), 12) for i in range(3)]  # type: ignore[arg-type]
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
