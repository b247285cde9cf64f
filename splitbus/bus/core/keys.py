"""Every Redis key splitbus uses, and nothing else builds key names.

Braces are Redis Cluster hash tags (a cluster hashes only the part between the first ``{`` and
the next ``}``), and the tags are chosen so that whatever one script or multi-key command
touches lies in one slot (docs/bus.md, "Slots"):

- the **cell** tag ``{cell}`` (``SPLITBUS_CELL``, default ``main``) holds the control plane of one
  cell of schedulers and workers: requests, task streams, worker records and leases, dispatch
  marks, reservations, cancellations (``sb:tasks:{main}:<worker>``);
- a **reader** tag ``{reader}`` (a result-reader shard of an API process) holds the result
  streams that shard follows and its wake-up stream (``sb:out:{api-1.out.0}:<request>``);
- a DP group's barrier, a P/D link and a control reply are single-key and keep a tag of their own.

The entity's id follows the tag, written without braces: only the first ``{...}`` is a tag. On a
single Redis the braces are only characters: the same code runs on both.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitbus.env import DEFAULT_CELL, DEFAULT_PREFIX, valid_tag

SCHEDULER_GROUP = "schedulers"
"""Consumer group of the scheduler replicas on the request stream."""
WORKER_GROUP = "workers"
"""Consumer group on each worker's task stream."""

