"""`splitbus up`'s banner, followed as a new user would: the curl body names the model the API
serves, and the `status` and `redis-cli` lines it prints run as printed. Then a Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from splitbus.tokenization.byte_level import write_byte_level_tokenizer
from tests.e2e.conftest import start_system, stop_system


def _model(folder: Path) -> Path:
    vocab = write_byte_level_tokenizer(folder)
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512, "vocab_size": vocab}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _run_printed(line: str) -> subprocess.CompletedProcess[str]:
    """A `splitbus ...` line of the banner, run as printed (with this tree's Python)."""
    argv = shlex.split(line)
    assert argv[0] == "splitbus", line
    env = {k: v for k, v in os.environ.items() if k not in ("SPLITBUS_REDIS_URL", "SPLITBUS_DATA_DIR")}
    return subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", *argv[1:]], capture_output=True, text=True, timeout=30, env=env
    )


@pytest.mark.timeout(150)
def test_banner_names_the_served_model_and_its_tool_lines_run(tmp_path: Path) -> None:
    system = start_system(tmp_path / "data", "--model", str(_model(tmp_path / "my-model")))
    try:
        banner = system.wait_output(r"(?s)splitbus is up.*Ctrl-C stops everything").group(0)
        body = json.loads(re.search(r"^\s+-d '(.*)'$", banner, re.M).group(1))  # type: ignore[union-attr]
        assert body["model"] == "my-model"
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=30)
        assert client.completions.create(model=body["model"], prompt=body["prompt"], max_tokens=3).choices[0].text
        status = _run_printed(re.search(r"^  status: (.*)$", banner, re.M).group(1))  # type: ignore[union-attr]
        assert status.returncode == 0 and status.stdout.count(" decode ") == 1, status.stdout + status.stderr
        groups = _run_printed(re.search(r"^  redis:  (.*)$", banner, re.M).group(1))  # type: ignore[union-attr]
        assert groups.returncode == 0 and "schedulers" in groups.stdout, groups.stdout + groups.stderr
        assert "REDISCLI_AUTH" not in banner and "redis-cli --user" not in banner  # the short form only
    finally:
        assert stop_system(system) == []
    assert "Traceback" not in "".join(system.output)  # a quiet Ctrl-C (the KV server printed a CancelledError)
