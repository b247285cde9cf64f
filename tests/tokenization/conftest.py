"""Model folders written by the tests: the byte-level tokenizer and the config files under test."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from splitbus.tokenization.byte_level import byte_level_tokenizer

FolderMaker = Callable[..., Path]


@pytest.fixture
def model_folder(tmp_path: Path) -> FolderMaker:
    """``model_folder(tokenizer_config, config, files)``: a folder holding the byte-level
    tokenizer (ids 256, 257, 258 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), these
    two configs and the other ``files`` (name -> JSON value, or a ``str`` written as it is)."""

    def make(
        tokenizer_config: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        files: dict[str, Any] | None = None,
    ) -> Path:
        folder = tmp_path / f"model{len(list(tmp_path.iterdir()))}"  # a fresh folder each call
        folder.mkdir()
        byte_level_tokenizer().save(str(folder / "tokenizer.json"))
        every = {"tokenizer_config.json": tokenizer_config or {}, "config.json": config or {}, **(files or {})}
        for name, content in every.items():
            text = content if isinstance(content, str) else json.dumps(content)
            (folder / name).write_text(text)
        return folder

    return make