STREAM_KINDS = ("requests", "tasks", "out", "ctrl", "reply", "cancel", "dead", "wake", "dp", "kv-events")
"""Bounded label values for metrics: a key's kind, never its full name."""


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (``SPLITBUS_PREFIX``, default ``sb``) for one cell
    (``SPLITBUS_CELL``, default ``main``)."""

    prefix: str = DEFAULT_PREFIX
    cell: str = DEFAULT_CELL
    """The control plane's hash tag: one slot per cell."""

    def __post_init__(self) -> None:
        if not valid_tag(self.cell):
            raise ValueError(f"the cell must be non-empty, without braces, colons or spaces: {self.cell!r}")

    def _control(self, kind: str, name: str | None = None) -> str:
        """A control-plane key: ``<prefix>:<kind>:{<cell>}`` (``:<name>`` after it)."""
        key = f"{self.prefix}:{kind}:{{{self.cell}}}"
        return key if name is None else f"{key}:{name}"

    @property
    def requests(self) -> str:
        """Stream of new requests from API nodes (group ``schedulers``)."""
        return self._control("requests")

    @property
    def workers(self) -> str:
        """Sorted set of worker ids, scored by last heartbeat (server time, ms)."""
        return self._control("workers")

    @property
    def cancel(self) -> str:
        """Stream of cancellations, read by every worker and scheduler of the cell."""
        return self._control("cancel")

    @property
    def dead(self) -> str:
        """Stream of dead letters: entries that could not be delivered or decoded."""
        return self._control("dead")

    @property
    def run(self) -> str:
        """String: the run id of the Redis server process the cell's state was last settled on
        (``splitbus.bus.runs``): dispatches wait while the server's differs."""
        return self._control("run")

    @property
    def readers(self) -> str:
        """Counter: result-reader shards that the cell's API processes placed on a cluster so far;
        the next API process's shards go to the primaries after them (one ``INCRBY`` per start)."""
        return self._control("readers")

    @property
    def registry_log(self) -> str:
        """Stream of the registry's changes (``MAXLEN ~``): workers' beats and loads, the
        schedulers' reservations, departures; every registry view follows it without a group
        (``splitbus.bus.registry_view``)."""
        return self._control("registry")

    @property
    def tenants(self) -> str:
        """Hash: each tenant's record (its name -> its limits, as JSON; ``splitbus.bus.tenants``)."""
        return self._control("tenants")

    @property
    def tenant_keys(self) -> str:
        """Hash: the SHA-256 of each API key (hex) -> the name of its tenant; no key in clear."""
        return self._control("tenant-keys")

    @property
    def planner(self) -> str:
        """Hash: the planner's last advice (``splitbus.bus.planner``); it expires three intervals
        after it was written, so a stopped planner's advice is not acted on."""
        return self._control("planner")

    def limits(self, tenant: str) -> str:
        """Hash: one tenant's token buckets (``splitbus.bus.limits``), each field the Redis time (ms)
        at which that bucket is full again; TTL: until the last of them is."""
        return self._control("limits", tenant)

    def inflight(self, tenant: str) -> str:
        """Sorted set: one tenant's requests in flight (their ids), scored by when each one's lease
        ends (Redis time, ms); TTL: the last lease taken."""
        return self._control("inflight", tenant)

    def tasks(self, worker: str) -> str:
        """Stream of tasks for one worker (group ``workers``)."""
        return self._control("tasks", worker)

    def worker(self, worker: str) -> str:
        """Hash: one worker's record and load."""
        return self._control("worker", worker)

    def lease(self, worker: str) -> str:
        """String with a TTL: the worker is alive while it exists."""
        return self._control("lease", worker)

    def scheduler_lease(self, name: str) -> str:
        """String with a TTL: the scheduler replica (its consumer name in ``schedulers``) is alive
        while it exists; once it is gone, the other replicas claim the entries pending with it."""
        return self._control("scheduler-lease", name)

    def ctrl(self, worker: str) -> str:
        """Stream of control commands to one worker."""
        return self._control("ctrl", worker)

    def reply(self, task: str) -> str:
        """Stream holding the reply to one control command (single-key: a slot of its own)."""
        return f"{self.prefix}:reply:{{{task}}}"

    def out(self, reader: str, request: str) -> str:
        """Result stream of one request, tagged by the reader shard that follows it: token
        deltas, then a final or error entry."""
        return f"{self.prefix}:out:{{{reader}}}:{request}"

    def kv(self, request: str) -> str:
        """Hash: the decode side's KV reservation for one request."""
        return self._control("kv", request)

    def dispatched(self, request: str) -> str:
        """String with a TTL: the request was dispatched (a duplicate entry is then skipped)."""
        return self._control("dispatched", request)

    def current(self, request: str) -> str:
        """String with a TTL: the hand-off id of the request's current dispatch (its tasks carry
        it). A task with another one is void: a reaper does not move it again and a decode
        worker does not reserve for it."""
        return self._control("current", request)

    def moved(self, request: str) -> str:
        """Counter with a TTL: how often the reaper moved the request off a dead worker."""
        return self._control("moved", request)

    def kv_events(self, worker: str) -> str:
        """Stream of one worker's KV cache events, one batch per engine step (``MAXLEN ~``);
        every scheduler replica reads it without a group. Under the cell's tag, so that one
        ``XREAD`` follows every worker's stream (docs/routing.md, "KV events")."""
        return self._control("kv-events", worker)

    def kv_snapshot(self, worker: str) -> str:
        """Hash: one worker's whole set of cached blocks after a given event id (a codec entry's
        ``type``, ``data``, ``ts``), and ``requested`` while a scheduler asks for a fresh one."""
        return self._control("kv-snapshot", worker)

    def reaping(self, worker: str) -> str:
        """String with a TTL: the scheduler replica that is taking over a dead worker's tasks."""
        return self._control("reaping", worker)

    def rdma(self, prefill: str, decode: str) -> str:
        """Hash: connection state between a prefill and a decode worker (tagged by the first)."""
        return f"{self.prefix}:rdma:{{{prefill}}}:{{{decode}}}"

    def dp(self, group: str) -> str:
        """Stream of one DP group's step plans: the ranks' lock-step barrier (every rank posts
        every step: a slot of its own, off the cell's)."""
        return f"{self.prefix}:dp:{{{group}}}"

    def ep_store(self, group: str) -> str:
        """Where a DP group's ranks meet to form their expert-parallel process group: rank 0's
        store address for the group's epoch (single-key: the group's own tag, as its barrier)."""
        return f"{self.prefix}:ep:{{{group}}}"

    def wake(self, reader: str) -> str:
        """Stream that wakes one multiplexed result reader shard when its set of streams changes
        (in the reader's slot: read in the same XREAD as its result streams)."""
        return f"{self.prefix}:wake:{{{reader}}}"

    def kind(self, key: str) -> str:
        """The key's kind (``requests``, ``out``, ...): a bounded metrics label."""
        rest = key[len(self.prefix) + 1 :] if key.startswith(self.prefix + ":") else key
        kind = rest.split(":", 1)[0]
        return kind if kind in STREAM_KINDS else "other"
