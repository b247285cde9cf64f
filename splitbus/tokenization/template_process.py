"""Chat templates rendered in child processes that can be killed.

The in-process bounds (``template_bounds``) stop what a template builds step by step, but one
step is one Python operation, and some run long or take much memory on small operands
(``[[1]] * n | sum(start=[])``, a huge int's ``%``, ``tojson`` with a long separator): a thread
cannot be stopped, and its memory is the API's. So the API renders in a pool of
``TemplateLimits.workers`` child processes (``pebble``'s ProcessPool), each with an address-space
bound (``RLIMIT_AS``) and a hard deadline: past it the child is killed and replaced, and the
request fails with ``ChatTemplateLimit``; the pool is never left blocked. Each child compiles a
template from its source once (compile failures too) and keeps it.

Children are spawned (a fresh interpreter, not a fork of the API's threads) when the API starts,
and die with it, even when it is SIGKILLed: each asks the kernel for SIGKILL when the thread
that started it goes (``PR_SET_PDEATHSIG``), the pool's own long-lived threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import enum
import functools
import json
import multiprocessing
import os
import resource
import signal
import sys
from dataclasses import dataclass
from typing import Any

import pebble

from splitbus.tokenization.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateLimit
from splitbus.tokenization.template_bounds import RENDER_TIME_S, RenderLimits

CHILD_MEMORY_BYTES = 256 << 20
"""Address space a child may take beyond what it holds when it starts (Python, Jinja, the
compiled templates): a real template's render takes a few MB; a value of 4 x a 128K context's
prompt-character bound (2 Mi characters) ~32 MB."""
KILL_GRACE_S = 1.0
"""Seconds past the render's own time bound before the child is killed: a template stopped by
its in-process clock fails with the precise reason and keeps its child (and its compiled
templates); only what that clock cannot stop (one long operation) is killed."""
COMPILED_PER_CHILD = 16
"""Compiled templates a child keeps (one per served model, usually)."""


class Outcome(enum.Enum):
    """How a render in a child ended (the child sends it with the prompt, or why not)."""

    RENDERED = "rendered"
    FAILED = "failed"
    LIMIT = "limit"


@dataclass(frozen=True)
class TemplateLimits:
    workers: int = 2
    """Child processes rendering at once (the API's tokenizer threads wait on them)."""
    time_s: float = RENDER_TIME_S
    """Seconds a render may run by its in-process clock; its child is killed at this plus
    ``KILL_GRACE_S`` (compiling the template included)."""
    memory_bytes: int = CHILD_MEMORY_BYTES
    """Address space a child may add to what it starts with."""


class TemplatePool:
    """Renders chat templates in killable children; ``start`` starts them, ``close`` stops them."""

    def __init__(self, limits: TemplateLimits = TemplateLimits()) -> None:
        self.limits = limits
        self._pool: pebble.ProcessPool | None = None
        # The children's parent-death signal follows the thread that started them: this one
        # lives as long as the pool (pebble's own thread starts the replacements).
        self._starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="template-pool")

    def render(
        self,
        source: str,
        special_tokens: dict[str, Any],
        messages: list[dict[str, Any]],
        max_chars: int,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt (blocking: call it from a thread); ChatTemplateError when the template
        fails on these messages, ChatTemplateLimit past a bound. The messages say why (for
        the log: they may quote the template)."""
        specials = json.dumps(special_tokens, sort_keys=True)
        args = (source, specials, messages, max_chars, add_generation_prompt, tools)
        outcome, text = _result(self._future(args))
        if outcome is Outcome.LIMIT:
            raise ChatTemplateLimit(text)
        if outcome is Outcome.FAILED:
            raise ChatTemplateError(text)
        return text

    def _future(self, args: tuple[Any, ...]) -> concurrent.futures.Future[tuple[Outcome, str]]:
        pool = self._pool
        if pool is not None and pool.active:  # the common case: no hop through the starter thread
            with contextlib.suppress(RuntimeError):  # it broke just now: the starter makes another
                return self._submit(pool, args)
        return self._starter.submit(self._schedule, args).result()

    def start(self, wait_s: float = 0.0) -> None:
        """Start the children now (they take ~0.5 s to load Jinja), not on the first render, and
        wait up to ``wait_s`` for them to have started (blocking: call it from a thread). A
        process that went on at once, stopped by a Ctrl-C just after, stopped children still
        unpickling their start-up state, whose interpreters printed a traceback."""
        started = self._starter.submit(self._schedule, ("", "{}", [], 0, False, None))
        if wait_s > 0:
            with contextlib.suppress(Exception):  # a slow or failed start: the first render starts them again
                started.result(wait_s).result(wait_s)

    def _schedule(self, args: tuple[Any, ...]) -> concurrent.futures.Future[tuple[Outcome, str]]:
        if self._pool is None or not self._pool.active:  # not yet, or broken: every child died at once
            self._stop_pool()
            context = multiprocessing.get_context("spawn")  # a fresh interpreter: not a fork of the API's threads
            init = (self.limits.memory_bytes, self.limits.time_s, os.getpid())
            self._pool = pebble.ProcessPool(
                self.limits.workers, initializer=start_child, initargs=init, context=context
            )
        return self._submit(self._pool, args)

    def _submit(
        self, pool: pebble.ProcessPool, args: tuple[Any, ...]
    ) -> concurrent.futures.Future[tuple[Outcome, str]]:
        return pool.schedule(render_here, args, timeout=self.limits.time_s + KILL_GRACE_S)

    def close(self) -> None:
        """Stop the children (those rendering are killed)."""
        self._starter.shutdown()
        self._stop_pool()

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None


def _result(future: concurrent.futures.Future[tuple[Outcome, str]]) -> tuple[Outcome, str]:
    try:
        return future.result()
    except TimeoutError:
        return Outcome.LIMIT, "the chat template's child ran past its deadline and was killed"
    except pebble.ProcessExpired as exc:  # killed by the kernel (memory), or crashed
        return Outcome.LIMIT, f"the chat template's child died (exit code {exc.exitcode})"
    except concurrent.futures.BrokenExecutor:  # every child died at once: the next render starts a new pool
        return Outcome.LIMIT, "the chat template's children all died"


# ---------------------------------------------------------------- in the child


def start_child(memory_bytes: int, time_s: float, parent: int) -> None:
    """A child's start: killed with its parent, bounded in memory, the render module loaded."""
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above: nobody would stop this child
        os._exit(1)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory_bytes,) * 2)
    _TIME_S[0] = time_s


_TIME_S = [RENDER_TIME_S]
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # SIGKILL, not SIGTERM: a child in one long C operation runs no Python signal handler.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _address_space() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * resource.getpagesize()


def render_here(
    source: str,
    special_tokens: str,
    messages: list[dict[str, Any]],
    max_chars: int,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[Outcome, str]:
    """One render, in the child: its outcome and the prompt, or why not."""
    try:
        template = _compiled(source, special_tokens)
        limits = RenderLimits(max_chars, _TIME_S[0])
        return Outcome.RENDERED, template.render(messages, limits, add_generation_prompt, tools)
    except ChatTemplateLimit as exc:
        return Outcome.LIMIT, str(exc)
    except ChatTemplateError as exc:
        return Outcome.FAILED, str(exc)
    except (MemoryError, RecursionError) as exc:
        return Outcome.LIMIT, f"the chat template exhausted its child ({type(exc).__name__})"
    except Exception as exc:  # the model's code: whatever it raises fails its request, not the child
        return Outcome.FAILED, f"the chat template failed: {type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=COMPILED_PER_CHILD)
def _compiled(source: str, special_tokens: str) -> ChatTemplate:
    return ChatTemplate(source, json.loads(special_tokens))  # a compile failure is kept too
