"""OpenAI request bodies -> validated parameters, and the response objects sent back.

Unknown fields are ignored (as vLLM does); known fields with values splitbus does not support
get a 400 that names them.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from splitbus.api import tools
from splitbus.api.errors import BadRequest
from splitbus.api.tools import ToolRequest
from splitbus.bus.messages._check import (  # the bus's bounds, the same here
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    PENALTY_RANGE,
    PRIORITY_RANGE,
    SEED_RANGE,
)
from splitbus.grammar.outcomes import GrammarError
from splitbus.grammar.request import GrammarSpec, grammar_spec

MAX_STOP_CHARS = 1024
"""The longest stop string, in characters. The worker's stop check costs O(new text) per token
whatever this is (worker/text.py), but it holds back up to this many characters per request
and keeps a table of this many ints per stop: the bound keeps that memory small and catches
nonsense (real stop strings are a few characters). At most the bus's own bound, or schedulers
would dead-letter requests the API admitted (tests/api/test_protocol.py checks it)."""
MAX_CHOICES = 16
"""The most choices one request may ask for (``n``): each is a request of its own on the bus."""
MAX_PROMPT_SCORES = 2**20
"""The most prompt logprob values (prompt tokens x (alternatives + 1)) one request may ask for:
about 20 MB of JSON in its reply; a 2,048-token prompt with 20 alternatives is 43,008."""
MAX_CACHE_SALT_CHARS = 1024
"""The longest ``cache_salt``, in characters: it is only hashed (splitbus.api.tenants), the bound
keeps that cheap."""
# Fields that only their default (or equivalent) value is accepted for.
UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}


@dataclass(frozen=True)
class LogitsOptions:
    """The parameters the workers' logits processors and sampler apply (splitbus.gpu_ops.logits):
    the bus's ``SamplingParams`` fields of the same names, which carry them to P and D alike."""

    presence_penalty: float = 0.0
    """OpenAI's, in [-2, 2]: lowers the logit of each token the output already holds."""
    frequency_penalty: float = 0.0
    """OpenAI's, in [-2, 2]: lowers a token's logit once for each time the output holds it."""
    repetition_penalty: float = 1.0
    """vLLM's (HF's), in (0, 2]: scales the logits of the tokens in the prompt or the output."""
    logit_bias: dict[str, float] = field(default_factory=dict)
    """OpenAI's: token id (in decimal, as JSON's keys are) -> a number in [-100, 100] added to its logit."""
    min_tokens: int = 0
    """vLLM's: no EOS or ``stop_token_ids`` token before this many tokens."""
    min_p: float = 0.0
    """vLLM's, in [0, 1]: tokens less likely than ``min_p`` times the likeliest are not drawn."""
    stop_token_ids: list[int] = field(default_factory=list)
    """vLLM's: token ids that end the request, as EOS does."""


@dataclass
class GenerationParams:
    kind: Literal["completion", "chat"]
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    """vLLM's extension: generate ``max_tokens`` even past an end-of-sequence token."""
    skip_special_tokens: bool = True
    """vLLM's extension: special tokens generated mid-text print nothing; false prints them."""
    spaces_between_special_tokens: bool = True
    """vLLM's extension: false prints an added token that follows another without a separator."""
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    cache_salt: str | None = None
    """vLLM's extension: requests share cached prompt KV only with requests of the same tenant
    and the same ``cache_salt`` (None: the tenant's unsalted share)."""
    n: int = 1
    """Choices to generate, each a request of its own on the bus (``choices.generate_many``)."""
    logprobs: int | None = None
    """Each generated token's logprob with this many top alternatives (completions' ``logprobs``;
    chat's ``top_logprobs`` once ``logprobs`` is true); None: none."""
    echo: bool = False
    """Completions: the prompt comes back before the completion (with its logprobs, the first
    null, when ``logprobs`` is set); ``max_tokens`` may then be 0."""
    prompt_logprobs: int | None = None
    """vLLM's extension: the prompt's logprobs, with this many top alternatives, in the choice's
    ``prompt_logprobs``."""

    logits: LogitsOptions = field(default_factory=LogitsOptions)
    """Penalties, biases, min-p, min_tokens and stop token ids (``check_logits_options`` once the
    model is known)."""
    tools: ToolRequest | None = None
    """Chat: the tools, ``tool_choice`` and ``parallel_tool_calls`` (None: no tools)."""

    grammar: GrammarSpec | None = None
    """Structured output (``response_format``, ``guided_*``), compiled before admission."""
    priority: int | None = None
    """vLLM's extension: lower is handled earlier, in the scheduler's waiting queue and stagger
    windows; None: the tenant's default (``generate.request_priority``)."""
    timeout: float | None = None
    """The request's own timeout in seconds, > 0 (an int as large as JSON gives is kept as it
    is); it may shorten the server's ``--request-timeout``, never lengthen it
    (``generate.Generation.timeout_s``); None: the server's."""

    @property
    def prompt_top(self) -> int | None:
        """What the worker computes of the prompt's logprobs: for ``prompt_logprobs``, and for
        ``echo`` with ``logprobs``."""
        echoed = self.logprobs if self.echo else None
        if echoed is None or self.prompt_logprobs is None:
            return echoed if self.prompt_logprobs is None else self.prompt_logprobs
        return max(echoed, self.prompt_logprobs)


