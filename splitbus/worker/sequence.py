"""One request's state on a worker."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from splitbus.bus.messages import GenerateRequest, Logprobs, Task
from splitbus.bus.roles import Phase
from splitbus.grammar.outcomes import Advance, GrammarError

if TYPE_CHECKING:  # llguidance loads socket (importlib.metadata): the core loads no I/O module
    from splitbus.grammar.constraint import Constraint


class Text(Protocol):
    """A request's text state (``splitbus.worker.text.TextStream``): named here by what it does,
    so that the modules every engine imports for ``Sequence`` do not import the detokenizer."""

    stopped: bool

    def push(self, token_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


@dataclass
class SeqSpans:
    """One request's open spans on a worker (``splitbus.worker.spans`` makes and ends them; the
    spans are the SDK's, typed loosely so that the core imports nothing of it)."""

    parent: str
    """The task's ``traceparent``: every span here is its child (but ``worker.kv_import``)."""
    step: Any = None
    """The stage it is in: ``worker.prefill_queue``, ``worker.prefill``, ``worker.kv_wait`` or ``worker.kv_import``."""
    decode: Any = None
    """``worker.decode``, from its first decode step here."""


@dataclass(eq=False)
class Sequence:
    task: Task
    entry_id: str
    text: Text
    blocks: int = 0
    block_table: list[int] = field(default_factory=list)
    cached: int = 0
    """Positions whose KV is in this worker's cache."""
    prompt_cached: int = 0
    """Prompt tokens whose KV a prefix cache held when the request came (not computed here)."""
    output_ids: list[int] = field(default_factory=list)
    kv: bytes | None = None
    kv_secret: str = ""
    """Decode side: the secret in this request's reservation, which P must prove it holds."""
    finish_reason: str | None = None
    queued_at: float = field(default_factory=time.monotonic)
    logprobs: Logprobs | None = None
    """The logprobs of the token the engine just chose, when the request asks for them: set by
    the engine, taken by the ``emit`` that sends the token."""
    prompt_logprobs: Logprobs | None = None
    """The prompt's logprobs, when the request asks for them and its prefill here computed them:
    sent with its first token."""
    fork_of: Sequence | None = None
    """In a prefill batch: the twin (``splitbus.worker.twins``) whose forward this one shares,
    its blocks and its last logits; None: it computes its own."""
    grammar: Constraint | None = None
    """Structured output: the request's grammar as of ``output_ids`` (built when the worker takes
    the task, given the tokens generated before, then each one as it is added)."""
    trace: SeqSpans | None = None
    """Its open spans on this worker; None: untraced."""

    @property
    def seed(self) -> int:
        """The request's sampling seed; without one, derived from its id, so every worker
        that continues the request draws the same tokens."""
        seed = self.request.sampling.seed
        return seed if seed is not None else zlib.crc32(self.request_id.encode())

    @property
    def all_tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_ids

    @property
    def request(self) -> GenerateRequest:
        return self.task.request

    @property
    def request_id(self) -> str:
        return self.task.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.task.request.prompt_token_ids)

    def add_token(self, token_id: int, eos_ids: tuple[int, ...]) -> str:
        """Append a generated token; returns the text it releases and sets ``finish_reason``."""
        self.output_ids.append(token_id)
        sampling = self.request.sampling
        # The token that ends the request is never printed, special or not (as vLLM). None ends it
        # before min_tokens: the paddle engine never draws one there (gpu_ops.logits masks them),
        # but the sim engine draws without logits.
        stops = token_id in sampling.stop_token_ids or (token_id in eos_ids and not sampling.ignore_eos)
        ends = stops and len(self.output_ids) > sampling.min_tokens
        text = "" if ends else self.text.push([token_id])
        if ends or self.text.stopped or self._grammar_ended(token_id):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= sampling.max_tokens:
            self.finish_reason = "length"
        return text

    def prompt_top(self) -> int | None:
        """How many top alternatives of each prompt token's logprob its prefill here computes;
        None: none. Only where the request's first entry goes out from: not a request that had
        generated tokens before (moved here, its first entry came from where it prefilled)."""
        return self.request.sampling.prompt_logprobs if scores_prompt(self.task) and self.cached == 0 else None

    def _grammar_ended(self, token_id: int) -> bool:
        """Whether the token completes the request's grammar (or, never with a masked engine, breaks it)."""
        return self.grammar is not None and self.grammar.advance(token_id) is not Advance.GOING

    def follow_grammar(self) -> str | None:
        """Give the grammar the tokens it has not seen (those generated on another worker, set in
        ``output_ids``); why they break it, or None."""
        try:
            if self.grammar is not None:
                self.grammar.follow(self.output_ids)
        except GrammarError as exc:
            return str(exc)
        return None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def scores_prompt(task: Task) -> bool:
    """Whether the prefill of ``task`` computes its prompt's logprobs: asked for, and no token
    generated before (a moved request's first entry, which carries them, went out already)."""
    return task.request.sampling.prompt_logprobs is not None and not task.output_token_ids


def kv_tokens(task: Task) -> int:
    """The positions a task holds KV blocks for: its prompt and the tokens generated before it on a
    prefill worker; prompt + max_tokens where it decodes."""
    if task.phase == Phase.PREFILL:
        return len(task.request.prompt_token_ids) + len(task.output_token_ids)
    return len(task.request.prompt_token_ids) + task.request.sampling.max_tokens
