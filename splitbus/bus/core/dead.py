"""Any consumer -> operators, on ``sb:dead:{cell}``: an entry taken out of circulation, and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from splitbus.bus.core.codec import message


@message
@dataclass
class DeadLetter:
    TYPE: ClassVar[str] = "dead"
    stream: str
    entry_id: str
    reason: str
    deliveries: int
    group: str = ""
    original_type: str = ""
    original_data: str = ""
    """The original ``data`` field, as text (undecodable bytes replaced)."""
