"""``bench serve``'s hop breakdown to the microsecond, inside each process: the four hops of
``splitbus.bench.http_client.HOPS`` cut at every step a request takes, from the hop marks each process
keeps with ``SPLITBUS_HOP_MARKS`` set (``splitbus.bus.core.hopmarks``) and the ``ts`` of its entries.

Requests are sent one at a time (an idle system, ``http_client.one_at_a_time``), as ``bench serve``
sends its probes (it starts its stack with the marks on and reports both tables); each
step is the time from the mark before it on the request's critical path to its own, p50 and p90
over the requests, and how many requests it has (n). A step a dispatch mode does not take
(``--dispatch api`` has no request entry and no scheduler: ``SKIPPED``) is left out of that
request's row: the next step counts from the mark before it. Any other mark missing fails the
trace (``TraceError``): folded into the next step, it would pass for that step's time.

    python -m splitbus.bench.hop_trace --dispatch scheduler --count 50

With ``--tokens``: the token path instead (``TOKEN_PATH``), ``--count`` streams of 64 tokens at
c = 1, each steady token cut from the end of the decode step before it to the client's chunk.
The required marks are the TTFT's (a token's marks are kept under ``REQUEST_ID/SEQ``, apart): a
token's step counts from the last mark present (a result already waiting has no ``tok.resumed``),
and a run in which no steady token has its marks fails (``TraceError``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from splitbus.bus.core.hopmarks import ENV, entry_key
from splitbus.bus.core.keys import Keys
from splitbus.bus.core.streams import entry_order


@dataclass(frozen=True)
class Step:
    """One step on a request's critical path: the mark that ends it, and what it is."""

    mark: str
    """A hop mark's name (``splitbus.bus.core.hopmarks``), or ``client.sent``/``client.first`` (the
    client's), or ``request.ts``/``task.ts``/``token.ts`` (an entry's ``ts``: when it was encoded)."""
    hop: str
    """Which of ``http_client.HOPS``' process hops it is in: ``api``, ``scheduler``, ``worker``, ``reader``."""
    what: str


PATH = (
    Step("api.route", "api", "client send -> the API's route runs (httpx, loopback, uvicorn's HTTP parse)"),
    Step("api.body", "api", "the body read and parsed as JSON"),
    Step("api.parsed", "api", "the OpenAI parameters checked (protocol.parse_*)"),
    Step("api.tokenized", "api", "the request id, the prompt tokenized (or its ids checked)"),
    Step("api.prepared", "api", "max_tokens, the hash chain for routing, grammar (none)"),
    Step("api.admitted", "api", "admission (overload, the tenant's limits)"),
    Step("request.ts", "api", "subscribed, the request built and encoded (its entry's ts)"),
    Step("requests.read", "scheduler", "the XADD through Redis to the scheduler's blocked read, its reply parsed"),
    Step("requests.decoded", "scheduler", "the entry decoded and validated"),
    Step("task.ts", "scheduler", "admitted, placed, the task encoded (its entry's ts)"),
    Step("tasks.read", "worker", "the dispatch through Redis to the worker's blocked read, its reply parsed"),
    Step("tasks.decoded", "worker", "the task decoded and validated"),
    Step("worker.taken", "worker", "taken (the request table, the engine's queue)"),
    Step("worker.prefill", "worker", "the engine loop awake, the prefill batch formed, the engine called"),
    Step("worker.prefilled", "worker", "the engine's prefill (the sim's sleep)"),
    Step("worker.token", "worker", "settled (the lease), the first token handed to the writer"),
    Step("token.ts", "worker", "the publisher awake, the token's entry encoded (its ts)"),
    Step("api.read", "reader", "the script through Redis to the API reader's blocked read, its reply parsed"),
    Step("api.decoded", "reader", "the result decoded"),
    Step("api.resumed", "reader", "the request's handler resumed with it"),
    Step("api.sse", "reader", "the response started, the first event built"),
    Step("client.first", "reader", "the event written, loopback, httpx and the SSE parse"),
)
SIDE = (
    ("request.ts", "api.written", "request entry encoded -> the API has its XADD's reply"),
    ("token.ts", "worker.written", "token entry encoded -> the worker has its script's reply"),
)
"""Off the critical path: a write's round trip as its writer sees it."""
SKIPPED = {
    "scheduler": frozenset[str](),
    "api": frozenset({"request.ts", "requests.read", "requests.decoded"}),
}
"""By dispatch mode, the steps of ``PATH`` its requests do not take; every other mark must be there."""


