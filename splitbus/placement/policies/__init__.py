"""Routing policies, by name: the table the scheduler and its command line read.

``register(name)`` puts a policy class in the table, ``names()`` lists it (the choices of
``splitbus scheduler --mode``), ``create(name, options)`` makes one. Every module of this package
but ``base`` is imported when the table is first read, so a new policy is one new file here,
named as the policy, whose class is decorated with ``@register``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TypeVar

from splitbus.placement.policies.base import Policy, PolicyOptions
from splitbus.placement.prefixes import NO_PREFIXES, Prefixes

P = TypeVar("P", bound=type[Policy])
POLICIES: dict[str, type[Policy]] = {}
"""Policy classes by name."""


class UnknownPolicy(ValueError):
    """A name that no policy is registered under."""


def register(name: str) -> Callable[[P], P]:
    """Class decorator: the policy is known as ``name`` from now on."""

    def add(cls: P) -> P:
        if POLICIES.get(name, cls) is not cls:
            raise ValueError(
                f"two routing policies are named {name!r}: {POLICIES[name].__qualname__}, {cls.__qualname__}"
            )
        cls.name = name
        POLICIES[name] = cls
        return cls

    return add


def names() -> list[str]:
    """Every policy's name, sorted."""
    _discover()
    return sorted(POLICIES)


def create(name: str, options: PolicyOptions | None = None, prefixes: Prefixes = NO_PREFIXES) -> Policy:
    """A new policy of the class registered as ``name``, knowing the workers' prefix caches
    through ``prefixes``."""
    _discover()
    if name not in POLICIES:
        raise UnknownPolicy(f"no routing policy is named {name!r} (there are: {', '.join(sorted(POLICIES))})")
    return POLICIES[name](options, prefixes)


def _discover() -> None:
    """Import every policy module of the package (each registers its policy as it is imported;
    one already imported is not run again)."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
