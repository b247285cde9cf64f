"""Configuration of one API process, validated once."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from splitbus.api import tool_parsers
from splitbus.api.tenants_file import FileTenant
from splitbus.bus.core.config import BusConfig
from splitbus.tokenization.tokenizer import MAX_CHARS_PER_TOKEN


@dataclass(frozen=True)
class ApiConfig:
    bus: BusConfig
    models: tuple[tuple[str, Path], ...]
    """(served name, Hugging Face folder) of each model whose tokenizer this API loads."""
    api_keys: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    """The address the server binds: without API keys, a Host name ``/v1/*`` answers to."""
    allowed_hosts: tuple[str, ...] = ()
    """More Host names ``/v1/*`` answers to without API keys (``*``: any). IP addresses and
    ``localhost`` always are; other names get 421 (DNS rebinding: splitbus/api/app.py)."""
    node_id: str = field(default_factory=lambda: f"api-{uuid.uuid4().hex[:8]}")
    max_body_bytes: int = 4 * 1024 * 1024
    """The largest request body: 413 when Content-Length says more (before reading) or when
    a body without one grows past it."""
    small_body_bytes: int = 64 * 1024
    """Bodies declaring at most this are "small"; larger ones, and bodies of unknown length,
    are "large" and share their own few read slots (below)."""
    max_small_body_reads: int = 256
    """Small bodies being read at once beyond which new requests get 429 (with Retry-After)."""
    max_large_body_reads: int = 8
    """Large bodies being read at once beyond which new ones get 429. Bodies being read hold
    memory: at most max_large_body_reads x max_body_bytes + max_small_body_reads x
    small_body_bytes (32 + 16 MiB by default), however many uploads stall; and a normal small
    request still gets a slot while stalled large ones hold all of theirs."""
    body_timeout_s: float = 30.0
    """Seconds to receive the whole body once the headers are in; past it, 408 and the
    connection is closed (a body shorter than its Content-Length no longer waits forever)."""
    header_timeout_s: float = 10.0
    """Seconds from the connection's first byte (or from a keep-alive request's first byte)
    to the end of the request headers; past it the connection is closed (slow-loris).
    uvicorn has no such timeout of its own: see splitbus/api/server.py."""
    max_connections: int = 16384
    """Connections open at once beyond which a new one is answered 429 with ``Retry-After: 1``
    at once, before its request is read (each holds a socket, a file descriptor and a protocol
    object; the process raises its descriptor limit to fit this many, where the system allows)."""
    max_header_bytes: int = 64 * 1024
    """Bytes of request line and headers beyond which the connection gets 431 and is closed."""
    max_prompt_chars: int | None = None
    """Characters of prompt (or of all messages' content) beyond which a request gets 400
    before it is tokenized. None: each model's context length x MAX_CHARS_PER_TOKEN."""
    tokenize_threads: int = 2
    """Threads that tokenize long prompts and render chat templates, off the event loop."""
    max_tokenize_queue: int = 64
    """Requests waiting for a tokenizer thread beyond which new ones get 429."""
    max_inflight: int = 1024
    """Requests in flight in this process beyond which new ones get 429."""
    max_backlog: int = 10_000
    """Entries in the request stream (not yet trimmed: unplaced or recent) beyond which new
    requests get 429: the schedulers are behind."""
    request_timeout_s: float = 600.0
    """Deadline of a request; past it the client gets an error and workers free its state."""
    early_refusal: bool = True
    """Whether a request the fleet is predicted not to start before its deadline is refused at
    admission (503 ``overloaded``: ``ApiState.refuse_late``). Off (``--no-early-refusal``), such
    requests are admitted and wait, up to their deadline: for a comparison run, or a fleet whose
    clients would rather queue than retry. The prefill rates are measured either way."""
    redis_connections: int = 7
    """Connections of the shared pool (XADD, cancellations, registry, wake-ups); with the
    reader's one, 8 in all by default, however many streams are open."""
    reader_shards: int | None = None
    """Connections that follow result streams; each multiplexes any number of streams, and on a
    cluster is one reader tag, placed on a primary of its own (docs/cluster.md). None: one per
    primary on a cluster, 1 on a single Redis."""
    registry_refresh_s: float = 0.5
    """How often the API reads the request stream's length (``max_backlog``). The registry view
    follows the registry log as it changes (``splitbus.bus.registry_view``)."""
    dispatch: str = "scheduler"
    """Who places a request: ``scheduler`` (it goes to the request stream, a scheduler replica
    places it) or ``api`` (this process places it itself, by load, and writes its tasks; one it
    cannot place goes to the request stream: ``splitbus.api.placing``)."""
    dispatch_mode: str = "splitwise"
    """With ``dispatch`` ``api``: the policy it places with, ``splitwise`` or ``mixed`` (the
    schedulers' ``--mode``)."""
    prefix_block_size: int = 16
    """Block size of the hash chain each request carries for cache-aware routing
    (``GenerateRequest.prefix_hashes``; the workers' ``--block-size``); 0: none, the scheduler
    hashes prompts itself."""
    tenant_cache_s: float = 2.0
    """How long an API key's tenant (or that it is no tenant's) is kept before the tenant store
    is read again for it (``splitbus.api.tenants``): a key removed or a limit changed with
    ``splitbus tenants`` takes at most this long to reach each API node. Also how often a node
    that requires no key yet looks for the store's first tenant."""
    tenant_cache_entries: int = 10_000
    """Keys whose answer is kept at most (the least recently used goes first)."""
    tenants: tuple[FileTenant, ...] = ()
    """The tenants of ``--tenants-file``, put in the tenant store at start (``tenants_file.seed``)."""
    tool_call_parser: str | None = None
    """The ``tool_parsers`` parser that reads tool calls out of the text of a chat with tools and
    ``tool_choice`` ``auto`` (the served models' family's); None: such text stays content."""

    def __post_init__(self) -> None:
        if self.dispatch not in ("scheduler", "api"):
            raise ValueError(f"dispatch must be scheduler or api, got {self.dispatch!r}")
        if self.dispatch_mode not in ("splitwise", "mixed"):
            raise ValueError(f"--dispatch api places with splitwise or mixed, not {self.dispatch_mode!r}")
        if self.tool_call_parser is not None:
            tool_parsers.create(self.tool_call_parser)  # UnknownParser (a ValueError) names the known ones
        names = [name for name, _ in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique: {names}")
        limits = (
            self.max_body_bytes,
            self.small_body_bytes,
            self.max_small_body_reads,
            self.max_large_body_reads,
            self.max_header_bytes,
            1 if self.max_prompt_chars is None else self.max_prompt_chars,
            self.tokenize_threads,
            self.max_tokenize_queue,
            self.max_inflight,
            self.max_backlog,
            self.redis_connections,
            1 if self.reader_shards is None else self.reader_shards,
            self.tenant_cache_entries,
        )
        if min(limits) < 1:
            raise ValueError("limits must be >= 1")
        timeouts = (
            self.request_timeout_s,
            self.registry_refresh_s,
            self.body_timeout_s,
            self.header_timeout_s,
            self.tenant_cache_s,
        )
        if min(timeouts) <= 0:
            raise ValueError("timeouts must be > 0")

    def prompt_char_limit(self, context_length: int) -> int:
        """The most prompt characters a model with this context accepts before tokenizing."""
        return context_length * MAX_CHARS_PER_TOKEN if self.max_prompt_chars is None else self.max_prompt_chars

    @property
    def max_redis_connections(self) -> int:
        """The most Redis connections this process holds, whatever the number of streams (on a
        single Redis: with ``reader_shards`` None, one shard)."""
        return self.redis_connections + (1 if self.reader_shards is None else self.reader_shards)
