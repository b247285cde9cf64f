"""Bounds on rendering a model's chat template: its time, the size of each value it builds,
the characters it builds in all, and the size of its output.

A chat template is code that comes with the model, and rendering runs in the API's small
thread pool: a nested ``range(100000)`` loop (10^10 steps) ran past 10 s and ``'x' * 10**8``
took 500 MB, and two such requests held both threads. A Python thread cannot be stopped from
outside, so the bounds are checked by the template's own steps: ``BoundedSandbox`` (the sandbox
Jinja already gives) checks the clock at every call, attribute or item access, operator and
loop iteration, and refuses before it is built any value that would print as more than
``VALUE_FACTOR`` x the output bound (``*``, ``**``, ``+``, ``%``, ``~``, ``join``, ``replace``,
``format``, padding widths: the operations whose result can be far larger than their operands;
sizes are ``weight``s, so a list of references to one string counts as it prints). What runs
between two checks is one operation on values already bounded, so a render overruns its
deadline by at most that.

Past a bound, ``TemplateLimitError``: the request fails with its own error, the thread is free.
"""

from __future__ import annotations

import functools
import re
import string
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from jinja2 import nodes, pass_context
from jinja2.filters import make_attrgetter
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

RENDER_TIME_S = 2.0
"""Seconds a render may run. Real templates render in well under a millisecond (SmolLM2's, on
an 8-message 4 KB conversation: ~50 us with these checks, 20 us in the bare sandbox), so this
only ever stops a template that loops for good."""
BUILD_FACTOR = 64
"""Characters a render may build in all (every string and list it makes, kept or not), as a
multiple of its output bound, and at least ``MIN_BUILD_CHARS``: a real template builds a few
times its output (one that appends to a namespace message by message, O(n^2)). It bounds memory
where the time bound alone would not (copying a bounded string runs at GB/s)."""
MIN_BUILD_CHARS = 2**25
VALUE_FACTOR = 4
"""The longest string or list a render may build (as it would print: ``weight``), as a multiple
of its output bound: a template may hold the whole conversation as a list (its messages' text
and then some), but not gigabytes."""
CLOCK_EVERY = 16
"""Steps between two reads of the clock."""
MAX_JSON_INDENT = 16
"""The largest ``tojson`` indent (real templates use 2 or 4): each nesting level of each line
pays it."""
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


class TemplateLimitError(Exception):
    """A render went past one of its bounds (not a ValueError: template code cannot cause it
    to be mistaken for its own errors)."""


@dataclass(frozen=True)
class RenderLimits:
    max_chars: int
    """The longest output (the API passes the prompt-character bound: a longer prompt is
    refused anyway); a value built on the way may print as ``VALUE_FACTOR`` times that."""
    time_s: float = RENDER_TIME_S
    """Seconds the render may run."""


@dataclass
class Budget:
    """One render's bounds and what it has used of them."""

    limits: RenderLimits
    deadline: float = 0.0
    built: int = 0
    output: int = 0
    started: float = field(default_factory=time.monotonic)
    build_limit: int = 0
    value_limit: int = 0
    steps: int = 0

    def __post_init__(self) -> None:
        self.deadline = self.started + self.limits.time_s
        self.build_limit = max(BUILD_FACTOR * self.limits.max_chars, MIN_BUILD_CHARS)
        self.value_limit = VALUE_FACTOR * self.limits.max_chars

    def tick(self) -> None:
        # The clock is read every CLOCK_EVERY steps: a step is one operation on bounded values.
        self.steps += 1
        if not self.steps % CLOCK_EVERY and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran longer than {self.limits.time_s:g} s")

    def check_size(self, size: int, what: str = "a value") -> None:
        """Refuse to build ``what`` of ``size`` characters (or items) when it is over the bound."""
        if size > self.value_limit:
            raise TemplateLimitError(
                f"the chat template builds {what} of {size} characters or items, more than {self.value_limit}"
            )

    def took(self, value: Any) -> Any:
        """Count a value the template built; refuse it past the bounds."""
        self.grow(self.weight(value))
        return value

    def weight(self, value: Any) -> int:
        """``weight(value)``, counted no further than just past the bound."""
        return weight(value, self.value_limit + 1)

    def grow(self, size: int) -> None:
        """Count ``size`` characters (or items) about to be built; refuse them past the bounds."""
        self.check_size(size)
        self.built += size
        if self.built > self.build_limit:
            raise TemplateLimitError(f"the chat template builds more than {self.build_limit} characters in all")

    def wrote(self, chunk: str) -> None:
        self.output += len(chunk)
        if self.output > self.limits.max_chars:
            raise TemplateLimitError(f"the chat template writes more than {self.limits.max_chars} characters")


