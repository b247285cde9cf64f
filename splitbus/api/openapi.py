"""``GET /openapi.json``: the routes and bodies this API accepts, for client generation and
fuzzing. Kept by hand beside ``protocol.py``, which enforces the same rules."""

from __future__ import annotations

import functools
from typing import Any

from splitbus import __version__
from splitbus.api.protocol import MAX_CACHE_SALT_CHARS, MAX_CHOICES, MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from splitbus.api.tools import MAX_CALLS_PER_MESSAGE, MAX_ID_CHARS, MAX_NAME_CHARS, MAX_SCHEMA_DEPTH, MAX_TOOLS
from splitbus.bus.messages._check import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    PENALTY_RANGE,
    PRIORITY_RANGE,
)
from splitbus.grammar.request import MAX_GRAMMAR_SOURCE_CHARS

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_PENALTY = {"type": ["number", "null"], "minimum": PENALTY_RANGE[0], "maximum": PENALTY_RANGE[1]}
_LOGITS_OPTIONS = {
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "repetition_penalty": {
        "type": ["number", "null"],
        "exclusiveMinimum": 0,
        "maximum": MAX_REPETITION_PENALTY,
        "description": "vLLM's extension; 1 is off",
    },
    "logit_bias": {
        "type": ["object", "null"],
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {"type": "number", "minimum": LOGIT_BIAS_RANGE[0], "maximum": LOGIT_BIAS_RANGE[1]},
        "description": "token id -> bias added to its logit; ids within the model's vocabulary",
    },
    "min_tokens": {"type": ["integer", "null"], "minimum": 0, "description": "vLLM's extension; <= max_tokens"},
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1, "description": "vLLM's extension"},
    "stop_token_ids": {
        "type": ["array", "null"],
        "items": {"type": "integer", "minimum": 0},
        "maxItems": MAX_STOP_TOKEN_IDS,
        "description": "vLLM's extension; ids within the model's vocabulary",
    },
}
"""What the workers apply to the logits (protocol.LogitsOptions)."""
_ONE_GRAMMAR = "structured output: at most one of response_format (json_object, json_schema) and guided_*"
_STRUCTURED = {
    "response_format": {
        "type": ["object", "null"],
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "required": ["schema"],
                "properties": {
                    "name": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
        "description": _ONE_GRAMMAR,
    },
    "guided_json": {
        "oneOf": [{"type": "object"}, {"type": "string", "maxLength": MAX_GRAMMAR_SOURCE_CHARS}, {"type": "null"}],
        "description": "vLLM's extension: a JSON schema, or its JSON text; " + _ONE_GRAMMAR,
    },
    "guided_regex": {
        "type": ["string", "null"],
        "minLength": 1,
        "maxLength": MAX_GRAMMAR_SOURCE_CHARS,
        "description": "vLLM's extension: the output matches this regex whole; " + _ONE_GRAMMAR,
    },
    "guided_choice": {
        "type": ["array", "null"],
        "items": {"type": "string"},
        "minItems": 1,
        "description": "vLLM's extension: the output is one of these strings; " + _ONE_GRAMMAR,
    },
    "guided_grammar": {
        "type": ["string", "null"],
        "minLength": 1,
        "maxLength": MAX_GRAMMAR_SOURCE_CHARS,
        "description": "vLLM's extension: a Lark or GBNF grammar the output follows; " + _ONE_GRAMMAR,
    },
}

_COMMON = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {
        "type": ["integer", "null"],
        "minimum": -1,
        "maximum": 2**31 - 1,
        "description": "-1 or 0 disables top-k",
    },
    "seed": {"type": ["integer", "null"]},
    "ignore_eos": {"type": ["boolean", "null"]},
    "skip_special_tokens": {"type": ["boolean", "null"], "description": "default true"},
    "spaces_between_special_tokens": {"type": ["boolean", "null"], "description": "default true"},
    "stop": {
        "oneOf": [
            {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                "maxItems": MAX_STOP_SEQUENCES,
            },
            {"type": "null"},
        ]
    },
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": {"type": "boolean"}},
        "description": "only with stream: true",
    },
    "user": {"type": "string"},
    "cache_salt": {
        "type": ["string", "null"],
        "minLength": 1,
        "maxLength": MAX_CACHE_SALT_CHARS,
        "description": "vLLM's extension: cached prompt KV is shared only by requests of one API key "
        "and the same cache_salt",
    },
    "n": {
        "type": ["integer", "null"],
        "minimum": 1,
        "maximum": MAX_CHOICES,
        "description": "choices, each a request of its own",
    },
    "priority": {
        "type": ["integer", "null"],
        "minimum": PRIORITY_RANGE[0],
        "maximum": PRIORITY_RANGE[1],
        "description": "vLLM's extension: lower is handled earlier in the scheduler's queue; "
        "absent or null: the tenant's default (0 unless set)",
    },
    "timeout": {
        "type": ["number", "null"],
        "exclusiveMinimum": 0,
        "description": "seconds before the request fails (504); at most the server's --request-timeout (a larger "
        "value is held to it); absent or null: the server's",
    },
    **_LOGITS_OPTIONS,
    **_STRUCTURED,
}

