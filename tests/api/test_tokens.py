"""vLLM's tokenizer routes (splitbus/api/tokens.py) on a live API process: /tokenize counts a
prompt's tokens as /v1/completions does, /detokenize gives back the text, /tokenizer_info names the
special tokens and the chat template; bad bodies are 400s; with several models the caller names
one; with API keys they need one. (lm-eval's use of them: tests/e2e/test_lm_eval.py.)"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from splitbus.redis_server import EmbeddedRedis
from splitbus.tokenization import ModelTokenizer
from tests.api.conftest import CONTEXT, ApiProcess, start_api, stop_api

PROMPT = "Hello, wörld<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model, "tiny")


@pytest.fixture(scope="module")
def keyed(redis_server: EmbeddedRedis, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An API with an API key that serves two models (no worker: these routes need none)."""
    second = tmp_path_factory.mktemp("models") / "tiny2"
    shutil.copytree(tiny_model, second)
    api = start_api(redis_server.url, "tokens", [tiny_model, second], "--api-key", "k1")
    yield api.url
    stop_api(api)


def _post(url: str, body: Any, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url, json=body, headers=headers, timeout=10)


def _error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return str(error["message"])


def test_tokenize_gives_the_ids_a_completion_prefills(api: ApiProcess, tokenizer: ModelTokenizer) -> None:
    reply = _post(api.url + "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert reply == {"count": len(reply["tokens"]), "max_model_len": CONTEXT, "tokens": tokenizer.encode(PROMPT)}
    assert reply["tokens"][-1] == tokenizer.eos_token_ids[-1]  # special-token text is its id, as lm-eval needs
    assert _post(api.url + "/tokenize", {"model": "tiny", "prompt": PROMPT}).json() == reply
    client = openai.OpenAI(base_url=api.v1, api_key="x", max_retries=0)
    usage = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage
    assert usage is not None and usage.prompt_tokens == reply["count"]


def test_detokenize_gives_back_the_text_special_tokens_included(api: ApiProcess, tokenizer: ModelTokenizer) -> None:
    reply = _post(api.url + "/detokenize", {"tokens": tokenizer.encode(PROMPT)})
    assert reply.json() == {"prompt": PROMPT}
    assert _post(api.url + "/detokenize", {"model": "tiny", "tokens": []}).json() == {"prompt": ""}


def test_tokenizer_info_names_the_special_tokens_and_the_template(api: ApiProcess, tokenizer: ModelTokenizer) -> None:
    info = httpx.get(api.url + "/tokenizer_info").json()
    assert info["model"] == "tiny" and info["model_max_length"] == CONTEXT
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>", None, "<|endoftext|>")
    assert info["chat_template"] == tokenizer.chat_template
    assert httpx.get(api.url + "/tokenizer_info", params={"model": "tiny"}).json() == info
    assert httpx.get(api.url + "/tokenizer_info", params={"model": "nope"}).status_code == 404


@pytest.mark.parametrize(
    ("route", "body", "param", "says"),
    [
        ("/tokenize", ["x"], None, "JSON object"),
        ("/tokenize", {}, "prompt", "'prompt' is required"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt", "must be a string"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}]}, "messages", "'messages' is not supported"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", "boolean"),
        ("/tokenize", {"prompt": "x", "model": 3}, "model", "must be a string"),
        ("/tokenize", {"prompt": "x" * (CONTEXT * 16 + 1)}, "prompt", f"at most {CONTEXT * 16}"),
        ("/detokenize", {"tokens": [1, True]}, "tokens", "list of token ids"),
        ("/detokenize", {"tokens": "1 2"}, "tokens", "list of token ids"),
        ("/detokenize", {"tokens": [1, 259]}, "tokens", "[0, 259)"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "[0, 259)"),
        ("/detokenize", {"tokens": [1] * (CONTEXT + 1)}, "tokens", f"at most {CONTEXT}"),
    ],
)
def test_bad_bodies_are_400s_that_say_why(api: ApiProcess, route: str, body: Any, param: str | None, says: str) -> None:
    assert says in _error(_post(api.url + route, body), 400, param)


def test_with_several_models_the_caller_names_one(keyed: str, tokenizer: ModelTokenizer) -> None:
    assert "name one with 'model'" in _error(_post(keyed + "/tokenize", {"prompt": "x"}, "k1"), 400, "model")
    info = httpx.get(keyed + "/tokenizer_info", headers={"Authorization": "Bearer k1"})
    assert "name one with 'model'" in _error(info, 400, "model")
    named = _post(keyed + "/tokenize", {"model": "tiny2", "prompt": "ab"}, "k1")
    assert named.json()["tokens"] == tokenizer.encode("ab")
    assert _error(_post(keyed + "/tokenize", {"model": "nope", "prompt": "x"}, "k1"), 404, "model")


@pytest.mark.parametrize("key", [None, "k2"])
def test_with_api_keys_the_routes_need_one(keyed: str, key: str | None) -> None:
    body = {"model": "tiny", "prompt": "x", "tokens": [1]}
    for route in ("/tokenize", "/detokenize"):
        assert _post(keyed + route, body, key).status_code == 401
        assert _post(keyed + route, body, "k1").status_code == 200
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    assert httpx.get(keyed + "/tokenizer_info", params={"model": "tiny"}, headers=headers).status_code == 401
