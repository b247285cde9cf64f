"""Structured output on a worker (splitbus/worker/core.py, sequence.py, the sim engine): a request's
grammar is built as its task is taken, followed from the tokens it already has (a migration, a
hand-off), holds each token the engine draws and ends the request when complete; one that does not
build, or tokens that break it, fail that request alone. Pure logic, as tests/worker/test_core.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.grammar.request import compile_grammar, grammar_spec
from splitbus.grammar.tokenizer import grammar_tokenizer
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import WorkerConfig
from splitbus.worker.core import Limits, WorkerCore
from splitbus.worker.effects import Ack, Effect, Emit, Fail, Finish
from splitbus.worker.engines.sim import SimEngine, sim_text
from splitbus.worker.table import Status
from splitbus.worker.worker import Worker
from tests.worker.test_core import BLOCKS, FREE, decode, frame, kinds, prefill

PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.fixture
def tokenizer(tiny_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model, "tiny")


@pytest.fixture
def core(tokenizer: ModelTokenizer) -> WorkerCore:
    return WorkerCore(Limits("w1", "tiny", 16, kv_wait_s=30.0), SimEngine(FREE, tokenizer, BLOCKS, 16), tokenizer)


def grammar(tokenizer: ModelTokenizer, body: dict[str, object]) -> str:
    spec = grammar_spec(body)
    assert spec is not None
    return compile_grammar(spec, grammar_tokenizer(tokenizer))


def task(phase: str, grammar: str | None, *, seed: int = 1, before: list[int] | None = None) -> Task:
    sampling = SamplingParams(max_tokens=40, seed=seed, grammar=grammar)
    request = GenerateRequest("r1", "tiny", [97, 98], sampling, "api", 0)
    return Task(phase, request, "" if phase == "mixed" else "p1", output_token_ids=before or [])


async def run(core: WorkerCore) -> list[Effect]:
    effects = await prefill(core)
    while core.has_work():
        effects += await decode(core)
    return effects


def text(effects: list[Effect]) -> str:
    return "".join(e.text for e in effects if isinstance(e, Emit)) + "".join(
        e.text for e in effects if isinstance(e, Finish)
    )


def finish(effects: list[Effect]) -> Finish:
    found = [e for e in effects if isinstance(e, Finish)]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_constrained_request_generates_what_its_grammar_allows_and_stops(
    core: WorkerCore, tokenizer: ModelTokenizer, seed: int
) -> None:
    core.admit("1-0", task("mixed", grammar(tokenizer, {"guided_regex": PHONE}), seed=seed))
    effects = await run(core)
    out = text(effects)
    assert len(out) == 8 and out[3] == "-" and (out[:3] + out[4:]).isdigit()
    assert finish(effects).reason == "stop" and finish(effects).completion_tokens == 8


async def test_a_request_taken_over_continues_its_grammar_from_its_tokens(
    core: WorkerCore, tokenizer: ModelTokenizer
) -> None:
    """A migrated request (its task holds the tokens streamed before): the grammar picks up there."""
    before = tokenizer.encode("ye")
    core.admit("1-0", task("mixed", grammar(tokenizer, {"guided_choice": ["yes", "no"]}), before=before))
    effects = await run(core)
    assert text(effects) == "s" and finish(effects).reason == "stop"


def test_a_grammar_that_does_not_build_fails_its_request_alone(core: WorkerCore, tokenizer: ModelTokenizer) -> None:
    admission = core.admit("1-0", task("mixed", '{"grammars": [{"lark_grammar": "start: nope"}]}'))
    assert admission.rejected is None and len(core.table) == 0
    fail = admission.effects[0]
    assert isinstance(fail, Fail) and (fail.code, fail.status) == ("invalid_grammar", 400)
    assert "does not build" in fail.message and Ack("1-0") in admission.effects


def test_tokens_before_that_break_the_grammar_fail_the_request(core: WorkerCore, tokenizer: ModelTokenizer) -> None:
    admission = core.admit("1-0", task("mixed", grammar(tokenizer, {"guided_regex": PHONE}), before=[97]))
    fail = admission.effects[0]
    assert isinstance(fail, Fail) and fail.code == "invalid_grammar" and "break the grammar" in fail.message


def test_a_decode_side_rebuilds_the_grammar_from_the_tokens_p_made(core: WorkerCore, tokenizer: ModelTokenizer) -> None:
    g = grammar(tokenizer, {"guided_regex": PHONE})
    seq = core.admit("1-0", task("decode", g)).awaiting_kv
    assert seq is not None and seq.grammar is not None
    meta: dict[str, object] = {"output_token_ids": tokenizer.encode("55"), "next_seq": 2}
    core.admit_kv("p1", frame(seq, "p1", meta))
    core.start_import("r1")
    assert core.end_import(seq, meta, None)[0] is None
    assert core.table.status(seq) is Status.RUNNING and seq.grammar.taken == 2


def test_a_decode_side_refuses_tokens_that_break_the_grammar(core: WorkerCore, tokenizer: ModelTokenizer) -> None:
    seq = core.admit("1-0", task("decode", grammar(tokenizer, {"guided_regex": PHONE}))).awaiting_kv
    assert seq is not None
    meta: dict[str, object] = {"output_token_ids": tokenizer.encode("5x"), "next_seq": 2}
    core.admit_kv("p1", frame(seq, "p1", meta))
    core.start_import("r1")
    refusal, effects = core.end_import(seq, meta, None)
    assert refusal is not None and "break the grammar" in refusal
    assert kinds(effects)[0] is Fail and len(core.table) == 0


async def test_an_unconstrained_request_is_unchanged(core: WorkerCore) -> None:
    core.admit("1-0", task("mixed", None))
    effects = await run(core)
    assert finish(effects).reason == "length" and text(effects) == sim_text(1, 40)


def test_a_model_without_structured_output_fails_only_constrained_requests(
    tiny_model: Path, tokenizer: ModelTokenizer
) -> None:
    undecodable = ModelTokenizer.load(tiny_model, "tiny")
    config = json.loads(undecodable.tokenizer.to_str())
    undecodable.tokenizer = Tokenizer.from_str(json.dumps({**config, "decoder": None}))  # llguidance needs one
    core = WorkerCore(Limits("w1", "tiny", 16), SimEngine(FREE, tokenizer, BLOCKS, 16), undecodable)
    fail = core.admit("1-0", task("mixed", '{"grammars": [{"lark_grammar": "start: \\"a\\""}]}')).effects[0]
    assert isinstance(fail, Fail) and fail.code == "invalid_grammar" and "cannot read the tokenizer" in fail.message
    assert core.admit("2-0", task("mixed", None)).rejected is None and len(core.table) == 1


async def test_a_worker_builds_the_vocabulary_at_start_and_starts_without_it(
    bus_config: BusConfig, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Built before any task, in a thread; a tokenizer llguidance cannot read costs the worker its
    structured output, not its start."""
    readable = ModelTokenizer.load(tiny_model, "tiny")
    undecodable = ModelTokenizer.load(tiny_model, "tiny")
    config = json.loads(undecodable.tokenizer.to_str())
    undecodable.tokenizer = Tokenizer.from_str(json.dumps({**config, "decoder": None}))
    for tokenizer in (readable, undecodable):
        settings = WorkerConfig(bus=bus_config, role="mixed", model_dir=tiny_model, model_name="tiny", worker_id="m1")
        worker = Worker(settings, tokenizer, SimEngine(FREE, tokenizer, BLOCKS, 16))
        try:
            await worker.prepare_grammars()
        finally:
            await worker.redis.aclose()
    assert grammar_tokenizer(readable).vocab_size == readable.vocab_size  # built: cached now
    assert "worker m1 serves no structured output: llguidance cannot read the tokenizer of tiny" in caplog.text
