"""Structured output: a request's grammar (a JSON schema, a regex, a choice, a Lark grammar),
compiled by the API with llguidance before admission (``request``) and followed token by token by
the worker that generates it (``constraint``), which masks each step's logits.

Import the modules themselves: this package loads nothing, so that the worker's core can name
``outcomes`` without loading llguidance (whose import pulls in ``importlib.metadata`` and, through
it, ``socket``: the core loads no I/O module, tests/worker/test_layers.py).
"""
