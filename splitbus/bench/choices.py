"""``splitbus bench choices``: what ``n`` > 1 costs the prefill worker (issue 37's target: ``n = 4``
costs one prefill, not four, measured by P's prefill counters).

It starts ``splitbus up --engine paddle --prefill 1 --decode 1`` (``--model`` when given, else
up's tiny random model) and sends, pair by pair, alternately:

- **(a)** one completion with ``n`` = N;
- **(b)** N completions with ``n`` = 1 and the same prompt, sent at once: how each choice was
  served before the choices were prefilled together (separate requests, sharing only the prefix
  cache).

Every request has a FRESH prompt of random token ids (seeded; its own for each pair and side, the
same length on both sides), so that no prefix cached by an earlier one flatters either side; the
first side of each pair swaps from pair to pair; one warm-up pair goes first, unmeasured. Every
request samples at temperature 1 with a seed ((b)'s request j with the seed (a)'s choice j draws
from) and ignores EOS, so it makes exactly ``max_tokens`` tokens; with ``max_tokens`` 1 it ends on
P, which isolates the prefill.

A response's wall time runs from sending (its first request) to the end of its (last) answer. The
prefill worker's ``prefills_done`` and ``prefills_shared`` (its registry hash, written at each
heartbeat) are read before and after each response, after two fresh heartbeats: the second one's
counters were taken after the response ended (``settled``). Their difference is what P did for
it: prompts computed = done − shared.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitbus.api.protocol import MAX_CHOICES, choice_seed
from splitbus.bench.http_client import cached_tokens
from splitbus.bench.serve_trace import FIRST_TOKEN_ID, LAST_TOKEN_ID
from splitbus.bus.core.keys import Keys

SIDES = ("a", "b")
"""(a) one request with ``n`` = N; (b) N requests with ``n`` = 1, concurrent."""
WARMUP_PAIRS = 1
"""Pairs sent first and not measured: the engine's first forwards of each shape are slower."""
HEARTBEAT_WAIT_S = 15.0
"""The longest a read of P's counters waits for its two heartbeats (every 0.5 s) before it fails."""
READY_WAIT_S = 180.0
"""The longest the bench waits for both workers to register (loading a model on a busy CPU)."""


@dataclass(frozen=True)
class ChoicesBenchConfig:
    n: int = 4
    """Choices of side (a)'s response; side (b) sends this many requests."""
    pairs: int = 10
    """Measured pairs: one response of each side."""
    prompt_tokens: int = 256
    """Tokens of every prompt."""
    max_tokens: int = 1
    """Tokens each choice makes (1: it finishes on P, so only the prefill is timed)."""
    seed: int = 0
    """Seeds the prompts and the sampling."""
    engine: str = "paddle"
    """``up``'s ``--engine`` (``sim`` in the tests: its counters are the same, its times are not)."""

    def __post_init__(self) -> None:
        if not 2 <= self.n <= MAX_CHOICES:
            raise ValueError(f"--n must be between 2 and {MAX_CHOICES} (the API's bound)")
        if min(self.pairs, self.prompt_tokens, self.max_tokens) < 1:
            raise ValueError("--pairs, --prompt-tokens and --max-tokens must be at least 1")


@dataclass(frozen=True)
class Counters:
    """The prefill worker's counters, as its registry hash held them."""

    done: int
    shared: int

    def minus(self, before: Counters) -> Counters:
        return Counters(self.done - before.done, self.shared - before.shared)

    @property
    def computed(self) -> int:
        """Prompts computed: the prefills that did not share a twin's forward."""
        return self.done - self.shared


class BenchFailed(Exception):
    """A request failed, or P stopped reporting: said, never reported as a measurement."""