class TraceError(RuntimeError):
    """The trace cannot be cut: a mark or an entry a step needs is missing."""


def missing(stamps: dict[str, int], dispatch: str) -> list[str]:
    """The marks one request's ``stamps`` lack that its dispatch mode's path needs, in path order."""
    needed = ["client.sent", *(s.mark for s in PATH if s.mark not in SKIPPED[dispatch])]
    return [mark for mark in needed if mark not in stamps]


def check(found: list[dict[str, Any]], dispatch: str) -> None:
    """``TraceError`` naming each request (by ``id``) that lacks a mark its path needs."""
    lacking = {str(f.get("id")): gone for f in found if (gone := missing(f, dispatch))}
    if lacking:
        listed = "; ".join(f"{rid}: {', '.join(gone)}" for rid, gone in lacking.items())
        raise TraceError(f"{len(lacking)} of {len(found)} requests lack marks ({dispatch} dispatch): {listed}")


def read_marks(folder: Path) -> dict[str, dict[str, int]]:
    """Every request's marks from the ``*.marks`` files in ``folder``: the first of each name
    (a later one is another result of the request, or a retry)."""
    marks: dict[str, dict[str, int]] = {}
    for path in sorted(folder.glob("*.marks")):
        for request_id, name, ns in _lines(path.read_text(errors="replace")):
            marks.setdefault(request_id, {}).setdefault(name, ns)
    return marks


def _lines(text: str) -> Iterator[tuple[str, str, int]]:
    """``ID MARK NS`` lines; anything else (a line cut by a process's end) skipped."""
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) == 3 and fields[2].isdigit():
            yield fields[0], fields[1], int(fields[2])


TOKEN_PATH = (
    Step("tok.engine", "step", "the last step's end -> this decode's engine call (the engine loop's turn)"),
    Step("tok.engined", "step", "the engine's decode step (the sim's sleep)"),
    Step("tok.step", "step", "settled (the lease), the token to the writer (end_decode, the outbox)"),
    Step("tok.flush", "worker", "the publisher awake, its write begun"),
    Step("token.ts", "worker", "the token's entry encoded (its ts)"),
    Step("tok.read", "reader", "the script through Redis to the API reader's blocked read, its reply parsed"),
    Step("tok.decoded", "reader", "the result decoded"),
    Step("tok.resumed", "reader", "the request's handler resumed with it"),
    Step("tok.sse", "reader", "the event built"),
    Step("client.token", "reader", "the event written, loopback, httpx and the SSE parse"),
)
"""A decode step's token, from the end of the step before it (``prev.step``: that step's ``tok.step``)
to the client: the ``step`` hop is the engine loop's, the others the token path beyond the engine."""
TOKEN_SIDE = (
    ("token.ts", "tok.written", "token entry encoded -> the worker has its script's reply"),
    ("prev.step", "tok.cadence", "the engine loop's cadence: one step's end to the next's"),
    ("prev.client", "client.itl", "the ITL: the client's chunk before to this one"),
)
"""Off the path: the worker's write as it sees it, and the step-to-step times at both ends."""
TOKEN_HOPS = ("step", "worker", "reader")


def steps_us(
    stamps: dict[str, int], path: tuple[Step, ...] = PATH, start: str = "client.sent", side: tuple = SIDE
) -> dict[str, float]:
    """One request's (or token's) steps in µs, by ``Step.mark``: each from the last mark present
    before it, the first from ``start``."""
    out: dict[str, float] = {}
    before = stamps.get(start)
    for step in path:
        at = stamps.get(step.mark)
        if at is None:
            continue
        if before is not None:
            out[step.mark] = (at - before) / 1000
        before = at
    for begin, end, _ in side:
        if begin in stamps and end in stamps:
            out[end] = (stamps[end] - stamps[begin]) / 1000
    return out


