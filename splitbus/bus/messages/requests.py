"""API node -> scheduler, on ``sb:requests:{cell}``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from splitbus.bus.blocks import HEX_DIGITS
from splitbus.bus.core.codec import message
from splitbus.bus.messages._check import (
    LOGIT_BIAS_RANGE,
    MAX_CHOICES,
    MAX_DEADLINE_MS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    PENALTY_RANGE,
    PRIORITY_RANGE,
    SEED_RANGE,
    require,
    require_bias_map,
    require_int,
    require_int_list,
    require_number,
    require_str,
    require_str_list,
    require_traceparent,
)
from splitbus.env import valid_tag

MAX_PREFIX_BLOCK_SIZE = 2**16
_HEX_RUN = re.compile(r"[0-9a-f]*")


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
    skip_special_tokens: bool = True
    """Special tokens generated mid-text print nothing (vLLM's default); false prints their text.
    EOS and ``stop_token_ids`` end the request and never print either way."""
    spaces_between_special_tokens: bool = True
    """With special tokens printed: false prints an added token that follows another bare, without
    the separator the tokenizer's decoder puts between them (vLLM's meaning)."""
    logprobs: int | None = None
    """Send each generated token's logprob and this many top alternatives (0: the token's own
    only); None: none."""
    prompt_logprobs: int | None = None
    """Send the prompt's logprobs (from its second token) and this many top alternatives; None: none."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of each token the output holds so far (0: off)."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once for each time the output holds it so far (0: off)."""
    repetition_penalty: float = 1.0
    """HF's and vLLM's: a positive logit of a token in the prompt or the output so far is divided
    by it, a negative one multiplied (1: off)."""
    logit_bias: dict[str, float] = field(default_factory=dict)
    """OpenAI's: added to the logits of these token ids, keyed by the id in decimal."""
    min_tokens: int = 0
    """vLLM's: EOS and ``stop_token_ids`` cannot be drawn before the output holds this many tokens."""
    min_p: float = 0.0
    """vLLM's: after temperature, tokens less likely than ``min_p`` times the likeliest are not drawn (0: off)."""
    grammar: str | None = None
    """Structured output: the llguidance grammar (its JSON form, as the API compiled it from
    ``response_format`` or ``guided_*``: ``splitbus.grammar``) every generated token must follow;
    a worker masks each step's logits with it. None: unconstrained."""

    def __post_init__(self) -> None:
        require_int(self.max_tokens, "max_tokens", minimum=1, maximum=MAX_TOKENS)
        require_number(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        require_number(self.top_p, "top_p", 0.0, 1.0)
        require_int(self.top_k, "top_k", minimum=0, maximum=MAX_TOKEN_ID)
        if self.seed is not None:
            require_int(self.seed, "seed", *SEED_RANGE)
        require_str_list(self.stop, "stop", MAX_STOP_SEQUENCES, MAX_STOP_CHARS)
        require_int_list(self.stop_token_ids, "stop_token_ids", max_len=MAX_STOP_TOKEN_IDS)
        require(type(self.ignore_eos) is bool, "ignore_eos must be a boolean")
        require(type(self.skip_special_tokens) is bool, "skip_special_tokens must be a boolean")
        require(type(self.spaces_between_special_tokens) is bool, "spaces_between_special_tokens must be a boolean")
        self._check_logprobs()
        self._check_logits_params()
        self._check_grammar()

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                require_int(getattr(self, name), name, minimum=0, maximum=MAX_LOGPROBS)

    def _check_logits_params(self) -> None:
        """The parameters the worker's logits processors read (splitbus.gpu_ops.logits); their
        bounds are OpenAI's and vLLM's."""
        require_number(self.presence_penalty, "presence_penalty", *PENALTY_RANGE)
        require_number(self.frequency_penalty, "frequency_penalty", *PENALTY_RANGE)
        require_number(self.repetition_penalty, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY)
        require(self.repetition_penalty > 0, "repetition_penalty must be > 0")
        require_bias_map(self.logit_bias, "logit_bias", MAX_LOGIT_BIAS, LOGIT_BIAS_RANGE)
        require_int(self.min_tokens, "min_tokens", minimum=0, maximum=self.max_tokens)
        require_number(self.min_p, "min_p", 0.0, 1.0)

    def _check_grammar(self) -> None:
        # Only its type and size: whether llguidance builds it is the worker's check (a request
        # whose grammar does not build fails alone there: WorkerCore.constrain).
        if self.grammar is not None:
            require_str(self.grammar, "grammar", max_chars=MAX_GRAMMAR_CHARS)


@message
@dataclass
class GenerateRequest:
    """One admitted request. The API node reads its results from ``sb:out:{reader}:<request_id>``."""

    TYPE: ClassVar[str] = "request"
    NESTED: ClassVar[dict[str, type]] = {"sampling": SamplingParams}

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    api_node: str
    deadline_ms: int
    """Wall-clock deadline, milliseconds since the epoch; past it the request fails."""
    reader: str = ""
    """The API's result-reader shard that follows the request's result stream: the stream's hash
    tag (``sb:out:{reader}:<request_id>``), which every writer of its results uses. Absent or
    empty: ``api_node`` (a producer with one reader of its own, such as an external dispatcher)."""
    prefix_hashes: str = ""
    """The chained block hashes (``splitbus.bus.blocks.chain_hex``: 32 hex digits a block) of the
    prompt's full blocks of ``prefix_block_size`` tokens, the last prompt token left out (what a
    worker's prefix cache can reuse): what a scheduler routes by (docs/routing.md), computed by the
    API as it tokenizes. Absent: the scheduler hashes the prompt itself. Like every field it is
    untrusted: a wrong chain misroutes the request, never changes its tokens (a worker hashes the
    prompt itself)."""
    prefix_block_size: int = 0
    """The block size of ``prefix_hashes`` (0: none)."""
    cache_salt: str = ""
    """The salt of the prompt's hash chain, ``HEX_DIGITS`` lowercase hex digits: the parent of its
    first block (``splitbus.bus.blocks.root_of``), in ``prefix_hashes``, in a worker's prefix cache
    and in a scheduler's own chain alike, so requests share cached KV only within a salt. The API
    derives it from the caller's tenant (API key) and the body's ``cache_salt``; never the key or
    the client's string itself (docs/security.md, "The prefix cache is shared only within a
    tenant"). Empty: unsalted."""
    choices: int = 1
    """How many choices its response has (``n``): 1, it is the response; more, it is one of them,
    a request of its own with the same prompt, whose workers its siblings follow where they have
    room, so that its prompt is prefilled once for all (docs/api.md, "n")."""
    choice_group: str = ""
    """With ``choices`` > 1: the response's id, the same for each of its choices (empty else).
    Untrusted like every field: a worker shares a prefill only between requests of one group with
    the same salt and the very same tokens."""
    priority: int = 0
    """vLLM's ``priority``: lower is handled earlier (the body's, else its tenant's default). A
    scheduler's waiting queue and stagger windows are ordered by it, then by fair share among
    tenants, then by arrival (docs/routing.md, "The waiting queue")."""
    tenant: str = ""
    """The name of the API key's tenant (``default`` for the keys an API was started with, or no
    key; "" from an API node that predates tenants): whose fair share of prompt tokens
    the request counts in (docs/tenants.md). Untrusted like every field: a wrong one moves the
    request in the queue, never changes what it computes or which cached prompts it may reuse
    (``cache_salt`` decides that)."""
    traceparent: str = ""
    """The W3C ``traceparent`` of the API's ``api.request`` span (docs/metrics.md, "Spans"): the
    parent of the scheduler's spans. Empty: not traced (the API runs without tracing)."""

    def __post_init__(self) -> None:
        if self.reader == "" and isinstance(self.api_node, str):
            self.reader = self.api_node
        require_str(self.request_id, "request_id")
        require_str(self.model, "model")
        require_int_list(self.prompt_token_ids, "prompt_token_ids")
        require(len(self.prompt_token_ids) > 0, "prompt_token_ids must not be empty")
        require(isinstance(self.sampling, SamplingParams), "sampling must be an object")
        require_str(self.api_node, "api_node")
        require_str(self.reader, "reader")
        if not valid_tag(self.reader):
            raise ValueError(f"reader must be a hash tag: no braces, colons or spaces, got {self.reader!r}")
        require_int(self.deadline_ms, "deadline_ms", minimum=0, maximum=MAX_DEADLINE_MS)
        self._check_prefix()
        self._check_salt()
        self._check_choices()
        require_int(self.priority, "priority", *PRIORITY_RANGE)
        require_str(self.tenant, "tenant", nonempty=False)
        require_traceparent(self.traceparent)

    def _check_prefix(self) -> None:
        require_int(self.prefix_block_size, "prefix_block_size", minimum=0, maximum=MAX_PREFIX_BLOCK_SIZE)
        require(type(self.prefix_hashes) is str, "prefix_hashes must be a string")
        if not self.prefix_hashes:
            return
        blocks = (len(self.prompt_token_ids) - 1) // max(self.prefix_block_size, 1)
        if self.prefix_block_size <= 0 or len(self.prefix_hashes) != blocks * HEX_DIGITS:
            raise ValueError(
                f"prefix_hashes must hold {HEX_DIGITS} hex digits for each of the prompt's {blocks} full blocks"
            )
        require(_HEX_RUN.fullmatch(self.prefix_hashes) is not None, "prefix_hashes must be lowercase hex")

    def _check_choices(self) -> None:
        require_int(self.choices, "choices", minimum=1, maximum=MAX_CHOICES)
        require_str(self.choice_group, "choice_group", nonempty=False)
        require((self.choices > 1) == (self.choice_group != ""), "choice_group is set exactly when choices > 1")

    def _check_salt(self) -> None:
        require(type(self.cache_salt) is str, "cache_salt must be a string")
        salted = len(self.cache_salt) == HEX_DIGITS and _HEX_RUN.fullmatch(self.cache_salt) is not None
        if self.cache_salt and not salted:
            raise ValueError(f"cache_salt must be empty or {HEX_DIGITS} lowercase hex digits")
