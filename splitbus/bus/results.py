"""Per-request result streams: a writer for workers and a multiplexed reader for API nodes.

The writer stamps every entry of a request with the next sequence number and writes one engine
step's entries, for all requests, in one round trip (one script per reader shard: a request's
stream is tagged by the shard that reads it, ``sb:out:{reader}:<request>``). The reader follows
many result streams with one XREAD per shard connection, so an API process holds a fixed number
of connections whatever the number of concurrent requests; it delivers each request's entries in ``seq`` order and drops
duplicates (a retried XADD, or two workers around a migration).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException
from redis.typing import EncodableT

from splitbus.bus.core import cluster, codec, follow, hopmarks, metrics
from splitbus.bus.core.batching import Batcher
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import TRANSIENT_ERRORS, connect, wait_until_reachable
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.ordered import OrderedWriter
from splitbus.bus.core.replies import Entry, RawEntry, RawXReadReply, pairs
from splitbus.bus.core.scripts import LuaScript, declare
from splitbus.bus.dispatch import CurrentDispatch
from splitbus.bus.messages.results import Failed, Finished, Logprobs, Result, TokenDelta
from splitbus.env import valid_tag

log = logging.getLogger(__name__)

# XADD each entry and set its stream's TTL where asked, in one call with one reply. A pipeline
# of XADDs costs the same in Redis, but redis-py parses each of its replies under its own
# timeout context: half the writer's CPU at 1000 entries per step. An entry that sets a TTL only
# on a stream it creates goes in with NOMKSTREAM (Redis >= 6.2) first, and again without it only
# if the stream was gone: one command per entry in the common case, where an XLEN after each
# XADD made two (Redis's CPU per token +50 %, measured with bench bus's token path).
_WRITE_STEP = declare(
    LuaScript(
        name="write_step",
        module=__name__,
        keys=(),
        repeated=("sb:out:{reader}:<request>",),
        argv=(
            "per key: the entry's `type`, `data`, `ts`, and the TTL (s) to set (> 0), or minus the TTL to set"
            " only if this entry created the stream (0: none)"
        ),
        returns="the number of entries written",
        source="""
for i, key in ipairs(KEYS) do
  local j = (i - 1) * 4
  local ttl = tonumber(ARGV[j + 4])
  local added = false
  if ttl < 0 then
    added = redis.call('XADD', key, 'NOMKSTREAM', '*', 'type', ARGV[j + 1], 'data', ARGV[j + 2], 'ts', ARGV[j + 3])
    ttl = -ttl
  end
  if not added then
    redis.call('XADD', key, '*', 'type', ARGV[j + 1], 'data', ARGV[j + 2], 'ts', ARGV[j + 3])
    if ttl > 0 then redis.call('EXPIRE', key, ttl) end
  end