def parse_completion(body: Any) -> GenerationParams:
    params = _common(body, "completion")
    params.prompt = _prompt(body.get("prompt"))
    params.logprobs = _top(body, "logprobs")
    params.echo = _bool(body, "echo")
    if params.echo and body.get("max_tokens") == 0:
        params.max_tokens = 0  # the prompt alone, scored: what an eval harness's loglikelihood sends
    return params


def parse_chat(body: Any) -> GenerationParams:
    params = _common(body, "chat")
    params.messages = _messages(body.get("messages"))
    params.tools = tools.parse_request(body)
    if _bool(body, "logprobs"):
        params.logprobs = _top(body, "top_logprobs") or 0
    elif body.get("top_logprobs") is not None:
        raise BadRequest("'top_logprobs' needs 'logprobs' to be true", "top_logprobs")
    if body.get("echo") not in (None, False):
        raise BadRequest("'echo' is supported by /v1/completions only", "echo")
    params.grammar = tools.constrained(params.tools, params.grammar)
    if body.get("max_completion_tokens") is not None:
        params.max_tokens = _int(body, "max_completion_tokens", minimum=1)
    return params


def _common(body: Any, kind: Literal["completion", "chat"]) -> GenerationParams:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _reject_unsupported(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", "model")
    stream = _bool(body, "stream")
    echo_only = kind == "completion" and body.get("max_tokens") == 0 and body.get("echo") is True
    return GenerationParams(
        kind=kind,
        model=model,
        max_tokens=_int(body, "max_tokens", minimum=0 if echo_only else 1)
        if body.get("max_tokens") is not None
        else None,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, exclusive_min=True),
        top_k=max(0, _int(body, "top_k", default=0, minimum=-1, maximum=MAX_TOKEN_ID)),
        seed=_int(body, "seed", minimum=SEED_RANGE[0], maximum=SEED_RANGE[1]) if body.get("seed") is not None else None,
        stop=_stop(body.get("stop")),
        ignore_eos=_bool(body, "ignore_eos"),
        skip_special_tokens=_bool(body, "skip_special_tokens", default=True),
        spaces_between_special_tokens=_bool(body, "spaces_between_special_tokens", default=True),
        stream=stream,
        include_usage=_stream_options(body, stream),
        user=body.get("user") if isinstance(body.get("user"), str) else None,
        cache_salt=_cache_salt(body.get("cache_salt")),
        prompt_logprobs=_prompt_top(body, stream),
        n=_choices(body),
        logits=_logits_options(body),
        grammar=_grammar(body),
        priority=_priority(body),
        timeout=_timeout(body),
    )


def _priority(body: dict[str, Any]) -> int | None:
    """vLLM's ``priority``: absent or null is the tenant's default; else an int32."""
    if body.get("priority") is None:
        return None
    return _int(body, "priority", minimum=PRIORITY_RANGE[0], maximum=PRIORITY_RANGE[1])


