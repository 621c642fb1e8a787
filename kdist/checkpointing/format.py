"""The on-disk layout of a checkpoint directory: step directories, what counts as committed,
moving a damaged step aside, durability (fsync) and the writability check.

A directory ``DIR`` holds one sub-directory per step, ``DIR/<step>/``:

* ``default/`` — orbax's array store (OCDBT), every process writing its own shards.
* ``kdist.json`` — the commit marker and metadata (see :mod:`kdist.checkpointing.metadata`),
  written by process 0 inside orbax's temporary directory after every array is written and
  before orbax renames the directory into place.

A step counts (is *committed*) only if its directory has its final name ``<step>`` and holds
``kdist.json``. A temporary directory (``<step>.orbax-checkpoint-tmp*``) is left over from
an interrupted save and deleted; a final directory without ``kdist.json`` lost its marker
after the commit and is moved aside like any damaged step (``<step>.damaged-<UTC time>``,
kept for inspection, never deleted by kdist).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from kdist.durable import fsync_dir, probe_writable

METADATA_NAME = "kdist.json"
ITEM_DIR = "default"  # orbax's directory for a single-item checkpoint
TMP_MARK = ".orbax-checkpoint-tmp"
DAMAGED_MARK = ".damaged-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or no usable checkpoint could be restored."""


def step_dirs(directory: Path) -> tuple[dict[int, Path], list[Path]]:
    """Final step directories by step (sorted), and partial (temporary) ones.

    Example:
        >>> step_dirs(Path("/nonexistent"))
        ({}, [])
    """
    final, partial = {}, []
    if not directory.is_dir():
        return final, partial
    for p in directory.iterdir():
        if not p.is_dir():
            continue
        if TMP_MARK in p.name:
            partial.append(p)
        elif p.name.isdigit():
            final[int(p.name)] = p
    return dict(sorted(final.items())), sorted(partial)


def damaged_dirs(directory: Path) -> list[Path]:
    """Step directories moved aside as damaged (``<step>.damaged-<time>``), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if DAMAGED_MARK in p.name)


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """Steps with a commit marker, oldest first (integrity not checked; see verify_step).

    Example:
        >>> committed_steps("/nonexistent")
        []
    """
    final, _ = step_dirs(Path(directory))
    return [s for s, p in final.items() if (p / METADATA_NAME).is_file()]


def read_metadata(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``kdist.json`` of a step directory (raises ``CheckpointError`` naming the file).

    Example:
        >>> read_metadata("runs/gpt/checkpoints/200")["step"]  # doctest: +SKIP
        200
    """
    path = Path(step_dir) / METADATA_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing: step {Path(step_dir).name} was never "
                              f"committed (interrupted save).") from e
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from e


def listing(directory: Path) -> str:
    """The names in ``directory`` for an error message."""
    if not directory.is_dir():
        return "no such directory"
    return str(sorted(p.name for p in directory.iterdir())) or "empty"


def array_files(root: Path) -> list[Path]:
    """The files of a step's array store, sorted. Only those: orbax rewrites its step-level
    ``_CHECKPOINT_METADATA`` at commit, so its size and checksum are not stable."""
    return sorted(f for f in (root / ITEM_DIR).rglob("*") if f.is_file())


def remove_partial(directory: Path) -> tuple[list[Path], list[tuple[Path, Path]]]:
    """Cleans what interrupted saves left: deletes temporary directories; moves aside
    (:func:`move_aside`, never deletes) a final step directory without ``kdist.json`` — a
    committed step whose marker was lost afterwards, whose arrays may be all there. Returns
    ``(removed, [(step dir, where it went)])``.

    Example:
        >>> remove_partial(Path("/nonexistent"))
        ([], [])
    """
    final, partial = step_dirs(directory)
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    unmarked = [p for p in final.values() if not (p / METADATA_NAME).is_file()]
    return partial, [(p, move_aside(p)) for p in unmarked]


def clean_partial(directory: Path) -> None:
    """:func:`remove_partial`, with a warning for each directory removed or moved aside."""
    removed, moved = remove_partial(directory)
    for p in removed:
        warnings.warn(f"Checkpoint: removed {p}, left by an interrupted save.", stacklevel=3)
    for p, aside in moved:
        warnings.warn(f"Checkpoint: step {p.name} has no {METADATA_NAME} (its commit marker "
                      f"was lost); moved it aside to {aside}, kept for inspection.",
                      stacklevel=3)


def move_aside(step_dir: Path) -> Path:
    """Renames a damaged step directory to ``<step>.damaged-<UTC time>`` (kept, not deleted):
    it no longer counts as a step, so training can save that step number again.

    Example:
        >>> move_aside(Path("runs/gpt/ckpt/200"))  # doctest: +SKIP
        PosixPath('runs/gpt/ckpt/200.damaged-20260101T120000Z')
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = step_dir.with_name(f"{step_dir.name}{DAMAGED_MARK}{stamp}")
    n = 1
    while target.exists():
        target = step_dir.with_name(f"{step_dir.name}{DAMAGED_MARK}{stamp}-{n}")
        n += 1
    step_dir.rename(target)
    fsync_dir(step_dir.parent)
    return target


def check_writable(directory: Path) -> None:
    """Creates ``directory`` if needed and writes (then removes) a probe file in it; raises
    ``CheckpointError`` naming the path and the fix when it cannot.

    Example:
        >>> check_writable(Path("/proc/kdist"))  # doctest: +SKIP
        Traceback (most recent call last):
        CheckpointError: The checkpoint directory /proc/kdist is not writable ...
    """
    try:
        probe_writable(directory)
    except OSError as e:
        raise CheckpointError(
            f"The checkpoint directory {directory} is not writable ({type(e).__name__}: "
            f"{e.strerror or e}); it is checked before training and before every save. Fix "
            f"its permissions (e.g. 'chmod u+w {directory}'), free space, or pass another "
            f"directory."
        ) from e
