"""API node -> scheduler, on ``sb:requests``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from splitbus.bus.codec import message
from splitbus.bus.messages._check import (
    require,
    require_int,
    require_int_list,
    require_number,
    require_str,
)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        require_int(self.max_tokens, "max_tokens", minimum=1)
        require_number(self.temperature, "temperature", minimum=0.0)
        require_number(self.top_p, "top_p", minimum=0.0)
        require(self.top_p <= 1.0, "top_p must be <= 1")
        require_int(self.top_k, "top_k", minimum=0)
        if self.seed is not None:
            require_int(self.seed, "seed")
        require(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop), "stop must be a list of strings")
        require_int_list(self.stop_token_ids, "stop_token_ids")


@message
@dataclass
class GenerateRequest:
    """One admitted request. The API node reads its results from ``sb:out:{request_id}``."""

    TYPE: ClassVar[str] = "request"
    NESTED: ClassVar[dict[str, type]] = {"sampling": SamplingParams}

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    api_node: str
    deadline_ms: int
    """Wall-clock deadline, milliseconds since the epoch; past it the request fails."""

    def __post_init__(self) -> None:
        require_str(self.request_id, "request_id")
        require_str(self.model, "model")
        require_int_list(self.prompt_token_ids, "prompt_token_ids")
        require(len(self.prompt_token_ids) > 0, "prompt_token_ids must not be empty")
        require(isinstance(self.sampling, SamplingParams), "sampling must be an object")
        require_str(self.api_node, "api_node")
        require_int(self.deadline_ms, "deadline_ms", minimum=0)
