"""Chat templates in killable children (``template_process``): each attack of issue 34 that one
Python operation carries past the in-process bounds is stopped in its child (memory) or by
killing it (time), fails only its own render, and the pool renders the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from splitbus.tokenization.chat_template import ChatTemplateError, ChatTemplateLimit
from splitbus.tokenization.template_process import TemplatePool

MAX_CHARS = 2**21  # a 128K context's prompt bound: the attacks' values pass the in-process checks
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
HI = [{"role": "user", "content": "hi"}]
ENDLESS_SUM = "{% set l = [[1]] * 2000000 %}{{ l | sum(start=[]) }}"  # ~10^12 copies, in one call
LIMIT_ATTACKS = {
    "sum": "{% set l = [[1]] * 150000 %}{{ l | sum(start=[]) }}",
    "modulo": "{{ (7**2000000) % (3**1062500) }}",
    "separators": "{{ ([1]*15000) | tojson(separators=(' '*30000, ':')) }}",
    "wordwrap": "{{ ('a '*8000) | wordwrap(1, wrapstring='-'*30000) }}",
    "indent": "{% set ns = namespace(v=1) %}{% for i in range(400) %}{% set ns.v = [ns.v] %}{% endfor %}"
    "{{ ns.v | tojson(indent=16) }}",
}
FAILING = {
    "truncate": "{{ 'x' | truncate(5, end='-'*30000) }}",
    "parens": "{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}",
}


@pytest.fixture(scope="module")
def pool() -> Iterator[TemplatePool]:
    templates = TemplatePool()
    yield templates
    templates.close()


def _normal(pool: TemplatePool) -> None:
    assert pool.render(CHATML, {}, HI, MAX_CHARS) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("name", LIMIT_ATTACKS)
def test_an_attack_is_stopped_and_the_next_render_is_served(pool: TemplatePool, name: str) -> None:
    with pytest.raises(ChatTemplateLimit):
        pool.render(LIMIT_ATTACKS[name], {}, HI, MAX_CHARS)
    _normal(pool)


@pytest.mark.parametrize("name", FAILING)
def test_a_failing_template_is_its_requests_error(pool: TemplatePool, name: str) -> None:
    with pytest.raises(ChatTemplateError) as raised:
        pool.render(FAILING[name], {}, HI, MAX_CHARS)
    assert not isinstance(raised.value, ChatTemplateLimit)
    with pytest.raises(ChatTemplateError):  # the compile failure is kept: the same error again
        pool.render(FAILING[name], {}, HI, MAX_CHARS)
    _normal(pool)


def test_children_killed_for_time_and_memory_are_replaced(pool: TemplatePool) -> None:
    """Both children killed at once (time), then one stopped by its memory bound: the pool
    still renders, with a child whose pid is new."""
    pool.start()
    before = _descendants(os.getpid())
    with pytest.raises(ChatTemplateLimit):
        pool.render("{{ " + " ~ ".join(["(7**2000000) % (3**1062500)"] * 2) + " }}", {}, HI, MAX_CHARS)
    with pytest.raises(ChatTemplateLimit):
        pool.render("{{ 'x' * 10**9 }}", {}, HI, 2**40)  # past the in-process size check: its address space stops it
    _normal(pool)
    assert not before <= _descendants(os.getpid())  # the killed children are gone, replaced


def test_children_die_with_an_api_killed_by_sigkill() -> None:
    """A process holding a pool is SIGKILLed while a child runs one C call for hours (its kill
    at the deadline was the parent's job): its forkserver and children go too."""
    script = (
        "from splitbus.tokenization.template_process import TemplatePool\n"
        "if __name__ == '__main__':\n"
        "    pool = TemplatePool(); pool.render('', {}, [], 9); pool.render('', {}, [], 9); print('up', flush=True)\n"
        "    while True:  # rendering when killed\n"
        f"        try: pool.render({ENDLESS_SUM!r}, {{}}, [], {MAX_CHARS})\n"
        "        except Exception: pass\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "up\n"
    descendants = _descendants(holder.pid)
    assert descendants
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in descendants):
        time.sleep(0.1)
    assert not [pid for pid in descendants if _alive(pid)]


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout
        todo += [int(p) for p in out.split() if int(p) not in found]
        found.update(int(p) for p in out.split())
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_the_tools_reach_the_template_in_the_child(pool: TemplatePool) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    template = "{{ tools | tojson }}|{{ messages[0].tool_calls[0].function.arguments.tz }}"
    messages = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {"tz": "UTC"}}}]}]
    assert pool.render(template, {}, messages, MAX_CHARS, tools=tools) == (
        '[{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]|UTC'
    )
    assert pool.render("{{ tools is none }}", {}, HI, MAX_CHARS) == "True"