def _timeout(body: dict[str, Any]) -> float | None:
    """The request's ``timeout``: absent or null is the server's; else a number of seconds > 0
    (finite: JSON has no NaN, but a body built otherwise may). Not clamped here: the server's
    timeout is the API's config, applied by ``generate.Generation.timeout_s``."""
    value = body.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise BadRequest(f"'timeout' must be a number of seconds > 0, got {_short(value)}", "timeout")
    return value


def _prompt_top(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``; as vLLM, not with ``stream`` (a chunk has no place for them)."""
    top = _top(body, "prompt_logprobs")
    if top is not None and stream:
        raise BadRequest("'prompt_logprobs' is not available when 'stream' is true", "prompt_logprobs")
    return top


def check_prompt_scores(params: GenerationParams, prompt_tokens: int) -> None:
    """The prompt logprobs a request asks for are bounded: every value the worker computes for
    it travels in one result entry and becomes JSON in one reply."""
    top = params.prompt_top
    if top is not None and prompt_tokens * (top + 1) > MAX_PROMPT_SCORES:
        raise BadRequest(
            f"prompt logprobs for {prompt_tokens} prompt tokens with {top} alternatives each are "
            f"{prompt_tokens * (top + 1)} values; at most {MAX_PROMPT_SCORES} are served: ask for fewer "
            "alternatives or a shorter prompt",
            "prompt_logprobs" if params.prompt_logprobs is not None else "echo",
        )


def _choices(body: dict[str, Any]) -> int:
    """``n``: absent or null is 1."""
    return 1 if body.get("n") is None else _int(body, "n", minimum=1, maximum=MAX_CHOICES)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: the request's for the first (so ``n`` = 1 answers as the first choice
    of ``n`` > 1), and for the others one derived from (seed, index) alone, so that the same request
    repeats exactly; None stays None (each choice is a request of its own, with its own draws)."""
    if seed is None or index == 0:
        return seed
    mixed = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % 2**64
    return mixed ^ (mixed >> 31)


def _top(body: dict[str, Any], name: str) -> int | None:
    """A count of top logprobs: absent or null, else 0 to ``MAX_LOGPROBS``."""
    if body.get(name) is None:
        return None
    return _int(body, name, minimum=0, maximum=MAX_LOGPROBS)


def _reject_unsupported(body: dict[str, Any]) -> None:
    for name, allowed in UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == ok and type(value) is type(ok) for ok in allowed):
            raise BadRequest(f"'{name}' = {value!r} is not supported by this server", name)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", name)
    return value


def _int(
    body: dict[str, Any], name: str, default: int | None = None, minimum: int | None = None, maximum: int | None = None
) -> int:
    value = body.get(name, default)
    if type(value) is not int:
        raise BadRequest(f"'{name}' must be an integer", name)
    if minimum is not None and value < minimum:
        raise BadRequest(f"'{name}' must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise BadRequest(f"'{name}' must be <= {maximum}, got {value}", name)
    return value


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, exclusive_min: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be a number", name)
    if value > high or value < low or (exclusive_min and value == low):
        bound = f"({low}, {high}]" if exclusive_min else f"[{low}, {high}]"
        raise BadRequest(f"'{name}' must be in {bound}, got {value}", name)
    return float(value)


def _cache_salt(value: Any) -> str | None:
    """vLLM's rule: absent or null, else a non-empty string; and at most MAX_CACHE_SALT_CHARS."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest("'cache_salt' must be a non-empty string if provided", "cache_salt")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"'cache_salt' may have at most {MAX_CACHE_SALT_CHARS} characters", "cache_salt")
    return value


def _grammar(body: dict[str, Any]) -> GrammarSpec | None:
    """``response_format`` and vLLM's ``guided_*`` (splitbus.grammar.request), parsed; compiled later."""
    try:
        return grammar_spec(body)
    except GrammarError as exc:
        raise BadRequest(str(exc), exc.field) from None


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise BadRequest(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise BadRequest(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got {longest}", "stop")
    return stops


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return _bool(options, "include_usage")


def _logits_options(body: dict[str, Any]) -> LogitsOptions:
    return LogitsOptions(
        presence_penalty=_number(body, "presence_penalty", 0.0, *PENALTY_RANGE),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, *PENALTY_RANGE),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, exclusive_min=True),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=_int(body, "min_tokens", minimum=0, maximum=MAX_TOKENS) if body.get("min_tokens") is not None else 0,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
    )


def _logit_bias(value: Any) -> dict[str, float]:
    """OpenAI's shape: token ids (strings, as JSON's object keys are) to numbers; at most
    ``MAX_LOGIT_BIAS`` of them. Each id is kept in its plain decimal spelling (``"007"``: ``"7"``)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} token ids, got {len(value)}", "logit_bias")
    return {_bias_token(key): _bias_value(bias) for key, bias in value.items()}


def _bias_token(key: str) -> str:
    if _DIGITS.fullmatch(key) is None or int(key) > MAX_TOKEN_ID:
        raise BadRequest(f"'logit_bias' keys must be token ids in [0, {MAX_TOKEN_ID}], got {key[:32]!r}", "logit_bias")
    return str(int(key))


_DIGITS = re.compile(r"[0-9]{1,10}")
"""A token id's spelling in a ``logit_bias`` key: ``MAX_TOKEN_ID`` has 10 digits."""


def _bias_value(value: Any) -> float:
    low, high = LOGIT_BIAS_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"'logit_bias' values must be numbers in [{low}, {high}], got {_short(value)}", "logit_bias")
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list) and len(value) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise BadRequest(f"'stop_token_ids' must be a list of token ids in [0, {MAX_TOKEN_ID}]", "stop_token_ids")
    return value


