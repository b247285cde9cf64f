"""Pure codec logic: no Redis needed."""

import importlib
import inspect
import pkgutil
import subprocess
import sys

import orjson
import pytest

import splitbus.bus.messages
from splitbus.bus.core import codec
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.messages import Cancel, Failed, Finished, GenerateRequest, Logprobs, SamplingParams, TokenDelta


def _request(**overrides: object) -> GenerateRequest:
    fields = dict(
        request_id="r1",
        model="m",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4, seed=7, stop=["\n"]),
        api_node="api-1",
        deadline_ms=1,
    )
    fields.update(overrides)
    return GenerateRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "msg",
    [
        _request(),
        _request(reader="api-1.out.3"),
        _request(prompt_token_ids=list(range(40)), prefix_hashes="0123456789abcdef" * 4, prefix_block_size=16),
        _request(cache_salt="0123456789abcdef" * 2),
        TokenDelta(seq=3, token_ids=[5, 6], text="hi"),
        TokenDelta(1, [5], "a", Logprobs([-0.5], [[5, 2]], [[-0.5, -1.25]]), Logprobs([-3.0], [[]], [[]])),
        Finished(seq=4, finish_reason="length", prompt_tokens=3, completion_tokens=2),
        Failed(seq=0, code="no_worker", message="none", status=503),
        Cancel("r1"),
    ],
)
def test_round_trip(msg: object) -> None:
    fields = codec.encode(msg)
    assert fields[b"type"] == msg.TYPE.encode()  # type: ignore[attr-defined]
    assert codec.decode(fields) == msg
    assert codec.published_us(fields) is not None


def test_entries_are_readable_json() -> None:
    fields = codec.encode(TokenDelta(seq=0, token_ids=[1]))
    assert orjson.loads(fields[b"data"]) == {
        "seq": 0,
        "token_ids": [1],
        "text": "",
        "logprobs": None,
        "prompt_logprobs": None,
    }


def test_unknown_fields_are_ignored() -> None:
    fields = {b"type": b"token", b"data": b'{"seq":0,"token_ids":[1],"future":true}'}
    assert codec.decode(fields) == TokenDelta(seq=0, token_ids=[1])