def table(
    rows: list[dict[str, float]],
    path: tuple[Step, ...] = PATH,
    hops: tuple[str, ...] = ("api", "scheduler", "worker", "reader"),
    side: tuple = SIDE,
    whole: str = "TTFT",
) -> list[dict[str, Any]]:
    """p50 and p90 (µs) of each step over ``rows`` (``steps_us``), in path order, with each
    hop's total and the whole path's (``ttft``: the TTFT, or a token's step and way); a step no
    row has is left out."""
    lines = [line for hop in hops for line in _hop_lines(rows, hop, path)]
    lines.append(_line("ttft", "", whole, [sum(r.get(s.mark, 0.0) for s in path) for r in rows]))
    return lines + [_line(end, "side", what, _values(rows, end)) for _, end, what in side if _values(rows, end)]


def _hop_lines(rows: list[dict[str, float]], hop: str, path: tuple[Step, ...]) -> list[dict[str, Any]]:
    """The steps of one hop that some row has, then the hop's total (none without a step)."""
    steps = [s for s in path if s.hop == hop and _values(rows, s.mark)]
    if not steps:
        return []
    totals = [sum(r.get(s.mark, 0.0) for s in steps) for r in rows]
    return [
        *(_line(s.mark, hop, s.what, _values(rows, s.mark)) for s in steps),
        _line(f"{hop}.total", hop, f"the {hop} hop", totals),
    ]


def _values(rows: list[dict[str, float]], mark: str) -> list[float]:
    return [r[mark] for r in rows if mark in r]


def _line(mark: str, hop: str, what: str, values: Iterable[float]) -> dict[str, Any]:
    listed = list(values)
    return {
        "mark": mark,
        "hop": hop,
        "what": what,
        "n": len(listed),
        "p50_us": float(np.median(listed)),
        "p90_us": float(np.percentile(listed, 90)),
    }


async def latest_task(r: Any, keys: Keys) -> tuple[int, dict[str, Any]]:
    """The newest task entry of any worker: its ``ts`` (ns) and the request it carries."""
    workers = [w.decode() for w in await r.zrange(keys.workers, 0, -1)]
    latest = [e for w in workers for e in await r.xrevrange(keys.tasks(w), count=1)]
    if not latest:
        raise TraceError(f"no task entry on the streams of {len(workers)} registered workers: nothing was dispatched")
    task = max(latest, key=lambda e: entry_order(e[0].decode()))
    return int(task[1][b"ts"]) * 1000, orjson.loads(task[1][b"data"])["request"]


async def entry_stamps(r: Any, keys: Keys) -> dict[str, Any]:
    """The latest request's id and its entries' ``ts`` (ns): the newest task entry of any worker,
    the request entry if it is that request's (none with ``--dispatch api``), its first result."""
    task_ts, data = await latest_task(r, keys)
    stamps = {"id": data["request_id"], "task.ts": task_ts}
    request = await r.xrevrange(keys.requests, count=1)
    if request and orjson.loads(request[0][1][b"data"])["request_id"] == data["request_id"]:
        stamps["request.ts"] = int(request[0][1][b"ts"]) * 1000
    out = keys.out(data.get("reader") or data["api_node"], data["request_id"])
    first = await r.xrange(out, count=1)
    if first:  # (none: ``check`` names token.ts as missing)
        stamps["token.ts"] = int(first[0][1][b"ts"]) * 1000
    return stamps


FLUSH_WAIT_S = 1.5
"""After the last probe, before the marks are read: a blocked read's bus timeout (1 s) has passed,
so every process has written its marks (``hopmarks.flush``)."""


async def probe(base_url: str, redis_url: str, model: str, prompt_len: int, count: int) -> list[dict[str, Any]]:
    """``count`` requests one at a time (after ``http_client.PROBE_WARMUP``): each one's id, its
    entries' ``ts`` (``entry_stamps``), when the client sent it and had its first token (ns)."""
    import redis.asyncio as aioredis

    from splitbus.bench.http_client import one_at_a_time

    r, found = aioredis.Redis.from_url(redis_url), []
    try:
        async with contextlib.aclosing(one_at_a_time(base_url, model, prompt_len, count)) as probes:
            async for sent, result in probes:
                stamps = await entry_stamps(r, Keys())
                first = sent + result.ttft_s
                found.append({**stamps, "client.sent": int(sent * 1e9), "client.first": int(first * 1e9)})
    finally:
        await r.aclose()
    return found


