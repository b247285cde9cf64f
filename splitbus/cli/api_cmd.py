"""``splitbus api``: one OpenAI-compatible API process (Starlette on uvicorn)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from splitbus import tracing
from splitbus.api import tool_parsers
from splitbus.cli.common import add_redis_url_argument, data_dir, redis_url, say
from splitbus.env import Env
from splitbus.masking import mask_url

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from splitbus.api.config import ApiConfig
    from splitbus.api.server import GuardedHttpToolsProtocol


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("api", help="run one OpenAI-compatible API process")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    add_redis_url_argument(p)
    p.add_argument(
        "--model",
        action="append",
        type=Path,
        default=[],
        required=True,
        metavar="PATH",
        help="Hugging Face model folder, or a .gguf file (converted once into a folder under DATA_DIR/models), "
        "whose tokenizer this API uses (repeatable)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="name clients use (default: a .gguf file's stem, or the folder name; one --model only)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=list(env.api_keys),
        help="accepted Bearer key (repeatable; prefer SPLITBUS_API_KEYS: argv is public)",
    )
    add_tenants_file_argument(p)
    p.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names the API answers to when no API key is set, beside IP addresses, localhost "
        "and --host ('*': any; others get 421)",
    )
    p.add_argument("--max-inflight", type=int, default=1024, help="requests in flight before 429 (default %(default)s)")
    p.add_argument(
        "--max-connections",
        type=int,
        default=16384,
        help="open connections before a new one is answered 429 at once (default %(default)s)",
    )
    p.add_argument(
        "--max-backlog", type=int, default=10_000, help="request-stream entries before 429 (default %(default)s)"
    )
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request fails (default %(default)s)"
    )
    p.add_argument(
        "--no-early-refusal",
        dest="early_refusal",
        action="store_false",
        help="admit a request even when the queue ahead is predicted to outlast its timeout (default: 503 "
        "overloaded at once; docs/tenants.md)",
    )
    p.add_argument(
        "--dispatch",
        choices=("scheduler", "api"),
        default="scheduler",
        help="who places requests: the schedulers (default) or this process itself, by load (docs/architecture.md)",
    )
    p.add_argument(
        "--dispatch-mode",
        choices=("splitwise", "mixed"),
        default="splitwise",
        help="with --dispatch api: the policy it places with, as the schedulers' --mode (default %(default)s)",
    )
    p.add_argument(
        "--prefix-block-size",
        type=int,
        default=16,
        help="block size of the prompt's hash chain sent for cache-aware routing: the workers' --block-size"
        " (0: none; default %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (default %(default)s)"
    )
    p.add_argument(
        "--max-large-bodies",
        type=int,
        default=8,
        help="bodies over 64 KiB (or chunked) received at once before 429 (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds to receive a body before 408 (default %(default)s)"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds to receive a request's headers before the connection is closed (default %(default)s)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="prompt characters refused before tokenizing (default: context length x 16)",
    )
    p.add_argument(
        "--reader-shards",
        type=int,
        default=None,
        help="connections that follow result streams, each a reader tag placed on its own primary on a cluster "
        "(default: one per primary on a cluster, 1 on a single Redis)",
    )
    p.add_argument(
        "--result-grace",
        type=float,
        default=5.0,
        help="seconds a result stream is kept once this API read its final entry, for inspection; 0: deleted "
        "at once (default %(default)s)",
    )
    p.add_argument(
        "--node-id",
        default=None,
        help="this API's name on the bus (default: random); with --workers N > 1, process i is NODE-i",
    )
    add_workers_argument(p, "--workers", env)
    add_tool_call_parser_argument(p)
    p.set_defaults(run=run)


def add_workers_argument(p: argparse.ArgumentParser, flag: str, env: Env) -> None:
    """``--workers`` (``splitbus api``) or ``--api-workers`` (``splitbus up``): API processes on one port."""
    from splitbus.api.procs import MAX_DEFAULT_WORKERS, default_workers

    p.add_argument(
        flag,
        type=_positive_int,
        default=env.api_workers or default_workers(),
        metavar="N",
        help=f"API processes sharing the port with SO_REUSEPORT, each a node of its own with its own Redis "
        f"connections and its own --max-connections and --max-inflight (default: SPLITBUS_API_WORKERS, else the "
        f"host's cores, at most {MAX_DEFAULT_WORKERS}, since each holds its own connections and tokenizers: "
        f"here %(default)s; "
        f"1: one process, no parent)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_tenants_file_argument(p: argparse.ArgumentParser) -> None:
    """``--tenants-file`` (``splitbus api`` and ``splitbus up``)."""
    p.add_argument(
        "--tenants-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSON file of tenants, their limits and their keys' SHA-256, put in the tenant store at start "
        "(docs/tenants.md)",
    )


def add_tool_call_parser_argument(p: argparse.ArgumentParser) -> None:
    """``--tool-call-parser``, its choices the parsers' table (``splitbus api`` and ``splitbus up``)."""
    p.add_argument(
        "--tool-call-parser",
        choices=tool_parsers.names(),
        default=None,
        help="read tool calls out of chat replies with tool_choice auto, in the served model family's format "
        "(hermes: Qwen2.5/Qwen3/Hermes <tool_call> JSON; llama3_json: Llama 3.x JSON); default: none, the text "
        "stays content",
    )


