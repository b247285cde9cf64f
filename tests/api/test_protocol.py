"""Request parsing, on hand-made bodies (no server needed)."""

from __future__ import annotations

import pytest

from splitbus.api.errors import BadRequest
from splitbus.api.protocol import (
    MAX_CACHE_SALT_CHARS,
    MAX_PROMPT_SCORES,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    check_prompt_scores,
    parse_chat,
    parse_completion,
)


def test_ignore_eos_is_taken_as_vllm_does() -> None:
    assert parse_completion({"model": "m", "prompt": "x", "ignore_eos": True}).ignore_eos
    assert not parse_completion({"model": "m", "prompt": "x"}).ignore_eos


def test_ignore_eos_must_be_a_boolean() -> None:
    with pytest.raises(BadRequest, match="'ignore_eos' must be a boolean"):
        parse_completion({"model": "m", "prompt": "x", "ignore_eos": "yes"})


SPECIAL_OPTIONS = ("skip_special_tokens", "spaces_between_special_tokens")


@pytest.mark.parametrize("name", SPECIAL_OPTIONS)
def test_special_token_options_default_to_true_as_vllm(name: str) -> None:
    assert getattr(parse_completion({"model": "m", "prompt": "x"}), name) is True
    assert getattr(parse_completion({"model": "m", "prompt": "x", name: None}), name) is True
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], name: False})
    assert getattr(chat, name) is False


@pytest.mark.parametrize("name", SPECIAL_OPTIONS)
@pytest.mark.parametrize("value", ["false", 0, 1, [], {}])
def test_special_token_options_must_be_booleans(name: str, value: object) -> None:
    with pytest.raises(BadRequest, match=f"'{name}' must be a boolean"):
        parse_completion({"model": "m", "prompt": "x", name: value})


@pytest.mark.parametrize(
    "stop, expected",
    [
        (None, []),
        ([], []),
        ("x" * MAX_STOP_CHARS, ["x" * MAX_STOP_CHARS]),
        (["ab"] * MAX_STOP_SEQUENCES, ["ab"] * MAX_STOP_SEQUENCES),
    ],
)
def test_stop_strings_within_the_bounds_are_taken(stop: object, expected: list[str]) -> None:
    assert parse_completion({"model": "m", "prompt": "x", "stop": stop}).stop == expected


@pytest.mark.parametrize(
    "stop, says",
    [
        ("x" * (MAX_STOP_CHARS + 1), f"at most {MAX_STOP_CHARS} characters"),
        (["ok", "s" * 200_000], f"at most {MAX_STOP_CHARS} characters"),
        (["s"] * (MAX_STOP_SEQUENCES + 1), f"at most {MAX_STOP_SEQUENCES} sequences"),
        ([""], "non-empty"),
        ([1], "non-empty"),
    ],
)
def test_stop_strings_over_the_bounds_are_refused(stop: object, says: str) -> None:
    with pytest.raises(BadRequest, match=says) as info:
        parse_completion({"model": "m", "prompt": "x", "stop": stop})
    assert info.value.param == "stop" and info.value.status == 400


def test_the_api_admits_no_stop_string_the_bus_would_refuse() -> None:
    from splitbus.bus.messages import _check

    assert MAX_STOP_CHARS <= _check.MAX_STOP_CHARS and MAX_STOP_SEQUENCES <= _check.MAX_STOP_SEQUENCES


def test_top_k_past_what_the_bus_carries_is_a_400() -> None:
    """Found by the fuzz test: top_k 2**31 passed the API and the bus refused it (a 500)."""
    assert parse_completion({"model": "m", "prompt": "x", "top_k": 2**31 - 1}).top_k == 2**31 - 1
    with pytest.raises(BadRequest, match="'top_k' must be <= 2147483647") as info:
        parse_completion({"model": "m", "prompt": "x", "top_k": 2**31})
    assert info.value.param == "top_k"


