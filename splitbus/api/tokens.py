"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

An eval harness scores a continuation by the logprobs of its tokens in an echoed prompt, so it
must split context from continuation by token exactly as the server tokenizes; without a local
copy of the model's tokenizer (lm-evaluation-harness needs transformers for one) it asks the
server. lm-eval's ``local-completions`` probes ``/tokenizer_info`` and ``/tokenize`` and uses them
when they answer. Each answers with the API's own tokenizer of the model, as ``/v1/completions``
tokenizes a prompt (no special tokens added unless asked)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitbus.api.errors import BadRequest, ContextLengthExceeded, ModelNotFound
from splitbus.api.generate import INLINE_TOKENIZE_CHARS
from splitbus.api.routes import read_json
from splitbus.api.state import ApiState
from splitbus.tokenization import ModelTokenizer

INFO_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
"""Always in ``/tokenizer_info`` (null when the model has none): lm-eval reads ``eos_token``,
``bos_token`` and ``pad_token``, and takes a server without an ``eos_token`` key for one
without the route."""
INLINE_DECODE_TOKENS = 4096
"""Up to this many ids are decoded on the event loop; more go to the tokenizer pool."""


async def tokenize(request: Request) -> Response:
    state: ApiState = request.state.api
    body = _object(await read_json(request))
    tokenizer = choose_tokenizer(state, body.get("model"))
    text = _prompt(body)
    limit = state.config.prompt_char_limit(tokenizer.context_length)
    if len(text) > limit:
        raise ContextLengthExceeded(f"The prompt has {len(text)} characters; /tokenize takes at most {limit}", "prompt")
    special = _flag(body, "add_special_tokens")
    if len(text) <= INLINE_TOKENIZE_CHARS:
        ids = tokenizer.encode_batch([text], add_special_tokens=special)[0]
    else:
        ids = await state.off_loop(lambda: tokenizer.encode_batch([text], add_special_tokens=special)[0])
    return JSONResponse({"count": len(ids), "max_model_len": tokenizer.context_length, "tokens": ids})


async def detokenize(request: Request) -> Response:
    state: ApiState = request.state.api
    body = _object(await read_json(request))
    tokenizer = choose_tokenizer(state, body.get("model"))
    ids = _token_ids(body.get("tokens"), tokenizer)
    # Special tokens print, as transformers' decode does by default: a prompt's ids (a harness
    # decoding what it will send) come back as the text that tokenizes to them again.
    if len(ids) <= INLINE_DECODE_TOKENS:
        text = tokenizer.decode(ids, skip_special_tokens=False)
    else:
        text = await state.off_loop(lambda: tokenizer.decode(ids, skip_special_tokens=False))
    return JSONResponse({"prompt": text})


async def tokenizer_info(request: Request) -> Response:
    state: ApiState = request.state.api
    tokenizer = choose_tokenizer(state, request.query_params.get("model"))
    return JSONResponse(info(tokenizer))


def info(tokenizer: ModelTokenizer) -> dict[str, Any]:
    """The model's special tokens by transformers' names, the chat template the API renders
    with, and the context length (transformers' ``model_max_length``)."""
    return {
        "model": tokenizer.name,
        **{name: tokenizer.special_tokens.get(name) for name in INFO_TOKENS},
        **tokenizer.special_tokens,
        "chat_template": tokenizer.chat_template,
        "model_max_length": tokenizer.context_length,
    }


def choose_tokenizer(state: ApiState, model: Any) -> ModelTokenizer:
    """The named model's tokenizer; unnamed (lm-eval sends no ``model``), the only one served."""
    if model is None:
        if len(state.tokenizers) == 1:
            return next(iter(state.tokenizers.values()))
        if not state.tokenizers:
            raise ModelNotFound("this server serves no model", "model")
        raise BadRequest(f"this server serves {len(state.tokenizers)} models: name one with 'model'", "model")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    return state.tokenizer(model)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        raise BadRequest("/tokenize takes a 'prompt' string; 'messages' is not supported here", "messages")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' is required and must be a string", "prompt")
    return prompt


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", name)
    return value


def _token_ids(value: Any, tokenizer: ModelTokenizer) -> list[int]:
    """A list of at most a context's worth of ids of the model's vocabulary (not bools: JSON
    ``true`` is no token)."""
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise BadRequest("'tokens' is required and must be a list of token ids", "tokens")
    if len(value) > tokenizer.context_length:
        raise BadRequest(f"'tokens' holds {len(value)} ids; at most {tokenizer.context_length}", "tokens")
    if value and (min(value) < 0 or max(value) >= tokenizer.vocab_size):
        raise BadRequest(f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
    return value
