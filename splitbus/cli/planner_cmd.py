"""``splitbus planner``: advise the prefill and decode counts that meet the TTFT and ITL targets
(docs/planner.md)."""

from __future__ import annotations

import argparse
import math

from splitbus.cli.common import (
    add_metrics_arguments,
    add_redis_url_argument,
    redis_url,
    run_service,
    say,
    serve_metrics,
)
from splitbus.env import Env
from splitbus.planner.predictors import PREDICTORS


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("planner", help="advise prefill and decode worker counts for TTFT and ITL targets")
    add_redis_url_argument(p)
    p.add_argument("--cell", default=env.cell, help="the cell to plan for (default: SPLITBUS_CELL, else %(default)s)")
    p.add_argument("--model", default="", help="size only the workers of this model (default: every worker)")
    p.add_argument("--ttft-slo-ms", type=positive, required=True, help="time to first token each request should meet")
    p.add_argument("--itl-slo-ms", type=positive, required=True, help="mean time between output tokens to meet")
    p.add_argument("--interval-s", type=positive, default=5.0, help="seconds between decisions (default %(default)s)")
    p.add_argument(
        "--predictor",
        choices=sorted(PREDICTORS),
        default="last",
        help="arrivals next interval: the last interval's (last, the default), an EWMA (ewma), or the larger of"
        " both (peak: up at once, down over about five intervals)",
    )
    p.add_argument("--min-workers", type=int, default=0, help="fewest workers advised per role (default %(default)s)")
    p.add_argument("--max-workers", type=int, default=1000, help="most workers advised per role (default %(default)s)")
    p.add_argument(
        "--start-delay-s",
        type=non_negative,
        default=30.0,
        help="seconds from asking for a worker to its first request: a prefill backlog cleared sooner"
        " gets no worker (default %(default)s)",
    )
    p.add_argument(
        "--scale-down-window-s",
        type=non_negative,
        default=30.0,
        help="a count goes down only to the highest computed over this window (default %(default)s)",
    )
    add_metrics_arguments(p)
    p.set_defaults(run=run)


def positive(text: str) -> float:
    """A finite number above 0 (``inf`` and ``nan`` parse as floats: refused here, with the usage)."""
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text[:40]!r}")
    return value


def non_negative(text: str) -> float:
    """A finite number of at least 0."""
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text[:40]!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # refused by every bound, with the one message


def run(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bus.core.config import BusConfig
    from splitbus.planner.config import PlannerConfig
    from splitbus.planner.service import PlannerService

    try:
        bus = BusConfig(redis_url=redis_url(args, env), prefix=env.prefix, cell=args.cell)
        config = PlannerConfig(
            ttft_slo_s=args.ttft_slo_ms / 1000,
            itl_slo_s=args.itl_slo_ms / 1000,
            interval_s=args.interval_s,
            predictor=args.predictor,
            scale_down_window_s=args.scale_down_window_s,
            start_delay_s=args.start_delay_s,
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            model=args.model,
        )
    except ValueError as exc:
        say(f"splitbus planner: {exc}")
        return 2
    if not serve_metrics(args, "planner"):
        return 2
    return run_service(PlannerService(bus, config))
