"""What ``--model`` names, turned into the Hugging Face folder to load and the name to serve.

``--model`` (on ``up``, ``worker``, ``api`` and ``bench engine``) takes a model folder or a
``.gguf`` file. A folder is loaded as it is; a GGUF file is converted once into a folder in the
cache under ``<data dir>/models`` (:func:`splitbus.model_files.gguf.prepare`, keyed by the file's
hash), and that folder is loaded. Clients ask for the model by its served name: the file's stem
(``SmolLM2-135M-Instruct.Q4_1``), not the cache folder's name, or the folder's name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from splitbus.tokenization import ModelFilesError

GGUF_SUFFIX = ".gguf"


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == GGUF_SUFFIX


def resolve_model(path: Path, data_dir: Path, progress: Callable[[str], None] = lambda _: None) -> Path:
    """The folder to load for ``--model path``: a folder itself, a ``.gguf`` file's converted
    folder under ``data_dir / "models"`` (converted on first use; ``progress`` says so first).
    Raises ModelFilesError naming the path when it is neither (or when the GGUF file cannot be
    converted)."""
    if path.is_dir():
        return path
    if not path.exists():
        raise ModelFilesError(f"model {path} does not exist (give a Hugging Face model folder or a .gguf file)")
    if not (path.is_file() and is_gguf(path)):
        raise ModelFilesError(f"model {path} is neither a Hugging Face model folder nor a .gguf file")
    from splitbus.model_files.gguf import prepare  # numpy and the gguf reader: only when a file is given

    cache = data_dir / "models" / "gguf"
    progress(f"{path}: its Hugging Face folder from {cache}, converted now if absent (once per file: a while)")
    return prepare(path, data_dir / "models")


def served_name(path: Path, given: str | None = None) -> str:
    """``--served-model-name`` if given, else a ``.gguf`` file's stem, else the folder's name."""
    if given:
        return given
    return path.stem if is_gguf(path) and not path.is_dir() else path.resolve().name
