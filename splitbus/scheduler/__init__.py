"""The scheduler: a consumer group on ``sb:requests:{cell}`` that places each request on workers.

``scheduler.py`` is its loop, ``policies/`` where requests go (one module per policy, by name),
``dispatch.py`` what a placement writes, ``reaper.py`` how a dead worker's tasks move. It imports
only ``splitbus.bus`` (tests/test_layering.py).
"""
