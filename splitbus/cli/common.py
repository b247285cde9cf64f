"""Helpers shared by the subcommands: logging, waiting for Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Callable

from splitbus.env import Env


def setup_logging(env: Env, part: str) -> None:
    """Log lines prefixed with the part's name, so interleaved output of ``up`` stays legible."""
    logging.basicConfig(
        level=env.log_level,
        format=f"%(asctime)s {part:<9} %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2"):  # a line per HTTP request
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (default: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port (default %(default)s)")


def serve_metrics(args: argparse.Namespace, part: str) -> bool:
    """Start the /metrics endpoint if asked for; False (after saying why) if the port is taken."""
    if not args.metrics_port:
        return True
    from prometheus_client import start_http_server

    try:
        start_http_server(args.metrics_port, addr=args.metrics_host)
    except OSError as exc:
        say(f"splitbus {part}: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc.strerror}")
        return False
    logging.getLogger(__name__).info("metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
    return True


def say(message: str) -> None:
    print(message, flush=True)


def wait_for_stop(check: Callable[[], str | None], poll_s: float = 0.5) -> str:
    """Block until SIGINT/SIGTERM, or until ``check`` returns a reason to stop. Returns why."""
    stop = threading.Event()
    reason = ["signal"]

    def on_signal(signum: int, _frame: object) -> None:
        reason[0] = signal.Signals(signum).name
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(poll_s):
            failure = check()
            if failure:
                return failure
        return reason[0]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_service(service: object) -> int:
    """Run an asyncio service (``run()`` + ``stopping`` event) until it ends or a signal
    arrives; the signal sets ``stopping`` so the service closes cleanly."""
    import asyncio

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.stopping.set)  # type: ignore[attr-defined]
        await service.run()  # type: ignore[attr-defined]

    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(main())
        else:
            uvloop.run(main())
    except Exception:
        # A bug that ended the service: say so, and exit non-zero so a supervisor restarts it.
        logging.getLogger(__name__).exception("stopped by a fatal error")
        return max(1, int(getattr(service, "exit_code", 0)))
    return int(getattr(service, "exit_code", 0))
