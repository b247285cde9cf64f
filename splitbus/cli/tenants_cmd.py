"""``splitbus tenants``: add, list, change and remove the tenants whose API keys the API accepts
(docs/tenants.md), in the Redis that ``splitbus status`` reads.

A key is a secret: a generated one is printed once, on the last line of ``add`` (or ``key``), and
never logged; one of the operator's own comes on stdin (``--key-stdin``), never in argv, which
every user of the host can read. Redis keeps only its SHA-256.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from splitbus.cli.common import add_redis_url_argument, redis_url, say
from splitbus.env import Env
from splitbus.masking import mask_text, mask_url

T = TypeVar("T")
NO_LIMIT = "none"
"""What ``tenants set`` takes to lift a limit (``--rps none``)."""
LIMITS = ("rps", "tpm", "prompt_tpm", "output_tpm", "concurrency")
"""The limits (``TenantLimits``' fields that may be None), as ``--rps``, ``--prompt-tpm``..."""
SETTINGS = ("priority", "weight")


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("tenants", help="add, list, change and remove tenants and their API keys")
    commands = p.add_subparsers(dest="tenants_command", metavar="COMMAND", required=True)
    add = _command(commands, "add", "add a tenant and an API key for it (printed once, on the last line)")
    _limit_arguments(add, lift=False)
    _key_argument(add)
    key = _command(commands, "key", "give a tenant another API key (printed once, on the last line)")
    _key_argument(key)
    _command(commands, "set", "change a tenant's limits ('none' lifts one)", lift=True)
    _command(commands, "rm", "remove a tenant and all its API keys")
    listing = commands.add_parser("list", help="every tenant and its limits (no keys)")
    add_redis_url_argument(listing)
    listing.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    listing.set_defaults(run=run)


def _command(
    commands: argparse._SubParsersAction, name: str, help: str, lift: bool | None = None
) -> argparse.ArgumentParser:
    p = commands.add_parser(name, help=help)
    p.add_argument("name", metavar="NAME", help="the tenant's name (letters, digits, '_', '.', '-'; at most 64)")
    if lift is not None:
        _limit_arguments(p, lift)
    add_redis_url_argument(p)
    p.set_defaults(run=run)
    return p


def _limit_arguments(p: argparse.ArgumentParser, lift: bool) -> None:
    """``--rps`` ... ``--weight``; with ``lift``, a limit may be ``none``. Not given: None (``add``:
    no limit, ``set``: unchanged)."""
    what = {
        "rps": "requests per second",
        "tpm": "tokens per minute, prompt and output together",
        "prompt_tpm": "prompt tokens per minute",
        "output_tpm": "output tokens per minute",
        "concurrency": "requests in flight at once",
    }
    for name, text in what.items():
        kind = float if name == "rps" else int
        hint = f" ('{NO_LIMIT}': no limit)" if lift else " (default: none)"
        p.add_argument(f"--{name.replace('_', '-')}", type=_limit(kind) if lift else kind, help=text + hint)
    p.add_argument("--priority", type=int, help="default priority of its requests (lower is served first; default 0)")
    p.add_argument("--weight", type=float, help="its fair share of prompt tokens among equal priorities (default 1)")


def _limit(kind: type[T]) -> Callable[[str], T | str]:
    def parse(text: str) -> T | str:
        return NO_LIMIT if text.strip().lower() == NO_LIMIT else kind(text)  # type: ignore[call-arg]

    parse.__name__ = kind.__name__  # argparse names it in "invalid float value"
    return parse


def _key_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--key-stdin",
        action="store_true",
        help="read the API key from stdin's first line instead of generating one (never from argv, which is public)",
    )


def run(args: argparse.Namespace, env: Env) -> int:
    from redis.exceptions import RedisError

    from splitbus.bus.core.connection import TRANSIENT_ERRORS
    from splitbus.bus.tenants import BadTenantRecord, TenantError

    url = redis_url(args, env)
    unreachable: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, RedisError, OSError)
    try:
        return asyncio.run(_ACTIONS[args.tenants_command](args, env, url))
    except (TenantError, BadTenantRecord) as exc:
        say(f"splitbus tenants {args.tenants_command}: {exc}")
        return 1 if isinstance(exc, TenantError) else 2
    except unreachable as exc:
        say(f"splitbus tenants: Redis at {mask_url(url)} is not reachable: {mask_text(str(exc))}")
        return 1


async def _with_store(env: Env, url: str, action: Callable[[Any], Awaitable[T]]) -> T:
    """``action(store)`` on a short-lived client of the bus at ``url``."""
    from splitbus.bus.core.config import BusConfig
    from splitbus.bus.core.connection import connect
    from splitbus.bus.tenants import TenantStore

    config = BusConfig(redis_url=url, prefix=env.prefix, cell=env.cell)
    client = connect(config, max_connections=2, name="tenants")
    try:
        return await action(TenantStore(client, config.keys))
    finally:
        await client.aclose()


