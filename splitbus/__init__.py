"""splitbus: control plane and Redis-Streams bus for disaggregated LLM serving."""

__version__ = "0.1.0"
