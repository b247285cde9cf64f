"""Exceptions raised by the bus: small classes, one meaning each."""


class BusError(Exception):
    """Base class of bus errors."""


class DecodeError(BusError):
    """A stream entry does not hold a valid message. The entry is dead-lettered."""


class RedisUnavailable(BusError):
    """Redis could not be reached within the allowed retries."""
