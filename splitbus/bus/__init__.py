"""The Redis-Streams bus, in two layers: the core (``splitbus.bus.core``: connection, codec, keys,
scripts, pipelines and the stream primitives), which imports no protocol, and the protocols
(the modules of this package, one per Redis protocol, with their messages in ``messages``).
Imports neither ``api`` nor ``worker``.

See docs/bus.md for the layers, keys, entry format and delivery guarantees.
"""

from splitbus.bus import messages  # noqa: F401  (registers the message types)
from splitbus.bus.core import dead  # noqa: F401  (registers the dead letter)