def _new_key(args: argparse.Namespace) -> tuple[str, bool]:
    """The key to add and whether it was generated (then it is printed)."""
    from splitbus.bus.tenants import check_key, new_key

    if not args.key_stdin:
        return new_key(), True
    return check_key(sys.stdin.readline().strip()), False


def _changes(args: argparse.Namespace) -> dict[str, Any]:
    """The limits and settings given (``none``: None, no limit)."""
    given = {name: getattr(args, name) for name in (*LIMITS, *SETTINGS) if getattr(args, name) is not None}
    return {name: None if value == NO_LIMIT else value for name, value in given.items()}


async def _add(args: argparse.Namespace, env: Env, url: str) -> int:
    from splitbus.bus.tenants import Tenant, TenantLimits, check_name, key_digest

    tenant = Tenant(check_name(args.name), limits=TenantLimits(**_changes(args)))
    key, generated = _new_key(args)
    await _with_store(env, url, lambda store: store.add(tenant, (key_digest(key),)))
    say(f"tenant {tenant.name} added: {describe(tenant.limits)}")
    _show_key(key, generated)
    return 0


async def _key(args: argparse.Namespace, env: Env, url: str) -> int:
    from splitbus.bus.tenants import check_name, key_digest

    key, generated = _new_key(args)
    await _with_store(env, url, lambda store: store.add_keys(check_name(args.name), (key_digest(key),)))
    say(f"tenant {args.name}: API key added")
    _show_key(key, generated)
    return 0


def _show_key(key: str, generated: bool) -> None:
    """A generated key, once, on the last line (for ``| tail -1``); one from stdin is not echoed."""
    from splitbus.bus.tenants import key_digest

    if generated:
        say("its API key (shown only now; Redis keeps only its SHA-256):")
        say(key)
    else:
        say(f"its API key: the one read from stdin (SHA-256 {key_digest(key)[:16]}...)")


async def _set(args: argparse.Namespace, env: Env, url: str) -> int:
    changes = _changes(args)
    if not changes:
        say("splitbus tenants set: nothing to change (give --rps, --tpm, ... or --weight)")
        return 2
    tenant = await _with_store(env, url, lambda store: store.set(args.name, **changes))
    say(f"tenant {tenant.name}: {describe(tenant.limits)}")
    return 0


async def _rm(args: argparse.Namespace, env: Env, url: str) -> int:
    removed = await _with_store(env, url, lambda store: store.remove(args.name))
    say(f"tenant {args.name} removed, with its {removed} API key(s)")
    return 0


async def _list(args: argparse.Namespace, env: Env, url: str) -> int:
    async def read(store: Any) -> tuple[list[Any], dict[str, int]]:
        return await store.all(), await store.key_counts()

    tenants, counts = await _with_store(env, url, read)
    say(json.dumps(listing(tenants, counts)) if args.json else render(listing(tenants, counts)))
    return 0


_ACTIONS: dict[str, Callable[[argparse.Namespace, Env, str], Coroutine[Any, Any, int]]] = {
    "add": _add,
    "key": _key,
    "set": _set,
    "rm": _rm,
    "list": _list,
}


def describe(limits: Any) -> str:
    """``rps 5, tpm 100000, ..., priority 0, weight 1``: every limit that is set, then the settings."""
    shown = {name: value for name, value in limits.to_json().items()}
    unlimited = [name for name in LIMITS if name not in shown]
    text = ", ".join(f"{name} {_number(value)}" for name, value in shown.items())
    return text + (f" (no {', '.join(unlimited)} limit)" if unlimited else "")


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def listing(tenants: list[Any], counts: dict[str, int]) -> dict[str, Any]:
    """``tenants list --json``: each tenant's limits and how many keys it has (never a key), and
    each record that does not read, with why."""
    from splitbus.bus.tenants import Tenant

    rows = [
        {"name": t.name, "keys": counts.get(t.name, 0), **t.limits.to_json()} for t in tenants if isinstance(t, Tenant)
    ]
    invalid = [str(t) for t in tenants if not isinstance(t, Tenant)]
    return {"tenants": rows, "invalid": invalid}


COLUMNS = ("name", "keys", *LIMITS, *SETTINGS)


def render(shown: dict[str, Any]) -> str:
    """A table: a tenant a row, ``-`` for no limit; an invalid record's error (printable only) below."""
    if not shown["tenants"] and not shown["invalid"]:
        return "no tenants"
    rows = [[name.upper() for name in COLUMNS], *([_cell(row, name) for name in COLUMNS] for row in shown["tenants"])]
    return "\n".join(_aligned(rows) + [f"invalid record: {_printable(error)}" for error in shown["invalid"]])


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def _printable(text: str) -> str:
    """A forged record's error for a terminal: a control character shown as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _cell(row: dict[str, Any], name: str) -> str:
    return _number(row[name]) if name in row else "-"
