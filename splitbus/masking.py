"""Secrets out of every line splitbus prints or logs: Redis passwords in URLs, and API keys.

One place, used by the banners (``up``, ``redis``, ``api``), ``status`` and the log formatter, so
a new message cannot forget it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

MASK = "***"
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^\s/@:]*:)(?P<password>[^\s@/]+)@", re.IGNORECASE)
"""``scheme://user:password@``: what Redis (and most) URLs carry a password in."""


def mask_url(url: str) -> str:
    """``redis://splitbus:s3cret@host:6379/0`` -> ``redis://splitbus:***@host:6379/0``.
    A URL without a password comes back as it was."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", url)


def mask_key(key: str) -> str:
    """An API key as it may be shown: its last 4 characters when it is long enough that they
    give nothing away (>= 16), else nothing of it."""
    return f"{MASK}{key[-4:]}" if len(key) >= 16 else MASK


def url_password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def mask_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Every URL password, and every one of ``secrets`` (API keys, passwords) wherever it occurs."""
    text = mask_url(text)
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


class MaskingFormatter(logging.Formatter):
    """Masks the finished line, traceback included: an exception's message can carry a URL."""

    def __init__(self, fmt: str, datefmt: str | None, secrets: Iterable[str]) -> None:
        super().__init__(fmt, datefmt)
        self._secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(super().format(record), self._secrets)
