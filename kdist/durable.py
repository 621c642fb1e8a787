"""Files that survive a crash or a power loss: fsync of files and directories, SHA-256
checksums, and the writability probe run before anything is written — shared by
checkpoints (:mod:`kdist.checkpointing`) and the replica groups' store
(:mod:`kdist.groups.store`).

Example:
    >>> file_checksum(Path("/dev/null"))
    'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

CHECKSUM = "sha256"
_CHUNK = 8 * 2**20


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsyncs every file and directory under ``root``, then ``root``'s parent (which holds the
    rename that made ``root`` final): after this the tree survives a power loss too."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
    fsync_dir(root.parent)


def file_checksum(path: Path) -> str:
    """The hex SHA-256 of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def probe_writable(directory: Path) -> None:
    """Creates ``directory`` if needed and writes (then removes) a probe file in it; the
    ``OSError`` of the first step that fails is raised (callers name the fix)."""
    probe = directory / f".kdist-write-test-{uuid.uuid4().hex}"
    directory.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"ok")
    probe.unlink()
