"""Value checks for message ``__post_init__``: a decoded entry must not carry wrong types."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what)


def require_int(value: Any, name: str, minimum: int | None = None) -> None:
    require(is_int(value), f"{name} must be an integer, got {type(value).__name__}")
    if minimum is not None:
        require(value >= minimum, f"{name} must be >= {minimum}, got {value}")


def require_str(value: Any, name: str, nonempty: bool = True) -> None:
    require(isinstance(value, str), f"{name} must be a string, got {type(value).__name__}")
    if nonempty:
        require(bool(value), f"{name} must not be empty")


def require_int_list(value: Any, name: str) -> None:
    require(isinstance(value, list), f"{name} must be a list of integers")
    require(all(is_int(v) and v >= 0 for v in value), f"{name} must hold non-negative integers")


def require_number(value: Any, name: str, minimum: float) -> None:
    require(isinstance(value, (int, float)) and not isinstance(value, bool), f"{name} must be a number")
    require(value >= minimum, f"{name} must be >= {minimum}, got {value}")