def build_config(args: argparse.Namespace, env: Env) -> ApiConfig:
    from splitbus.api.config import ApiConfig
    from splitbus.api.tenants_file import read_tenants_file
    from splitbus.bus.core.config import BusConfig
    from splitbus.model_files.resolve import resolve_model, served_name

    if args.served_model_name and len(args.model) != 1:
        raise ValueError("--served-model-name needs exactly one --model")
    where = data_dir(args, env)
    models = tuple((served_name(path, args.served_model_name), resolve_model(path, where, say)) for path in args.model)
    return ApiConfig(
        bus=BusConfig(
            redis_url=redis_url(args, env), prefix=env.prefix, cell=env.cell, result_grace_s=args.result_grace
        ),
        models=models,
        api_keys=tuple(args.api_key),
        tenants=read_tenants_file(args.tenants_file) if args.tenants_file else (),
        host=args.host,
        allowed_hosts=tuple(name.strip() for name in args.allowed_hosts.split(",") if name.strip()),
        max_inflight=args.max_inflight,
        max_connections=args.max_connections,
        max_backlog=args.max_backlog,
        request_timeout_s=args.request_timeout,
        early_refusal=args.early_refusal,
        max_body_bytes=args.max_body_bytes,
        max_large_body_reads=args.max_large_bodies,
        body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
        max_prompt_chars=args.max_prompt_chars,
        reader_shards=args.reader_shards,
        prefix_block_size=args.prefix_block_size,
        dispatch=args.dispatch,
        dispatch_mode=args.dispatch_mode,
        tool_call_parser=args.tool_call_parser,
        **({"node_id": args.node_id} if args.node_id else {}),
    )


def run(args: argparse.Namespace, env: Env) -> int:
    from splitbus.tokenization import ModelFilesError

    try:
        config = build_config(args, env)
        for _, folder in config.models:  # fail before binding the port, naming the problem
            from splitbus.tokenization import ModelTokenizer

            ModelTokenizer.load(folder)
    except (ValueError, ModelFilesError) as exc:
        say(f"splitbus api: {exc}")
        return 2
    if args.workers > 1:
        if args.port == 0:  # each process would be given a port of its own
            say("splitbus api: --port 0 needs --workers 1: processes that share a port need it named")
            return 2
        return _run_processes(config, args.host, args.port, args.workers, env)
    say(f"API on http://{args.host}:{args.port}/v1 (node {config.node_id}, {_about(config)})")
    return serve(config, args.host, args.port)


def _about(config: ApiConfig) -> str:
    """The banner's Redis and keys part: the URL masked, the keys counted, never shown."""
    keys = (
        f"{len(config.api_keys)} API key(s)"
        if config.api_keys
        else "no API key given: keys from the tenant store once it holds a tenant (splitbus tenants add), "
        "until then anyone who reaches the port may use it"
    )
    return f"Redis {mask_url(config.bus.redis_url)}, {keys}"


def serve(config: ApiConfig, host: str, port: int, sock: socket.socket | None = None) -> int:
    """Serve ``config`` on ``host:port`` until stopped (uvicorn binds it), or on ``sock`` (a
    process of ``--workers N``, whose socket shares the port: bound, and listened on by uvicorn
    once the app has started); the app's exit code."""
    import uvicorn

    from splitbus.api.app import create_app

    _raise_descriptor_limit(config.max_connections + DESCRIPTORS_BESIDE_CONNECTIONS)
    app = create_app(config)
    with _failure_exit_kept(app), tracing.process("api"):
        if sock is None:
            uvicorn.run(app, host=host, port=port, **server_options(config))
        else:
            uvicorn.Server(uvicorn.Config(app, **server_options(config))).run(sockets=[sock])
    return int(app.state.exit_code)


