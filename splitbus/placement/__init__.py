"""Placement: where a request's tasks go, and what that writes. A library, used by the scheduler
process (``splitbus.scheduler``) and by an API node that places requests itself
(``splitbus api --dispatch api``, ``splitbus.api.placing``).

``policies/`` decides (one module per policy, by name; ``decision.py`` what a policy answers),
over a registry snapshot and this replica's ``Local`` reservations (``ledger.py``), with the costs
of ``costs.py`` and their numpy forms in ``columns.py``; ``dispatcher.py`` writes a decision's
tasks through the bus's dispatch script. It imports only ``splitbus.bus`` (tests/test_layering.py).
"""
