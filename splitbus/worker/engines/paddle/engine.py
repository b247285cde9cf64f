"""The Paddle engine: a CausalLM, a paged KV cache, counter-based sampling.

All Paddle work runs on one dedicated thread, in order: forwards, KV export and import never
overlap, and the worker's event loop stays free for heartbeats and transfers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import paddle

from splitbus.bus.records import ExpertLoad
from splitbus.gpu_ops import logits as processors
from splitbus.gpu_ops.sampling import Draws, on_host, sample_batch
from splitbus.grammar.constraint import mask_logits
from splitbus.worker.engines.paddle import logprobs
from splitbus.worker.engines.paddle.dtypes import compute_dtype
from splitbus.worker.engines.paddle.model import CausalLM, Chunk, load_model
from splitbus.worker.engines.prefix import PagedBlocks
from splitbus.worker.sequence import Sequence
from splitbus.worker.twins import computing

log = logging.getLogger(__name__)
T = TypeVar("T")


class PaddleEngine(PagedBlocks):
    def __init__(self, model: CausalLM, eos_token_ids: tuple[int, ...], total_blocks: int, block_size: int) -> None:
        super().__init__(range(1, total_blocks), block_size)  # block 0 is the cache's scratch block
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.config.vocab_size
        self.cache = model.new_cache(total_blocks, block_size)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="paddle")
        self._weight_bytes = model.weight_bytes() if model.held else (0, 0)
        self._expert_tokens = (np.zeros(len(model.held), dtype=np.int64),) * 2
        """Tokens each held expert took (in the last forward, since the start): replaced whole once
        a forward ends, on the Paddle thread, so that a load report on the event loop never reads
        the model's counts of a forward half done."""

    @classmethod
    def load(
        cls,
        folder: Path,
        eos_token_ids: tuple[int, ...],
        total_blocks: int | Callable[[str], int],
        block_size: int,
        threads: int = 1,
        shard: tuple[int, int] = (0, 1),
        spec: str = "auto",
        kernels: str = "auto",
    ) -> PaddleEngine:
        """The engine on the device ``spec`` (``--device``), in its ``dtypes.compute_dtype``; its
        KV blocks given, or counted by ``total_blocks(device)`` once the weights are loaded;
        ``kernels``: ``splitbus.gpu_ops.kernels.KERNELS``'s name (``--paddle-kernels``)."""
        from splitbus.gpu_ops import device

        where = device.select_device(threads, spec)
        model = load_model(folder, shard, compute_dtype(where), kernels)
        device.release_unused_memory()
        log.info(
            "loaded %s (%s, %d layers) on %s, %s, kernels: %s",
            folder, model.config.arch, model.config.layers, where, model.dtype, model.kernels.name,
        )  # fmt: skip
        if model.held:
            dense, experts = model.weight_bytes()
            log.info(
                "rank %d of %d holds experts %d-%d of %d in each MoE layer: %.1f MiB of weights "
                "(attention, embeddings and dense layers %.1f MiB, its experts %.1f MiB)",
                *shard, model.held.start, model.held.stop - 1, len(model.expert_tokens),
                (dense + experts) / 2**20, dense / 2**20, experts / 2**20,
            )  # fmt: skip
        blocks = total_blocks if isinstance(total_blocks, int) else total_blocks(where)
        return cls(model, eos_token_ids, blocks, block_size)

    async def form_expert_group(self, host: str, port: int, rank: int, size: int, timeout_s: float) -> None:
        from splitbus.gpu_ops.expert_parallel import ExpertGroup, Rendezvous

        meet = Rendezvous(host, port, rank, size, max(1, int(timeout_s)))
        self.model.group = await self._run(lambda: ExpertGroup.form(meet))

    def expert_load(self) -> ExpertLoad | None:
        held = self.model.held
        if not held:
            return None
        last, total = self._expert_tokens
        experts = len(self.model.expert_tokens)
        return ExpertLoad(
            experts, (held.start, held.stop), tuple(last.tolist()), tuple(total.tolist()), self._weight_bytes
        )

    def kv_capacity(self, seq: Sequence) -> int:
        return seq.blocks * self.block_size * self.cache.bytes_per_token()

    async def prefill(self, batch: list[Sequence]) -> list[int]:
        self.take_new_hits(batch)  # before the forward reads the block tables
        tokens = await self._run(lambda: self._prefill(batch))
        self.store_computed(batch)  # on the event loop, as reserve and release: the pool has one thread
        return tokens

    async def decode(self, batch: list[Sequence]) -> list[int]:
        return await self._run(lambda: self._decode(batch))

    async def idle(self) -> None:
        # One token at position 0 of block 0, the scratch block: computes, stores nothing (under
        # expert parallelism it also joins every MoE layer's exchange, as a forward must), and
        # counts in no expert's load.
        await self._run(lambda: self._forward([Chunk([0], 0, [0])], counted=False))

    async def export_kv(self, seq: Sequence) -> bytes:
        return await self._run(lambda: self.cache.export(seq.block_table, seq.cached))

    async def import_kv(self, seq: Sequence, payload: bytes) -> str | None:
        # P computed the prompt and the tokens a moved request had streamed before (its task's
        # output_token_ids); the token P generated has no KV yet: D's first decode computes it.
        length = len(seq.request.prompt_token_ids) + len(seq.task.output_token_ids)
        if len(payload) != length * self.cache.bytes_per_token():  # before blocks change hands
            return f"KV payload has {len(payload)} bytes, expected {length * self.cache.bytes_per_token()}"
        shared = self.share_imported(seq, length)  # on the event loop, as reserve: the pool has one thread
        await self._run(lambda: self.cache.import_(seq.block_table, length, payload, start=shared))
        self.store_imported(seq, length)
        seq.cached = length
        return None

    def _prefill(self, batch: list[Sequence]) -> list[int]:
        # Only the uncached suffix: positions [0, seq.cached) came from the prefix cache, and the
        # attention reads them from the block table (its mask is aligned for a query offset). At
        # least the last token: a prefill done once already (its results then lost with Redis:
        # ``abort_prefill``) has it all cached, and needs its logits again.
        # Twins forked from one in the batch are not computed: they draw from its row.
        own, rows = computing(batch)
        starts = [min(seq.cached, len(seq.all_tokens) - 1) for seq in own]
        chunks = [Chunk(seq.all_tokens[a:], a, seq.block_table) for seq, a in zip(own, starts, strict=True)]
        wanted = {j: k for j, seq in enumerate(own) if (k := seq.prompt_top()) is not None}
        logits = self._forward(chunks, prompt_top=wanted)
        for seq, j in zip(batch, rows, strict=True):
            if j in wanted:  # a prefill done again keeps what the first one computed
                seq.prompt_logprobs = self.model.prompt_logprobs[j]
        for seq in batch:
            seq.cached = len(seq.all_tokens)
        if rows != list(range(len(own))):  # twins draw from their leader's row
            logits = paddle.index_select(logits, paddle.to_tensor(rows, dtype="int64"))
        return self._sample(batch, logits)

    def _decode(self, batch: list[Sequence]) -> list[int]:
        chunks = [Chunk([seq.output_ids[-1]], seq.cached, seq.block_table) for seq in batch]
        logits = self._forward(chunks)
        for seq in batch:
            seq.cached += 1
        return self._sample(batch, logits)

    def _forward(
        self, chunks: list[Chunk], counted: bool = True, prompt_top: dict[int, int] | None = None
    ) -> paddle.Tensor:
        logits = self.model.run(chunks, self.cache, counted, prompt_top)
        held = self.model.held
        last = self.model.expert_tokens[held.start : held.stop].copy()
        self._expert_tokens = (last, self._expert_tokens[1] + last)
        return logits

    def _sample(self, batch: list[Sequence], logits: paddle.Tensor) -> list[int]:
        """The batch's next tokens, drawn where the logits are (``sample_batch``). Only the rows
        that need the host come to it: a request's raw logits for its logprobs, and those its
        processors or grammar change, which go back processed; the tokens come back as one array."""
        raw = _host_rows(logits, [j for j, seq in enumerate(batch) if self._on_host(seq)])
        processed = {j: self._processed(batch[j], row) for j, row in raw.items() if _changed(batch[j])}
        seeds, steps = [seq.seed for seq in batch], [len(seq.output_ids) for seq in batch]
        draws = Draws.of([seq.request.sampling for seq in batch], seeds, steps)
        tokens = sample_batch(logits, draws, processed).tolist()
        for j, row in raw.items():
            logprobs.sampled(batch[j], row, tokens[j])  # of the raw logits, before any processor or mask
        return tokens

    @staticmethod
    def _on_host(seq: Sequence) -> bool:
        return seq.request.sampling.logprobs is not None or _changed(seq)

    def _processed(self, seq: Sequence, row: np.ndarray) -> np.ndarray:
        s = seq.request.sampling
        row = processors.process(row, s, seq.request.prompt_token_ids, seq.output_ids, self.eos_token_ids)
        return mask_logits(seq.grammar, row)  # structured output: what the grammar refuses is -inf

    async def _run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)


def _changed(seq: Sequence) -> bool:
    """Whether a sequence's processors or grammar change its logits this step."""
    return seq.grammar is not None or processors.active(seq.request.sampling, len(seq.output_ids))


def _host_rows(logits: paddle.Tensor, rows: list[int]) -> dict[int, np.ndarray]:
    """``logits``' rows ``rows`` on the host, by row: one gather and one copy, in float32 (bf16
    logits cast on the device: ``on_host``)."""
    if not rows:
        return {}
    values = on_host(paddle.index_select(logits, paddle.to_tensor(rows, dtype="int64")))
    return dict(zip(rows, values, strict=True))
