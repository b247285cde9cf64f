"""``splitbus up`` started by a benchmark, in a temporary folder, stopped with SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


class LocalSystem:
    def __init__(self, *up_args: str, environ: dict[str, str] | None = None) -> None:
        """``environ``: more variables for ``up`` (``SPLITBUS_OFFLINE``, say)."""
        from splitbus.redis_server import die_with_parent, free_port

        self.port = free_port()
        self._data = tempfile.TemporaryDirectory(prefix="splitbus-bench-")
        self.data_dir = Path(self._data.name)
        args = ["up", "--port", str(self.port), "--data-dir", self._data.name, *up_args]
        # Its own embedded Redis, under the default key prefix that the benchmarks read.
        env = {k: v for k, v in os.environ.items() if k not in ("SPLITBUS_REDIS_URL", "SPLITBUS_PREFIX")}
        env.update(environ or {}, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitbus.cli.main", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=die_with_parent,
        )  # no orphaned system if the benchmark is killed
        self.output: list[str] = []
        self.redis_url = self._wait_up()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_up(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            match = re.search(r"splitbus is up: API \S+  Redis (\S+)", line)
            if match:
                from splitbus.redis_server import embedded_url

                threading.Thread(target=self._drain, daemon=True).start()
                return embedded_url(self.data_dir / "redis") or match.group(1)  # the banner masks the password
        raise RuntimeError("splitbus up did not start:\n" + "".join(self.output[-30:]))

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._data.cleanup()
