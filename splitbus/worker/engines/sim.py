"""The simulated engine: models time and KV size, emits deterministic tokens.

A token depends only on the request's seed and its position, so a request that moves to
another worker continues the same sequence, and tests know every token in advance. Its logprobs
come from a made-up model (``sim_logprobs``): half the probability on the token it draws, the
rest spread evenly over the vocabulary's other tokens; a prompt's tokens are uniform.

Its cost model (``SimConfig``) also stands for EP when its workers are the ranks of a DP group:
a group step lasts as long as the slowest rank's compute plus an all-to-all that grows with
the most tokens any rank puts through the step (``group_step_s``); docs/dp.md, "EP cost model".
The simulation behind ``splitbus bench stagger`` uses the same functions.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import random
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitbus.worker.engines import Capabilities, EngineSetup, EngineType, register
from splitbus.worker.engines.prefix import PagedBlocks
from splitbus.worker.twins import computing

if TYPE_CHECKING:  # types only: the registry imports this module to build the CLI's parser
    from splitbus.bus.messages import GenerateRequest, Logprobs
    from splitbus.tokenization import ModelTokenizer
    from splitbus.worker.sequence import Sequence

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
CLOSERS = '"}]'
"""Under a grammar, the characters that end a JSON string or container (``grammar.choose``)."""
DEFAULT_KV_BLOCKS = 8192
"""Its KV blocks without ``--kv-blocks``: it holds no memory, so no budget sizes them."""


@dataclass(frozen=True)
class SimConfig:
    """Cost model of the simulated engine (time is slept, not computed)."""

    prefill_s_per_token: float = 0.00005
    decode_step_s: float = 0.004
    decode_s_per_seq: float = 0.0001
    kv_bytes_per_token: int = 4096
    """Bytes shipped from P to D per prompt token (Qwen2.5-0.5B in bf16 holds ~12 KiB)."""
    poison_token: int = -1
    """Fault injection: a step that holds a request whose prompt contains this token raises."""
    crash_token: int = -1
    """Fault injection: a prefill of a prompt holding this token kills the process (SIGKILL), as
    a segfault or the kernel's OOM killer would: no exception, nothing acked."""
    a2a_s: float = 0.015
    """DP groups only: the fixed part of a group step's EP all-to-all (dispatch and combine of
    every MoE layer); a worker on its own has none. The default is about two thirds of a group's
    decode step (32 sequences a rank): the large-EP end of what DeepEP's published decode kernels
    take of a DeepSeek-V3 decode step (docs/dp.md, "EP cost model")."""
    a2a_s_per_token: float = 0.000005
    """DP groups only: the all-to-all's part per token of the rank that puts the most through
    the step (every rank waits for the largest). The default, a tenth of a prefill token's
    compute, is an assumption for what the overlap of two micro-batches leaves exposed."""

    def __post_init__(self) -> None:
        costs = (self.prefill_s_per_token, self.decode_step_s, self.decode_s_per_seq, self.a2a_s, self.a2a_s_per_token)
        if min(costs) < 0 or self.kv_bytes_per_token < 1:
            raise ValueError("sim costs must be >= 0 and kv_bytes_per_token >= 1")

    def forward_s(self, action: str, tokens: int) -> float:
        """One rank's compute in a step, by what it does there (``worker.dp.decide``): a prefill of
        ``tokens`` prompt tokens, a decode of ``tokens`` sequences, an idle forward (it still
        joins the collective) or nothing (``none``: the group does not step)."""
        if action == "prefill":
            return self.prefill_s_per_token * tokens
        if action == "decode":
            return self.decode_step_s + self.decode_s_per_seq * tokens
        return self.decode_step_s if action == "idle" else 0.0

    def all_to_all_s(self, tokens_by_rank: Iterable[int]) -> float:
        """The all-to-all of a group step whose ranks put these tokens through it: every rank
        sends to and receives from every other, so all wait for the rank with the most."""
        return self.a2a_s + self.a2a_s_per_token * max(tokens_by_rank, default=0)

    def group_step_s(self, forwards: Iterable[tuple[str, int]]) -> float:
        """How long a DP group's step lasts, for every rank: the slowest rank's compute plus the
        all-to-all. ``forwards``: each rank's (action, tokens), tokens being its prefill tokens
        or its decode batch size (0 for an idle forward). 0 when no rank steps."""
        stepping = [(action, tokens) for action, tokens in forwards if action != "none"]
        if not stepping:
            return 0.0
        return max(self.forward_s(a, t) for a, t in stepping) + self.all_to_all_s(t for _, t in stepping)