def _run_processes(config: ApiConfig, host: str, port: int, workers: int, env: Env) -> int:
    """``--workers N`` > 1: N API processes on one port, this one their parent (splitbus/api/procs.py),
    their metrics kept in a folder of their own for /metrics to sum (splitbus/api/metrics.py)."""
    from splitbus.api.metrics import shared_across_processes
    from splitbus.api.procs import NoReusePort, check_port, node_ids, run_group

    try:
        check_port(host, port)
    except NoReusePort as exc:
        say(f"splitbus api: {exc}")
        return 2
    except OSError as exc:  # in use: as one process that cannot bind, an exit that may be retried
        say(f"splitbus api: cannot listen on {host}:{port}: {exc}")
        return 1
    nodes = node_ids(config.node_id, workers)
    say(f"API on http://{host}:{port}/v1 ({workers} processes, nodes {nodes[0]}..{nodes[-1]}, {_about(config)})")
    targets = [
        functools.partial(serve_process, dataclasses.replace(config, node_id=node), host, port, env, i)
        for i, node in enumerate(nodes)
    ]
    with shared_across_processes():
        return run_group(targets, say).exit_code


def serve_process(config: ApiConfig, host: str, port: int, env: Env, index: int) -> None:
    """One process of ``--workers N`` (its own interpreter): its socket on the shared port, then
    the app; it exits with the app's code (2: the port cannot be shared; 1: it cannot be bound)."""
    from splitbus.api.procs import EXIT_USAGE, NoReusePort, reuse_port_socket
    from splitbus.cli.common import setup_logging

    setup_logging(env, f"api{index}")
    try:
        sock = reuse_port_socket(host, port)
    except OSError as exc:
        say(f"splitbus api: process {index} cannot listen on {host}:{port}: {exc}")
        sys.exit(EXIT_USAGE if isinstance(exc, NoReusePort) else 1)
    sys.exit(serve(config, host, port, sock))


@contextlib.contextmanager
def _failure_exit_kept(app: Starlette) -> Iterator[None]:
    """uvicorn raises the signal that stopped it again once it has shut down, so that the process
    ends by it. After a background loop's failure that signal is the API's own SIGTERM (see
    splitbus/api/state.py): its repeat is dropped here, so that ``run`` returns the exit code the
    app kept (``EXIT_FATAL``), not death by SIGTERM. A stop from outside (exit code 0) still ends
    the process by its signal, as it always did: its spans are flushed first, since nothing after
    the signal runs (``tracing.process``'s own flush would not)."""

    def on_sigterm(signum: int, _frame: object) -> None:
        if not app.state.exit_code:
            tracing.shutdown()
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


DESCRIPTORS_BESIDE_CONNECTIONS = 1024
"""File descriptors the API needs beside its clients' connections (Redis, files, the loop)."""


def _raise_descriptor_limit(wanted: int) -> None:
    """Raise the soft limit on open files towards ``wanted`` (not past the hard limit): each
    connection holds a descriptor, and at the limit accept fails and clients see resets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        say(f"splitbus api: at most {target} open files (the hard limit): fewer connections than --max-connections")


GRACEFUL_SHUTDOWN_S = 5
"""Seconds uvicorn lets requests in progress (streams) finish after SIGTERM before it cancels
them: the app's own shutdown (closing its Redis connections, flushing spans) must then fit before
the group's parent kills the process (``procs.STOP_TIMEOUT_S``, 8 s) and ``splitbus up`` kills
the API (10 s)."""

LISTEN_BACKLOG = 16384
"""Connections the kernel queues before uvicorn accepts them (capped by ``net.core.somaxconn``):
a burst of thousands of clients connecting at once waits there instead of being refused."""


class ServerOptions(TypedDict):
    """The keyword arguments ``server_options`` gives ``uvicorn.run``, typed so that mypy checks
    each against uvicorn's own signature."""

    log_level: str
    loop: str
    http: type[GuardedHttpToolsProtocol]
    timeout_keep_alive: int
    timeout_graceful_shutdown: int
    backlog: int


def server_options(config: ApiConfig) -> ServerOptions:
    """uvicorn's options: its HTTP protocol with a header deadline (uvicorn has none; see
    splitbus/api/server.py), idle keep-alive connections closed after 5 s (uvicorn's default,
    said here because the slow-loris bound relies on it), streams cut ``GRACEFUL_SHUTDOWN_S``
    after SIGTERM, and a listen backlog that absorbs bursts of new connections."""
    from splitbus.api.server import guarded_protocol

    return {
        "log_level": "warning",
        "loop": "auto",
        "http": guarded_protocol(
            config.header_timeout_s, config.max_header_bytes, config.body_timeout_s, config.max_connections
        ),
        "timeout_keep_alive": 5,
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S,
        "backlog": LISTEN_BACKLOG,
    }
