"""A worker's answers to control commands (``splitbus.bus.control``)."""

from __future__ import annotations

from typing import Any, Protocol

import redis.asyncio as aioredis
from prometheus_client import generate_latest

from splitbus.bus.control import CommandFailed, ControlServer, Handler
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import Keys
from splitbus.bus.messages.control import MAX_DRAIN_TIMEOUT_S
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry
from splitbus.bus.roles import Role
from splitbus.bus.tasks import unread_tasks
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.links import PeerLinks
from splitbus.worker.table import RequestTable, Status
from splitbus.worker.transfer import TransferError


class ServedConfig(Protocol):
    """What the commands read of a worker's config (``WorkerConfig`` has it)."""

    @property
    def bus(self) -> BusConfig: ...
    @property
    def role(self) -> str: ...
    @property
    def model_name(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_requests(self) -> int: ...
    @property
    def max_prefill_tokens(self) -> int: ...
    @property
    def dp_group(self) -> str: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def drain_timeout_s(self) -> float: ...


class ControlledWorker(Protocol):
    """What the commands read of a worker (``splitbus.worker.worker.Worker`` has it)."""

    @property
    def id(self) -> str: ...
    @property
    def config(self) -> ServedConfig: ...
    @property
    def tokenizer(self) -> ModelTokenizer: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def redis(self) -> aioredis.Redis: ...
    @property
    def keys(self) -> Keys: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def links(self) -> PeerLinks: ...
    @property
    def requests(self) -> RequestTable: ...
    def load(self) -> WorkerLoad: ...
    def begin_drain(self, timeout_s: float) -> bool: ...


def control_server(worker: ControlledWorker) -> ControlServer:
    handlers: dict[str, Handler] = {
        "get_payload": lambda args: get_payload(worker),
        "get_metrics": lambda args: get_metrics(),
        "connect_rdma": lambda args: connect_rdma(worker, args),
        "drain": lambda args: drain(worker, args),
    }
    return ControlServer(worker.redis, worker.config.bus, worker.id, handlers)


async def get_payload(worker: ControlledWorker) -> dict[str, Any]:
    """What an external router needs to place work on this worker."""
    load, c = worker.load(), worker.config
    return {
        "worker_id": worker.id,
        "role": c.role,
        "model": c.model_name,
        "engine": c.engine,
        "transfer_endpoint": worker.endpoint,
        "block_size": c.block_size,
        "free_kv_blocks": load.free_kv_blocks,
        "total_kv_blocks": load.total_kv_blocks,
        "running_requests": load.running,
        "waiting_requests": load.waiting,
        "queued_prefill_tokens": load.queued_prefill_tokens,
        "max_batch_size": c.max_requests,
        "max_prefill_tokens": c.max_prefill_tokens,
        "max_input_length": worker.tokenizer.context_length,
        "unhandled_requests": await unread_tasks(worker.redis, worker.keys, worker.id)
        + worker.requests.count(Status.QUEUED),
        "dp_group": c.dp_group,
        "dp_rank": c.dp_rank,
        "dp_size": c.dp_size,
        # A MoE worker's placement and its experts' loads, for an expert balancer; None for a
        # dense model or an engine without experts.
        "experts": load.experts.to_json() if load.experts is not None else None,
    }


async def get_metrics() -> dict[str, Any]:
    return {"content_type": "text/plain; version=0.0.4", "text": generate_latest().decode()}


async def connect_rdma(worker: ControlledWorker, args: dict[str, Any]) -> dict[str, Any]:
    """Connect this prefill worker to the decode worker ``args["decode_worker"]`` and record it
    in ``sb:rdma:{P}:{D}``. Only to a live decode worker's registered endpoint: an
    ``args["endpoint"]`` must be that one, so the command cannot make a worker connect (and
    later send KV) to an address of the caller's choosing."""
    if worker.config.role == Role.DECODE:
        raise CommandFailed(f"{worker.id} is a decode worker; send connect_rdma to the prefill worker")
    decode_worker = args.get("decode_worker")
    if not isinstance(decode_worker, str) or not decode_worker:
        raise CommandFailed("connect_rdma needs args.decode_worker, the id of a decode worker")
    endpoint = await _endpoint_of(worker, decode_worker)
    asked = args.get("endpoint")
    if asked not in (None, "", endpoint):
        raise CommandFailed(f"{asked!r} is not {decode_worker}'s registered KV endpoint ({endpoint}); not connecting")
    try:
        await worker.links.ensure(decode_worker, endpoint)
    except TransferError as exc:
        raise CommandFailed(f"could not connect to {decode_worker} at {endpoint}: {exc}") from exc
    return {
        "state": "connected",
        "decode_worker": decode_worker,
        "endpoint": endpoint,
        "key": worker.links.records.key(decode_worker),
    }


async def drain(worker: ControlledWorker, args: dict[str, Any]) -> dict[str, Any]:
    """Drain this worker, as SIGTERM does with ``--drain-timeout`` (``splitbus.worker.drain``), for
    orchestrators that cannot signal it: ``args["timeout_s"]`` bounds it (default: the worker's
    ``--drain-timeout``, which must then be set). Answered at once; the worker leaves once drained."""
    config = worker.config
    if config.dp_size:
        raise CommandFailed(f"{worker.id} is a DP rank: a group stops whole, it is not drained")
    timeout_s = args.get("timeout_s", config.drain_timeout_s)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise CommandFailed("drain takes args.timeout_s, a number of seconds")
    if not 0 < timeout_s <= MAX_DRAIN_TIMEOUT_S:
        unset = "" if "timeout_s" in args else " (the worker has no --drain-timeout: give one)"
        raise CommandFailed(f"drain needs 0 < args.timeout_s <= {MAX_DRAIN_TIMEOUT_S:g}{unset}")
    started = worker.begin_drain(float(timeout_s))
    return {"state": "draining", "timeout_s": float(timeout_s), "already": not started}


async def _endpoint_of(worker: ControlledWorker, decode_worker: str) -> str:
    info = next((w for w in await worker.registry.snapshot() if w.record.worker_id == decode_worker), None)
    if info is None or not info.alive:
        raise CommandFailed(f"no live worker {decode_worker!r} in the registry")
    if info.record.role not in (Role.DECODE, Role.MIXED) or not info.record.transfer_endpoint:
        raise CommandFailed(f"{decode_worker} is a {info.record.role} worker with no KV endpoint to connect to")
    return info.record.transfer_endpoint
