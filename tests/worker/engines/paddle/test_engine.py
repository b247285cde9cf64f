"""The paddle engine: P->D hand-off, mixed and full recompute give the same tokens."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import paddle
import pytest

from splitbus import architectures
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.gpu_ops.logits import process
from splitbus.gpu_ops.sampling import log_softmax_top, sample, sample_on_device
from splitbus.tokenization import ModelFilesError, ModelTokenizer
from splitbus.worker.engines.paddle import engine as engine_module
from splitbus.worker.engines.paddle.engine import PaddleEngine
from splitbus.worker.engines.paddle.model import FORWARDS, CausalLM, Chunk, load_model
from splitbus.worker.engines.paddle.tiny import make_tiny_model
from splitbus.worker.sequence import Sequence
from splitbus.worker.text import TextStream
from tests.architectures.toy import TOY, register_toy
from tests.worker.engines.test_prefix import keeps_its_blocks_in_the_one_pool

PROMPT_LENGTHS = (1, 15, 16, 17, 100)
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral", "qwen3_moe"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # qwen2 in bf16: the conversion path, biases and tied embeddings.
    dtype = "bfloat16" if request.param == "qwen2" else "float32"
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, seed=1, dtype=dtype)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> CausalLM:
    return load_model(model_dir)


def _engine(model: CausalLM) -> PaddleEngine:
    return PaddleEngine(model, (), total_blocks=256, block_size=16)


def _seq(phase: str, prompt: list[int], rid: str, tokenizer: ModelTokenizer, **sampling: object) -> Sequence:
    params = SamplingParams(max_tokens=NEW_TOKENS, **sampling)  # type: ignore[arg-type]
    request = GenerateRequest(rid, "m", prompt, params, "api", 0)
    return Sequence(Task(phase, request, peer="" if phase == "mixed" else "x"), "0-0", TextStream(tokenizer, []))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in PROMPT_LENGTHS]


async def _decode_all(engine: PaddleEngine, batch: list[Sequence]) -> None:
    while len(batch[0].output_ids) < NEW_TOKENS:
        for seq, token in zip(batch, await engine.decode(batch), strict=True):
            seq.output_ids.append(token)


async def _mixed(model: CausalLM, tok: ModelTokenizer, **sampling: object) -> list[list[int]]:
    engine = _engine(model)
    batch = [_seq("mixed", p, f"r{i}", tok, **sampling) for i, p in enumerate(_prompts())]
    for seq in batch:
        assert engine.reserve(seq, seq.prompt_len + NEW_TOKENS)
    for seq, token in zip(batch, await engine.prefill(batch), strict=True):
        seq.output_ids.append(token)
    await _decode_all(engine, batch)
    return [s.output_ids for s in batch]


async def _split(model: CausalLM, tok: ModelTokenizer, **sampling: object) -> list[list[int]]:
    prefill, decode = _engine(model), _engine(model)
    decode.pool.allocate(7)  # D's block ids differ from P's
    on_p = [_seq("prefill", p, f"r{i}", tok, **sampling) for i, p in enumerate(_prompts())]
    on_d = [_seq("decode", p, f"r{i}", tok, **sampling) for i, p in enumerate(_prompts())]
    for p_seq, d_seq in zip(on_p, on_d, strict=True):
        assert prefill.reserve(p_seq, p_seq.prompt_len) and decode.reserve(d_seq, d_seq.prompt_len + NEW_TOKENS)
    for seq, token in zip(on_p, await prefill.prefill(on_p), strict=True):
        seq.output_ids.append(token)
    for p_seq, d_seq in zip(on_p, on_d, strict=True):
        assert await decode.import_kv(d_seq, await prefill.export_kv(p_seq)) is None
        d_seq.output_ids = list(p_seq.output_ids)
    await _decode_all(decode, on_d)
    return [s.output_ids for s in on_d]


def _recompute(model: CausalLM) -> list[list[int]]:
    outputs = []
    for prompt in _prompts():
        tokens: list[int] = []
        for _ in range(NEW_TOKENS):
            tokens.append(int(np.argmax(model.forward([Chunk(prompt + tokens, 0)])[0])))
        outputs.append(tokens)
    return outputs


def test_greedy_tokens_match_across_paths(model: CausalLM, model_dir: Path) -> None:
    tok = ModelTokenizer.load(model_dir)
    mixed = asyncio.run(_mixed(model, tok, temperature=0.0))
    split = asyncio.run(_split(model, tok, temperature=0.0))
    assert split == mixed == _recompute(model)


def test_idle_forwards_between_steps_change_no_request(model: CausalLM, model_dir: Path) -> None:
    """A DP rank runs idle forwards while its group steps (before its work comes, between its
    decodes): they touch only the scratch block, so no request's tokens or blocks change."""
    tok = ModelTokenizer.load(model_dir)
    engine = _engine(model)
    free = engine.free_blocks
    asyncio.run(engine.idle())
    assert engine.free_blocks == free == engine.total_blocks
    batch = [_seq("mixed", p, f"r{i}", tok, temperature=0.0) for i, p in enumerate(_prompts())]
    for seq in batch:
        assert engine.reserve(seq, seq.prompt_len + NEW_TOKENS)
    held = engine.free_blocks

    async def steps_with_idles() -> None:
        await engine.idle()
        for seq, token in zip(batch, await engine.prefill(batch), strict=True):
            seq.output_ids.append(token)
        while len(batch[0].output_ids) < NEW_TOKENS:
            await engine.idle()
            for seq, token in zip(batch, await engine.decode(batch), strict=True):
                seq.output_ids.append(token)

    asyncio.run(steps_with_idles())
    assert [s.output_ids for s in batch] == asyncio.run(_mixed(model, tok, temperature=0.0))
    assert engine.free_blocks == held
    for seq in batch:
        engine.release(seq)
    assert engine.free_blocks == free


