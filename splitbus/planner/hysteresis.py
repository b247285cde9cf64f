"""Damping the advised counts: a count goes up at once, and down only when every count computed
over the last window was lower (Kubernetes' scale-down stabilization window). A fleet that
flaps between two counts keeps the higher: starting and draining workers costs more than an
idle one for a while."""

from __future__ import annotations

from collections import deque


class Stabilizer:
    """One role's advised count over time."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._raw: deque[tuple[float, int]] = deque()
        """The counts computed within the window, oldest first, with when."""
        self.desired: int | None = None
        """The count advised last (None before the first)."""

    def settle(self, at_s: float, raw: int) -> int:
        """The count to advise now that ``raw`` was computed at ``at_s`` (seconds)."""
        self._raw.append((at_s, raw))
        while at_s - self._raw[0][0] >= self._window_s and len(self._raw) > 1:
            self._raw.popleft()
        highest = max(count for _, count in self._raw)
        if self.desired is None or raw >= self.desired:
            self.desired = raw
        elif highest <= self.desired - 1:
            self.desired = highest
        return self.desired