@pytest.mark.parametrize(
    "fields, why",
    [
        ({b"type": b"nope", b"data": b"{}"}, "unknown message type"),
        ({b"type": b"token"}, "not JSON"),
        ({b"type": b"token", b"data": b"{not json"}, "not JSON"),
        ({b"type": b"token", b"data": b"[1,2]"}, "JSON object"),
        ({b"type": b"token", b"data": b'{"token_ids":[1]}'}, "seq"),
        ({b"type": b"token", b"data": b'{"seq":"0","token_ids":[1]}'}, "seq must be an integer"),
        ({b"type": b"token", b"data": b'{"seq":0,"token_ids":[-1]}'}, r"integers in \[0, 2147483647\], got -1"),
        ({b"type": b"request", b"data": b'{"request_id":"r"}'}, "missing"),
    ],
)
def test_bad_entries_raise_decode_error(fields: dict[bytes, bytes], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        codec.decode(fields)


@pytest.mark.parametrize(
    "logprobs, why",
    [
        ({"token": [-0.5, -0.1], "top_ids": [[1]], "top": [[-0.5]]}, "one per token"),
        ({"token": [0.5], "top_ids": [[1]], "top": [[-0.5]]}, "log-probabilities"),
        ({"token": [-0.5], "top_ids": [[1, 2]], "top": [[-0.5]]}, "one per top id"),
        ({"token": [-0.5], "top_ids": [list(range(21))], "top": [[-0.5] * 21]}, "at most 20"),
        ({"token": ["x"], "top_ids": [[]], "top": [[]]}, "log-probabilities"),
        ({"token": [-1e9], "top_ids": [[]], "top": [[]]}, "log-probabilities"),
        ({"token": [-0.5], "top_ids": [[-1]], "top": [[-0.5]]}, "integers"),
        ({"token": [-0.5, -0.5], "top_ids": [[], []], "top": [[], []]}, "one entry per token"),
    ],
)
def test_token_logprobs_are_bounded(logprobs: dict[str, object], why: str) -> None:
    data = orjson.dumps({"seq": 0, "token_ids": [1], "logprobs": logprobs})
    with pytest.raises(DecodeError, match=why):
        codec.decode({b"type": b"token", b"data": data})


def test_a_requests_reader_is_its_api_node_unless_named() -> None:
    assert _request().reader == "api-1"
    data = orjson.dumps(_request(reader="api-1.out.2"))
    assert orjson.loads(data)["reader"] == "api-1.out.2"  # the JSON carries it: workers build the key from it
    old = {k: v for k, v in orjson.loads(data).items() if k != "reader"}  # a producer that never names one
    assert codec.decode({b"type": b"request", b"data": orjson.dumps(old)}).reader == "api-1"  # type: ignore[attr-defined]


@pytest.mark.parametrize("reader", ["a{b", "a}b", "a:b", "a b", "x" * 257, 7])
def test_a_reader_that_is_no_hash_tag_is_refused(reader: object) -> None:
    data = orjson.dumps({**orjson.loads(orjson.dumps(_request())), "reader": reader})
    with pytest.raises(DecodeError, match="reader"):
        codec.decode({b"type": b"request", b"data": data})


def test_nested_sampling_params_are_validated() -> None:
    data = orjson.dumps(_request()).replace(b'"max_tokens":4', b'"max_tokens":0')
    with pytest.raises(DecodeError, match="max_tokens"):
        codec.decode({b"type": b"request", b"data": data})


def _task_data(**overrides: object) -> bytes:
    from splitbus.bus.messages import Task

    data = orjson.loads(orjson.dumps(Task("mixed", _request())))
    data.update(overrides)
    return orjson.dumps(data)


@pytest.mark.parametrize(
    "overrides, why",
    [
        # The attacks of issue 16: a token id the tokenizer cannot convert (OverflowError), and
        # a reservation that drove the worker's counters to -10**12.
        ({"output_token_ids": [4294967296]}, r"output_token_ids must hold integers in \[0, 2147483647\], got 42949"),
        ({"reserved": [10**12, 1, 1]}, r"reserved prefill tokens must be <= 4194304, got 1000000000000"),
        ({"reserved": [1, 2, 1]}, "reserved requests must be <= 1"),
        ({"reserved": [1, 1, -1]}, "reserved KV blocks must be >= 0"),
        ({"reserved": [1.0e12, 1, 1]}, "reserved prefill tokens must be an integer"),
        ({"reserved": [1, 1]}, "reserved must hold 3 numbers"),
        ({"first_seq": 2**31}, "first_seq must be <="),
        ({"batch_ranks": 10**9}, "batch_ranks must be <="),
        ({"peer": "p" * 300}, "peer must be at most 256 characters"),
        ({"output_token_ids": [1] * (2**22 + 1)}, "output_token_ids must hold at most 4194304 items"),
    ],
)
def test_task_fields_are_bounded(overrides: dict[str, object], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        codec.decode({b"type": b"task", b"data": _task_data(**overrides)})


@pytest.mark.parametrize(
    "sampling, why",
    [
        ({"max_tokens": 2**40}, "max_tokens must be <="),
        ({"temperature": 1e300}, "temperature must be in"),
        ({"top_k": 2**40}, "top_k must be <="),
        ({"stop": ["x"] * 17}, "stop must hold at most 16"),
        ({"stop": ["x" * 5000]}, "at most 4096 characters"),
        ({"stop_token_ids": [2**33]}, "stop_token_ids must hold integers"),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be a boolean"),
        ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens must be a boolean"),
        ({"logprobs": 21}, "logprobs must be <= 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0"),
        ({"logprobs": True}, "logprobs must be an integer"),
    ],
)
def test_request_fields_are_bounded(sampling: dict[str, object], why: str) -> None:
    data = orjson.loads(orjson.dumps(_request()))
    data["sampling"].update(sampling)
    with pytest.raises(DecodeError, match=why):
        codec.decode({b"type": b"request", b"data": orjson.dumps(data)})


def test_a_request_from_an_older_api_gets_the_special_token_defaults() -> None:
    data = orjson.loads(orjson.dumps(_request()))
    del data["sampling"]["skip_special_tokens"], data["sampling"]["spaces_between_special_tokens"]
    sampling = codec.decode({b"type": b"request", b"data": orjson.dumps(data)}).sampling  # type: ignore[attr-defined]
    assert sampling.skip_special_tokens is True and sampling.spaces_between_special_tokens is True


def test_prompt_ids_and_deadline_are_bounded() -> None:
    for field, value, why in (
        ("prompt_token_ids", [2**31], "prompt_token_ids must hold integers"),
        ("deadline_ms", 2**60, "deadline_ms must be <="),
        ("request_id", "r" * 257, "request_id must be at most 256"),
    ):
        data = orjson.loads(orjson.dumps(_request()))
        data[field] = value
        with pytest.raises(DecodeError, match=why):
            codec.decode({b"type": b"request", b"data": orjson.dumps(data)})


def test_oversized_data_is_refused_unparsed() -> None:
    with pytest.raises(DecodeError, match="more than"):
        codec.decode({b"type": b"token", b"data": b" " * (codec.MAX_DATA_BYTES + 1)})


@pytest.mark.parametrize(
    "data, found",
    [
        (b'{"request_id":"cmpl-1","api_node":"api-1"}', ("cmpl-1", "api-1")),
        (b'{"request_id":"cmpl-1","api_node":"api-1","reader":"api-1.out.0"}', ("cmpl-1", "api-1.out.0")),
        (b'{"request":{"request_id":"cmpl-2","reader":"a.0"},"output_token_ids":[4294967296]}', ("cmpl-2", "a.0")),
        (b'{"request_id":"a}b","api_node":"api-1"}', None),  # would move the result stream's hash tag
        (b'{"request_id":"cmpl-3","reader":"a:b"}', None),  # a colon: no tag
        (b'{"request_id":"cmpl-3"}', None),  # no reader: no stream to name
        (b'{"request_id":7,"api_node":"api-1"}', None),
        (b"{broken", None),
    ],
)
def test_the_request_an_undecodable_entry_names(data: bytes, found: tuple[str, str] | None) -> None:
    named = codec.request_named_by({b"type": b"task", b"data": data})
    assert (named and (named.request_id, named.reader)) == found


MESSAGE_MODULES = [
    *(f"splitbus.bus.messages.{found.name}" for found in pkgutil.iter_modules(splitbus.bus.messages.__path__)),
    "splitbus.bus.core.dead",  # the dead letter: the core's consumer-group queue writes it
]
"""Every module that defines message types."""


@pytest.mark.parametrize("name", MESSAGE_MODULES)
def test_every_message_module_registers_its_types(name: str) -> None:
    # A message class without @message would encode, and then no consumer could decode it.
    for cls in _types_of(name):
        assert codec._REGISTRY.get(cls.TYPE.encode()) is cls, f"{cls.__name__} is not registered"


def test_importing_the_codec_alone_registers_every_type() -> None:
    """Importing the codec alone (a fresh interpreter) registers every type, the dead letter included:
    importing ``splitbus.bus.core.codec`` runs ``splitbus/bus/__init__.py``, which imports them."""
    names = sorted({cls.TYPE for name in MESSAGE_MODULES for cls in _types_of(name)})
    script = (
        "from splitbus.bus.core import codec; import sys; "
        "sys.stdout.write(' '.join(sorted(t.decode() for t in codec._REGISTRY)))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == names
    assert "dead" in names


def _types_of(name: str) -> list[type]:
    module = importlib.import_module(name)
    return [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == name and "TYPE" in vars(c)]


def test_a_requests_prefix_chain_is_bounded_by_its_prompt() -> None:
    prompt = list(range(40))  # 39 tokens hashed: two full blocks of 16
    for bad in (
        {"prefix_hashes": "00" * 16, "prefix_block_size": 16},  # one block short
        {"prefix_hashes": "0123456789abcdef" * 6, "prefix_block_size": 16},  # one too many
        {"prefix_hashes": "0123456789abcdef" * 2, "prefix_block_size": 16},  # two 64-bit hashes: too short
        {"prefix_hashes": "0123456789ABCDEF" * 4, "prefix_block_size": 16},
        {"prefix_hashes": "0123456789abcdef" * 4, "prefix_block_size": 0},
        {"prefix_hashes": 7, "prefix_block_size": 16},
        {"prefix_block_size": -1},
    ):
        with pytest.raises(ValueError):
            _request(prompt_token_ids=prompt, **bad)


@pytest.mark.parametrize("salt", ["0" * 31, "0" * 33, "0123456789ABCDEF" * 2, "g" * 32, 7, None, "tenant-a"])
def test_a_requests_cache_salt_is_empty_or_32_hex_digits(salt: object) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        _request(cache_salt=salt)


@pytest.mark.parametrize(
    ("choices", "group"), [(0, ""), (129, "g"), (True, "g"), (2, ""), (1, "g"), (2, 5), (2, "g" * 257)]
)
def test_a_requests_choices_are_bounded_and_named_exactly_when_several(choices: object, group: object) -> None:
    with pytest.raises(ValueError, match="choice"):
        _request(choices=choices, choice_group=group)


def test_a_choice_of_a_response_round_trips() -> None:
    from splitbus.bus.messages import Task

    request = _request(choices=4, choice_group="cmpl-1")
    assert codec.decode(codec.encode(request)) == request
    task = Task("prefill", request, "d1", twins=4)
    assert codec.decode(codec.encode(task)) == task
    for twins in (0, 129, 1.5):
        with pytest.raises(ValueError, match="twins"):
            Task("prefill", request, "d1", twins=twins)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("priority", "tenant"), [(-(2**31) - 1, ""), (2**31, ""), (True, ""), (1.5, ""), ("1", ""), (0, 5), (0, "t" * 257)]
)
def test_a_requests_priority_and_tenant_are_bounded(priority: object, tenant: object) -> None:
    with pytest.raises(ValueError, match="priority|tenant"):
        _request(priority=priority, tenant=tenant)


def test_a_requests_priority_and_tenant_round_trip_and_default_to_the_default_tenant() -> None:
    request = _request(priority=-(2**31), tenant="team-a")
    assert codec.decode(codec.encode(request)) == request
    plain = codec.decode(codec.encode(_request()))
    assert isinstance(plain, GenerateRequest) and (plain.priority, plain.tenant) == (0, "")
    data = orjson.loads(codec.encode(_request())[b"data"])  # an entry of an API node that predates the fields
    del data["priority"], data["tenant"]
    old = codec.decode({b"type": b"request", b"data": orjson.dumps(data), b"ts": b"1"})
    assert isinstance(old, GenerateRequest) and (old.priority, old.tenant) == (0, "")


def test_script_argv_is_the_encoded_entry_in_field_order() -> None:
    kind, data, ts = codec.script_argv(Cancel("r1", "deadline"))
    assert kind == b"cancel" and orjson.loads(data) == orjson.loads(codec.encode(Cancel("r1", "deadline"))[b"data"])
    assert codec.decode({b"type": kind, b"data": data, b"ts": ts}) == Cancel("r1", "deadline")
    assert list(codec.encode(Cancel("r1"))) == [b"type", b"data", b"ts"]


def test_what_is_made_out_of_an_undecodable_entry() -> None:
    fields = {b"type": b"nonsense", b"data": b'{"task_id": "t1", "x": [1]}'}
    assert codec.undecoded(fields) == {"task_id": "t1", "x": [1]}
    assert codec.undecoded({b"data": b"[1, 2]"}) is None  # JSON, but no object
    assert codec.undecoded({b"data": b"{not json"}) is None
    assert codec.undecoded({}) is None
    assert codec.data_size(fields) == len(fields[b"data"]) and codec.data_size({}) == 0
    assert codec.as_text({b"type": b"x", b"data": b"\xff{}"}) == ("x", "\ufffd{}")
    assert codec.as_text({}) == ("", "")


def test_flat_entries_carry_one_field_per_value() -> None:
    fields = codec.flat({"w": "decode-0", "epoch": 17, "plan": b"\x00raw"})
    assert fields == {b"w": b"decode-0", b"epoch": b"17", b"plan": b"\x00raw"}
    assert codec.flat_text(codec.flat({"w": "d", "at": 5})) == {"w": "d", "at": "5"}
    with pytest.raises(ValueError):
        codec.flat_text({b"w": b"\xff"})


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    "traceparent",
    [
        TRACEPARENT.upper(),
        "01" + TRACEPARENT[2:],
        "00-" + "0" * 32 + TRACEPARENT[35:],
        TRACEPARENT[:36] + "0" * 16 + "-01",
        TRACEPARENT + "-x",
        TRACEPARENT[:-1],
        " " + TRACEPARENT,
        "x" * 10_000,
        7,
        None,
    ],
)
def test_a_traceparent_is_empty_or_exactly_w3cs(traceparent: object) -> None:
    from splitbus.bus.messages import Task

    with pytest.raises(ValueError, match="traceparent"):
        _request(traceparent=traceparent)
    with pytest.raises(ValueError, match="traceparent"):
        Task("prefill", _request(), "d1", traceparent=traceparent)  # type: ignore[arg-type]
    data = orjson.loads(codec.encode(_request())[b"data"])
    data["traceparent"] = traceparent
    with pytest.raises(DecodeError):  # an entry that carries one fails alone, as any bad field
        codec.decode({b"type": b"request", b"data": orjson.dumps(data), b"ts": b"1"})


def test_a_traceparent_round_trips_and_an_older_entry_has_none() -> None:
    from splitbus.bus.messages import Task

    request = _request(traceparent=TRACEPARENT)
    assert codec.decode(codec.encode(request)) == request
    task = Task("decode", request, "p1", traceparent=TRACEPARENT[:36] + "1" * 16 + "-00")
    assert codec.decode(codec.encode(task)) == task
    data = orjson.loads(codec.encode(_request())[b"data"])
    del data["traceparent"]  # an API node that predates the field
    old = codec.decode({b"type": b"request", b"data": orjson.dumps(data), b"ts": b"1"})
    assert isinstance(old, GenerateRequest) and old.traceparent == ""
