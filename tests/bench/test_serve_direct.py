"""The engine loop behind ``bench serve``'s baselines (``DirectLoop``) and the sim engine's own
HTTP server over it (``sim_http``), in-process: a request waits for KV room as on a worker, a
client that leaves frees its blocks, a stopped engine or a stalled stream fails its requests
instead of hanging them, and what can never be served is refused up front. No server is started."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from splitbus.bench import sim_http
from splitbus.bench.serve_direct import DirectLoop, Pending, new_sequence
from splitbus.bench.sim_http import BadRequest, _Streamed, admit, events
from splitbus.worker import engines
from splitbus.worker.engines.prefix import BlockPool
from splitbus.worker.sequence import Sequence

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    engines.get("sim").make_default_model(folder)
    return folder


def _small_pool(loop: DirectLoop, blocks: int) -> DirectLoop:
    """The loop with a KV pool of ``blocks`` blocks, so that two requests cannot both hold theirs."""
    loop.engine.pool = BlockPool(range(blocks), BLOCK)  # type: ignore[attr-defined]
    loop.engine.total_blocks = blocks
    return loop


async def _chunks(stream: AsyncIterator[bytes]) -> list[dict[str, object] | str]:
    return [orjson.loads(c[6:]) if c != b"data: [DONE]\n\n" else "[DONE]" async for c in stream]


class _Logged(Pending):
    """A request whose tokens are noted, by name, in one log shared with the others."""

    def __init__(self, seq: Sequence, name: str, log: list[str]) -> None:
        super().__init__(seq)
        self.name, self.log = name, log

    def token(self, text: str) -> None:
        self.log.append(self.name)


async def test_a_request_without_kv_room_waits_for_it_as_on_a_worker(model_dir: Path) -> None:
    """Two requests whose blocks do not fit together (3 + 4 of 6): the second is admitted only
    when the first leaves, and both finish (it was queued without its blocks before, and the two
    decoded side by side)."""
    loop = _small_pool(DirectLoop.load(model_dir, "tiny"), 6)
    log: list[str] = []
    first = _Logged(new_sequence(loop.tokenizer, list(range(40, 80)), 3), "first", log)  # 43 tokens: 3 blocks
    second = _Logged(new_sequence(loop.tokenizer, list(range(100, 150)), 3), "second", log)  # 53 tokens: 4
    loop.submit(first)
    loop.submit(second)
    engine = loop.start()
    try:
        await asyncio.wait_for(asyncio.gather(first.done, second.done), 30)
    finally:
        engine.cancel()
    assert log == ["first"] * 3 + ["second"] * 3


async def test_a_client_that_leaves_drops_its_request_and_frees_its_blocks(model_dir: Path) -> None:
    loop = DirectLoop.load(model_dir, "tiny")
    engine = loop.start()
    try:
        pending = _Streamed(new_sequence(loop.tokenizer, list(range(40, 80)), 1000))
        loop.submit(pending)
        stream = events(loop, pending, "tiny", usage=False)
        first = orjson.loads((await anext(stream))[6:])
        assert first["choices"][0]["text"] and pending in loop.running
        await stream.aclose()  # as Starlette ends a response whose client disconnected
        await asyncio.wait_for(pending.done, 10)
        await asyncio.sleep(0.05)  # the step under way when it left ends
    finally:
        engine.cancel()
    assert loop.running == [] and not loop.live
    assert len(pending.seq.output_ids) < 1000 and pending.seq.finish_reason is None
    assert loop.engine.free_blocks == loop.engine.total_blocks


async def test_a_request_waiting_for_room_leaves_at_once_when_cancelled(model_dir: Path) -> None:
    loop = DirectLoop.load(model_dir, "tiny")  # not started: the request stays waiting
    pending = _Streamed(new_sequence(loop.tokenizer, [5, 6, 7], 2))
    loop.submit(pending)
    loop.cancel(pending)
    await asyncio.sleep(0)  # the done future's callbacks run
    assert pending.done.done() and not loop.waiting and not loop.live


async def test_a_stopped_engine_fails_every_stream_and_refuses_new_requests(model_dir: Path) -> None:
    loop = DirectLoop.load(model_dir, "tiny")

    async def broken(_: object) -> list[int]:
        raise RuntimeError("the GPU fell off")

    loop.engine.prefill = broken  # type: ignore[method-assign]
    pending = _Streamed(new_sequence(loop.tokenizer, [5, 6, 7], 2))
    loop.submit(pending)
    engine = loop.start()
    chunks = await asyncio.wait_for(_chunks(events(loop, pending, "tiny", usage=True)), 10)
    assert engine.done() and loop.stopped == "the engine loop stopped: RuntimeError('the GPU fell off')"
    assert chunks == [{"error": {"message": loop.stopped, "type": "server_error", "code": 500}}, "[DONE]"]
    with pytest.raises(BadRequest, match="the engine loop stopped") as refused:
        admit(loop, [5, 6, 7], 2)
    assert refused.value.status == 503


async def test_a_stream_without_its_next_token_ends_with_an_error(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sim_http, "TOKEN_TIMEOUT_S", 0.05)
    loop = DirectLoop.load(model_dir, "tiny")  # never started: no token comes
    pending = _Streamed(new_sequence(loop.tokenizer, [5, 6, 7], 2))
    loop.submit(pending)
    chunks = await asyncio.wait_for(_chunks(events(loop, pending, "tiny", usage=True)), 10)
    assert chunks == [{"error": {"message": "no token within 0.05 s", "type": "server_error", "code": 500}}, "[DONE]"]
    assert not loop.waiting and pending.done.done()  # it left the loop


async def test_what_can_never_be_served_is_refused_before_it_is_queued(model_dir: Path) -> None:
    loop = _small_pool(DirectLoop.load(model_dir, "tiny"), 6)
    context = loop.tokenizer.context_length
    with pytest.raises(BadRequest, match=f"exceed the model's context length {context}$") as long:
        admit(loop, [5] * (context - 3), 4)
    assert long.value.status == 400
    with pytest.raises(BadRequest, match="^97 tokens never fit the 96 of the KV pool$") as big:
        admit(loop, [5] * 90, 7)
    assert big.value.status == 503
    assert admit(loop, [5] * 90, 6).prompt_len == 90
    assert not loop.waiting  # nothing refused was queued