class PrefillCounters:
    """Reads the one prefill worker's hash (``Keys.worker``) through the bus's Redis."""

    def __init__(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self.redis, self.keys, self.key = aioredis.Redis.from_url(redis_url, decode_responses=True), Keys(), ""

    async def find(self) -> None:
        """The prefill worker's hash key, once it and the decode worker have registered (``up``
        says it is up before a worker that loads a model has): the bench starts one of each."""
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:
            roles = await self._roles()
            if sorted(roles.values()) == ["decode", "prefill"]:
                self.key = self.keys.worker(next(w for w, role in roles.items() if role == "prefill"))
                return
            await asyncio.sleep(0.2)
        raise BenchFailed(f"expected one prefill and one decode worker in the registry, found {roles}")

    async def _roles(self) -> dict[str, str]:
        """Each registered worker's role ("" for a hash not written yet)."""
        ids = [str(w) for w in await self.redis.zrange(self.keys.workers, 0, -1)]
        return {w: str(await self.redis.hget(self.keys.worker(w), "role") or "") for w in ids}

    async def _read(self) -> tuple[int, Counters]:
        beat, done, shared = await self.redis.hmget(self.key, ["heartbeat_ms", "prefills_done", "prefills_shared"])
        return int(beat or 0), Counters(int(done or 0), int(shared or 0))

    async def settled(self) -> Counters:
        """The counters of the second heartbeat after this call: its snapshot was taken after the
        first one's write, which came after this call began, so it holds every prefill that
        ended before the call."""
        first, _ = await self._read()
        beats, deadline = [first], time.monotonic() + HEARTBEAT_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            beat, counters = await self._read()
            if beat != beats[-1]:
                beats.append(beat)
            if len(beats) == 3:
                return counters
        raise BenchFailed(f"the prefill worker's heartbeat stopped ({self.key})")

    async def close(self) -> None:
        await self.redis.aclose()


def prompt(config: ChoicesBenchConfig, pair: int, side: str) -> list[int]:
    """The prompt of ``side``'s response in ``pair`` (-1 and below: warm-up): its own for each."""
    rng = np.random.default_rng((config.seed, pair + WARMUP_PAIRS, SIDES.index(side)))
    return [int(t) for t in rng.integers(FIRST_TOKEN_ID, LAST_TOKEN_ID + 1, config.prompt_tokens)]


class Client:
    """Non-streamed completions over HTTP (httpx, as ``bench serve``)."""

    def __init__(self, base_url: str, config: ChoicesBenchConfig) -> None:
        import httpx

        limits = httpx.Limits(max_connections=config.n, max_keepalive_connections=config.n)
        self.http = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600)
        self.config, self.model = config, ""

    async def find_model(self) -> None:
        """The served model's name, as ``/v1/models`` says (up names it after the folder or file)."""
        response = await self.http.get("/v1/models")
        self.model = response.json()["data"][0]["id"]

    async def complete(self, tokens: list[int], n: int, seed: int | None) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": tokens,
            "n": n,
            "max_tokens": self.config.max_tokens,
            "temperature": 1.0,
            "seed": seed,
            "ignore_eos": True,
        }
        response = await self.http.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise BenchFailed(f"HTTP {response.status_code}: {response.text[:300]}")
        reply: dict[str, Any] = response.json()
        return reply

    async def respond(self, side: str, tokens: list[int], seed: int) -> list[dict[str, Any]]:
        """Side (a): one request of ``n`` choices; (b): ``n`` requests of one, sent at once."""
        n = self.config.n
        if side == "a":
            return [await self.complete(tokens, n, seed)]
        return list(await asyncio.gather(*(self.complete(tokens, 1, choice_seed(seed, j)) for j in range(n))))

    async def close(self) -> None:
        await self.http.aclose()


async def measure_response(
    client: Client, counters: PrefillCounters, before: Counters, pair: int, side: str
) -> tuple[dict[str, Any], Counters]:
    """One response of ``side`` (its prompt fresh), timed, and what P did for it since ``before``
    (the counters settled after the previous one); and the counters settled after it."""
    config = client.config
    started = time.perf_counter()
    replies = await client.respond(side, prompt(config, pair, side), config.seed + pair)
    wall_ms = (time.perf_counter() - started) * 1000
    after = await counters.settled()
    did = after.minus(before)
    choices = sum(len(r["choices"]) for r in replies)
    if choices != config.n:
        raise BenchFailed(f"side ({side}) got {choices} choices, not {config.n}")
    usage = [r["usage"] for r in replies]
    prompt_tokens, cached = sum(u["prompt_tokens"] for u in usage), sum(cached_tokens(u) for u in usage)
    row = {
        "pair": pair,
        "wall_ms": wall_ms,
        "prefills_done": did.done,
        "prefills_shared": did.shared,
        "prompts_computed": did.computed,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "prompt_tokens_computed": prompt_tokens - cached,
        "completion_tokens": sum(u["completion_tokens"] for u in usage),
    }
    return row, after


