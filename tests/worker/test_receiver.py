"""The decode side of the hand-off (splitbus/worker/receiver.py), against a real Redis: a KV
frame's import holds its request in the table, so a newer task of it taken meanwhile has it next."""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.engines.sim import SimConfig, SimEngine
from splitbus.worker.kv_proof import Header, kv_proof
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import Status
from splitbus.worker.transfer import KV
from splitbus.worker.worker import Worker
from tests.worker.replies import add

REQUEST = GenerateRequest("r-again", "tiny", [97, 98], SamplingParams(max_tokens=8), "api", 0)


@pytest.fixture
async def worker(bus_config: BusConfig, tiny_model: Path):  # type: ignore[no-untyped-def]
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    config = WorkerConfig(bus=bus_config, role="decode", model_dir=tiny_model, model_name="tiny", worker_id="d1")
    worker = Worker(config, tokenizer, SimEngine(SimConfig(), tokenizer, 64, 16))
    await worker.tasks.ensure_group()
    yield worker
    await worker.loops.close()
    await worker.redis.aclose()


async def take_decode_task(worker: Worker, handoff: str) -> Sequence:
    """A decode task from p1 written to the worker's stream and taken: its blocks reserved."""
    await add(worker.redis, worker.keys.tasks(worker.id), Task("decode", REQUEST, peer="p1", handoff=handoff))
    await worker.feed.feed_tasks()
    seq = worker.requests.get(REQUEST.request_id, Status.AWAITING_KV)
    assert seq is not None and seq.task.handoff == handoff
    return seq


def kv_frame(worker: Worker, seq: Sequence) -> tuple[Header, bytes]:
    """The frame p1 sends for ``seq``: its first token, signed with the reservation's secret."""
    assert isinstance(worker.engine, SimEngine)
    payload = worker.engine.kv_payload(seq.request)
    meta = {"output_token_ids": [5], "next_seq": 1}
    size, crc = len(payload), zlib.crc32(payload)
    return Header(
        KV, seq.request_id, {**meta, "proof": kv_proof(seq.kv_secret, "p1", seq.request_id, meta, size, crc)}, size, crc
    ), payload


async def test_a_request_moved_here_again_during_its_import_goes_to_the_newer_task(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine imports in an executor: a real window. The request's older dispatch is
    # replaced meanwhile (its prefill worker died) and the newer decode task comes to this same
    # worker. The older task must let go once its import ends (its blocks freed, its task acked,
    # a refusal for its sender), and the newer one waits for its own KV: on the old path the
    # import re-added the older task and raised, and its blocks and task were never let go.
    total = worker.engine.free_blocks
    older = await take_decode_task(worker, "h1")
    header, payload = kv_frame(worker, older)
    importing, release = asyncio.Event(), asyncio.Event()
    real_import = worker.engine.import_kv

    async def slow_import(seq: Sequence, data: bytes) -> str | None:
        importing.set()
        await release.wait()
        return await real_import(seq, data)

    monkeypatch.setattr(worker.engine, "import_kv", slow_import)
    imported = asyncio.create_task(worker.receiver.import_kv("p1", header, payload))
    await asyncio.wait_for(importing.wait(), 5)
    assert worker.requests.status(older) is Status.IMPORTING  # held through the import
    assert worker.receiver.admit_kv("p1", header) is not None  # a second frame meanwhile is refused
    newer = await take_decode_task(worker, "h2")
    release.set()
    refusal = await asyncio.wait_for(imported, 5)
    assert refusal is not None and "moved" in refusal
    assert worker.requests.of() == [newer] and worker.requests.status(newer) is Status.AWAITING_KV
    assert worker.engine.free_blocks == total - newer.blocks  # the older task's blocks are free
    await worker.publisher.publish()
    assert await worker.tasks.pending_ids() == {newer.entry_id}  # the older task acked
    reservation = await worker.reservations.read(REQUEST.request_id)
    assert reservation is not None and reservation.handoff == "h2"  # the newer task's reservation stays