def test_seeded_sampling_survives_the_move(model: CausalLM, model_dir: Path) -> None:
    tok = ModelTokenizer.load(model_dir)
    params = dict(temperature=0.9, top_k=40, top_p=0.95, seed=123)
    mixed = asyncio.run(_mixed(model, tok, **params))
    assert asyncio.run(_split(model, tok, **params)) == mixed
    assert len({tuple(t) for t in mixed}) == len(mixed)  # the draws really vary


def test_logits_processors_hold_across_the_move(model: CausalLM, model_dir: Path) -> None:
    """Penalties and a bias read only the request, its prompt and the tokens so far: D, taking
    over from P, draws what a mixed worker and a full recompute do, and they change the draws."""
    tok = ModelTokenizer.load(model_dir)
    bias = {str(t): -5.0 for t in range(0, 256, 3)}
    options = dict(repetition_penalty=1.8, frequency_penalty=0.5, presence_penalty=0.3, logit_bias=bias)
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, **options)  # type: ignore[arg-type]
    expected = []
    for prompt in _prompts():
        tokens: list[int] = []
        for _ in range(NEW_TOKENS):
            row = model.forward([Chunk(prompt + tokens, 0)])[0]
            tokens.append(int(np.argmax(process(row, sampling, prompt, tokens, ()))))
        expected.append(tokens)
    mixed = asyncio.run(_mixed(model, tok, temperature=0.0, **options))
    assert asyncio.run(_split(model, tok, temperature=0.0, **options)) == mixed == expected
    assert mixed != _recompute(model)


def test_a_moved_request_continues_exactly_from_the_tokens_it_had_streamed(model: CausalLM, model_dir: Path) -> None:
    """A request moved after streaming tokens: its new P prefills the prompt and those tokens,
    and its new D imports that KV (the prompt's length and the streamed tokens': the import
    counted the prompt only and refused every such cache) and decodes on from there."""
    tok, expected = ModelTokenizer.load(model_dir), _recompute(model)
    prefill, decode = _engine(model), _engine(model)

    async def move(i: int, prompt: list[int], streamed: int) -> list[int]:
        p_seq, d_seq = (_seq(phase, prompt, f"r{i}", tok, temperature=0.0) for phase in ("prefill", "decode"))
        for seq in (p_seq, d_seq):  # the reaper's new tasks carry what was streamed
            seq.task.output_token_ids = expected[i][:streamed]
            seq.output_ids = list(seq.task.output_token_ids)
        assert prefill.reserve(p_seq, len(p_seq.all_tokens)) and decode.reserve(d_seq, p_seq.prompt_len + NEW_TOKENS)
        p_seq.output_ids += await prefill.prefill([p_seq])
        assert await decode.import_kv(d_seq, await prefill.export_kv(p_seq)) is None
        d_seq.output_ids = list(p_seq.output_ids)
        await _decode_all(decode, [d_seq])
        return d_seq.output_ids

    for i, prompt in enumerate(_prompts()):
        assert asyncio.run(move(i, prompt, streamed=3 + i)) == expected[i]


