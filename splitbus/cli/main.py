"""The ``splitbus`` command. Each subcommand starts its part as a process of its own; heavy
imports happen inside the subcommand, so ``splitbus --help`` stays fast."""

from __future__ import annotations

import argparse
import sys

from splitbus import __version__
from splitbus.cli import (
    api_cmd,
    bench,
    ctl_cmd,
    model_cmd,
    planner_cmd,
    redis_cli_cmd,
    redis_cmd,
    scheduler_cmd,
    status_cmd,
    tenants_cmd,
    up,
    worker_cmd,
)
from splitbus.cli.common import setup_logging
from splitbus.env import Env, load_env


def build_parser(env: Env) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitbus", description="Disaggregated LLM serving over Redis Streams.")
    parser.add_argument("--version", action="version", version=f"splitbus {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = (
        up,
        redis_cmd,
        api_cmd,
        scheduler_cmd,
        worker_cmd,
        planner_cmd,
        status_cmd,
        tenants_cmd,
        ctl_cmd,
        redis_cli_cmd,
        model_cmd,
        bench,
    )
    for module in commands:
        module.add_parser(subparsers, env)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        env = load_env()
    except ValueError as exc:
        print(f"splitbus: {exc}", file=sys.stderr)
        return 2
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(env)
    if argv[:1] == [redis_cli_cmd.COMMAND]:  # its ARGS may look like options: kept as given
        args = redis_cli_cmd.parse(parser, argv[1:])
    else:
        args = parser.parse_args(argv)
    setup_logging(env, args.command)
    return int(args.run(args, env))


if __name__ == "__main__":
    sys.exit(main())
