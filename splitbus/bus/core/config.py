"""One configuration object for everything on the bus, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitbus.bus.core.cluster import is_cluster_url, parse_cluster_url
from splitbus.bus.core.keys import Keys
from splitbus.env import DEFAULT_CELL, DEFAULT_PREFIX, valid_tag


@dataclass(frozen=True)
class BusConfig:
    redis_url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    """One Redis (any URL redis-py reads), or a Redis Cluster:
    ``redis+cluster://user:password@host:port,host:port,...`` (``splitbus.bus.core.cluster``). Not in
    ``repr``: it carries the password, and a config can end up in a log line or a test report."""
    prefix: str = DEFAULT_PREFIX
    cell: str = DEFAULT_CELL
    """The cell this process belongs to (``SPLITBUS_CELL``): the hash tag of its control-plane
    keys (docs/bus.md, "Keys"). Every scheduler, worker and API node of a cell shares it."""
    block_ms: int = 1000
    """How long one blocking read waits. Kept well under ``socket_timeout_s``: redis-py 8
    retries a read that outlives its socket timeout and can then raise after a minute."""
    socket_timeout_s: float = 5.0
    claim_idle_ms: int = 30_000
    """An entry pending this long with its consumer is taken over by a claimer."""
    max_deliveries: int = 5
    """An entry delivered this many times without an ack goes to the dead-letter stream."""
    result_ttl_s: int = 3600
    """Result streams expire this long after their first entry (a bound on leaks)."""
    finished_result_ttl_s: int = 120
    """...and this long after their final entry: the backstop for a stream nobody reads to its
    end (its client went away, its API node died), which a late reader can still replay."""
    result_grace_s: float = 5.0
    """Once an API node's reader has a request's final entry, the stream is kept this long more
    (for ``redis-cli`` inspection; a worker that died between its final entry and its ack is then
    still seen as done by the reaper), then deleted; 0: deleted at once. Finished streams are most
    of what Redis holds under load: this bounds them to ``result_grace_s`` x the request rate."""
    replay_window_s: float = 5.0
    """A worker keeps the result entries it wrote this long (and a finished request's, this long
    after its final entry), to write again what a new Redis run lost (a restart from an AOF
    fsynced once a second, a failover to a replica that was behind: ``ResultWriter.replay``).
    Longer than what such a run loses (~1 s) and the time to see the run (a heartbeat); 0: off."""
    dead_maxlen: int = 10_000
    dead_worker_keep_s: int = 3600
    """A worker that died (after the reaper moved its work) or stopped: its record, task and
    control streams stay this long for operators to look at, then expire."""
    reader_count: int = 256
    """Entries per stream per read in the multiplexed result reader."""

    def __post_init__(self) -> None:
        # In the order of the checks before they were split: a config with several faults names the same one.
        if not valid_tag(self.cell):
            raise ValueError(f"cell must be non-empty, without braces, colons or spaces: {self.cell!r}")
        self._check_reads()
        if self.finished_result_ttl_s < 1 or self.result_ttl_s < self.finished_result_ttl_s:
            raise ValueError("need 1 <= finished_result_ttl_s <= result_ttl_s")
        self._check_cluster_url()
        self._check_windows()

    def _check_reads(self) -> None:
        if self.block_ms <= 0:
            raise ValueError("block_ms must be > 0 (BLOCK 0 waits forever and hangs on a dead server)")
        if self.block_ms / 1000 >= self.socket_timeout_s:
            raise ValueError(f"block_ms ({self.block_ms}) must be below socket_timeout_s ({self.socket_timeout_s}s)")
        if self.max_deliveries < 1 or self.claim_idle_ms < 1:
            raise ValueError("max_deliveries and claim_idle_ms must be >= 1")

    def _check_cluster_url(self) -> None:
        if is_cluster_url(self.redis_url):
            cluster = parse_cluster_url(self.redis_url)  # a malformed one fails here, at start, not at first use
            if cluster.tls:
                cluster.tls.check_files()  # so does one naming a certificate that is not there

    def _check_windows(self) -> None:
        if not 0 <= self.result_grace_s <= self.finished_result_ttl_s:
            raise ValueError("need 0 <= result_grace_s <= finished_result_ttl_s")
        if not 0 <= self.replay_window_s <= self.finished_result_ttl_s:
            raise ValueError("need 0 <= replay_window_s <= finished_result_ttl_s (0: no replay)")

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, self.cell)