def hops_ms(found: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``http_client.HOPS`` (p50 and p90, ms) from the probes' stamps: the hops between the client and
    the request, task and first result entries. A request the API dispatched itself (``--dispatch
    api``) has no request entry: its first hop ends at its task's, and the scheduler's hop is 0."""
    from splitbus.bench.http_client import HOPS

    rows = [_hops(f) for f in found]
    return {name: _p50_p90([row[k] for row in rows]) for k, name in enumerate(HOPS)}


def _hops(f: dict[str, Any]) -> list[float]:
    """One request's ``http_client.HOPS`` in ms."""
    edges = [f["client.sent"], f.get("request.ts", f["task.ts"]), f["task.ts"], f["token.ts"], f["client.first"]]
    return [(b - a) / 1e6 for a, b in itertools.pairwise(edges)] + [(edges[-1] - edges[0]) / 1e6]


def _p50_p90(values: list[float]) -> dict[str, float]:
    return {"p50": float(np.median(values)), "p90": float(np.percentile(values, 90))}


async def breakdown(
    base_url: str,
    redis_url: str,
    marks: Path,
    model: str,
    prompt_len: int,
    count: int = 45,
    dispatch: str = "scheduler",
) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """``count`` probes (``probe``) of a system whose processes keep hop marks in ``marks``: its
    hops (``hops_ms``) and their steps (``table``); ``TraceError`` if a request lacks a mark its
    ``dispatch`` mode's path needs."""
    found = await probe(base_url, redis_url, model, prompt_len, count)
    await asyncio.sleep(FLUSH_WAIT_S)
    kept = read_marks(marks)
    stamped = [{**kept.get(f["id"], {}), **f} for f in found]
    check(stamped, dispatch)
    return hops_ms(found), table([steps_us(s) for s in stamped])


TOKEN_SKIP = 2
"""A stream's first tokens left out of the token table: the first is the prefill's, the second's
step starts where the first was handed over (not a steady decode step)."""


async def token_probe(
    base_url: str, redis_url: str, model: str, prompt_len: int, max_tokens: int, count: int
) -> list[dict[str, dict[str, int]]]:
    """``count`` streams of ``max_tokens`` one at a time (c = 1, after ``http_client.PROBE_WARMUP``
    short ones): each token's client stamps (``token_stamps``) and its entry's ``ts``, by
    ``hopmarks.entry_key``."""
    import httpx
    import redis.asyncio as aioredis

    from splitbus.bench.http_client import PROBE_WARMUP, one_at_a_time

    r, found = aioredis.Redis.from_url(redis_url), []
    async with contextlib.aclosing(one_at_a_time(base_url, model, prompt_len, 0)) as warm:
        _ = [item async for item in warm]  # PROBE_WARMUP requests: the processes' first calls
    try:
        async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=60) as client:
            for i in range(count):
                chunks = await _stream(client, model, [32 + (PROBE_WARMUP + i) % 50] * prompt_len, max_tokens)
                _, sent = await latest_task(r, Keys())
                found.append(await token_stamps(r, Keys(), sent["request_id"], chunks))
    finally:
        await r.aclose()
    return found


