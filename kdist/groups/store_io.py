"""How the replica store writes and reads its files: JSON records created atomically (or
exclusively: the first writer wins), orbax trees, checksums, and the waiting out of a full
or read-only store — what :mod:`kdist.groups.store`'s layout is built from.

Example:
    >>> retrying("a record", "/tmp", lambda: 1)
    1
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

from kdist import orbax_writer as writer
from kdist.durable import file_checksum, fsync_dir

STORE_WAIT = 300.0  # seconds a write waits for a full or read-only store before giving up
# Errors that mean "the store cannot take this write now", not "the write is wrong": a full
# disk or quota, a file system remounted read-only, permissions taken away, an I/O error of
# a network mount. Worth waiting for; anything else is raised at once.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                  errno.EIO}


class StoreError(RuntimeError):
    """The store is unusable, damaged, or a round cannot close."""


def storage_unavailable(error: BaseException) -> bool:
    """Whether ``error`` is the store refusing writes (full, read-only), which may pass.
    orbax reports a full disk as ``ValueError("RESOURCE_EXHAUSTED...")``, not an OSError."""
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
        return True
    text = str(error)
    return any(k in text for k in ("RESOURCE_EXHAUSTED", "No space left", "Read-only file"))


def say(text: str) -> None:
    """``[groups] text`` on stdout; output that cannot be written (a closed pipe: the
    supervisor died) is dropped, never raised — it must not stop a save."""
    try:
        print(f"[groups] {text}", flush=True)
    except (OSError, ValueError):
        pass


def retrying(what: str, path, write, wait: float | None = None, say=say):
    """Runs ``write()``; while the store refuses writes (:func:`storage_unavailable`),
    retries with backoff (0.1 s doubling to 5 s), saying once ``store full / read-only at
    PATH, waiting`` and once that it went on. After ``wait`` seconds (default
    :data:`STORE_WAIT`; 0: no retry) a :class:`StoreError` naming ``what`` and ``path``."""
    limit = STORE_WAIT if wait is None else wait
    began, delay, said = time.monotonic(), 0.1, False
    while True:
        try:
            result = write()
        except Exception as e:  # noqa: BLE001 (filtered just below)
            if not storage_unavailable(e):
                raise
            waited = time.monotonic() - began
            if waited >= limit:
                raise StoreError(
                    f"The replica store at {path} stayed full or read-only for {waited:.0f} s "
                    f"({e}): {what} was not written. Free space (or make it writable) and "
                    f"relaunch: the job resumes from its newest durable outer state.") from e
            if not said:
                said = True
                say(f"store full / read-only at {path} ({e}), waiting up to {limit:.0f} s "
                    f"to write {what}")
            time.sleep(min(delay, max(limit - waited, 0.0)))
            delay = min(2 * delay, 5.0)
            continue
        if said:
            say(f"store at {path} writable again after {time.monotonic() - began:.1f} s: "
                f"{what} written")
        return result


def write_json(path: Path, value: dict, exclusive: bool = False) -> bool:
    """Writes ``value`` to ``path`` atomically (a temporary file, fsynced, renamed; with
    ``exclusive`` linked, so an existing ``path`` is kept). Returns False only when
    ``exclusive`` and ``path`` already existed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    try:
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, None if there is no such file; a file that is not one
    (emptied, truncated, overwritten by hand) is a :class:`StoreError` naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise StoreError(f"{path} is damaged: not UTF-8 text ({e}).") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreError(f"{path} is damaged: {len(text.encode())} bytes that are not a JSON "
                         f"record ({e}).") from None
    if not isinstance(value, dict):
        raise StoreError(f"{path} is damaged: a JSON {type(value).__name__}, not a record.")
    return value


def new_attempt() -> str:
    """A random id naming one attempt's directory (every process of a group must use the
    same one: :func:`kdist.groups.host.agree` it)."""
    return os.urandom(6).hex()


def orbax_save(target: Path, tree: dict, clean: bool) -> None:
    """Saves ``tree`` to ``target`` with orbax; with ``clean`` (one process writes it all)
    first removing what a failed try of this same attempt left (a full disk interrupts a
    save half-way). Never with several processes: another one may be writing there now."""
    import orbax.checkpoint as ocp

    for leftover in target.parent.glob(f"{target.name}*") if clean else ():
        shutil.rmtree(leftover, ignore_errors=True)
    with writer.checkpointer() as checkpointer:
        checkpointer.save(target, args=ocp.args.PyTreeSave(tree))


def checksums(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): file_checksum(f)
            for f in sorted(root.rglob("*")) if f.is_file() and f.name != "_CHECKPOINT_METADATA"}


def restore(source: Path, target: dict) -> dict:
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(source, args=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