end
return #KEYS
""",
    )
)

LATENCY_SAMPLE_EVERY = 16
"""Observe publish->read latency on one token entry in this many: a histogram observation
costs about as much as decoding the entry."""


@dataclass(frozen=True)
class _Pending:
    """One buffered entry: the request, the reader shard whose slot its stream is in, the entry."""

    request_id: str
    reader: str
    result: Result
    ends: bool = True
    """Whether writing it ends the request on this writer (a terminal entry buffered by
    ``finish``/``fail``); not a replayed entry's, nor the ``results_lost`` error's: the request may
    still be open here, and writes go on."""
    first: bool = False
    """The first entry this writer wrote for the request since ``open``: what precedes it is
    another writer's (the prefill worker's first token, a dead worker's entries), which that
    writer replays, so a replay does not count it as lost beyond the window."""


REPLAY_TOP_COUNT = 16
"""On replay, entries read from a stream's end (``XREVRANGE + - COUNT``) beyond as many as the
writer kept for it: room for what another writer of the stream replayed after them, and for
entries that are not results."""

RESULTS_LOST = "results_lost"
"""The error code a replay writes where Redis lost more of a stream than the replay window held."""


class ResultWriter:
    """Buffers one step's result entries for many requests and writes them in one round trip:
    one script per reader shard (a result stream lies in its reader's slot, and a script's keys
    must share one), all in one pipeline."""

    def __init__(self, redis: aioredis.Redis, config: BusConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        self._config = config
        self._clock = clock
        """What the replay window is measured with (a test's own clock)."""
        self._keys = config.keys
        self._next_seq: dict[str, int] = {}
        self._first_seq: dict[str, int] = {}  # where each open request started on this writer
        self._readers: dict[str, str] = {}
        self._fresh: set[str] = set()  # streams that need their EXPIRE set
        self._writes: OrderedWriter[_Pending] = OrderedWriter(redis, _WRITE_STEP)
        # What was written within the replay window, one (monotonic time, entries) per flush
        # round, oldest first: a new Redis run may have lost any of it (``replay``).
        self._retained: deque[tuple[float, list[_Pending]]] = deque()
        # Requests discarded (moved to other workers), by when: what was kept of them before is
        # not replayed. In time order, pruned with the window.
        self._discarded: dict[str, float] = {}

    def open(self, request_id: str, *, reader: str, first_seq: int = 0) -> None:
        """Start writing a request, whose results ``reader`` (``GenerateRequest.reader``) follows.
        A request that moved from another worker continues at ``first_seq`` (the number of entries
        already sent), so its stream stays gap-free."""
        self._next_seq[request_id] = first_seq
        self._first_seq[request_id] = first_seq
        self._readers[request_id] = reader
        self._fresh.add(request_id)

    def tokens(
        self,
        request_id: str,
        token_ids: list[int],
        text: str = "",
        logprobs: Logprobs | None = None,
        prompt_logprobs: Logprobs | None = None,
    ) -> None:
        self._append(request_id, TokenDelta(self._take_seq(request_id), token_ids, text, logprobs, prompt_logprobs))

    def finish(
        self,
        request_id: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        text: str = "",
        cached_tokens: int = 0,
    ) -> None:
        seq = self._take_seq(request_id)
        done = Finished(seq, finish_reason, prompt_tokens, completion_tokens, text, cached_tokens=cached_tokens)
        self._append(request_id, done)

    def fail(self, request_id: str, code: str, message: str, status: int = 500, *, reader: str) -> None:
        """End a request with an error. Allowed without ``open``: readers accept an error
        entry whatever its sequence number, since any party may have to fail a request."""
        if request_id not in self._next_seq:
            self.open(request_id, reader=reader)
        self._append(request_id, Failed(self._take_seq(request_id), code, message, status))

    def next_seq(self, request_id: str) -> int:
        """The sequence number the request's next entry will get here."""
        return self._next_seq[request_id]

    def mark_next(self, request_ids: Iterable[str], name: str) -> None:
        """Hop marks: ``name`` for the next entry of each open request (``hopmarks.mark_entry``)."""
        for request_id in request_ids:
            seq = self._next_seq.get(request_id)
            if seq is not None:
                hopmarks.mark_entry(request_id, seq, name)

    def forget(self, request_id: str) -> None:
        """Stop writing a request without ending it (another worker continues it)."""
        self._next_seq.pop(request_id, None)
        self._first_seq.pop(request_id, None)
        self._readers.pop(request_id, None)
        if not self._writes.holds(request_id):
            self._fresh.discard(request_id)

    def discard(self, request_id: str) -> None:
        """Forget a request and drop what is buffered for it, unwritten: it moved to other
        workers while this one was cut off (hung, or away from Redis past its lease), and they
        continue it from what the stream held then."""
        self._writes.drop(request_id)
        if self._retained:
            self._discarded.pop(request_id, None)  # to the end: the dict stays in time order
            self._discarded[request_id] = self._clock()
        self.forget(request_id)

    @property
    def pending(self) -> int:
        return self._writes.pending

    @property
    def scripts(self) -> int:
        """Write scripts sent so far (one per reader shard per flush round)."""
        return self._writes.scripts

    async def flush(self) -> None:
        """Write everything buffered since the last flush in one round trip: a script per reader
        shard and ``ordered.CHUNK`` entries (several go in one pipeline). An entry leaves the
        buffer only once written, so a failed flush (Redis away) loses nothing: the next flush
        writes it again, and readers drop any duplicate by seq. A script Redis lost (a restart)
        is loaded again once."""
        reloaded = False
        while self._writes.pending:
            runs = self._writes.runs()
            if hopmarks.on:
                _mark_entries([p for run in runs for p in run], "tok.flush")
            done = await self._writes.write([self._script_args(run) for run in runs])
            if hopmarks.on:
                _mark_written(done.written)
            self._settle(done.written)
            if done.lost_script and not reloaded:
                await self._writes.reload()
                reloaded = True
            elif done.errors:
                raise done.errors[0]

    def _script_args(self, chunk: list[_Pending]) -> tuple[list[str], list[EncodableT]]:
        keys: list[str] = []
        args: list[EncodableT] = []
        seen: set[str] = set()
        for p in chunk:
            keys.append(self._keys.out(p.reader, p.request_id))
            args += (*codec.script_argv(p.result), self._ttl_for(p.request_id, p.result, p.request_id not in seen))
            seen.add(p.request_id)
        return keys, args

    def _ttl_for(self, request_id: str, result: Result, first_in_chunk: bool) -> int:
        """The TTL to set with this entry: on a request's first and last entries; on the others,
        only if the entry creates the stream (negative): the API's reader deleted it, having
        the request's end, while this worker still writes (a run nobody follows any more), and a
        stream without a TTL would stay for ever; it is kept as a finished one is."""
        if result.terminal:
            return self._config.finished_result_ttl_s
        if first_in_chunk and request_id in self._fresh:
            return self._config.result_ttl_s
        return -self._config.finished_result_ttl_s

    def _settle(self, written: list[_Pending]) -> None:
        for p in written:
            self._fresh.discard(p.request_id)
            if p.ends and p.result.terminal:
                self._next_seq.pop(p.request_id, None)
                self._first_seq.pop(p.request_id, None)
                self._readers.pop(p.request_id, None)
        if written:
            metrics.ENTRIES_PRODUCED.labels("out").inc(len(written))
            self._retain(written)

    def _retain(self, written: list[_Pending]) -> None:
        """Keep what was just written for the replay window, and let go of what left it: one
        append per flush round, and whole rounds drop off the front (the token path pays this on
        every flush)."""
        window = self._config.replay_window_s
        if window <= 0:
            return
        now = self._clock()
        self._retained.append((now, written))
        while self._retained and self._retained[0][0] < now - window:
            self._retained.popleft()
        while self._discarded and next(iter(self._discarded.values())) < now - window:
            del self._discarded[next(iter(self._discarded))]

    @property
    def retained(self) -> int:
        """Entries kept for a replay now (those of requests discarded since they were written
        are not counted: they are not replayed)."""
        return sum(len(kept) for kept in self._retained_by_request().values())

    async def replay(self) -> int:
        """Write again what a new Redis run lost (``splitbus.bus.runs``): per request with entries
        kept from the replay window, those its stream's last entries do not hold are buffered
        again, in ``seq`` order, and flushed. Where the stream lost more than the window holds
        (its top ``seq`` + 1 is below the oldest one kept, which is not the first this writer
        wrote), a ``Failed`` (``results_lost``, 503) is written instead: its client gets an error
        now, not a timeout at its deadline. Readers drop duplicates by ``seq``, so an entry
        written again that was not lost costs only bytes. Returns the entries buffered again
        (errors included). Redis errors are the caller's: nothing is dropped, call it again."""
        again: list[_Pending] = []
        for request_id, kept in self._retained_by_request().items():
            again += self._replayable(request_id, kept, await self._seqs_present(kept[0].reader, request_id, len(kept)))
        for p in again:
            if p.request_id in self._next_seq:
                self._fresh.add(p.request_id)  # a stream recreated for a running request: its long TTL
        self._writes.add_first([(p.reader, p.request_id, p) for p in again])
        await self.flush()
        return len(again)

    def _retained_by_request(self) -> dict[str, list[_Pending]]:
        """The kept entries of each request, one per ``seq`` (a replay retains its copies too),
        in ``seq`` order."""
        by_request: dict[str, dict[int, _Pending]] = {}
        for at, written in self._retained:
            for p in written:
                if at > self._discarded.get(p.request_id, -1.0):
                    by_request.setdefault(p.request_id, {})[p.result.seq] = p
        return {rid: [kept[s] for s in sorted(kept)] for rid, kept in by_request.items()}

    def _replayable(self, request_id: str, kept: list[_Pending], present: set[int]) -> list[_Pending]:
        """What to write again for one request whose stream's last entries hold ``present``.

        Not "everything above the stream's top": two writers of one stream (P's first token, D's
        rest) replay independently, and D's replay may come first. An entry of this writer older
        than what was read is written again too (a duplicate, unless lost)."""
        lost = [replace(p, ends=False) for p in kept if p.result.seq not in present]
        top = max(present, default=-1)
        if not lost or top + 1 >= kept[0].result.seq or kept[0].first:
            return lost  # (what precedes this writer's first entry is its other writer's to replay)
        if top < 0:
            # No stream, and its start is older than the window (older than any write a new run
            # loses): it was deleted on purpose (its reader had the final entry) or expired.
            return []
        message = (
            f"Redis lost results of {request_id} beyond the replay window ({self._config.replay_window_s:g} s):"
            f" its stream ends at seq {top}, the oldest entry kept to write again is seq {kept[0].result.seq}"
        )
        log.error("%s", message)
        failed = Failed(kept[-1].result.seq + 1, RESULTS_LOST, message, 503)
        return [_Pending(request_id, kept[0].reader, failed, ends=False)]

    async def _seqs_present(self, reader: str, request_id: str, kept: int) -> set[int]:
        """The ``seq`` of each result among the stream's last ``kept`` + REPLAY_TOP_COUNT entries
        (this writer's entries, if not lost, and what another writer replayed after them)."""
        key = self._keys.out(reader, request_id)
        entries = cast(list[Entry], await self._redis.xrevrange(key, count=kept + REPLAY_TOP_COUNT))
        present: set[int] = set()
        for _, fields in entries:
            with contextlib.suppress(DecodeError):
                entry = codec.decode(fields)
                if isinstance(entry, (TokenDelta, Finished, Failed)):
                    present.add(entry.seq)
        return present

    def _take_seq(self, request_id: str) -> int:
        try:
            seq = self._next_seq[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} was not opened on this writer") from None
        self._next_seq[request_id] = seq + 1
        return seq

    def _append(self, request_id: str, result: Result) -> None:
        if hopmarks.on:
            hopmarks.mark_entry(request_id, result.seq, "tok.step")
        first = result.seq == self._first_seq.get(request_id)
        reader = self._readers[request_id]
        self._writes.add(reader, request_id, _Pending(request_id, reader, result, first=first))


def _mark_entries(pending: Iterable[_Pending], name: str) -> None:
    """Hop marks: ``name`` for each of these entries (the token path's, one set a token)."""
    for p in pending:
        hopmarks.mark_entry(p.request_id, p.result.seq, name)


def _mark_written(written: list[_Pending]) -> None:
    """Hop marks: ``tok.written`` for each entry written, and ``worker.written`` for a request's first
    entry from this writer only (the first token's write, bench serve's side step), not one a token."""
    _mark_entries(written, "tok.written")
    for p in written:
        if p.first:
            hopmarks.mark(p.request_id, "worker.written")


def _mark_read(request_id: str, seq: int, read_ns: int) -> None:
    """Hop marks: a result entry read (its shard's reply, ``read_ns``) and decoded (now), for the
    first token's hop (``api.*``) and the token path (``tok.*``)."""
    decoded_ns = time.time_ns()
    hopmarks.mark(request_id, "api.read", read_ns)
    hopmarks.mark(request_id, "api.decoded", decoded_ns)
    hopmarks.mark_entry(request_id, seq, "tok.read", read_ns)
    hopmarks.mark_entry(request_id, seq, "tok.decoded", decoded_ns)


class ClientLeft(Exception):
    """A subscription's client went away while it waited for a result (``Subscription.leave``)."""


@dataclass(eq=False)
class Subscription:
    """The results of one request, in ``seq`` order, ending with its terminal entry."""

    request_id: str
    key: str
    last_id: str = "0-0"
    next_seq: int = 0
    done: bool = False
    _held: dict[int, Result] = field(default_factory=dict)
    # A deque and one waiter instead of an asyncio.Queue, and one timer per request instead of
    # asyncio.wait_for per token (a task and a timer each time): this runs for every token.
    _ready: deque[Result] = field(default_factory=deque)
    _waiter: asyncio.Future[None] | None = None
    _timer: asyncio.TimerHandle | None = None
    expired: bool = False
    left: bool = False
    """Its client went away (``leave``): ``get`` raises ``ClientLeft`` instead of waiting."""

    def accept(self, result: Result) -> None:
        """Deliver in order; hold early entries, drop duplicates. An error ends at once."""
        if self.done:
            return
        if isinstance(result, Failed):
            self._deliver(result)
        elif result.seq < self.next_seq or result.seq in self._held:
            metrics.DUPLICATES_DROPPED.inc()
        elif result.seq > self.next_seq:
            self._held[result.seq] = result
        else:
            self._deliver(result)
            while not self.done and self.next_seq in self._held:
                self._deliver(self._held.pop(self.next_seq))

    def _deliver(self, result: Result) -> None:
        self._ready.append(result)
        self.next_seq = result.seq + 1
        self.done = result.terminal
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def expire_at(self, when: float) -> None:
        """From event-loop time ``when`` on, ``get`` raises TimeoutError instead of waiting.
        One timer per request, not one per token."""
        self._timer = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self._wake()

    def leave(self) -> None:
        """Its client went away: a ``get`` waiting now (or later, with nothing ready) raises
        ``ClientLeft``. What watches the client calls it, so the request's own task waits on
        its results alone, woken by the reader directly (not by a task that waits for it)."""
        self.left = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    async def get(self) -> Result:
        """The next result (TimeoutError once expired)."""
        while not self._ready:
            if self.expired:
                raise TimeoutError(f"no result for {self.request_id} in time")
            if self.left:
                raise ClientLeft(self.request_id)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._ready.popleft()

    def get_nowait(self) -> Result | None:
        """The next result if one is here already, else None."""
        return self._ready.popleft() if self._ready else None

    async def __aiter__(self) -> AsyncIterator[Result]:
        while True:
            result = await self.get()
            yield result
            if result.terminal:
                return


def _as_sent(response: object, **options: object) -> object:
    """Redis's reply as it came (a RawXReadReply), for XREAD on a shard's connection."""
    return response


@dataclass
class Sent:
    """What a request's result stream holds already: where a request that moves to other
    workers continues (the reaper's redispatch)."""

    next_seq: int = 0
    tokens: list[int] = field(default_factory=list)
    ended: bool = False


async def read_sent(redis: aioredis.Redis, config: BusConfig, reader: str, request_id: str) -> Sent:
    """What the request's result stream holds: its tokens in ``seq`` order, the next ``seq``,
    whether it ended. Entries that are not results (undecodable, or another type) count for nothing."""
    by_seq: dict[int, list[int]] = {}
    sent = Sent()
    for _, fields in cast(list[Entry], await redis.xrange(config.keys.out(reader, request_id))):
        with contextlib.suppress(DecodeError):
            entry = codec.decode(fields)
            if not isinstance(entry, (TokenDelta, Finished, Failed)):
                continue  # not a result: nothing was sent by it
            sent.ended = sent.ended or isinstance(entry, (Finished, Failed))
            if isinstance(entry, TokenDelta):
                by_seq[entry.seq] = entry.token_ids
            sent.next_seq = max(sent.next_seq, entry.seq + 1)
    sent.tokens = [t for seq in sorted(by_seq) for t in by_seq[seq]]
    return sent


HAND_OVER_STREAMS = 4
"""A reply of at most this many streams is handed over before the shard reads again: one loop
turn (``asyncio.sleep(0)``) in which the handlers it woke send their events, before the next XREAD
is built and written (60-80 µs of a token's way at c = 1, hop marks: ``bench.hop_trace
--tokens``). A larger reply's XREAD goes out first, as before: under load Redis then gathers the
next batch while the handlers write."""


class _Shard:
    """One connection and one XREAD loop over a subset of the subscribed streams; ``retire`` is
    called with each subscription whose final entry it read."""

    def __init__(self, config: BusConfig, name: str, retire: Callable[[Subscription], None]) -> None:
        self._config = config
        self.name = name
        """The shard's reader tag: its wake stream and the result streams it follows share it."""
        self._retire = retire
        # One connection: a shard runs one XREAD at a time. (Not redis-py's single_connection_client,
        # whose lock can hang aclose() after a cancelled read.)
        self._redis = connect(config, max_connections=1, name=name)
        # XREAD replies as Redis sends them: redis-py's conversion to dicts costs more per
        # token than decoding the entry does.
        self._redis.set_response_callback("XREAD", _as_sent)
        self.wake_key = config.keys.wake(name)
        self._wake_id = "0-0"
        self.subs: dict[str, Subscription] = {}
        self.blocked = False
        self.xreads = 0
        """XREAD calls issued; a subscription wakes each blocked one at most once."""
        self.woken_xread = -1
        self.closing = False
        self._reads = 0
        self._read_ns = 0
        """When the last read's reply came (``time.time_ns()``), with hop marks on."""

    async def run(self) -> None:
        fresh = True
        while not self.closing:
            try:
                if fresh:  # a wake stream left by an earlier process of the same name
                    await self._redis.delete(self.wake_key)
                    fresh = False
                await self._read_once()
            except TRANSIENT_ERRORS as exc:
                self.blocked = False
                log.warning("result reader: Redis unavailable (%s); retrying", exc)
                await wait_until_reachable(self._redis, lambda: self.closing)
            except Exception:  # never die silently: every API request depends on this loop
                self.blocked = False
                log.exception("result reader failed; retrying")
                await asyncio.sleep(0.5)

    async def _read_once(self) -> None:
        streams = {self.wake_key: self._wake_id}
        streams.update((key, sub.last_id) for key, sub in self.subs.items())
        self.xreads += 1
        self.blocked = True
        if hopmarks.on:  # about to wait: the marks so far go to their file now, not on a hop
            hopmarks.flush()
        # On a cluster, to the primary of the shard's slot (its wake stream's): no COMMAND GETKEYS.
        reply = await follow.read_reply(self._redis, streams, self._config.reader_count, self._config.block_ms)
        self.blocked = False
        self._read_ns = time.time_ns() if hopmarks.on else 0
        read = cast(RawXReadReply, reply or [])
        for key, entries in read:
            self._dispatch(key.decode(), entries)
        if len(read) <= HAND_OVER_STREAMS:
            await asyncio.sleep(0)

    def _dispatch(self, key: str, entries: list[RawEntry]) -> None:
        if key == self.wake_key:
            self._wake_id = entries[-1][0].decode()
            return
        sub = self.subs.get(key)
        if sub is None:  # unsubscribed while the read was in flight
            return
        sub.last_id = entries[-1][0].decode()
        _OUT_CONSUMED.inc(len(entries))
        for entry_id, fields in entries:
            self._accept(sub, entry_id, fields)
        if sub.done:
            self.subs.pop(key, None)
            self._retire(sub)

    def _accept(self, sub: Subscription, entry_id: bytes, flat: list[bytes]) -> None:
        fields = pairs(flat)
        self._reads += 1
        if self._reads % LATENCY_SAMPLE_EVERY == 0:
            published = codec.published_us(fields)
            if published is not None:
                metrics.PUBLISH_TO_READ.labels("out").observe(max(0.0, (codec.now_us() - published) / 1e6))
        try:
            result = codec.decode(fields)
        except DecodeError as exc:
            log.error("undecodable result entry %s on %s: %s", entry_id, sub.key, exc)
            return
        if isinstance(result, (TokenDelta, Finished, Failed)):
            if hopmarks.on:
                _mark_read(sub.request_id, result.seq, self._read_ns)
            sub.accept(result)
        else:
            log.error("result entry %s on %s is a %s, not a result", entry_id, sub.key, result.TYPE)

    async def close(self) -> None:
        with contextlib.suppress(*TRANSIENT_ERRORS):  # node names are random: nobody reuses it
            await self._redis.delete(self.wake_key)
        await self._redis.aclose()

    async def discard(self) -> None:
        """Drop a shard that never ran (renamed before start): its client has no connection yet."""
        await self._redis.aclose()


def _log_wake_failure(reply: asyncio.Future[Any]) -> None:
    if not reply.cancelled() and reply.exception() is not None:
        # The shard's read times out after block_ms and picks the stream up then.
        log.warning("result reader: wake-up failed (%s)", reply.exception())


def shard_name(reader: str, shard: int) -> str:
    """The name of a reader's shard ``shard``: the tag of the result streams it follows."""
    return f"{reader}.{shard}"


def _log_retire_failure(reply: asyncio.Future[Any]) -> None:
    if not reply.cancelled() and reply.exception() is not None:
        # The stream still expires finished_result_ttl_s after its final entry, the hand-off id
        # after the request's deadline.
        log.warning("result reader: could not retire a finished request's keys (%s)", reply.exception())


_NO_SLOT_MAP: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, RedisClusterException)
"""Why a cluster's slot map may not be read at start: Redis away, or no startup node answers
(redis-py's ``RedisClusterException``)."""

