"""Greedy text two ways, for the paddle engine's end-to-end tests: the engine's full recompute in
this process (the reference), and `splitbus up`'s answers through the openai client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import openai

from splitbus.tokenization import ModelTokenizer
from splitbus.worker.engines.paddle.model import Chunk, load_model
from splitbus.worker.text import TextStream


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in lengths]


def reference(model_dir: Path, asked: list[list[int]], new: int) -> list[str]:
    """Each prompt's ``new`` greedy tokens, every one by a forward over the whole sequence (no KV
    cache), as text."""
    model, tok = load_model(model_dir), ModelTokenizer.load(model_dir)
    texts = []
    for prompt in asked:
        tokens: list[int] = []
        for _ in range(new):
            tokens.append(int(np.argmax(model.forward([Chunk(prompt + tokens, 0)])[0])))
        stream = TextStream(tok, [])
        texts.append("".join(stream.push([t]) for t in tokens) + stream.flush())
    return texts


async def ask_all(v1: str, asked: list[list[int]], new: int) -> list[str]:
    """The served model's greedy completions of ``asked``, all at once: prefilled and decoded in
    shared batches."""
    client = openai.AsyncOpenAI(base_url=v1, api_key="x", max_retries=0, timeout=120)

    async def one(prompt: list[int]) -> str:
        reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=new, temperature=0)
        return reply.choices[0].text

    try:
        return await asyncio.gather(*(one(p) for p in asked))
    finally:
        await client.close()