def test_paged_and_contiguous_logits_agree(model: CausalLM) -> None:
    cache = model.new_cache(64, 16)
    for prompt in _prompts():
        table = cache.allocator.allocate(-(-len(prompt) // 16))
        assert table is not None
        if len(prompt) > 1:  # all but the last token first, so the last attends over the cache
            model.forward([Chunk(prompt[:-1], 0, table)], cache)
        paged = model.forward([Chunk(prompt[-1:], len(prompt) - 1, table)], cache)
        np.testing.assert_allclose(paged[0], model.forward([Chunk(prompt, 0)])[0], atol=1e-4)
        cache.allocator.release(table)


def _broken(tmp_path: Path, model_dir: Path) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(model_dir, folder)
    return folder


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda f: (f / "config.json").unlink(), "config.json is missing"),
        (lambda f: (f / "model.safetensors").unlink(), "holds no *.safetensors file"),
        (lambda f: _edit_config(f, architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
        (lambda f: _edit_config(f, intermediate_size=100), "expected [100, 256]"),
        (lambda f: _edit_config(f, num_hidden_layers=9), "missing tensor model.layers.4."),
        (lambda f: (f / "model.safetensors").write_bytes(b"not a safetensors file"), "cannot be read"),
    ],
)
def test_bad_model_folders_fail_at_load_naming_the_problem(
    tmp_path: Path, model_dir: Path, breakage: object, message: str
) -> None:
    folder = _broken(tmp_path, model_dir)
    breakage(folder)  # type: ignore[operator]
    with pytest.raises(ModelFilesError) as info:
        load_model(folder)
    assert message in str(info.value)


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


async def _greedy_pair(engine: PaddleEngine, tok: ModelTokenizer, prompts: list[list[int]]) -> list[Sequence]:
    done = []
    for i, prompt in enumerate(prompts):
        seq = _seq("mixed", prompt, f"p{i}", tok, temperature=0.0)
        assert engine.reserve(seq, seq.prompt_len + NEW_TOKENS)
        seq.output_ids.append((await engine.prefill([seq]))[0])
        await _decode_all(engine, [seq])
        engine.release(seq)
        done.append(seq)
    return done


def test_prefix_reuse_gives_the_same_greedy_tokens(model: CausalLM, model_dir: Path) -> None:
    tok = ModelTokenizer.load(model_dir, "m")
    shared = _prompts()[-1][:40]
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    cached = asyncio.run(_greedy_pair(_engine(model), tok, prompts))
    fresh = [asyncio.run(_greedy_pair(_engine(model), tok, [p]))[0] for p in prompts]
    assert [s.output_ids for s in cached] == [s.output_ids for s in fresh]
    assert cached[1].prompt_cached == 32 and fresh[1].prompt_cached == 0  # only the suffix was prefilled


def test_the_paddle_engine_keeps_its_blocks_in_the_one_block_pool() -> None:
    assert keeps_its_blocks_in_the_one_pool(PaddleEngine)


def test_the_engine_has_the_forward_of_every_registered_architecture() -> None:
    for arch in architectures.registered():
        assert arch.forward in FORWARDS, arch.hf_name


def test_an_architecture_whose_forward_the_engine_lacks_fails_at_load(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, tmp_path: Path
) -> None:
    register_toy(monkeypatch)  # a copy of the table, restored after the test
    monkey = shutil.copytree(model_dir, tmp_path / "monkey")
    architectures.register(
        replace(TOY, hf_name="MonkeyForCausalLM", model_type="monkey", gguf_name="monkey", forward="monkey")
    )
    _edit_config(monkey, architectures=["MonkeyForCausalLM"], model_type="monkey")
    with pytest.raises(ValueError, match="the paddle engine has no forward 'monkey' for MonkeyForCausalLM"):
        load_model(monkey)


def test_a_prefill_done_again_gives_the_same_token_and_keeps_its_prompt_logprobs(
    model: CausalLM, model_dir: Path
) -> None:
    """The worker runs a prefill again when the first one's results were lost with Redis
    (``abort_prefill``): every position is cached by then, and the last one's logits are
    computed again; the prompt logprobs the first one computed are still sent."""
    tok = ModelTokenizer.load(model_dir)
    engine = _engine(model)
    batch = [_seq("mixed", p, f"r{i}", tok, logprobs=2, prompt_logprobs=3) for i, p in enumerate(_prompts())]
    for seq in batch:
        assert engine.reserve(seq, seq.prompt_len + NEW_TOKENS)
    first = asyncio.run(engine.prefill(batch))
    scored = [seq.prompt_logprobs for seq in batch]
    assert all(s is not None and len(s) == seq.prompt_len - 1 for s, seq in zip(scored, batch, strict=True))
    again = asyncio.run(engine.prefill(batch))
    assert again == first and [seq.prompt_logprobs for seq in batch] == scored


def _choice(phase: str, prompt: list[int], i: int, tok: ModelTokenizer) -> Sequence:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=700 + i)
    request = GenerateRequest(f"c-{i}", "m", prompt, params, "api", 0, choices=3, choice_group="c")
    return Sequence(Task(phase, request, peer="x"), "0-0", TextStream(tok, []))


