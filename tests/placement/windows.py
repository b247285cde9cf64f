"""Stagger windows as a busy scheduler has them: with a rate of recent arrivals to expect more from."""

from __future__ import annotations

from collections import deque

from splitbus.placement.stagger import RECENT_ARRIVALS, StaggerWindow


def busy_window(max_wait_s: float, now: float, rate_per_s: float = 1000.0) -> StaggerWindow[str]:
    """A window that has seen ``RECENT_ARRIVALS`` arrivals up to ``now`` at ``rate_per_s``."""
    gaps = range(RECENT_ARRIVALS, 0, -1)
    return StaggerWindow(max_wait_s=max_wait_s, recent=deque((now - i / rate_per_s for i in gaps), RECENT_ARRIVALS))
