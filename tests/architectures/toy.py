"""An architecture no module of the package declares, registered for one test: what adding an
architecture file does, and so what every reader of the table must then accept."""

from __future__ import annotations

import pytest

from splitbus import architectures
from splitbus.architectures import Architecture

TOY = Architecture("ToyForCausalLM", model_type="toy", gguf_name="toy", qkv_bias=True, tiny_ties_embeddings=True)


def register_toy(monkeypatch: pytest.MonkeyPatch) -> Architecture:
    """``TOY`` registered until the test ends (``monkeypatch`` restores the table)."""
    architectures.registered()  # the package's own ones first, as a reader would find them
    monkeypatch.setattr(architectures, "_BY_NAME", dict(architectures._BY_NAME))
    return architectures.register(TOY)
