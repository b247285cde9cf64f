"""The scheduler: a consumer group on ``sb:requests`` that places each request on workers."""

from splitbus.bus.scheduler.config import SchedulerConfig
from splitbus.bus.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerConfig"]
