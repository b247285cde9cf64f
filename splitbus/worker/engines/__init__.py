"""Engines, by name: the registry the worker CLI and ``splitbus up`` take ``--engine`` from.

Every module of this package is an engine (or a helper that registers none): an engine module
defines an ``EngineType`` subclass and decorates it with ``@register``. The package's modules are
imported the first time the registry is asked (``names``, ``get``, ``create``), so adding an
engine is one new file here and nothing else. Importing this package imports no engine: an
engine module keeps heavy imports (paddle) inside its ``create``.

Layout: ``interface.py`` the interface the worker calls (``Engine``); ``base.py`` what an
engine module builds on (``EngineType``, ``Capabilities``, ``EngineSetup``, KV sizing);
``sim.py`` the simulated engine; ``paddle/`` the PaddlePaddle engine.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from typing import TypeVar

from splitbus.worker.engines.base import DTYPE_BYTES, Capabilities, EngineSetup, EngineType, kv_bytes_per_token
from splitbus.worker.engines.interface import Engine

__all__ = [
    "DTYPE_BYTES",
    "Capabilities",
    "Engine",
    "EngineSetup",
    "EngineType",
    "add_arguments",
    "create",
    "get",
    "kv_bytes_per_token",
    "names",
    "register",
]

T = TypeVar("T", bound=type[EngineType])
_REGISTRY: dict[str, EngineType] = {}
_found = False


def register(cls: T) -> T:
    """Class decorator: make the engine creatable by ``cls.name``."""
    known = _REGISTRY.get(cls.name)
    if known is not None and type(known) is not cls:
        raise ValueError(f"engine {cls.name!r} is registered twice: {type(known).__qualname__} and {cls.__qualname__}")
    _REGISTRY[cls.name] = cls()
    return cls


def _find() -> dict[str, EngineType]:
    """The registry, once every engine module of this package has been imported (and so registered)."""
    global _found
    if not _found:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
        _found = True  # only once all imported: a module that failed to import fails the next call too
    return _REGISTRY


def names(first: str | None = None) -> tuple[str, ...]:
    """Registered engine names, sorted, ``first`` (a CLI's default) before the others."""
    return tuple(sorted(_find(), key=lambda name: (name != first, name)))


def get(name: str) -> EngineType:
    engine_type = _find().get(name)
    if engine_type is None:
        raise ValueError(f"engine must be one of {names()}, got {name!r}")
    return engine_type


def create(name: str, setup: EngineSetup) -> Engine:
    """The engine ``name`` built from ``setup``; ValueError naming the known ones if there is none."""
    return get(name).create(setup)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every registered engine's own options, in the order of ``names()``."""
    for name in names():
        _REGISTRY[name].add_arguments(parser)
