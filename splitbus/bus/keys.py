"""Every Redis key splitbus uses, and nothing else builds key names.

Braces are Redis Cluster hash tags: all keys of one request (``out``, ``kv``) share a slot, and
so do all keys of one worker (``tasks``, ``worker``, ``lease``, ``ctrl``). A scheduler replica's
lease is tagged by its consumer name, and every script touches one key (or keys of one tag).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitbus.env import DEFAULT_PREFIX

SCHEDULER_GROUP = "schedulers"
"""Consumer group of the scheduler replicas on the request stream."""
WORKER_GROUP = "workers"
"""Consumer group on each worker's task stream."""

STREAM_KINDS = ("requests", "tasks", "out", "ctrl", "reply", "cancel", "dead", "wake", "dp")
"""Bounded label values for metrics: a key's kind, never its full name."""


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (``SPLITBUS_PREFIX``, default ``sb``)."""

    prefix: str = DEFAULT_PREFIX

    @property
    def requests(self) -> str:
        """Stream of new requests from API nodes (group ``schedulers``)."""
        return f"{self.prefix}:requests"

    @property
    def workers(self) -> str:
        """Sorted set of worker ids, scored by last heartbeat (server time, ms)."""
        return f"{self.prefix}:workers"

    @property
    def cancel(self) -> str:
        """Stream of cancellations, read by every worker and scheduler."""
        return f"{self.prefix}:cancel"

    @property
    def dead(self) -> str:
        """Stream of dead letters: entries that could not be delivered or decoded."""
        return f"{self.prefix}:dead"

    def tasks(self, worker: str) -> str:
        """Stream of tasks for one worker (group ``workers``)."""
        return f"{self.prefix}:tasks:{{{worker}}}"

    def worker(self, worker: str) -> str:
        """Hash: one worker's record and load."""
        return f"{self.prefix}:worker:{{{worker}}}"

    def lease(self, worker: str) -> str:
        """String with a TTL: the worker is alive while it exists."""
        return f"{self.prefix}:lease:{{{worker}}}"

    def scheduler_lease(self, name: str) -> str:
        """String with a TTL: the scheduler replica (its consumer name in ``schedulers``) is alive
        while it exists; once it is gone, the other replicas claim the entries pending with it."""
        return f"{self.prefix}:scheduler-lease:{{{name}}}"

    def ctrl(self, worker: str) -> str:
        """Stream of control commands to one worker."""
        return f"{self.prefix}:ctrl:{{{worker}}}"

    def reply(self, task: str) -> str:
        """Stream holding the reply to one control command."""
        return f"{self.prefix}:reply:{{{task}}}"

    def out(self, request: str) -> str:
        """Result stream of one request: token deltas, then a final or error entry."""
        return f"{self.prefix}:out:{{{request}}}"

    def kv(self, request: str) -> str:
        """Hash: the decode side's KV reservation for one request."""
        return f"{self.prefix}:kv:{{{request}}}"

    def dispatched(self, request: str) -> str:
        """String with a TTL: the request was dispatched (a duplicate entry is then skipped)."""
        return f"{self.prefix}:dispatched:{{{request}}}"

    def current(self, request: str) -> str:
        """String with a TTL: the hand-off id of the request's current dispatch (its tasks carry
        it). A task with another one is void: a reaper does not move it again and a decode
        worker does not reserve for it."""
        return f"{self.prefix}:current:{{{request}}}"

    def moved(self, request: str) -> str:
        """Counter with a TTL: how often the reaper moved the request off a dead worker."""
        return f"{self.prefix}:moved:{{{request}}}"

    def reaping(self, worker: str) -> str:
        """String with a TTL: the scheduler replica that is taking over a dead worker's tasks."""
        return f"{self.prefix}:reaping:{{{worker}}}"

    def rdma(self, prefill: str, decode: str) -> str:
        """Hash: connection state between a prefill and a decode worker."""
        return f"{self.prefix}:rdma:{{{prefill}}}:{{{decode}}}"

    def dp(self, group: str) -> str:
        """Stream of one DP group's step plans: the ranks' lock-step barrier."""
        return f"{self.prefix}:dp:{{{group}}}"

    def wake(self, reader: str) -> str:
        """Stream that wakes one multiplexed result reader when its set of streams changes."""
        return f"{self.prefix}:wake:{{{reader}}}"

    def kind(self, key: str) -> str:
        """The key's kind (``requests``, ``out``, ...): a bounded metrics label."""
        rest = key[len(self.prefix) + 1 :] if key.startswith(self.prefix + ":") else key
        kind = rest.split(":", 1)[0]
        return kind if kind in STREAM_KINDS else "other"
