"""The simulated engine: models time and KV size, emits deterministic tokens.

A token depends only on the request's seed and its position, so a request that moves to
another worker continues the same sequence, and tests know every token in advance.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import zlib

from splitbus.bus.messages import GenerateRequest
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.config import SimConfig
from splitbus.worker.sequence import Sequence

ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def request_seed(request: GenerateRequest) -> int:
    seed = request.sampling.seed
    return seed if seed is not None else zlib.crc32(request.request_id.encode())


def sim_token(token_ids: list[int], seed: int, position: int) -> int:
    return token_ids[random.Random(seed * 1_000_003 + position).randrange(len(token_ids))]


def sim_text(seed: int, count: int) -> str:
    """The text the sim engine generates for ``count`` tokens (what tests expect)."""
    return "".join(ALPHABET[random.Random(seed * 1_000_003 + i).randrange(len(ALPHABET))] for i in range(count))


class SimEngine:
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, config: SimConfig, tokenizer: ModelTokenizer) -> None:
        self.config = config
        self.token_ids = [tokenizer.encode(c)[0] for c in ALPHABET]

    async def prefill(self, batch: list[Sequence]) -> None:
        """Compute each sequence's KV and sample its next token."""
        await asyncio.sleep(self.config.prefill_s_per_token * sum(s.prompt_len for s in batch))
        for seq in batch:
            seq.kv = self.kv_payload(seq.request)

    async def decode(self, batch: list[Sequence]) -> None:
        """One step: the time of a batched forward pass."""
        await asyncio.sleep(self.config.decode_step_s + self.config.decode_s_per_seq * len(batch))

    def next_token(self, seq: Sequence) -> int:
        return sim_token(self.token_ids, request_seed(seq.request), len(seq.output_ids))

    def kv_payload(self, request: GenerateRequest) -> bytes:
        """KV bytes of a realistic size, derived from the request so the receiver can check them."""
        size = len(request.prompt_token_ids) * self.config.kv_bytes_per_token
        block = hashlib.blake2b(request.request_id.encode(), digest_size=64).digest()
        return (block * (size // len(block) + 1))[:size]

    def import_kv(self, seq: Sequence, payload: bytes) -> str | None:
        """Take a transferred KV cache; returns why it is refused, or None."""
        if payload != self.kv_payload(seq.request):
            return f"KV payload of {len(payload)} bytes does not match the request"
        seq.kv = payload
        return None
