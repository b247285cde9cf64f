"""Anyone -> every worker and scheduler, on ``sb:cancel:{cell}``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from splitbus.bus.core.codec import message
from splitbus.bus.messages._check import require_str


@message
@dataclass
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    request_id: str
    reason: str = "client_disconnected"
    worker: str = ""
    """With ``entry_id``: only this worker drops only that task (the request moved elsewhere)."""
    entry_id: str = ""

    def __post_init__(self) -> None:
        require_str(self.request_id, "request_id")
        require_str(self.reason, "reason")
        require_str(self.worker, "worker", nonempty=False)
        require_str(self.entry_id, "entry_id", nonempty=False)
