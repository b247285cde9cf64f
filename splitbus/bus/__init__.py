"""The Redis-Streams bus. Imports neither ``api`` nor ``worker``.

See docs/bus.md for the keys, entry format and delivery guarantees.
"""

from splitbus.bus import messages  # noqa: F401  (registers the message types)
from splitbus.bus.core import dead  # noqa: F401  (registers the dead letter)
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP, WORKER_GROUP, Keys

__all__ = ["BusConfig", "Keys", "SCHEDULER_GROUP", "WORKER_GROUP"]
