"""A DP group of 4 sim ranks: lock-step, idle forwards, and a dead rank."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import defaultdict
from pathlib import Path

import openai
import orjson

from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import start_system, stop_system


def _ranks(system) -> dict[int, dict[str, str]]:  # type: ignore[no-untyped-def]
    r = system.redis()
    return {int(h["dp_rank"]): h for h in (r.hgetall(Keys().worker(w)) for w in r.zrange(Keys().workers, 0, -1))}


def _settled(system) -> dict[int, dict[str, str]]:  # type: ignore[no-untyped-def]
    """The ranks once the heartbeats (every 0.5 s) have published the 30 steps on all four, idle
    forwards counted, and no rank is inside a forward (its announced end has passed); as they are
    after 5 s otherwise. A bounded wait, not a fixed sleep."""
    deadline = time.monotonic() + 5
    while True:
        ranks = _ranks(system)
        steps = {int(h["steps"]) for h in ranks.values()}
        idle = sorted(int(h["idle_forwards"]) for h in ranks.values())
        ended = all(int(h.get("forward_ends_ms", 0)) <= time.time() * 1000 for h in ranks.values())  # none mid-forward
        if (len(ranks) == 4 and len(steps) == 1 and min(steps) >= 30 and idle[1] >= 29 and ended) or (
            time.monotonic() > deadline
        ):
            return ranks
        time.sleep(0.1)


def test_ranks_step_together_and_count_idle_forwards(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--dp", "4")
    try:
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        sent_ms = int(time.time() * 1000)
        reply = client.completions.create(model="tiny", prompt="one", max_tokens=30, seed=4)  # one rank busy
        assert reply.choices[0].text == sim_text(4, 30)
        ranks = _settled(system)
        assert sorted(ranks) == [0, 1, 2, 3]
        steps = {int(h["steps"]) for h in ranks.values()}
        assert len(steps) == 1 and steps.pop() >= 30  # the same number of steps on every rank
        idle = sorted(int(h["idle_forwards"]) for h in ranks.values())
        assert idle[0] == 0 and idle[1:] == [idle[3]] * 3 and idle[3] >= 29  # three ranks idled while one worked
        worker = next(h for h in ranks.values() if int(h["idle_forwards"]) == 0)
        assert int(worker["busy_time_us"]) > 0 and int(worker["idle_time_us"]) == 0
        for h in ranks.values():  # the step time covers both kinds of step
            assert int(h["busy_time_us"]) + int(h["idle_time_us"]) <= int(h["step_time_us"])
            assert (int(h["idle_time_us"]) > 0) == (int(h["idle_forwards"]) > 0)
            assert 0 <= int(h["idle_forward_us"]) <= int(h["idle_time_us"])  # the forward, inside its step
        for h in ranks.values():  # each rank announced when its forwards would end (stagger windows close there)
            assert sent_ms <= int(h["forward_ends_ms"]) <= time.time() * 1000
        _assert_lock_step(system)
        # The group was idle when the request came: the rank that got it woke the others.
        assert any("wake" in fields for _, fields in system.redis().xrange(Keys().dp("g0")))
    finally:
        assert stop_system(system) == []


def _assert_lock_step(system) -> None:  # type: ignore[no-untyped-def]
    """In the barrier stream, no rank posts step s+1 before every rank posted step s."""
    entries = system.redis().xrange(Keys().dp("g0"))
    posted: dict[int, set[int]] = defaultdict(set)
    for _, fields in entries:
        if "plan" not in fields:  # a nudge that woke the idle group
            continue
        step, rank = int(fields["step"]), orjson.loads(fields["plan"])["rank"]
        if step > 0 and step - 1 in posted:
            assert posted[step - 1] == {0, 1, 2, 3}, f"rank {rank} ran ahead to step {step}"
        posted[step].add(rank)
    assert len(posted) >= 30


def test_a_dead_rank_breaks_the_group_with_a_clear_error(tmp_path: Path) -> None:
    system = start_system(
        tmp_path,
        "--dp",
        "4",
        "--worker-arg=--dp-barrier-timeout",
        "--worker-arg=2",
        "--scheduler-arg=--no-worker-wait",
        "--scheduler-arg=2",
    )
    try:
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=3, seed=2).choices[0].text == sim_text(
            2, 3
        )
        os.kill(system.pid_of(r"--dp-rank 2"), signal.SIGKILL)
        started = time.monotonic()
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=50)
            raise AssertionError("the broken group served a request")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            request_id = exc.response.headers["x-request-id"]
            assert request_id in str(exc.body)
            # the group's reason: in the API's log, not in the client's body
            logged = system.wait_output(rf"request {request_id} failed .*$").group(0)
            assert re.search(r"did not (reach|finish) step|no live DP rank", logged)
        assert time.monotonic() - started < 20
        output = "".join(system.output)
        deadline = time.monotonic() + 10
        while not re.search(r"did not (reach|finish) step", output) and time.monotonic() < deadline:
            time.sleep(0.2)
            output = "".join(system.output)
        assert re.search(r"DP group g0 is broken: rank\(s\) \[2\] did not (reach|finish) step \d+ within 2s", output)
        system.wait_output(
            r"^rank[013] exited with code 3 \(DP group g0 is broken: a rank died or hung; "
        )  # up says so
    finally:
        stop_system(system)


def test_a_group_re_forms_once_its_ranks_are_back(tmp_path: Path) -> None:
    # With the default barrier timeout (5 s), longer than a worker's lease (3 s), the new rank 2
    # finds all four ranks live while the survivors still step in the old group: the case that flapped.
    system = start_system(tmp_path, "--dp", "4")
    try:
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="x", max_tokens=3, seed=2)
        assert reply.choices[0].text == sim_text(2, 3)
        killed = len(system.output)
        os.kill(system.pid_of(r"--dp-rank 2"), signal.SIGKILL)
        for rank in (0, 1, 3):  # the survivors break the old group and come back
            system.wait_output(rf"^rank{rank} restarted", start=killed)
        for rank in range(4):  # the restarted rank 2 joins them: it used to break them at step 0, in turns
            system.wait_output(rf"^rank{rank} .*rank {rank} of 4 in step with the others", start=killed)
        reply = client.completions.create(model="tiny", prompt="y", max_tokens=3, seed=5)
        assert reply.choices[0].text == sim_text(5, 3)  # served again
        since = "".join(system.output[killed:])
        assert sorted(re.findall(r"^rank(\d) exited with code 3", since, re.M)) == ["0", "1", "3"], since  # each once
        assert "(restart 2)" not in since, since  # one round of restarts
    finally:
        assert stop_system(system) == []
