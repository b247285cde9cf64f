"""Hop marks (splitbus/bus/core/hopmarks.py): what a process writes for ``bench serve``'s hop breakdown,
and a group consumer's marks against a real redis-server."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from splitbus.bench.hop_trace import read_marks
from splitbus.bus.core import hopmarks
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import Producer
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.request_stream import request_consumer
from splitbus.bus.results import ResultReader, ResultWriter


@pytest.fixture
def marks_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Hop marks on, written to ``tmp_path`` (as ``SPLITBUS_HOP_MARKS`` set at start would)."""
    monkeypatch.setattr(hopmarks, "FOLDER", str(tmp_path))
    monkeypatch.setattr(hopmarks, "on", True)
    monkeypatch.setattr(hopmarks, "_fd", None)
    monkeypatch.setattr(hopmarks, "_marks", [])
    return tmp_path


def _request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, "m", [1, 2], SamplingParams(), "api", 0)


def test_marks_are_kept_in_memory_until_flushed_then_appended(marks_on: Path) -> None:
    hopmarks.mark("cmpl-1", "api.route", 100)
    hopmarks.mark("cmpl-1", "api.body")
    assert not list(marks_on.glob("*.marks"))  # nothing written between two marks
    hopmarks.flush()
    hopmarks.flush()  # nothing new: nothing written
    hopmarks.mark("cmpl-2", "api.route", 300)
    hopmarks.flush()
    (path,) = marks_on.glob("*.marks")
    lines = path.read_text().splitlines()
    assert lines[0] == "cmpl-1 api.route 100" and lines[2] == "cmpl-2 api.route 300"
    assert lines[1].startswith("cmpl-1 api.body ") and int(lines[1].split()[2]) > 300


def test_a_message_is_marked_by_its_request_a_task_by_its_request_s(marks_on: Path) -> None:
    class Task:
        request = _request("cmpl-t")

    hopmarks.mark_message(_request("cmpl-r"), "requests.read", 1)
    hopmarks.mark_message(Task(), "tasks.read", 2)
    hopmarks.mark_message(object(), "other.read", 3)  # names no request: not marked
    hopmarks.mark("bad id", "api.route", 4)  # a space would break the line: dropped
    hopmarks.mark("bad\nid", "api.route", 5)  # and so would a line break
    hopmarks.mark("bad\u2028id", "api.route", 6)  # (any splitlines reads by)
    hopmarks.flush()
    assert read_marks(marks_on) == {"cmpl-r": {"requests.read": 1}, "cmpl-t": {"tasks.read": 2}}


