"""Anyone -> one worker on ``sb:ctrl:{cell}:<worker>``, and the worker's answer on ``sb:reply:{task}``.

A caller (an operator, ``splitbus ctl``, someone's own router) names a fresh ``task_id``, writes
the command, and reads the reply stream named after that id; the reply expires after a while.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from splitbus.bus.core.codec import message
from splitbus.bus.messages._check import require, require_str

COMMANDS = ("get_payload", "get_metrics", "connect_rdma", "drain")
MAX_DRAIN_TIMEOUT_S = 86_400.0
"""The longest drain (``drain``'s ``timeout_s``, a worker's --drain-timeout): a day; nothing held runs for longer."""


@message
@dataclass
class ControlCommand:
    TYPE: ClassVar[str] = "command"
    task_id: str
    """Names the reply stream, ``sb:reply:{task_id}``."""
    cmd: str
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require_str(self.task_id, "task_id")
        require_str(self.cmd, "cmd")
        require(isinstance(self.args, dict), "args must be an object")


@message
@dataclass
class ControlReply:
    TYPE: ClassVar[str] = "reply"
    task_id: str
    cmd: str
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Why the command failed (``ok`` is false)."""
    worker: str = ""
