"""The sampling parameters the workers' logits processors read, on the bus: carried as they
were set, bounded on decode as every field is, absent from an older producer's entries."""

from __future__ import annotations

import orjson
import pytest

from splitbus.bus.core import codec
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.messages import GenerateRequest, SamplingParams

SET = dict(
    presence_penalty=-1.5,
    frequency_penalty=2,
    repetition_penalty=1.2,
    logit_bias={"0": -100, "2147483647": 100.0, "17": 0.5},
    min_tokens=4,
    min_p=0.05,
    stop_token_ids=[9],
)


def _request_data(**sampling: object) -> bytes:
    params = SamplingParams(max_tokens=4)
    data = orjson.loads(orjson.dumps(GenerateRequest("r1", "m", [1, 2], params, "api-1", 1)))
    data["sampling"].update(sampling)
    return orjson.dumps(data)


def _decode(data: bytes) -> SamplingParams:
    request = codec.decode({b"type": b"request", b"data": data})
    assert isinstance(request, GenerateRequest)
    return request.sampling


def test_the_parameters_travel_as_set() -> None:
    sampling = SamplingParams(max_tokens=4, **SET)  # type: ignore[arg-type]  # a mapping of mixed values
    request = GenerateRequest("r1", "m", [1, 2], sampling, "api-1", 1)
    assert codec.decode(codec.encode(request)) == request
    assert _decode(_request_data(**SET)) == sampling


def test_an_older_producers_request_has_them_off() -> None:
    data = orjson.loads(_request_data())
    for name in SET:
        del data["sampling"][name]
    assert _decode(orjson.dumps(data)) == SamplingParams(max_tokens=4)
    off = SamplingParams()
    assert (off.presence_penalty, off.frequency_penalty, off.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (off.logit_bias, off.min_tokens, off.min_p, off.stop_token_ids) == ({}, 0, 0.0, [])


@pytest.mark.parametrize(
    "sampling, why",
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": True}, "frequency_penalty must be a number"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": 2.01}, r"repetition_penalty must be in \[0.0, 2.0\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0.0, 1.0\]"),
        ({"min_tokens": 5}, "min_tokens must be <= 4"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"logit_bias": [[1, 2]]}, "logit_bias must be an object"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias must hold at most 300 entries"),
        ({"logit_bias": {"07": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"-1": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"2147483648": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"1": 100.5}}, r"logit_bias\[1\] must be in \[-100.0, 100.0\]"),
        ({"logit_bias": {"1": "5"}}, r"logit_bias\[1\] must be a number"),
    ],
)
def test_the_parameters_are_bounded_on_decode(sampling: dict[str, object], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        _decode(_request_data(**sampling))
