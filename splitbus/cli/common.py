"""Helpers shared by the subcommands: logging (secrets masked), the Redis URL option, waiting for
Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from splitbus import aio
from splitbus.env import Env
from splitbus.masking import MaskingFormatter, url_password

LOCAL_REDIS = "redis://127.0.0.1:6379/0"


def setup_logging(env: Env, part: str) -> None:
    """Log lines prefixed with the part's name, so interleaved output of ``up`` stays legible;
    the Redis password and the API keys this process knows are masked in every line."""
    handler = logging.StreamHandler(sys.stderr)
    secrets = (*env.api_keys, url_password(env.redis_url or "") or "")
    line = f"%(asctime)s {part:<9} %(levelname)-7s %(name)s: %(message)s"
    handler.setFormatter(MaskingFormatter(line, "%H:%M:%S", secrets))
    logging.basicConfig(level=env.log_level, handlers=[handler])
    for noisy in ("httpx", "httpx2", "httpcore", "httpcore2"):  # a line per HTTP request
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_redis_url_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        default=None,
        metavar="URL",
        help="Redis to use (default: SPLITBUS_REDIS_URL, else the embedded Redis last started in "
        "the data folder, else redis://127.0.0.1:6379/0); prefer the variable: argv is public",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the data folder of `splitbus up` or `splitbus redis` whose embedded Redis (or cluster) to use, "
        "and whose models/ caches converted .gguf files (default: SPLITBUS_DATA_DIR, else .splitbus)",
    )


def data_dir(args: argparse.Namespace, env: Env) -> Path:
    return getattr(args, "data_dir", None) or env.data_dir


def redis_url(args: argparse.Namespace, env: Env) -> str:
    """--redis-url, else SPLITBUS_REDIS_URL, else the embedded Redis or Redis Cluster in the data
    folder, whichever started last (its password read from its file), else a local Redis on the
    default port."""
    from splitbus.cli.embedded import embedded_bus_url

    return args.redis_url or env.redis_url or embedded_bus_url(data_dir(args, env)) or LOCAL_REDIS


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (default: off)"
    )
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
    """One line to stdout, in one write: ``up`` relays its parts' lines from threads while it
    speaks itself, and ``print``'s two writes (the text, then the newline) could take another
    line between them."""
    print(message + "\n", end="", flush=True)


def wait_for_stop(check: Callable[[], str | None], poll_s: float = 0.5) -> str:
    """Block until SIGINT/SIGTERM, or until ``check`` returns a reason to stop. Returns why.

    The handler only notes the signal (a list's append takes no lock): a handler that set a
    ``threading.Event`` could run while this thread held the event's own lock inside its
    ``wait``, and wait for that lock forever (``up`` hung so, its parts all stopped). The signal's
    byte on a wake-up pipe (``signal.set_wakeup_fd``) ends the wait at once, so that a second
    Ctrl-C just after the first reaches the caller's handler for it."""
    noted: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        noted.append(signal.Signals(signum).name)

    with contextlib.ExitStack() as restore:  # whatever was set is put back, even by a signal mid-way
        wake, woken = os.pipe()
        restore.callback(os.close, wake)
        restore.callback(os.close, woken)
        os.set_blocking(wake, False)
        os.set_blocking(woken, False)
        restore.callback(signal.set_wakeup_fd, signal.set_wakeup_fd(woken))
        for sig in (signal.SIGINT, signal.SIGTERM):
            restore.callback(signal.signal, sig, signal.signal(sig, on_signal))
        why = _until_noted(noted, wake, check, poll_s)
    return why


def _until_noted(noted: list[str], wake: int, check: Callable[[], str | None], poll_s: float) -> str:
    """Poll ``check`` every ``poll_s`` until it gives a reason or a signal is noted; a byte on
    ``wake`` (a signal's) ends a poll's wait early."""
    while not noted:
        if select.select([wake], [], [], poll_s)[0]:
            _drain(wake)  # any handled signal writes its byte here (SIGCHLD, a caller's own)
        failure = None if noted else check()
        if failure:
            return failure
    return noted[0]


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


def run_service(service: object, on_sigterm: Callable[[], object] | None = None) -> int:
    """Run an asyncio service (``run()`` + ``stopping`` event) until it ends or a signal
    arrives; the signal sets ``stopping`` so the service closes cleanly. ``on_sigterm``: what
    SIGTERM does instead (a worker's drain); SIGINT still stops at once."""
    import asyncio

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, service.stopping.set)  # type: ignore[attr-defined]
        loop.add_signal_handler(signal.SIGTERM, on_sigterm or service.stopping.set)  # type: ignore[attr-defined]
        await service.run()  # type: ignore[attr-defined]

    try:
        aio.run(main())
    except Exception:
        # A bug that ended the service: say so, and exit non-zero so a supervisor restarts it.
        logging.getLogger(__name__).exception("stopped by a fatal error")
        return max(1, int(getattr(service, "exit_code", 0)))
    return int(getattr(service, "exit_code", 0))