async def test_a_group_consumer_marks_each_request_read_and_decoded(
    marks_on: Path, redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    consumer = request_consumer(redis, bus_config, "s1")
    await consumer.ensure_group()
    await Producer(redis, bus_config).send(bus_config.keys.requests, _request("cmpl-a"))
    (got,) = await consumer.read(10, block_ms=1000)
    await consumer.read(10, block_ms=1)  # the next read flushes before it waits
    marks = read_marks(marks_on)["cmpl-a"]
    assert got.message.request_id == "cmpl-a"
    assert marks["requests.read"] <= marks["requests.decoded"]
    assert marks["requests.read"] >= int(got.published_us or 0) * 1000  # after the entry was encoded


async def test_a_result_writer_marks_a_request_s_first_write_only(
    marks_on: Path, redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    writer = ResultWriter(redis, bus_config)
    writer.open("cmpl-w", reader="api")
    writer.tokens("cmpl-w", [1], "a")
    await writer.flush()
    for token in (2, 3):
        writer.tokens("cmpl-w", [token], "b")
        await writer.flush()
    writer.finish("cmpl-w", "stop", 2, 3)
    await writer.flush()
    request_marks = [m[:2] for m in hopmarks._marks if m[0] == "cmpl-w"]
    assert request_marks == [("cmpl-w", "worker.written")]  # not one a token
    written = [m[0] for m in hopmarks._marks if m[1] == "tok.written"]  # the token path's: one an entry
    assert written == [hopmarks.entry_key("cmpl-w", seq) for seq in range(4)]


def test_a_folder_that_cannot_take_the_file_turns_marks_off_with_one_warning_at_start(
    marks_on: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hopmarks.FOLDER = str(marks_on / "missing")  # (marks_on's monkeypatch restores it)
    with caplog.at_level(logging.WARNING, logger=hopmarks.__name__):
        hopmarks.start()
    assert not hopmarks.on
    assert [r.getMessage() for r in caplog.records] == [
        f"hop marks off: SPLITBUS_HOP_MARKS={marks_on / 'missing'} cannot be written: "
        f"[Errno 2] No such file or directory: '{marks_on / 'missing'}/{os.getpid()}.marks'"
    ]


async def test_a_bad_folder_leaves_a_bus_read_loop_reading(
    marks_on: Path, redis: aioredis.Redis, bus_config: BusConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Marks kept, then their file cannot be made (the folder is a file): the read that flushes
    them goes on, the marks turn off with one warning."""
    hopmarks.FOLDER = str(marks_on / "a-file")
    (marks_on / "a-file").write_text("")
    consumer = request_consumer(redis, bus_config, "s1")
    await consumer.ensure_group()
    producer = Producer(redis, bus_config)
    await producer.send(bus_config.keys.requests, _request("cmpl-a"))
    with caplog.at_level(logging.WARNING, logger=hopmarks.__name__):
        assert len(await consumer.read(10, block_ms=1000)) == 1
        await producer.send(bus_config.keys.requests, _request("cmpl-b"))
        (got,) = await consumer.read(10, block_ms=1000)  # flushes cmpl-a's marks first
        await producer.send(bus_config.keys.requests, _request("cmpl-c"))
        assert len(await consumer.read(10, block_ms=1000)) == 1
    assert got.message.request_id == "cmpl-b" and not hopmarks.on and hopmarks._marks == []
    assert len(caplog.records) == 1 and "hop marks off" in caplog.records[0].getMessage()


async def test_no_marks_when_off(tmp_path: Path, redis: aioredis.Redis, bus_config: BusConfig) -> None:
    assert not hopmarks.on  # the test run does not set SPLITBUS_HOP_MARKS
    consumer = request_consumer(redis, bus_config, "s1")
    await consumer.ensure_group()
    await Producer(redis, bus_config).send(bus_config.keys.requests, _request("cmpl-b"))
    assert len(await consumer.read(10, block_ms=1000)) == 1
    assert hopmarks._marks == []


async def test_the_token_path_marks_each_entry_by_its_seq(
    marks_on: Path, redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """The writer's step, flush and reply, the API reader's read and decode, under REQUEST/SEQ."""
    reader = ResultReader(bus_config, redis, name="api-marks", shards=1)
    await reader.start()
    try:
        sub = await reader.subscribe("cmpl-k")
        writer = ResultWriter(redis, bus_config)
        writer.open("cmpl-k", reader=reader.reader_of("cmpl-k"))
        writer.mark_next(["cmpl-k", "cmpl-unopened"], "tok.engine")  # an unopened request: no mark
        writer.tokens("cmpl-k", [10])
        writer.finish("cmpl-k", "length", prompt_tokens=1, completion_tokens=1)
        await writer.flush()
        assert [r.seq async for r in sub] == [0, 1]
    finally:
        await reader.close()
    hopmarks.flush()
    marks = read_marks(marks_on)
    token = marks[hopmarks.entry_key("cmpl-k", 0)]
    order = ["tok.engine", "tok.step", "tok.flush", "tok.written"]
    assert sorted(order, key=token.__getitem__) == order
    assert token["tok.flush"] <= token["tok.read"] <= token["tok.decoded"]
    assert set(marks[hopmarks.entry_key("cmpl-k", 1)]) >= {"tok.step", "tok.flush", "tok.read"}  # the Finished
    assert "cmpl-unopened/0" not in marks and marks["cmpl-k"]["api.read"] == token["tok.read"]


async def test_the_token_marks_turn_off_with_the_rest_when_the_file_cannot_be_written(
    marks_on: Path, redis: aioredis.Redis, bus_config: BusConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer's per-token marks kept, then their file cannot be made: marks off, and the next
    tokens' writes keep none."""
    hopmarks.FOLDER = str(marks_on / "a-file")
    (marks_on / "a-file").write_text("")
    writer = ResultWriter(redis, bus_config)
    writer.open("cmpl-o", reader="api")
    writer.mark_next(["cmpl-o"], "tok.engine")
    writer.tokens("cmpl-o", [1])
    await writer.flush()
    assert {m[1] for m in hopmarks._marks} >= {"tok.engine", "tok.step", "tok.flush", "tok.written"}
    with caplog.at_level(logging.WARNING, logger=hopmarks.__name__):
        hopmarks.flush()
    assert not hopmarks.on and hopmarks._marks == [] and len(caplog.records) == 1
    writer.tokens("cmpl-o", [2])
    await writer.flush()
    assert hopmarks._marks == [] and not list(marks_on.glob("*.marks"))