_WAKE = codec.flat({"w": 1})
"""A wake-up's entry: what it holds does not matter, that it is there does."""

_OUT_CONSUMED = metrics.ENTRIES_CONSUMED.labels("out")  # per read: look the child up once


class ResultReader:
    """Follows the result streams of one API process over ``shards`` Redis connections of its
    own; wake-ups go through ``redis``, the caller's client.

    Shard ``i`` is named ``<name>.<i>``, its streams' tag. On a cluster, ``start`` places the
    shards instead (unless ``placed`` is false): shard ``i`` gets the first of ``<name>.<i>``,
    ``<name>.<i>-1``, ... whose slot is served by primary ``(first + i) mod N`` (primaries in slot
    order), where ``first`` counts the shards the cell's API processes placed before this one
    (``INCRBY`` on ``sb:readers:{cell}``): A processes of S shards each fill the N primaries
    round-robin, and S = N (``shards=None`` on a cluster) puts one shard of each on every primary.
    ``shards=None``: one per primary on a cluster, 1 on a single Redis."""

    def __init__(
        self, config: BusConfig, redis: aioredis.Redis, name: str, shards: int | None = 1, *, placed: bool = True
    ) -> None:
        count = 1 if shards is None else shards
        if count < 1:
            raise ValueError("shards must be >= 1")
        if not valid_tag(shard_name(name, count - 1)):
            raise ValueError(f"a reader's name must fit a hash tag: no braces, colons or spaces, got {name!r}")
        self._config = config
        self._keys = config.keys
        self._redis = redis
        self._name = name
        self._wanted = shards
        self._placed = placed
        self._shards = [_Shard(config, shard_name(name, i), self._retire) for i in range(count)]
        self._waker = Batcher(redis)
        self._grace_ms = round(config.result_grace_s * 1000)
        self._current = CurrentDispatch(redis, config.keys)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def connections(self) -> int:
        """Redis connections this reader holds itself: one per shard."""
        return len(self._shards)

    async def start(self) -> None:
        if self._placed:
            await self._place()
        self._tasks = [asyncio.create_task(s.run(), name=f"result-shard-{i}") for i, s in enumerate(self._shards)]

    async def _place(self) -> None:
        """On a cluster, rename the shards (before they run) so that each primary gets its turn
        (see the class). Redis unreachable or the map unreadable: the names stay as made, hashed
        wherever they land; only the spread suffers. A reshard later moves slots under the
        names: the spread degrades until the process restarts, nothing breaks (MOVED is followed)."""
        try:
            slots = await cluster.slot_map(self._redis)
            if slots is None or slots.primaries == 0:
                return
            count = self._wanted or slots.primaries
            first = int(await self._redis.incrby(self._keys.readers, count)) - count
        except _NO_SLOT_MAP as exc:
            log.warning("result reader: no slot map (%s); reader tags hashed, not placed per primary", exc)
            return
        names = [slots.tag_on(shard_name(self._name, i), (first + i) % slots.primaries) for i in range(count)]
        unused, self._shards = self._shards, [_Shard(self._config, name, self._retire) for name in names]
        for shard in unused:
            await shard.discard()

    @property
    def names(self) -> list[str]:
        """The shards' names: the reader tags of this process's result streams."""
        return [shard.name for shard in self._shards]

    async def close(self) -> None:
        """Stop the shards: flag them and wake them, so each blocking read returns at once.
        Cancelling is only the fallback: redis-py can swallow the cancellation of a blocking
        read on a reconnected connection, and the task then never ends."""
        for shard in self._shards:
            shard.closing = True
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await asyncio.gather(*self._wake(shard))
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=self._config.block_ms / 1000 + 1)
            for task in stuck:
                task.cancel()
        for shard in self._shards:
            await shard.close()  # closing the connection also ends a read that ignored cancel
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def reader_of(self, request_id: str) -> str:
        """The shard that follows the request's results: what its ``GenerateRequest.reader`` says,
        so that its workers write its stream in the shard's slot."""
        return self._shard_of(request_id).name

    async def subscribe(self, request_id: str, from_id: str = "0-0") -> Subscription:
        """Follow a request's results (its stream is ``sb:out:{reader_of(request_id)}:<id>``).
        Subscribe before the request is published: reading starts at the stream's beginning, so
        nothing written in between is missed."""
        shard = self._shard_of(request_id)
        key = self._keys.out(shard.name, request_id)
        sub = Subscription(request_id, key, last_id=from_id)
        shard.subs[key] = sub
        if shard.blocked and shard.woken_xread != shard.xreads:
            # Its XREAD in flight does not include this stream: end it. Not awaited: the
            # caller's own XADD need not wait, and the reader reads the new stream from its
            # start whenever it wakes.
            shard.woken_xread = shard.xreads
            for reply in self._wake(shard):
                reply.add_done_callback(_log_wake_failure)
        return sub

    def _wake(self, shard: _Shard) -> list[asyncio.Future[Any]]:
        return [
            self._waker.call("xadd", shard.wake_key, _WAKE, maxlen=16, approximate=True),
            self._waker.call("expire", shard.wake_key, self._config.result_ttl_s),
        ]

    def _retire(self, sub: Subscription) -> None:
        """This reader has the request's final entry, and nothing needs its stream after it: the
        stream goes ``result_grace_s`` from now (at once for 0), not ``finished_result_ttl_s``
        after the entry, and the request's hand-off id at once. Not awaited: two commands per
        finished request, sent in the pipeline of the wake-ups."""
        if self._grace_ms:
            stream = self._waker.call("pexpire", sub.key, self._grace_ms)
        else:
            stream = self._waker.call("delete", sub.key)  # DEL: a few KB (and UNLINK is not in the ACL)
        for reply in (stream, self._current.forget(self._waker, sub.request_id)):
            reply.add_done_callback(_log_retire_failure)

    def unsubscribe(self, sub: Subscription) -> None:
        sub.stop_timer()
        self._shard_of(sub.request_id).subs.pop(sub.key, None)

    @property
    def active(self) -> int:
        return sum(len(s.subs) for s in self._shards)

    def _shard_of(self, request_id: str) -> _Shard:
        return self._shards[zlib.crc32(request_id.encode()) % len(self._shards)]
