"""The event loop every process runs on (``splitbus/aio.py``)."""

from __future__ import annotations

import gc

from splitbus import aio


def _scanned(obj: object) -> bool:
    """Whether a collection of some generation would scan ``obj`` (the frozen are in none)."""
    return any(o is obj for generation in range(3) for o in gc.get_objects(generation))


def test_a_service_runs_with_what_it_built_frozen_out_of_the_collectors_scans() -> None:
    built = [object() for _ in range(3)]  # what a service builds before it serves

    async def serve() -> tuple[bool, bool]:
        made_while_serving = [object()]
        return _scanned(built), _scanned(made_while_serving)

    gc.unfreeze()
    try:
        assert _scanned(built)
        assert aio.run(serve()) == (False, True)
    finally:
        gc.unfreeze()
