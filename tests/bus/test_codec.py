"""Pure codec logic: no Redis needed."""

import orjson
import pytest

from splitbus.bus import codec
from splitbus.bus.errors import DecodeError
from splitbus.bus.messages import Cancel, Failed, Finished, GenerateRequest, SamplingParams, TokenDelta


def _request(**overrides: object) -> GenerateRequest:
    fields = dict(
        request_id="r1", model="m", prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4, seed=7, stop=["\n"]), api_node="api-1", deadline_ms=1,
    )
    fields.update(overrides)
    return GenerateRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "msg",
    [
        _request(),
        TokenDelta(seq=3, token_ids=[5, 6], text="hi"),
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
    assert orjson.loads(fields[b"data"]) == {"seq": 0, "token_ids": [1], "text": ""}


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
        ({b"type": b"token", b"data": b'{"seq":0,"token_ids":[-1]}'}, "non-negative"),
        ({b"type": b"request", b"data": b'{"request_id":"r"}'}, "missing"),
    ],
)
def test_bad_entries_raise_decode_error(fields: dict[bytes, bytes], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        codec.decode(fields)


def test_nested_sampling_params_are_validated() -> None:
    data = orjson.dumps(_request()).replace(b'"max_tokens":4', b'"max_tokens":0')
    with pytest.raises(DecodeError, match="max_tokens"):
        codec.decode({b"type": b"request", b"data": data})
