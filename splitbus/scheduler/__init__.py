"""The scheduler process: a consumer group on ``sb:requests:{cell}`` that places each request on workers.

``scheduler.py`` is its loop, ``reaper.py`` how a dead worker's tasks move, ``recovery.py`` what it
does after a new Redis run, ``config.py`` its settings. Where requests go, and what that writes, is
the placement library's (``splitbus.placement``), which the API shares. It imports only
``splitbus.bus`` and ``splitbus.placement`` (tests/test_layering.py).
"""
