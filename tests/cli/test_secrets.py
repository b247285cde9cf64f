"""`splitbus up` keeps its secrets off every command line and out of its output: the attack is
`ps` (any local user reads /proc/<pid>/cmdline) and a log or terminal that others see."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import redis

from splitbus.redis_server import embedded_url, free_port
from tests.e2e.conftest import _cmdline, _descendants

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main"]
KEY = "sk-test-0123456789abcdef-secret"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


@pytest.mark.timeout(120)
def test_up_passes_secrets_through_the_environment_only(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITBUS_")} | {
        "SPLITBUS_API_KEYS": KEY,
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        SPLITBUS + ["up", "--engine", "sim", "--port", str(port), "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    out: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C stops everything" in line:
                break
        banner = "".join(out)
        assert "splitbus is up" in banner, banner
        url = embedded_url(tmp_path / "redis")
        admin = embedded_url(tmp_path / "redis", admin=True)
        assert url and admin
        password = url.split(":")[2].split("@")[0]
        secrets = (KEY, password, admin.split(":")[2].split("@")[0])
        children = _descendants(proc.pid)
        assert len(children) >= 5  # redis-server, scheduler, prefill, decode, api
        for pid in [proc.pid, *children]:
            for secret in secrets:
                assert secret not in _cmdline(pid), _cmdline(pid)
        api = next(pid for pid in children if " api " in _cmdline(pid))
        assert _environ(api)["SPLITBUS_API_KEYS"] == KEY and _environ(api)["SPLITBUS_REDIS_URL"] == url
        worker = next(pid for pid in children if "--role decode" in _cmdline(pid))
        assert _environ(worker)["SPLITBUS_API_KEYS"] == ""  # only the API gets the keys
        for secret in secrets:
            assert secret not in banner
        assert "redis://splitbus:***@" in banner and "***cret" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=30)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=3).choices[0].text
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=int(url.rsplit(":", 1)[1].split("/")[0])).ping()
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    for secret in (KEY,):
        assert secret not in rest, "a key was printed while running or stopping"
    assert not re.search(r"redis://[^:\s]*:[^*\s][^@\s]*@", rest)
