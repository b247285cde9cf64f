"""`splitbus up --engine sim`, P and D: its tokens are letters drawn from the seed, with no
logits, so of the sampling parameters on the logits only stop_token_ids and min_tokens act there;
they act through the worker's stop check, on P and D alike (min_tokens on stop strings too)."""

from __future__ import annotations

import openai

from splitbus.tokenization.byte_level import byte_level_tokenizer
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System

SEED, NEW = 5, 30


def test_stop_token_ids_end_and_min_tokens_holds_them_off(system: System) -> None:
    client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
    text = sim_text(SEED, NEW)
    letter = next(c for c in text if text.count(c) >= 2)  # a letter drawn twice: a stop, then one held off
    first, second = text.index(letter), text.index(letter, text.index(letter) + 1)
    stop = {"stop_token_ids": [byte_level_tokenizer().encode(letter).ids[0]]}
    for min_tokens, shown in ((0, first), (first, first), (first + 1, second)):
        reply = client.completions.create(
            model="tiny", prompt="x", max_tokens=NEW, seed=SEED, extra_body={**stop, "min_tokens": min_tokens}
        )
        assert reply.choices[0].text == text[:shown] and reply.choices[0].finish_reason == "stop"
        assert reply.usage is not None and reply.usage.completion_tokens == shown + 1
    held_string = client.completions.create(
        model="tiny", prompt="x", max_tokens=NEW, seed=SEED, stop=[letter], extra_body={"min_tokens": first + 1}
    )
    assert held_string.choices[0].text == text[:second] and held_string.choices[0].finish_reason == "stop"
    penalized = client.completions.create(
        model="tiny", prompt="x", max_tokens=NEW, seed=SEED, presence_penalty=2, logit_bias={"97": -100}
    )
    assert penalized.choices[0].text == text  # no logits: nothing to penalize (docs/api.md)
