"""Model architectures, by their Hugging Face name: the one table that the engine's config
reader, its weight loader, the tiny model, ``make-tiny-model --arch`` and the GGUF converter read.

Every module of this package but ``base`` is an architecture: it builds an ``Architecture`` (or a
subclass) and passes it to ``register``. The package's modules are imported the first time the
registry is asked, so adding an architecture is one new file here, plus the forward it names when
no engine runs one like it yet. Plain Python (no paddle, no gguf): the API process reads it too.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any, Final

from splitbus.architectures.base import Architecture, Experts, MixtureOfExperts, ModelConfig, Shapes
from splitbus.tokenization import ModelFilesError

__all__ = [
    "DEFAULT",
    "Architecture",
    "Experts",
    "MixtureOfExperts",
    "ModelConfig",
    "Shapes",
    "config_from",
    "get",
    "load_config",
    "of_config",
    "of_gguf",
    "of_model_type",
    "register",
    "registered",
]

DEFAULT: Final = "llama"
"""The ``model_type`` of the model ``splitbus up`` and ``make-tiny-model`` write when asked for none."""

_BY_NAME: dict[str, Architecture] = {}
_found = False


def register(arch: Architecture) -> Architecture:
    """Make ``arch`` known by its Hugging Face name; ValueError when another one already has
    that name, its ``model_type`` or its GGUF name."""
    clash = next((other for other in _BY_NAME.values() if other != arch and _shares_a_name(other, arch)), None)
    if clash is not None:
        raise ValueError(f"architecture {arch.hf_name!r} shares a name with the registered {clash.hf_name!r}")
    _BY_NAME[arch.hf_name] = arch
    return arch


def _shares_a_name(one: Architecture, other: Architecture) -> bool:
    """Two GGUF layouts may share a name if one has experts and the other not: llama.cpp writes
    Mixtral as ``llama`` with ``llama.expert_count`` > 0."""
    same_gguf = one.gguf_layout and other.gguf_layout and _gguf_key(one) == _gguf_key(other)
    return one.hf_name == other.hf_name or one.model_type == other.model_type or same_gguf


def _gguf_key(arch: Architecture) -> tuple[str, bool]:
    return arch.gguf_name, isinstance(arch, MixtureOfExperts)


def registered() -> tuple[Architecture, ...]:
    """Every architecture, once each module of this package has been imported, by Hugging Face name."""
    global _found
    if not _found:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
        _found = True  # only once all imported: a module that failed to import fails the next call too
    return tuple(_BY_NAME[name] for name in sorted(_BY_NAME))


def get(hf_name: str) -> Architecture:
    """The architecture of that Hugging Face name; ValueError naming the known ones otherwise."""
    found = {a.hf_name: a for a in registered()}
    if hf_name not in found:
        raise ValueError(f"architecture must be one of {sorted(found)}, got {hf_name!r}")
    return found[hf_name]


def of_model_type(model_type: str) -> Architecture:
    """The architecture of that ``model_type`` ("llama"); ValueError naming the known ones otherwise."""
    found = {a.model_type: a for a in registered()}
    if model_type not in found:
        raise ValueError(f"arch must be one of {sorted(found)}")
    return found[model_type]


def of_gguf(name: str, experts: bool = False) -> Architecture | None:
    """The architecture of a GGUF file whose ``general.architecture`` is ``name`` and which has
    experts (``{name}.expert_count`` > 0) or not, if one is registered whose GGUF layout is read."""
    return next((a for a in registered() if a.gguf_layout and _gguf_key(a) == (name, experts)), None)


def of_config(raw: dict[str, Any], where: Path | str = "config.json") -> Architecture:
    """The first registered architecture ``config.json``'s ``architectures`` lists;
    ModelFilesError naming ``where`` and the known ones when it lists none."""
    listed = raw.get("architectures") or []
    known = {a.hf_name: a for a in registered()}
    found = next((known[name] for name in listed if isinstance(name, str) and name in known), None)
    if found is None:
        raise ModelFilesError(
            f"{where}: architecture {listed or 'missing'} is not supported; expected one of {sorted(known)}"
        )
    return found


def config_from(raw: dict[str, Any], where: Path | str = "config.json") -> ModelConfig:
    """A ``config.json``'s content as the engine's ``ModelConfig``, by its architecture."""
    return of_config(raw, where).model_config(raw, where)


def load_config(folder: Path) -> ModelConfig:
    """The ``config.json`` of a model folder as the engine's ``ModelConfig``."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFilesError(f"{path} is missing") from None
    except ValueError as exc:
        raise ModelFilesError(f"{path} is not valid JSON: {exc}") from None
    return config_from(raw, path)