def _draw(seed: int, position: int) -> int:
    return random.Random(seed * 1_000_003 + position).randrange(len(ALPHABET))


def _unit(seed: int, position: int) -> float:
    """A second draw for (seed, position), uniform in [0, 1): a constrained request's choice."""
    return random.Random(seed * 1_000_003 + position + 2**61).random()


def sim_text(seed: int, count: int) -> str:
    """The text the sim engine generates for ``count`` tokens (what tests expect)."""
    return "".join(ALPHABET[_draw(seed, i)] for i in range(count))


def sim_logprobs(token: int, vocab: int, k: int) -> Logprobs:
    """The sim model's logprobs at a generated position that drew ``token`` (of ``vocab``): half
    the probability on it, the rest evenly on the others; its top ``k``: the token, then the
    others by id."""
    from splitbus.bus.messages import Logprobs

    drawn, other = math.log(0.5), math.log(0.5 / max(vocab - 1, 1))
    rest = [t for t in range(min(k, vocab)) if t != token][: max(k - 1, 0)]
    top = [token, *rest][:k]
    return Logprobs([drawn], [top], [[drawn] + [other] * (len(top) - 1)])


def sim_prompt_logprobs(prompt: list[int], vocab: int, k: int) -> Logprobs:
    """The sim model's logprobs of a prompt's tokens after the first: uniform; top ``k``: the
    lowest ids."""
    from splitbus.bus.messages import Logprobs

    even, n = -math.log(vocab), len(prompt) - 1
    top = list(range(min(k, vocab)))
    return Logprobs([even] * n, [top] * n, [[even] * len(top)] * n)


