"""The files one request crosses, from the API handler to its last token, measured on the real
stack: `splitbus up --engine sim --api-workers 1` (embedded Redis, one scheduler, one prefill and
one decode worker, one API process), every Python process of it recording its calls into the
splitbus package (tools/path_trace/sitecustomize.py, loaded only here, through PYTHONPATH).

    python -m tools.request_path [--requests 10] [--json FILE]

After warm-up requests (first-call imports and caches are not the path), it records a window of
REQUESTS streamed completions, one at a time, then (past the API's result grace) two idle windows
as long. A function is on the request's path when it ran, in the request window, at least once
every two requests more than in the busier idle window: what the requests add to the background
loops (lease, heartbeat, registry refresh, blocking reads), with room for those loops' jitter of a
turn or two either way. A file is crossed when one of its functions is on the path. Counting this
way can miss a file whose only part in the request is an extra turn of a loop that turns anyway (a
blocking read returning early); it does not add a file that only the background touches.

A file is entered twice when the path, having gone from it into another file, comes back into it
by a call (returning to a caller is no entry): a file on a cycle of the calls between files (one
of its path's functions called, not resumed after an await, by a function of another file; per
process, over the request window). Per-token loops make the sequence of entries repeat by design,
so it is the cycle, not the repetition, that counts: a callback, or two files that call each
other. A call from outside splitbus (the event loop, a thread's start) is no edge, so a callback
scheduled through the loop is not seen.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "splitbus"
HOOK = Path(__file__).resolve().parent / "path_trace"
REQUESTS = 10
SETTLE_S = 6.0  # past the API's 5 s result grace: the warm-up's stream deletions are not in a window


@dataclass(frozen=True)
class Event:
    """One call into the package: when (monotonic ns), which function, whether it started (not
    resumed), and the file of the nearest splitbus caller ("" from outside the package)."""

    t: int
    code: int
    fresh: bool
    caller: str


@dataclass
class Process:
    """One process's recording: its name, its functions (id -> (file, qualified name)), its events."""

    pid: int
    ppid: int
    argv: str
    codes: dict[int, tuple[str, str]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    @property
    def name(self) -> str:
        words = self.argv.split()
        command = words[words.index("splitbus.cli.main") + 1] if "splitbus.cli.main" in words else words[-1]
        role = words[words.index("--role") + 1] if "--role" in words else ""
        return f"{role} {command}".strip()


Window = tuple[int, int]


def read_trace(path: Path) -> Process | None:
    """One PID.tsv file written by the recorder; None for a process that ended before its first write."""
    process: Process | None = None
    for line in path.read_text().splitlines():
        kind, *rest = line.split("\t")
        if kind == "P":
            process = Process(int(rest[0]), int(rest[1]), rest[2])
        elif kind == "C" and process is not None:
            process.codes[int(rest[0])] = (rest[1], rest[2])
        elif kind == "E" and process is not None and len(rest) == 4:
            process.events.append(Event(int(rest[0]), int(rest[1]), rest[2] == "1", rest[3]))
    return process


def counts(events: Iterable[Event], window: Window) -> Counter[int]:
    return Counter(e.code for e in events if window[0] <= e.t < window[1])


def on_path(events: list[Event], busy: Window, idle: list[Window], requests: int) -> set[int]:
    """The functions that ran, in ``busy``, at least once every two requests more than in any idle window."""
    ran = counts(events, busy)
    quiet = [counts(events, window) for window in idle]
    least = (requests + 1) // 2
    return {code for code, n in ran.items() if n - max((q[code] for q in quiet), default=0) >= least}


def calls(process: Process, window: Window, path: set[int]) -> Counter[tuple[str, str]]:
    """(caller's file, callee's file) for each call from one file into a function on the path of
    another during ``window``; calls from outside splitbus (the event loop, a thread) are no edge."""
    edges: Counter[tuple[str, str]] = Counter()
    for event in process.events:
        file = process.codes[event.code][0]
        if window[0] <= event.t < window[1] and event.code in path and event.fresh and event.caller not in ("", file):
            edges[(event.caller, file)] += 1
    return edges


def entered_twice(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The groups of files that call into each other (a file that calls, directly or through
    others, into one that called it): the strongly connected parts of the call graph with more
    than one file, each sorted, in order of their first file."""
    graph: dict[str, set[str]] = {}
    for caller, callee in edges:
        graph.setdefault(caller, set()).add(callee)
        graph.setdefault(callee, set())
    reach = {file: _reachable(graph, file) for file in graph}
    groups = {tuple(sorted(f for f in reach[file] if file in reach[f])) for file in graph if file in reach[file]}
    return sorted(list(group) for group in groups if len(group) > 1)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo.extend(graph[file])
    return seen


def files_in_order(process: Process, window: Window, path: set[int]) -> list[str]:
    """The files of the functions on the path, in order of their first call during ``window``."""
    files: dict[str, None] = {}
    for event in process.events:
        if event.code in path and window[0] <= event.t < window[1]:
            files.setdefault(process.codes[event.code][0])
    return list(files)


def analyse(processes: list[Process], busy: Window, idle: list[Window], requests: int) -> dict[str, Any]:
    """The report: per process, its files on the path (in order of first call) and the groups of
    files that call back into each other; over all, the distinct files (a file two processes run is
    one file to read), their sum over processes, and the files entered twice."""
    rows = []
    for process in sorted(processes, key=lambda p: p.pid):
        path = on_path(process.events, busy, idle, requests)
        files = files_in_order(process, busy, path)
        if files:
            edges = calls(process, busy, path)
            rows.append(_row(process, files, edges))
    union = sorted({file for row in rows for file in row["files"]})
    twice = sorted({f"{row['process']}: {file}" for row in rows for group in row["entered_twice"] for file in group})
    return {
        "files": len(union),
        "files_per_process": sum(len(row["files"]) for row in rows),
        "entered_twice": len(twice),
        "requests": requests,
        "processes": rows,
        "all_files": union,
        "twice": twice,
    }


def _row(process: Process, files: list[str], edges: Counter[tuple[str, str]]) -> dict[str, Any]:
    return {
        "process": process.name,
        "pid": process.pid,
        "files": files,
        "calls": [[caller, callee, n] for (caller, callee), n in sorted(edges.items())],
        "entered_twice": entered_twice(edges),
    }


@contextlib.contextmanager
def _environ(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` set in this process's environment while the block runs, then as they were."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stream(client: Any, model: str) -> None:
    body = {"model": model, "prompt": "one request, followed", "max_tokens": 8, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass


def record(requests: int, folder: Path) -> tuple[list[Process], Window, list[Window]]:
    """Start the stack with the recorder on, warm it up, record the windows; the processes' traces."""
    import httpx

    from splitbus.bench.system import LocalSystem

    recording = {
        "SPLITBUS_PATH_TRACE": str(folder),
        "SPLITBUS_PATH_TRACE_ROOT": f"{PACKAGE}{os.sep}",
        "SPLITBUS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    with _environ(recording):  # for `splitbus up` and its children only: not this process's later ones
        # one API process, which its argv names (--workers N > 1 would serve from spawned children)
        system = LocalSystem("--engine", "sim", "--prefill", "1", "--decode", "1", "--api-workers", "1")
    try:
        with httpx.Client(base_url=system.base_url, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for _ in range(3):
                _stream(client, model)
            time.sleep(SETTLE_S)
            busy_start = time.monotonic_ns()
            for _ in range(requests):
                _stream(client, model)
            length = time.monotonic_ns() - busy_start
            busy = (busy_start, busy_start + length)
            time.sleep(SETTLE_S)
            idle_start = time.monotonic_ns()
            idle = [(idle_start, idle_start + length), (idle_start + length, idle_start + 2 * length)]
            time.sleep(2 * length / 1e9 + 0.5)  # and one flush of every recorder
    finally:
        system.stop()
    traces = [read_trace(path) for path in sorted(folder.glob("*.tsv"))]
    return [trace for trace in traces if trace is not None], busy, idle


def render(report: dict[str, Any]) -> str:
    lines = []
    for row in report["processes"]:
        lines.append(f"{row['process']} (pid {row['pid']}): {len(row['files'])} files")
        lines.extend(f"  {file}" for file in row["files"])
        lines.extend(f"  calling back into each other: {', '.join(group)}" for group in row["entered_twice"])
    lines.append(
        f"{report['files']} files crossed ({report['files_per_process']} counting each process's own), "
        f"{report['entered_twice']} entered twice"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help=f"requests in the measured window (default {REQUESTS})"
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="splitbus-path-") as folder:
        processes, busy, idle = record(args.requests, Path(folder))
    report = analyse(processes, busy, idle, args.requests)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