def order(pair: int) -> tuple[str, ...]:
    """Which side goes first swaps from pair to pair: a load that comes and goes meets both."""
    return SIDES if pair % 2 == 0 else SIDES[::-1]


async def measure(
    base_url: str, redis_url: str, config: ChoicesBenchConfig, progress: Callable[[str], None]
) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """The served model's name, and each side's responses, pair by pair, after the warm-up."""
    client, counters = Client(base_url, config), PrefillCounters(redis_url)
    rows: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    try:
        await client.find_model()
        await counters.find()
        last = await counters.settled()
        for pair in range(-WARMUP_PAIRS, config.pairs):
            for side in order(pair):
                row, last = await measure_response(client, counters, last, pair, side)
                if pair >= 0:
                    rows[side].append(row)
            if pair >= 0:
                progress(f"pair {pair + 1}/{config.pairs}: {_pair_line(rows, config.n)}")
    finally:
        await client.close()
        await counters.close()
    return client.model, rows


def _pair_line(rows: dict[str, list[dict[str, Any]]], n: int) -> str:
    a, b = rows["a"][-1], rows["b"][-1]
    return (
        f"(a) n = {n}: {a['wall_ms']:.0f} ms, {a['prompts_computed']} prompt(s) computed; "
        f"(b) {n} x n = 1: {b['wall_ms']:.0f} ms, {b['prompts_computed']} computed"
    )


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's figures: wall time quantiles, and P's work per response."""
    walls = [r["wall_ms"] for r in rows]
    per = {
        f"{field}_per_response": sum(r[field] for r in rows) / len(rows)
        for field in ("prompts_computed", "prefills_done", "prefills_shared", "cached_tokens", "prompt_tokens_computed")
    }
    return {
        "wall_ms": {
            "p50": statistics.median(walls),
            "p90": float(np.percentile(walls, 90)),
            "min": min(walls),
            "max": max(walls),
        },
        **per,
        "prompts_computed_each": [r["prompts_computed"] for r in rows],
        "responses": rows,
    }


def paired_diff(rows: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """(b) − (a) within each pair, its p10, p50 and p90 (ms): a load that comes and goes on the
    machine moves both responses of a pair alike, so this is steadier than the sides' quantiles."""
    diffs = [b["wall_ms"] - a["wall_ms"] for a, b in zip(rows["a"], rows["b"], strict=True)]
    return {f"p{q}": float(np.percentile(diffs, q)) for q in (10, 50, 90)}


def up_args(config: ChoicesBenchConfig, model: Path | None, name: str | None) -> list[str]:
    """``splitbus up``'s arguments: one P, one D, the model when given."""
    args = ["--engine", config.engine, "--prefill", "1", "--decode", "1"]
    if model is not None:
        args += ["--model", str(model), *(["--served-model-name", name] if name else [])]
    return args


def run_choices_bench(
    config: ChoicesBenchConfig, model: Path | None, name: str | None, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Start ``up`` (the model at ``model``, a converted folder, served as ``name``; None: up's tiny
    one, offline), measure both sides, stop it."""
    from splitbus.bench.system import LocalSystem

    args = up_args(config, model, name)
    progress(f"starting splitbus up {' '.join(args)}")
    system = LocalSystem(*args, environ={"SPLITBUS_OFFLINE": "1"})  # no download: the tiny model without --model
    try:
        progress(
            f"{WARMUP_PAIRS} warm-up pair, then {config.pairs} pairs of (a) n = {config.n}, (b) {config.n} x n = 1"
        )
        served, rows = asyncio.run(measure(system.base_url, system.redis_url, config, progress))
    finally:
        system.stop()
    sides = {side: summarize(rows[side]) for side in SIDES}
    return {
        "config": asdict(config),
        "model": served if model is not None or config.engine != "paddle" else f"{served} (random weights)",
        "target": "splitbus up " + " ".join(args),
        "sides": sides,
        "wall_ratio_b_over_a": sides["b"]["wall_ms"]["p50"] / sides["a"]["wall_ms"]["p50"],
        "paired_diff_ms": paired_diff(rows),
        "one_prefill_met": set(sides["a"]["prompts_computed_each"]) == {1},
    }
