"""Folders under the data folder: 0700, whichever part of splitbus creates them first.

``Path.mkdir(mode=0o700, parents=True)`` gives that mode to the last folder only (the parents it
makes get 0777 less the umask: 0755), and ``exist_ok`` leaves a folder that is already there as it
is. So the data folder and ``models/`` came out 0755 when a conversion or ``fetch-model`` made
them before the embedded Redis did, and stayed so.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE = 0o700


def create_private(folder: Path) -> Path:
    """Create ``folder`` and each missing parent, every one 0700 (the umask cannot widen or narrow
    it). A folder that exists is left as it is: the data folder may be one the user made and
    shares on purpose (splitbus's own folders in it are 0700 all the same, by :func:`private_folder`)."""
    missing = [path for path in (folder, *folder.parents) if not path.exists()]
    for path in reversed(missing):
        try:
            path.mkdir(mode=PRIVATE)
        except FileExistsError:  # another process made it meanwhile, through this function too
            continue
        os.chmod(path, PRIVATE)
    return folder


def private_folder(folder: Path) -> Path:
    """A folder splitbus owns by its name (``models/``, ``models/gguf/``, ``redis/``...): created as
    :func:`create_private` does, or, when it is there already (an older splitbus made it 0755),
    set to 0700 if it is this user's. A symbolic link is followed and its target left alone: the
    user pointed it elsewhere on purpose."""
    create_private(folder)
    if folder.is_symlink():
        return folder
    info = folder.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(folder, PRIVATE)
    return folder
