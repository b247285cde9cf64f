"""The ``splitbus`` command. Each subcommand starts its part as a process of its own; heavy
imports happen inside the subcommand, so ``splitbus --help`` stays fast."""

from __future__ import annotations

import argparse
import sys

from splitbus import __version__
from splitbus.cli import api_cmd, bench, ctl_cmd, model_cmd, redis_cmd, scheduler_cmd, status_cmd, up, worker_cmd
from splitbus.cli.common import setup_logging
from splitbus.env import Env, load_env


def build_parser(env: Env) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitbus", description="Disaggregated LLM serving over Redis Streams."
    )
    parser.add_argument("--version", action="version", version=f"splitbus {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (up, redis_cmd, api_cmd, scheduler_cmd, worker_cmd, status_cmd, ctl_cmd, model_cmd, bench):
        module.add_parser(subparsers, env)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        env = load_env()
    except ValueError as exc:
        print(f"splitbus: {exc}", file=sys.stderr)
        return 2
    args = build_parser(env).parse_args(argv)
    setup_logging(env, args.command)
    return int(args.run(args, env))


if __name__ == "__main__":
    sys.exit(main())
