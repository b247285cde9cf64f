"""``splitbus scheduler``: one scheduler replica."""

from __future__ import annotations

import argparse

from splitbus import tracing
from splitbus.cli.common import (
    add_metrics_arguments,
    add_redis_url_argument,
    redis_url,
    run_service,
    say,
    serve_metrics,
)
from splitbus.env import Env
from splitbus.placement import policies


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("scheduler", help="run one scheduler replica")
    p.add_argument(
        "--mode",
        choices=policies.names(),
        default="splitwise",
        help="routing policy (dp, splitwise_dp: staggered batches unless --no-stagger; dp with them is stagger)",
    )
    p.add_argument("--no-stagger", action="store_true", help="dp, splitwise_dp: place each arrival at once (naive)")
    p.add_argument(
        "--stagger-max-wait-ms",
        type=float,
        default=500.0,
        help="dp, splitwise_dp: longest hold of an arrival (the window closes at the group's step end before that)",
    )
    add_redis_url_argument(p)
    p.add_argument("--name", default=None, help="consumer name (default: host and pid)")
    p.add_argument("--no-worker-wait", type=float, default=10.0, help="seconds a request waits for a worker before 503")
    p.add_argument(
        "--lease-ms",
        type=int,
        default=2000,
        help="this replica's lease: not renewed this long (dead, hung), the others take its requests",
    )
    p.add_argument(
        "--claim-idle-ms",
        type=int,
        default=30_000,
        help="take over requests pending this long with a replica that holds its lease (alive, stuck)",
    )
    p.add_argument(
        "--dead-consumer-keep-s",
        type=float,
        default=600.0,
        help="delete a replica without lease or pending requests from the group after this long idle",
    )
    p.add_argument(
        "--dispatched-mark-ttl",
        type=int,
        default=60,
        help="seconds a request's dispatched mark is kept: a duplicate request entry within it is only acked "
        "(default %(default)s; at least claim idle + no-worker wait)",
    )
    p.add_argument(
        "--recovery-grace",
        type=float,
        default=3.0,
        help="after a Redis restart or failover, seconds to dispatch nothing while workers re-assert what they hold"
        " (default %(default)s)",
    )
    p.add_argument(
        "--max-queued-prefill-tokens",
        type=int,
        default=0,
        help="splitwise, mixed: give a worker requests to prefill only while it has fewer prompt tokens queued; the "
        "rest waits here, by priority and tenants' fair share (default %(default)s: no bound; docs/tenants.md)",
    )
    add_routing_arguments(p)
    add_metrics_arguments(p)
    p.set_defaults(run=run)


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    """The cache-aware cost and conditional disaggregation (docs/routing.md)."""
    g = p.add_argument_group("routing by KV cache (docs/routing.md)")
    g.add_argument(
        "--overlap-weight",
        type=float,
        default=4.0,
        help="prompt tokens of credit per prompt token a worker holds cached; 0 places by load alone"
        " (default %(default)s)",
    )
    g.add_argument(
        "--overlap-load-cap",
        type=int,
        default=16384,
        help="no credit for a worker whose queued prefill tokens exceed the least loaded one's by more than this"
        " (default %(default)s)",
    )
    g.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="splitwise: prefill on the decode worker when it would compute at most this many prompt tokens"
        " (default %(default)s: never for this reason)",
    )
    g.add_argument(
        "--prefill-queue-bound",
        type=int,
        default=0,
        help="splitwise: prefill on the decode worker when every prefill worker has more prompt tokens queued"
        " (default %(default)s: never for this reason)",
    )
    g.add_argument(
        "--local-prefill-min-free-kv",
        type=float,
        default=0.1,
        help="splitwise: never prefill on a decode worker left with less than this share of its KV blocks free"
        " (default %(default)s)",
    )
    g.add_argument("--no-kv-events", action="store_true", help="do not follow the workers' KV events (load only)")


def run(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bus.core.config import BusConfig
    from splitbus.placement.costs import CacheCost
    from splitbus.placement.disagg import Disaggregation
    from splitbus.scheduler.config import SchedulerConfig
    from splitbus.scheduler.scheduler import Scheduler

    try:
        config = SchedulerConfig(
            bus=BusConfig(
                redis_url=redis_url(args, env), prefix=env.prefix, cell=env.cell, claim_idle_ms=args.claim_idle_ms
            ),
            mode=args.mode,
            no_worker_wait_s=args.no_worker_wait,
            lease_ms=args.lease_ms,
            dead_consumer_keep_s=args.dead_consumer_keep_s,
            dispatched_ttl_s=args.dispatched_mark_ttl,
            recovery_grace_s=args.recovery_grace,
            stagger=not args.no_stagger,
            stagger_max_wait_s=args.stagger_max_wait_ms / 1000,
            cost=CacheCost(args.overlap_weight, args.overlap_load_cap),
            disagg=Disaggregation(
                args.local_prefill_max_tokens, args.prefill_queue_bound, args.local_prefill_min_free_kv
            ),
            kv_events=not args.no_kv_events,
            max_queued_prefill_tokens=args.max_queued_prefill_tokens,
            **({"name": args.name} if args.name else {}),
        )
    except ValueError as exc:
        say(f"splitbus scheduler: {exc}")
        return 2
    if not serve_metrics(args, "scheduler"):
        return 2
    with tracing.process("scheduler"):
        return run_service(Scheduler(config))