_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON,
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            ]
        },
    },
}

_FUNCTION_NAME = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS}


def _function(**fields: Any) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", ...fields}}``: a tool, a call, a named choice."""
    function = {"type": "object", "required": ["name"], "properties": {"name": _FUNCTION_NAME, **fields}}
    return {
        "type": "object",
        "required": ["function"],
        "properties": {"type": {"type": "string", "enum": ["function"]}, "function": function},
    }


_TOOL_CALL = _function(arguments={"type": "string", "description": "a JSON object, as text"})
_TOOL_CALL["properties"]["id"] = {"type": "string", "maxLength": MAX_ID_CHARS}
_TOOL = _function(
    description={"type": "string"},
    parameters={"type": "object", "description": f"a JSON schema, nested at most {MAX_SCHEMA_DEPTH} deep"},
)
_TOOL_FIELDS = {
    "tools": {"type": ["array", "null"], "items": _TOOL, "maxItems": MAX_TOOLS},
    "tool_choice": {
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {**_function(), "required": ["type", "function"], "description": "a function of tools"},
            {"type": "null"},
        ]
    },
    "parallel_tool_calls": {"type": ["boolean", "null"]},
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "developer", "tool"]},
        "name": {"type": "string", "maxLength": MAX_ID_CHARS},
        "tool_calls": {"type": "array", "items": _TOOL_CALL, "maxItems": MAX_CALLS_PER_MESSAGE},
        "tool_call_id": {"type": "string", "maxLength": MAX_ID_CHARS},
        "content": {
            "oneOf": [
                {"type": "null"},
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
                    },
                },
            ]
        },
    },
}

_CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        **_TOOL_FIELDS,
    },
}


_TOKENIZE_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "model": {"type": "string", "description": "optional when the API serves one model"},
        "prompt": {"type": "string"},
        "add_special_tokens": {"type": ["boolean", "null"], "description": "default false, as prompts are tokenized"},
    },
}

_DETOKENIZE_REQUEST = {
    "type": "object",
    "required": ["tokens"],
    "properties": {
        "model": {"type": "string", "description": "optional when the API serves one model"},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}


def _with_models(schema: dict[str, Any], models: tuple[str, ...]) -> dict[str, Any]:
    if not models:
        return schema
    properties = {**schema["properties"], "model": {"type": "string", "enum": list(models)}}
    return {**schema, "properties": properties}


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(s): {
            "description": "error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for s in statuses
    }


def _post(summary: str, schema: str, responses: dict[str, Any]) -> dict[str, Any]:
    """A JSON-body POST that needs the bearer key (when keys are set)."""
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": responses,
        }
    }


def _generation(summary: str, schema: str) -> dict[str, Any]:
    ok = {
        "description": "a JSON body, or server-sent events when stream is true",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    return _post(summary, schema, {"200": ok, **_errors(400, 401, 404, 408, 413, 415, 421, 429, 500, 503, 504)})


def _tokenizer_route(summary: str, schema: str) -> dict[str, Any]:
    return _post(summary, schema, {"200": {"description": "ok"}, **_errors(400, 401, 404, 408, 413, 415, 421, 429)})


def _get(summary: str, *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "ok"}, **_errors(*errors)}}}


@functools.cache
def openapi_spec(models: tuple[str, ...] = ()) -> dict[str, Any]:
    """The document; ``models`` (the names this API serves) become the ``model`` enum."""
    schemas = {
        "CompletionRequest": _with_models(_COMPLETION_REQUEST, models),
        "ChatCompletionRequest": _with_models(_CHAT_REQUEST, models),
        "TokenizeRequest": _with_models(_TOKENIZE_REQUEST, models),
        "DetokenizeRequest": _with_models(_DETOKENIZE_REQUEST, models),
        "Error": _ERROR,
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "splitbus OpenAI-compatible API", "version": __version__},
        "paths": {
            "/v1/completions": _generation("Create a completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("Create a chat completion", "ChatCompletionRequest"),
            "/v1/models": {
                "get": {**_get("Models that live workers serve", 401, 421)["get"], "security": [{"bearer": []}]}
            },
            "/health": _get("The process is alive"),
            "/ready": _get("Redis answers and at least one worker is live", 503),
            "/metrics": _get("Prometheus metrics"),
            "/tokenize": _tokenizer_route("A prompt's token ids, as vLLM's /tokenize", "TokenizeRequest"),
            "/detokenize": _tokenizer_route("The text of token ids, as vLLM's /detokenize", "DetokenizeRequest"),
            "/tokenizer_info": {
                "get": {
                    **_get("The model's special tokens and chat template", 400, 401, 404, 421)["get"],
                    "security": [{"bearer": []}],
                    "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
                }
            },
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