class SimEngine(PagedBlocks):
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, config: SimConfig, tokenizer: ModelTokenizer, total_blocks: int, block_size: int) -> None:
        super().__init__(range(total_blocks), block_size)
        self.config = config
        self.token_ids = [tokenizer.encode(c)[0] for c in ALPHABET]
        self.closers = tuple(tokenizer.encode(c)[0] for c in CLOSERS)
        self.vocab_size = tokenizer.vocab_size

    def kv_capacity(self, seq: Sequence) -> int:
        return seq.blocks * self.block_size * self.config.kv_bytes_per_token

    def _check_poison(self, batch: list[Sequence]) -> None:
        poison = self.config.poison_token
        if poison >= 0 and any(poison in s.request.prompt_token_ids for s in batch):
            raise RuntimeError(f"sim engine: poison token {poison} in the batch")

    async def prefill(self, batch: list[Sequence]) -> list[int]:
        self._check_poison(batch)
        self.take_new_hits(batch)
        if self.config.crash_token >= 0 and any(self.config.crash_token in s.request.prompt_token_ids for s in batch):
            os.kill(os.getpid(), signal.SIGKILL)
        # Only the uncached suffix is computed (``reserve`` found the cached prefix), once for twins.
        own, _ = computing(batch)
        await asyncio.sleep(self.config.forward_s("prefill", sum(len(s.all_tokens) - s.cached for s in own)))
        for seq in batch:
            if (k := seq.prompt_top()) is not None:
                seq.prompt_logprobs = sim_prompt_logprobs(seq.request.prompt_token_ids, self.vocab_size, k)
            seq.kv = self.kv_payload(seq.request)
            seq.cached = len(seq.all_tokens)
        self.store_computed(batch)
        return [self._next(seq) for seq in batch]

    async def decode(self, batch: list[Sequence]) -> list[int]:
        self._check_poison(batch)
        await asyncio.sleep(self.config.forward_s("decode", len(batch)))
        for seq in batch:
            seq.cached += 1  # the token fed now has its KV
        return [self._next(seq) for seq in batch]

    async def idle(self) -> None:
        await asyncio.sleep(self.config.forward_s("idle", 0))

    def group_step_s(self, forwards: Iterable[tuple[str, int]]) -> float:
        """How long the step of a DP group of sim ranks lasts (``SimConfig.group_step_s``)."""
        return self.config.group_step_s(forwards)

    def _next(self, seq: Sequence) -> int:
        own = self.token_ids[_draw(seq.seed, len(seq.output_ids))]
        token = own if seq.grammar is None else self._constrained(seq, own)
        if (k := seq.request.sampling.logprobs) is not None:
            seq.logprobs = sim_logprobs(token, self.vocab_size, k)
        return token

    def _constrained(self, seq: Sequence, own: int) -> int:
        """Its own token if the grammar allows it, else one the grammar allows (``choose``)."""
        from splitbus.grammar.constraint import choose  # here: the CLI's parser imports this module

        assert seq.grammar is not None
        return choose(seq.grammar, own, self.closers, _unit(seq.seed, len(seq.output_ids)))

    def kv_payload(self, request: GenerateRequest) -> bytes:
        """KV bytes of a realistic size, derived from the request so the receiver can check them."""
        size = len(request.prompt_token_ids) * self.config.kv_bytes_per_token
        block = hashlib.blake2b(request.request_id.encode(), digest_size=64).digest()
        return (block * (size // len(block) + 1))[:size]

    async def export_kv(self, seq: Sequence) -> bytes:
        return seq.kv or self.kv_payload(seq.request)

    async def import_kv(self, seq: Sequence, payload: bytes) -> str | None:
        if payload != self.kv_payload(seq.request):
            return f"KV payload of {len(payload)} bytes does not match the request"
        self.share_imported(seq, seq.prompt_len)  # blocks are ids here: the sharing is all there is
        self.store_imported(seq, seq.prompt_len)
        seq.cached = seq.prompt_len
        return None


@register
class SimType(EngineType):
    name = "sim"
    capabilities = Capabilities(simulated_group=True)
    kv_blocks_default = str(DEFAULT_KV_BLOCKS)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sim-prefill-us-per-token", type=float, default=50.0)
        parser.add_argument("--sim-decode-step-ms", type=float, default=4.0)
        parser.add_argument(
            "--sim-decode-us-per-seq", type=float, default=100.0, help="added to a decode step per running sequence"
        )
        parser.add_argument("--sim-kv-bytes-per-token", type=int, default=4096)
        parser.add_argument(
            "--sim-ep-a2a-ms",
            type=float,
            default=SimConfig.a2a_s * 1e3,
            help="DP groups only: the fixed part of a group step's EP all-to-all",
        )
        parser.add_argument(
            "--sim-ep-a2a-us-per-token",
            type=float,
            default=SimConfig.a2a_s_per_token * 1e6,
            help="DP groups only: added to the all-to-all per token of the rank with the most in the step",
        )
        parser.add_argument(
            "--sim-poison-token",
            type=int,
            default=-1,
            help="fault injection: fail any step holding a prompt with this token",
        )
        parser.add_argument(
            "--sim-crash-token", type=int, default=-1, help="fault injection: SIGKILL on a prompt with this token"
        )

    def options_from(self, args: argparse.Namespace) -> SimConfig:
        return SimConfig(
            args.sim_prefill_us_per_token / 1e6,
            args.sim_decode_step_ms / 1e3,
            args.sim_decode_us_per_seq / 1e6,
            kv_bytes_per_token=args.sim_kv_bytes_per_token,
            poison_token=args.sim_poison_token,
            crash_token=args.sim_crash_token,
            a2a_s=args.sim_ep_a2a_ms / 1e3,
            a2a_s_per_token=args.sim_ep_a2a_us_per_token / 1e6,
        )

    def create(self, setup: EngineSetup) -> SimEngine:
        options = setup.options if setup.options is not None else SimConfig()
        if not isinstance(options, SimConfig):
            raise TypeError(f"the sim engine takes a SimConfig, not {type(options).__name__}")
        return SimEngine(options, setup.tokenizer, setup.kv_blocks or DEFAULT_KV_BLOCKS, setup.block_size)
