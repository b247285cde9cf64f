"""The real SmolLM2-135M-Instruct file served by ``splitbus up`` through one prefill and one
decode paddle worker (KV over TCP), asked through the ``openai`` client: the answer names Paris
and ends on EOS. Skipped when ``splitbus fetch-model smollm2`` has not put the file in the data
folder (``.ci/run`` does)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from splitbus.bus.core.keys import Keys
from splitbus.env import load_env
from splitbus.model_files.fetch import SOURCES, fetched_path
from tests.e2e.conftest import System, start_system, stop_system

GGUF = fetched_path(SOURCES["smollm2"], load_env().data_dir / "models")
NAME = "SmolLM2-135M-Instruct.Q4_1"  # the file's stem: up's served name when none is given
QUESTION = "What is the capital of France?"
SPECIAL = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
ROLES = (("prefill", 0), ("decode", 1))
"""Which counter shows each worker's part: prefills_done for P, decodes_done for D."""


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} is absent: `splitbus fetch-model smollm2` puts it there")
    data_dir = tmp_path_factory.mktemp("smollm2")
    # The converted folder (~515 MB, seconds to make) is cached beside the fetched file, keyed by
    # its sha256: only the first run in a clone converts; Redis and the rest stay in tmp.
    (data_dir / "models").symlink_to(GGUF.parent.parent.resolve(), target_is_directory=True)
    running = start_system(data_dir, "--engine", "paddle", "--model", str(GGUF), "--prefill", "1", "--decode", "1")
    yield running
    assert stop_system(running) == []


def _ask(system: System) -> tuple[str, str | None, int]:
    """The streamed answer's text, its finish reason and its completion token count."""
    client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, used = [], None, 0
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    client.close()
    return "".join(text), finish, used


def _work_done(system: System) -> dict[str, tuple[int, int]]:
    """Per role, (prefills_done, decodes_done) as the workers' heartbeats (every 0.5 s) report them."""
    r, keys = system.redis(), Keys()  # the system uses the default prefix and cell
    records = [r.hgetall(keys.worker(wid)) for wid in r.zrange(keys.workers, 0, -1)]
    return {h["role"]: (int(h["prefills_done"]), int(h["decodes_done"])) for h in records}


def test_capital_of_france_through_p_and_d(smollm2: System) -> None:
    text, finish, used = _ask(smollm2)
    assert "Paris" in text, text
    assert finish == "stop" and used < 32, (finish, used, text)  # EOS, not the token limit
    assert not [s for s in SPECIAL if s in text], text
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and min(_work_done(smollm2).get(r, (0, 0))[i] for r, i in ROLES) < 1:
        time.sleep(0.1)
    done = _work_done(smollm2)
    assert set(done) == {"prefill", "decode"}, done
    assert done["prefill"][0] >= 1 and done["decode"][1] >= 1, done
