"""The one masking helper: URL passwords and API keys out of printed and logged lines."""

from __future__ import annotations

import io
import logging

from splitbus.masking import MaskingFormatter, mask_key, mask_text, mask_url


def test_mask_url() -> None:
    assert mask_url("redis://splitbus:s3cr3t@127.0.0.1:6379/0") == "redis://splitbus:***@127.0.0.1:6379/0"
    assert mask_url("rediss://:s3cr3t@h:6380/0") == "rediss://:***@h:6380/0"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert mask_url("at redis://u:p%40ss@h/0 and rediss://v:q@k/1") == "at redis://u:***@h/0 and rediss://v:***@k/1"


def test_mask_key_shows_nothing_of_a_short_key() -> None:
    assert mask_key("abc") == "***"
    assert mask_key("sk-0123456789abcdef") == "***cdef"
    assert mask_text("Bearer sk-0123456789abcdef ok", ["sk-0123456789abcdef"]) == "Bearer *** ok"


def test_the_log_formatter_masks_messages_and_tracebacks() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(MaskingFormatter("%(message)s", None, ["the-api-key-0123456789"]))
    log = logging.getLogger("test_masking")
    log.addHandler(handler)
    try:
        log.warning("connecting to %s with %s", "redis://splitbus:pw123@h:1/0", "the-api-key-0123456789")
        try:
            raise ValueError("bad redis://a:leaked@h/0")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "pw123" not in text and "the-api-key" not in text and "leaked" not in text
    assert "redis://splitbus:***@h:1/0 with ***" in text and "redis://a:***@h/0" in text