_ACTIVE = threading.local()


def active() -> Budget | None:
    """The budget of the render running on this thread (None outside one: at compile time)."""
    return getattr(_ACTIVE, "budget", None)


def render_bounded(chunks: Callable[[], Iterable[str]], limits: RenderLimits) -> str:
    """The joined output of ``chunks()`` (a template's ``generate``), run under ``limits``."""
    budget = Budget(limits)
    _ACTIVE.budget = budget
    try:
        out = []
        for chunk in chunks():
            budget.wrote(chunk)
            out.append(chunk)
        return "".join(out)
    except (MemoryError, RecursionError, OverflowError) as exc:
        raise TemplateLimitError(f"the chat template exhausted the renderer ({type(exc).__name__})") from None
    finally:
        _ACTIVE.budget = None


def weight(value: Any, limit: int) -> int:
    """About the characters ``value`` prints as (its ``str``, a tuple's repr, ``tojson``): a
    string its length, a container its items' and one each, an int its digits. A list of 8000
    references to one 8000-character string costs 8000 pointers, but prints as 64 M characters:
    the bounds are on this, not on ``len``. Counting stops once past ``limit``."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    items = _items(value)
    if items is None:
        return 1
    total = 0
    for item in items:
        total += 1 + weight(item, limit - total)
        if total > limit:
            break
    return total


def _items(value: Any) -> Iterable[Any] | None:
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, dict):
        return (part for pair in value.items() for part in pair)
    if isinstance(value, Namespace):  # a template's own mutable object: what it holds prints too
        return _items(getattr(value, "_Namespace__attrs", {}))
    return None


def _tick() -> Budget | None:
    budget = active()
    if budget is not None:
        budget.tick()
    return budget


def _took(budget: Budget | None, value: Any) -> Any:
    return value if budget is None else budget.took(value)


# ---------------------------------------------------------------- sizes predicted before building


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple, bytes))


def check_binop(budget: Budget, operator: str, left: Any, right: Any) -> None:
    """Refuse an operator whose result would be over the bounds, before it is computed."""
    if operator == "*":
        _check_product(budget, left, right)
    elif operator == "**":
        _check_power(budget, left, right)
    elif operator == "+" and _sized(left) and _sized(right):
        budget.check_size(budget.weight(left) + budget.weight(right))
    elif operator == "%" and isinstance(left, str):
        check_percent(budget, left, right)


def _check_power(budget: Budget, left: Any, right: Any) -> None:
    """An integer to a positive power grows by the base's bits per unit of the exponent."""
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _check_int_bits(budget, left.bit_length() * right)