def test_cache_salt_is_taken_in_both_bodies_as_vllm_does() -> None:
    assert parse_completion({"model": "m", "prompt": "x"}).cache_salt is None
    assert parse_completion({"model": "m", "prompt": "x", "cache_salt": None}).cache_salt is None
    assert parse_completion({"model": "m", "prompt": "x", "cache_salt": "s" * MAX_CACHE_SALT_CHARS}).cache_salt
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "cache_salt": "team-1"})
    assert chat.cache_salt == "team-1"


@pytest.mark.parametrize(
    ("salt", "says"),
    [
        ("", "non-empty string"),
        (7, "non-empty string"),
        (["a"], "non-empty string"),
        ("s" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS} characters"),
    ],
)
def test_a_bad_cache_salt_is_a_400(salt: object, says: str) -> None:
    with pytest.raises(BadRequest, match=says) as info:
        parse_completion({"model": "m", "prompt": "x", "cache_salt": salt})
    assert info.value.param == "cache_salt" and info.value.status == 400


def test_prompt_logprobs_are_bounded_and_not_streamed() -> None:
    params = parse_completion({"model": "m", "prompt": "x", "prompt_logprobs": 20})
    check_prompt_scores(params, MAX_PROMPT_SCORES // 21)
    with pytest.raises(BadRequest, match="ask for fewer alternatives or a shorter prompt") as refused:
        check_prompt_scores(params, MAX_PROMPT_SCORES // 21 + 1)
    assert refused.value.param == "prompt_logprobs"
    echoed = parse_completion({"model": "m", "prompt": "x", "echo": True, "logprobs": 0})
    with pytest.raises(BadRequest) as refused:
        check_prompt_scores(echoed, MAX_PROMPT_SCORES + 1)
    assert refused.value.param == "echo"
    with pytest.raises(BadRequest, match="not available when 'stream' is true"):
        parse_completion({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True})


def test_priority_is_taken_in_both_bodies_as_vllm_does() -> None:
    assert parse_completion({"model": "m", "prompt": "x"}).priority is None  # the tenant's default
    assert parse_completion({"model": "m", "prompt": "x", "priority": None}).priority is None
    assert parse_completion({"model": "m", "prompt": "x", "priority": -(2**31)}).priority == -(2**31)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": 7})
    assert chat.priority == 7


@pytest.mark.parametrize(
    ("priority", "says"),
    [(2**31, "must be <= 2147483647"), (-(2**31) - 1, "must be >= -2147483648"), (1.5, "integer"), (True, "integer")],
)
def test_a_bad_priority_is_a_400(priority: object, says: str) -> None:
    for parse, body in (
        (parse_completion, {"prompt": "x"}),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        with pytest.raises(BadRequest, match=says) as info:
            parse({"model": "m", "priority": priority, **body})
        assert info.value.param == "priority" and info.value.status == 400


def test_a_requests_timeout_is_taken_in_both_bodies() -> None:
    assert parse_completion({"model": "m", "prompt": "x"}).timeout is None  # the server's
    assert parse_completion({"model": "m", "prompt": "x", "timeout": None}).timeout is None
    assert parse_completion({"model": "m", "prompt": "x", "timeout": 2.5}).timeout == 2.5
    assert parse_completion({"model": "m", "prompt": "x", "timeout": 10**30}).timeout == 10**30  # held later
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "timeout": 30})
    assert chat.timeout == 30


@pytest.mark.parametrize("timeout", [0, -1, 0.0, float("nan"), float("inf"), "10", True, [5], {"s": 5}])
def test_a_bad_timeout_is_a_400_naming_the_field(timeout: object) -> None:
    for parse, body in (
        (parse_completion, {"prompt": "x"}),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        with pytest.raises(BadRequest, match="'timeout' must be a number of seconds > 0") as info:
            parse({"model": "m", "timeout": timeout, **body})
        assert info.value.param == "timeout" and info.value.status == 400