async def _stream(client: Any, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One streamed completion: when (``time.time_ns()``) each chunk with text came."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and (orjson.loads(line[6:]).get("choices") or [{}])[0].get("text"):
                times.append(time.time_ns())
    return times


async def token_stamps(r: Any, keys: Keys, request_id: str, chunks: list[int]) -> dict[str, dict[str, int]]:
    """Each token entry's ``ts`` and the client's time of the chunk with its text (the k-th token
    entry's, the k-th chunk's), by ``hopmarks.entry_key``; none when they do not pair up (tokens
    the API merged into one event)."""
    _, sent = await latest_task(r, keys)
    entries = await r.xrange(keys.out(sent.get("reader") or sent["api_node"], request_id))
    tokens = [(orjson.loads(f[b"data"]), int(f[b"ts"])) for _, f in entries if f.get(b"type") == b"token"]
    if len(tokens) != len(chunks):
        return {}
    return {
        entry_key(request_id, data["seq"]): {"token.ts": ts * 1000, "client.token": at}
        for (data, ts), at in zip(tokens, chunks, strict=True)
    }


def token_rows(found: list[dict[str, dict[str, int]]], kept: dict[str, dict[str, int]]) -> list[dict[str, float]]:
    """The token path's steps (µs) of every steady decode token (``TOKEN_SKIP`` on), each with
    the marks its processes kept and, as ``prev.step``, the step before it's end."""
    rows = []
    for tokens in found:
        for key, stamps in tokens.items():
            request_id, seq = key.rsplit("/", 1)
            before = entry_key(request_id, int(seq) - 1)
            previous, marks = kept.get(before, {}).get("tok.step"), kept.get(key, {})
            if int(seq) < TOKEN_SKIP or previous is None or "tok.step" not in marks:
                continue
            ends = {"tok.cadence": marks["tok.step"], "client.itl": stamps["client.token"]}
            starts = {"prev.step": previous, "prev.client": tokens[before]["client.token"]}
            rows.append(steps_us({**marks, **stamps, **ends, **starts}, TOKEN_PATH, "prev.step", TOKEN_SIDE))
    return rows


def token_table(rows: list[dict[str, float]]) -> list[dict[str, Any]]:
    """``table`` of the token path: the engine loop's step, the worker's write, the reader's;
    ``TraceError`` if no steady token had its marks (a table of nothing would pass for one)."""
    if not rows:
        raise TraceError("no steady token has its marks: no stream's tokens paired with its chunks, or none was marked")
    return table(rows, TOKEN_PATH, TOKEN_HOPS, TOKEN_SIDE, "a decode step and its token's way to the client")


async def token_breakdown(
    base_url: str, redis_url: str, marks: Path, model: str, prompt_len: int, max_tokens: int = 64, count: int = 10
) -> list[dict[str, Any]]:
    """``count`` streams at c = 1 of a system keeping hop marks in ``marks``: the token table."""
    found = await token_probe(base_url, redis_url, model, prompt_len, max_tokens, count)
    await asyncio.sleep(FLUSH_WAIT_S)
    return token_table(token_rows(found, read_marks(marks)))


def measure(
    dispatch: str, count: int, model: str = "tiny", prompt_len: int = 128, tokens: bool = False
) -> list[dict[str, Any]]:
    """``splitbus up --engine sim --mixed 1 --dispatch DISPATCH`` with hop marks on, traced: the
    TTFT's steps, or (``tokens``) the token path's over ``count`` streams of 64 tokens."""
    from splitbus.bench.system import LocalSystem

    with tempfile.TemporaryDirectory(prefix="splitbus-marks-") as folder:
        system = LocalSystem("--engine", "sim", "--mixed", "1", "--dispatch", dispatch, environ={ENV: folder})
        try:
            if tokens:
                stream = token_breakdown(
                    system.base_url, system.redis_url, Path(folder), model, prompt_len, count=count
                )
                return asyncio.run(stream)
            probes = breakdown(system.base_url, system.redis_url, Path(folder), model, prompt_len, count, dispatch)
            return asyncio.run(probes)[1]
        finally:
            system.stop()


def markdown(lines: list[dict[str, Any]]) -> str:
    rows = [f"| {x['hop']} | {x['what']} | {x['n']} | {x['p50_us']:.0f} | {x['p90_us']:.0f} |" for x in lines]
    return "\n".join(["| hop | step | n | p50 µs | p90 µs |", "| --- | --- | ---: | ---: | ---: |", *rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dispatch", choices=("scheduler", "api"), default="scheduler")
    parser.add_argument("--count", type=int, default=50, help="requests timed after the warm-up (--tokens: streams)")
    parser.add_argument("--json", help="also write the steps here")
    parser.add_argument("--tokens", action="store_true", help="the token path (ITL) at c = 1 instead of the TTFT's")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    try:
        lines = measure(args.dispatch, args.count, tokens=args.tokens)
    except TraceError as exc:
        raise SystemExit(f"hop_trace: {exc}") from None
    print(markdown(lines))
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(lines, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
