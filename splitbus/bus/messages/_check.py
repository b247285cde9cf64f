"""Value checks for message ``__post_init__``: a decoded entry must not carry wrong types."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    return type(value) is int  # bool is not an int here


def require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what)


def require_int(value: Any, name: str, minimum: int | None = None) -> None:
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def require_str(value: Any, name: str, nonempty: bool = True) -> None:
    require(isinstance(value, str), f"{name} must be a string, got {type(value).__name__}")
    if nonempty:
        require(bool(value), f"{name} must not be empty")


def require_int_list(value: Any, name: str) -> None:
    if type(value) is not list:
        raise ValueError(f"{name} must be a list of integers")
    for v in value:
        if type(v) is not int or v < 0:
            raise ValueError(f"{name} must hold non-negative integers")


def require_number(value: Any, name: str, minimum: float) -> None:
    require(isinstance(value, (int, float)) and not isinstance(value, bool), f"{name} must be a number")
    require(value >= minimum, f"{name} must be >= {minimum}, got {value}")