def _check_product(budget: Budget, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        _check_int_bits(budget, left.bit_length() + right.bit_length())
    elif _sized(left) and isinstance(right, int):
        budget.check_size(budget.weight(left) * right)
    elif _sized(right) and isinstance(left, int):
        budget.check_size(budget.weight(right) * left)


def _check_int_bits(budget: Budget, bits: int) -> None:
    # An int of ~max_chars decimal digits: a prompt could print no larger one.
    budget.check_size(bits // 3, "an integer")


def check_percent(budget: Budget, fmt: str, values: Any) -> None:
    """``fmt % values`` (and the ``format`` filter): each conversion's width or its longest value."""
    args = list(values.values()) if isinstance(values, dict) else values if isinstance(values, tuple) else [values]
    longest = max((budget.weight(v) for v in args), default=0)
    size = len(fmt)
    for width, precision, _ in _PERCENT_SPEC.findall(fmt):
        if "*" in (width, precision):
            raise TemplateLimitError("the chat template formats with a width taken from its values ('%*')")
        size += max(int(width or 0), int(precision or 0), longest)
    budget.check_size(size)


def check_format(budget: Budget, fmt: str, values: list[Any]) -> None:
    """``fmt.format(...)``: each field's width, or its longest value."""
    longest = max((budget.weight(v) for v in values), default=0)
    size = len(fmt)
    for _, name, spec, _ in string.Formatter().parse(fmt):
        if name is None:
            continue
        if spec and "{" in spec:
            raise TemplateLimitError("the chat template formats with a width taken from its values ('{:{}}')")
        size += max(sum(int(n) for n in re.findall(r"\d+", spec or "")), longest)
    budget.check_size(size)


def joined_size(budget: Budget, separator: str, items: list[Any]) -> int:
    return len(separator) * max(len(items) - 1, 0) + sum(budget.weight(item) for item in items)


def replaced_size(text: str, old: str, new: str, count: int | None = None) -> int:
    found = text.count(old) if old else len(text) + 1
    if count is not None and count >= 0:
        found = min(found, count)
    return len(text) + found * (len(new) - len(old))


# ---------------------------------------------------------------- str methods


def _join(budget: Budget, text: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    items = list(args[0])  # materialized once: the generator is counted, then joined
    budget.check_size(joined_size(budget, text, items))
    return (items,)


def _replace(budget: Budget, text: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        budget.check_size(replaced_size(text, args[0], args[1], args[2] if len(args) > 2 else None))
    return args


def _width(budget: Budget, text: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    if args and isinstance(args[0], int):
        budget.check_size(args[0])
    return args


def _expandtabs(budget: Budget, text: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    tab = args[0] if args and isinstance(args[0], int) else 8
    budget.check_size(len(text) + text.count("\t") * tab)
    return args


def _refused(budget: Budget, text: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    raise TemplateLimitError("the chat template calls str.translate, which it may not (no bound on its output)")


_STR_METHODS: dict[str, Callable[[Budget, str, tuple[Any, ...]], tuple[Any, ...]]] = {
    "join": _join,
    "replace": _replace,
    "center": _width,
    "ljust": _width,
    "rjust": _width,
    "zfill": _width,
    "expandtabs": _expandtabs,
    "translate": _refused,
}


def checked_args(budget: Budget, func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A str method's arguments, once the size of its result is known to be in bounds."""
    owner = getattr(func, "__self__", None)
    if isinstance(func, types.BuiltinMethodType) and isinstance(owner, str):
        check = _STR_METHODS.get(func.__name__)
        if check is not None:
            return check(budget, owner, args)
    return args


# ---------------------------------------------------------------- filters


def _check_join_filter(budget: Budget, context: Context, args: list[Any], kwargs: dict[str, Any]) -> None:
    separator = kwargs.get("d", args[1] if len(args) > 1 else "")
    attribute = kwargs.pop("attribute", args.pop(2) if len(args) > 2 else None)
    items = list(args[0])
    if attribute is not None:
        items = list(map(make_attrgetter(context.environment, attribute), items))
    args[0] = items
    budget.check_size(joined_size(budget, str(separator), items))


def _check_replace_filter(budget: Budget, context: Context, args: list[Any], kwargs: dict[str, Any]) -> None:
    _replace(budget, str(args[0]), tuple(map(str, args[1:3])) + tuple(args[3:]))


def _check_indent_filter(budget: Budget, context: Context, args: list[Any], kwargs: dict[str, Any]) -> None:
    width = kwargs.get("width", args[1] if len(args) > 1 else 4)
    pad = len(width) if isinstance(width, str) else width
    text = str(args[0])
    budget.check_size(len(text) + (text.count("\n") + 1) * pad)


def _check_count_arg(budget: Budget, context: Context, args: list[Any], kwargs: dict[str, Any]) -> None:
    # center's width, batch's line count, slice's count: the size of what they build
    if len(args) > 1 and isinstance(args[1], int):
        budget.check_size(args[1])


def _check_format_filter(budget: Budget, context: Context, args: list[Any], kwargs: dict[str, Any]) -> None:
    check_percent(budget, str(args[0]), kwargs or tuple(args[1:]))


def _check_tojson(budget: Budget, context: Context, args: list[Any], kwargs: dict[str, Any]) -> None:
    indent = kwargs.get("indent", args[2] if len(args) > 2 else None)
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise TemplateLimitError(f"the chat template asks tojson for an indent over {MAX_JSON_INDENT}")


FILTER_CHECKS: dict[str, Callable[[Budget, Context, list[Any], dict[str, Any]], None]] = {
    "join": _check_join_filter,
    "replace": _check_replace_filter,
    "indent": _check_indent_filter,
    "center": _check_count_arg,
    "batch": _check_count_arg,
    "slice": _check_count_arg,
    "format": _check_format_filter,
    "tojson": _check_tojson,
}
"""Filters whose output can be far larger than their input: checked before they run. Every
filter's result is checked after it too (``Budget.took``)."""


def bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` as a filter that ticks the clock and checks sizes. It takes the context (so
    that Jinja never runs it at compile time, outside a budget) and passes on what ``func``
    asks for (its ``jinja_pass_arg``: context, eval context or environment)."""
    passes = getattr(func, "jinja_pass_arg", None)
    check = FILTER_CHECKS.get(name)

    @pass_context
    @functools.wraps(func)
    def bounded(context: Context, *args: Any, **kwargs: Any) -> Any:
        budget = _tick()
        args_list = list(args)
        if budget is not None and check is not None:
            check(budget, context, args_list, kwargs)
        return _took(budget, func(*_passed(passes, context), *args_list, **kwargs))

    return bounded


def _passed(passes: Any, context: Context) -> tuple[Any, ...]:
    name = getattr(passes, "name", None)
    if name == "context":
        return (context,)
    if name == "eval_context":
        return (context.eval_ctx,)
    if name == "environment":
        return (context.environment,)
    return ()


# ---------------------------------------------------------------- the environment


class _Bounding(NodeTransformer):
    """Every ``for`` loop iterates through ``BoundedSandbox.bounded_iter`` (a check a step) and
    every ``~`` joins through ``BoundedSandbox.bounded_concat`` (a size check)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _call("bounded_iter", [cast(nodes.Expr, node.iter)], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _call("bounded_concat", node.nodes, node.lineno)


def _call(method: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(method), args, [], None, None, lineno=lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with the checks of ``RenderLimits`` in its hooks."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs in one call: no template uses it

    def bound_filters(self) -> None:
        """Wrap every filter (call once all are registered)."""
        self.filters = {name: bounded_filter(name, func) for name, func in self.filters.items()}

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Bounding().visit(super()._parse(source, name, filename))
        assert isinstance(tree, nodes.Template)
        return tree

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _tick()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        if operator == "+" and type(left) is str and type(right) is str:  # most of what templates do: one check
            budget.grow(len(left) + len(right))
            return left + right
        check_binop(budget, operator, left, right)
        return budget.took(super().call_binop(context, operator, left, right))

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _tick()
        if budget is not None:
            args = checked_args(budget, obj, args)
        return _took(budget, super().call(context, obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, sandboxed = value.__self__, wrapper

        def bounded(*args: Any, **kwargs: Any) -> str:
            budget = active()
            if budget is not None:
                mapped = list(args[0].values()) if value.__name__ == "format_map" and args else []
                check_format(budget, fmt, [*args, *kwargs.values(), *mapped])
            return _took(budget, sandboxed(*args, **kwargs))

        return bounded

    def concat(self, parts: Iterable[str]) -> str:
        """Joins a block's output (a macro's, a ``set`` block's): checked, as ``~`` is."""
        kept = list(parts)
        budget = active()
        if budget is not None:
            budget.check_size(joined_size(budget, "", kept))
        return str(_took(budget, "".join(kept)))

    def bounded_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            _tick()
            yield item

    def bounded_concat(self, *parts: Any) -> str:
        budget = active()
        if budget is not None:
            budget.check_size(joined_size(budget, "", list(parts)))  # before str(): a list may print as a lot
        return str(_took(budget, "".join(str(part) for part in parts)))
