"""The bus's core: what every protocol stands on, and nothing of any protocol.

Connection (one Redis or a cluster), the codec, key names, the script table, shared pipelines,
and three stream primitives: a consumer-group queue (``streams``), a follower of many streams
(``follow``) and an ordered writer (``ordered``). The protocols (``splitbus/bus/*.py``) are
small declarations on them; a core module imports no protocol (tests/test_layering.py).
"""
