"""Message types, one module per direction (who writes -> who reads).

- ``requests``: API node -> scheduler (``sb:requests:{cell}``)
- ``tasks``: scheduler -> worker (``sb:tasks:{cell}:<worker>``)
- ``results``: worker -> API node (``sb:out:{reader}:<request>``)
- ``cancel``: anyone -> every worker and scheduler (``sb:cancel:{cell}``)
- ``control``: anyone -> one worker (``sb:ctrl:{cell}:<worker>``), and its reply (``sb:reply:{task}``)

Importing this package registers every type with the codec: every module in it is imported, so
a new message module needs no line here to be decoded (its types are exported from its module).
"""

import importlib
import pkgutil

from splitbus.bus.messages.cancel import Cancel
from splitbus.bus.messages.control import ControlCommand, ControlReply
from splitbus.bus.messages.requests import GenerateRequest, SamplingParams
from splitbus.bus.messages.results import Failed, Finished, Logprobs, Result, TokenDelta
from splitbus.bus.messages.tasks import Task

__all__ = [
    "Cancel",
    "ControlCommand",
    "ControlReply",
    "Failed",
    "Finished",
    "GenerateRequest",
    "Logprobs",
    "Result",
    "SamplingParams",
    "Task",
    "TokenDelta",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