def check_logits_options(options: LogitsOptions, vocab_size: int, max_tokens: int) -> None:
    """What only the model and the tokenized prompt decide: the token ids of ``logit_bias`` and
    ``stop_token_ids`` within the model's vocabulary (as a prompt's ids), and ``min_tokens`` at
    most the request's ``max_tokens`` (its default is known once the prompt's length is)."""
    for name, ids in (("logit_bias", map(int, options.logit_bias)), ("stop_token_ids", options.stop_token_ids)):
        outside = next((i for i in ids if i >= vocab_size), None)
        if outside is not None:
            raise BadRequest(
                f"'{name}' holds token id {outside}, outside the model's vocabulary [0, {vocab_size})", name
            )
    if options.min_tokens > max_tokens:
        raise BadRequest(f"'min_tokens' ({options.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")


def _prompt(value: Any) -> str | list[int]:
    value = _one_prompt(value)
    if isinstance(value, str):
        if not value:
            raise BadRequest("'prompt' must not be empty", "prompt")
        return value
    if _token_ids(value):
        return value
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise BadRequest("several prompts in one request are not supported; send one per request", "prompt")
    raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")


def _one_prompt(value: Any) -> Any:
    """A batch of one prompt (``["text"]``, ``[[1, 2]]``) as that prompt; anything else as it is."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return value[0]
    return value


def _token_ids(value: Any) -> bool:
    """A non-empty list of ints (not bools: ``type`` is ``int`` exactly)."""
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


ROLES = ("system", "user", "assistant", "developer", "tool")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    return [_message(m, i) for i, m in enumerate(value)]


def _message(message: Any, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise BadRequest(f"{param} must be an object with a role in {ROLES}", param)
    content = _content(message.get("content"), param)
    return {"role": message["role"], "content": content, **tools.message_fields(message, param)}


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"{param}.content must be a string or a list of text parts", f"{param}.content")


# ---------------------------------------------------------------- responses


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens a prefix cache held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(params: GenerationParams, rid: str, created: int, tokens: dict[str, int]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if params.kind == "chat" else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": params.model, "choices": [], "usage": tokens}


def full_response(
    params: GenerationParams,
    rid: str,
    created: int,
    text: str,
    finish_reason: str,
    tokens: dict[str, int],
    logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any]
    if params.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        kind = "chat.completion"
    else:
        choice, kind = {"index": 0, "text": text}, "text_completion"
    choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return {"id": rid, "object": kind, "created": created, "model": params.model, "choices": [choice], "usage": tokens}