async def _choices_forked(model: CausalLM, tok: ModelTokenizer, prompt: list[int]) -> tuple[list[list[int]], int]:
    """Three choices of one prompt: P prefills it once (twins forked from the first), D imports
    each, sharing the full blocks the first brought; (their tokens, D's blocks in use)."""
    prefill, decode = _engine(model), _engine(model)
    on_p = [_choice("prefill", prompt, i, tok) for i in range(3)]
    on_d = [_choice("decode", prompt, i, tok) for i in range(3)]
    assert prefill.reserve(on_p[0], len(prompt))
    for twin in on_p[1:]:
        prefill.fork(on_p[0], twin)
        twin.fork_of = on_p[0]
    for seq, token in zip(on_p, await prefill.prefill(on_p), strict=True):
        seq.output_ids.append(token)
    for p_seq, d_seq in zip(on_p, on_d, strict=True):
        assert decode.reserve(d_seq, d_seq.prompt_len + NEW_TOKENS)
        assert await decode.import_kv(d_seq, await prefill.export_kv(p_seq)) is None
        d_seq.output_ids = list(p_seq.output_ids)
    await _decode_all(decode, on_d)
    return [s.output_ids for s in on_d], decode.total_blocks - decode.free_blocks


async def _choices_alone(model: CausalLM, tok: ModelTokenizer, prompt: list[int]) -> list[list[int]]:
    outputs = []
    for i in range(3):
        engine = _engine(model)
        seq = _choice("mixed", prompt, i, tok)
        assert engine.reserve(seq, seq.prompt_len + NEW_TOKENS)
        seq.output_ids = await engine.prefill([seq])
        await _decode_all(engine, [seq])
        outputs.append(seq.output_ids)
    return outputs


