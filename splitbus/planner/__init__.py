"""The planner (docs/planner.md): sizes the prefill and decode fleets to the TTFT and ITL targets
from the load the workers report. A pure core (``core``: readings in, a decision out; with
``rates``, ``model``, ``fit``, ``predictors``, ``hysteresis``) and a thin shell (``service``) that
reads the registry, publishes the advice (``splitbus.bus.planner``) and its gauges."""
