"""The call recorder of tools/request_path.py, loaded by every Python process of its run because
that run puts this folder first on PYTHONPATH, and inert unless SPLITBUS_PATH_TRACE names a
folder: no product code imports it.

Each call into a function of the splitbus package (SPLITBUS_PATH_TRACE_ROOT) is one line in
FOLDER/PID.tsv: the monotonic time (one clock for all processes), the function, whether the call
starts the function (a coroutine or generator resuming after an await or a yield does not), and
the file of the nearest splitbus function up the stack (the caller), empty when the event loop,
a thread's start or an executor comes first. A thread writes the lines out every 0.2 s, so a
process that is killed loses at most that much.
"""

from __future__ import annotations

import dis
import os
import sys
import threading
import time
from collections import deque
from types import CodeType, FrameType
from typing import Any

_FOLDER = os.environ.get("SPLITBUS_PATH_TRACE", "")
_ROOT = os.environ.get("SPLITBUS_PATH_TRACE_ROOT", "")
_FILES: dict[CodeType, str | None] = {}
_STARTS: dict[CodeType, int] = {}
_IDS: dict[CodeType, int] = {}
_LINES: deque[str] = deque()
_LOOP: dict[CodeType, bool] = {}
_LOOP_PARTS = (
    f"{os.sep}asyncio{os.sep}",
    f"{os.sep}uvloop{os.sep}",
    f"{os.sep}threading.py",
    f"{os.sep}concurrent{os.sep}",
)


def _file(code: CodeType) -> str | None:
    """The code's file relative to the package's parent (``splitbus/api/app.py``), None outside it."""
    try:
        return _FILES[code]
    except KeyError:
        name = code.co_filename
        _FILES[code] = name[len(_ROOT) - len("splitbus/") :] if name.startswith(_ROOT) else None
        return _FILES[code]


def _loop(code: CodeType) -> bool:
    """Whether the code is the event loop's or a thread's start: what it runs was scheduled, not
    called, so the walk up the stack for a caller stops there (not at whoever started the loop)."""
    if code not in _LOOP:
        name = code.co_filename
        _LOOP[code] = any(part in name for part in _LOOP_PARTS)
    return _LOOP[code]


def _start(code: CodeType) -> int:
    """The offset of the code's first RESUME: a frame at or before it is starting, not resuming."""
    if code not in _STARTS:
        offsets = [i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"]
        _STARTS[code] = offsets[0] if offsets else 0
    return _STARTS[code]


def _code_id(code: CodeType, file: str) -> int:
    if code not in _IDS:
        _IDS[code] = len(_IDS)
        name = getattr(code, "co_qualname", code.co_name)  # 3.11's
        _LINES.append(f"C\t{_IDS[code]}\t{file}\t{name}\t{code.co_firstlineno}")
    return _IDS[code]


def _hook(frame: FrameType, event: str, arg: Any) -> None:
    if event != "call":
        return
    code = frame.f_code
    file = _file(code)
    if file is None:
        return
    caller = frame.f_back
    while caller is not None and _file(caller.f_code) is None:
        caller = None if _loop(caller.f_code) else caller.f_back
    fresh = int(frame.f_lasti <= _start(code))
    caller_file = _file(caller.f_code) if caller is not None else ""
    _LINES.append(f"E\t{time.monotonic_ns()}\t{_code_id(code, file)}\t{fresh}\t{caller_file}")


def _writer(path: str) -> None:
    with open(path, "a", buffering=1 << 16) as out:
        with open("/proc/self/cmdline", "rb") as cmdline:
            argv = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
        out.write(f"P\t{os.getpid()}\t{os.getppid()}\t{argv}\n")
        while True:
            time.sleep(0.2)
            lines = [_LINES.popleft() for _ in range(len(_LINES))]
            out.write("".join(line + "\n" for line in lines))
            out.flush()


def _begin() -> None:
    """Start recording in this process (again in a forked child, with a file of its own)."""
    _LINES.clear()
    _IDS.clear()
    path = os.path.join(_FOLDER, f"{os.getpid()}.tsv")
    threading.Thread(target=_writer, args=(path,), daemon=True, name="path-trace").start()
    sys.setprofile(_hook)
    threading.setprofile(_hook)


if _FOLDER and _ROOT:
    os.register_at_fork(after_in_child=_begin)
    _begin()