@pytest.mark.parametrize("length", [33, 48])
def test_choices_prefilled_once_and_sharing_blocks_on_d_draw_what_each_draws_alone(
    model: CausalLM, model_dir: Path, length: int
) -> None:
    tok = ModelTokenizer.load(model_dir)
    prompt = [int(t) for t in np.random.default_rng(length).integers(0, 256, length)]
    forked, used = asyncio.run(_choices_forked(model, tok, prompt))
    assert forked == asyncio.run(_choices_alone(model, tok, prompt))
    assert len({tuple(t) for t in forked}) == 3  # the draws really vary
    # Each choice holds prompt + NEW_TOKENS positions; the prompt's full blocks but the last token's
    # are held once: 33 -> 2 shared, 48 -> 2 (the block holding position 47 is each one's own).
    own = -(-(length + NEW_TOKENS) // 16)
    assert used == 3 * own - 2 * ((length - 1) // 16)


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_mixed_batch_draws_in_one_batch_what_each_request_draws_alone(
    model: CausalLM, model_dir: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy, sampled, top-k/top-p, penalised and logprob-asking requests in one step: the batch
    sampler's tokens are the per-request reference's (processors on the raw row, then ``sample``),
    and only the requests that asked get logprobs, of the raw row. ``device``: the Paddle ops a
    GPU's logits take, with the processed rows uploaded into the batch (run here on the CPU)."""
    if where == "device":
        monkeypatch.setattr(
            engine_module, "sample_batch", lambda logits, draws, rows: sample_on_device(logits, draws, rows)
        )
    tok = ModelTokenizer.load(model_dir)
    options: list[dict[str, object]] = [
        dict(temperature=0.0),
        dict(temperature=0.9, seed=4),
        dict(temperature=1.2, top_k=7, top_p=0.8, seed=5, logprobs=2),
        dict(temperature=0.7, repetition_penalty=1.5, logit_bias={"3": 9.0}, seed=6),
        dict(temperature=0.0, frequency_penalty=2.0, logprobs=0),
    ]
    batch = [_seq("mixed", p, f"r{i}", tok, **o) for i, (p, o) in enumerate(zip(_prompts(), options, strict=True))]
    for seq in batch:
        seq.output_ids = [3, 3, 8]
    logits = np.random.default_rng(8).normal(0, 2, (len(batch), model.config.vocab_size)).astype(np.float32)
    tokens = _engine(model)._sample(batch, paddle.to_tensor(logits))
    for seq, row, token in zip(batch, logits, tokens, strict=True):
        s = seq.request.sampling
        processed = process(row, s, seq.request.prompt_token_ids, seq.output_ids, ())
        assert token == sample(processed, s.temperature, s.top_k, s.top_p, seq.seed, 3, s.min_p)
        assert (seq.logprobs is None) == (s.logprobs is None)
    chosen, _, _ = log_softmax_top(logits[2:3], np.array([tokens[2]]), 2)
    assert batch[2].logprobs is not None and batch[2].logprobs.token[0] == pytest.approx(chosen[0])


def test_bf16_logits_come_to_the_host_as_their_values_not_their_bits(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU's logits are bf16; what comes of them to the host (the rows a request's logprobs,
    processors or grammar need, ``forward``'s logits, the prompt's logprobs) is cast to float32
    where they are: numpy has no bf16, and ``numpy()`` of one gives its raw uint16 bits."""
    bf16 = paddle.to_tensor(np.random.default_rng(11).normal(0, 3, (3, 40)).astype(np.float32)).astype("bfloat16")
    exact = bf16.astype("float32").numpy()
    rows = engine_module._host_rows(bf16, [0, 2])
    assert [rows[j].dtype for j in (0, 2)] == [np.float32] * 2
    np.testing.assert_array_equal(np.stack([rows[0], rows[2]]), exact[[0, 2]])
    prompt = _prompts()[4]
    wide = model.forward([Chunk(prompt, 0)], prompt_top={0: 3})
    scored = model.prompt_logprobs[0]
    plain = model._logits
    monkeypatch.setattr(model, "_logits", lambda x: plain(x).astype("bfloat16"))
    narrow = model.forward([Chunk(prompt, 0)], prompt_top={0: 3})
    assert narrow.dtype == np.float32
    np.testing.assert_array_equal(narrow, paddle.to_tensor(wide).astype("bfloat16").astype("float32").numpy())
    np.testing.assert_allclose(model.prompt_logprobs[0].token, scored.token, atol=0.05)  # bf16's rounding


class _OnlyEnd:
    """A grammar whose only allowed token is the end of sequence (its output is complete)."""

    def __init__(self, vocab: int, end: int) -> None:
        self.vocab, self.end = vocab, end

    def allowed(self) -> np.ndarray:
        allowed = np.zeros(self.vocab, dtype=bool)
        allowed[self.end] = True
        return allowed


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_request_whose_every_token_is_masked_gets_its_raw_rows_argmax(
    model: CausalLM, model_dir: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``min_tokens`` holds back the end of sequence, the only token the grammar allows: the row
    has nothing to draw from. Greedy or sampled, on either path, its token is the argmax of its
    raw row (a token the grammar refused: it ends the request)."""
    if where == "device":
        monkeypatch.setattr(
            engine_module, "sample_batch", lambda logits, draws, rows: sample_on_device(logits, draws, rows)
        )
    tok = ModelTokenizer.load(model_dir)
    vocab, end = model.config.vocab_size, 5
    batch = [
        _seq("mixed", p, f"r{i}", tok, temperature=t, seed=i, min_tokens=3)
        for i, (p, t) in enumerate(zip(_prompts()[:2], (0.0, 1.0), strict=True))
    ]
    for seq in batch:
        seq.grammar = _OnlyEnd(vocab, end)  # type: ignore[assignment]
    logits = np.random.default_rng(12).normal(0, 2, (2, vocab)).astype(np.float32)
    tokens = PaddleEngine(model, (end,), total_blocks=256, block_size=16)._sample(batch, paddle.to_tensor(logits))
    assert tokens == np.argmax(logits, axis=1).tolist() and end not in tokens
