"""The token store: a corpus tokenized once into a memory-mapped ``.npy`` token stream.

Documents are tokenized, each followed by the end-of-text id, and concatenated into one
stream, written under a lock and a temporary name (concurrent processes build it once; a
crash never leaves a store that looks finished). Ids are checked against the vocabulary
while they are written (before the cast to the store's dtype could wrap them), and the
store's id range is kept beside it (``PATH.meta.json``) and checked whenever it is opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
from pathlib import Path

import keras
import numpy as np

from kdist.data.checks import check_id_range
from kdist.data.tokenizer import END_OF_TEXT

_ENCODE_CHUNK = 64  # documents per tokenizer call
# A fixed-size .npy header: written as a placeholder first, rewritten with the length last.
_HEADER_BYTES = 128


@contextlib.contextmanager
def exclusive(lock_path: Path):
    """An exclusive lock between processes (``flock`` on ``lock_path``), held in the block.

    Processes that start together (the ranks of one job, or several jobs on one cache)
    then build a tokenizer or token store once, and the others wait and reuse it.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """A version-1.0 ``.npy`` header for a 1-D array, padded to ``_HEADER_BYTES``."""
    text = (f"{{'descr': {np.lib.format.dtype_to_descr(np.dtype(dtype))!r}, "
            f"'fortran_order': False, 'shape': ({length},), }}")
    body = text.ljust(_HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


def token_store(
    documents, tokenizer, path: Path, num_documents: int | None = None, verbose: bool = True,
    what: str | None = None, end_of_text: str = END_OF_TEXT,
) -> np.ndarray:
    """The memory-mapped token stream of ``documents``, tokenized into ``path`` once.

    ``documents`` is an iterable of strings, or a callable returning one (then it is only
    called if the store must be built). It is consumed in a single streaming pass, chunk by
    chunk, each document followed by the id of ``end_of_text``, with a progress bar
    (``num_documents`` sets its target): a corpus larger than memory is never held whole.
    The file is written under a temporary name and renamed when complete, while holding a
    lock: other processes wait and then reuse it, and a crash leaves no file that looks like
    a finished store (its leftover is removed by the next builder).

    The smallest and largest token id are recorded beside the store (``PATH.meta.json``,
    computed in the same pass; for a store without it, in one pass over the file, once), and
    checked against ``tokenizer.vocabulary_size()`` every time the store is opened: an id
    outside ``[0, vocabulary_size)`` (a tokenizer that emits one, a store written by another
    tokenizer) raises ``ValueError`` naming ``what`` (default: the path) rather than training
    on NaN logits and a loss of 0.0.

    Example:
        >>> tokens = token_store(["a b", "c"], tokenizer, Path("/tmp/t.npy"))  # doctest: +SKIP
    """
    path = Path(path)
    if not path.exists():
        with exclusive(path.with_name(path.name + ".lock")):
            if not path.exists():  # another process may have built it while we waited
                _write_token_store(documents, tokenizer, path, num_documents, verbose, what,
                                   end_of_text)
    tokens = np.load(path, mmap_mode="r")
    minimum, maximum = store_id_range(path, tokens)
    if len(tokens):
        check_id_range(
            minimum, maximum, tokenizer.vocabulary_size(), what or f"The token store {path}",
            fix=f"The store does not belong to this tokenizer: delete {path} (and "
                f"{_meta_path(path).name}) to rebuild it, or use the tokenizer it was built "
                f"with.",
        )
    return tokens


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".meta.json")


def store_id_range(path: Path, tokens: np.ndarray | None = None) -> tuple[int, int]:
    """The (smallest, largest) token id of the store at ``path``, from its metadata.

    A store written before the metadata existed gets it now: one pass over the file
    (chunked, so a memory map is never read whole at once), then cached beside it. An empty
    store gives ``(0, -1)``.

    Example:
        >>> store_id_range(Path("/tmp/tokens.npy"))  # doctest: +SKIP
        (0, 8191)
    """
    path = Path(path)
    meta = _meta_path(path)
    stat = path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if meta.exists():
        try:
            recorded = json.loads(meta.read_text())
            if all(recorded.get(k) == v for k, v in key.items()):
                return int(recorded["min_id"]), int(recorded["max_id"])
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or stale: recompute
    if tokens is None:
        tokens = np.load(path, mmap_mode="r")
    minimum, maximum = 0, -1
    chunk = 1 << 24
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start:start + chunk])
        low, high = int(part.min()), int(part.max())
        minimum, maximum = (low, high) if start == 0 else (min(minimum, low), max(maximum, high))
    _write_meta(path, minimum, maximum)
    return minimum, maximum


def _write_meta(path: Path, minimum: int, maximum: int, file: Path | None = None) -> None:
    """Writes ``path``'s metadata; ``file`` (default ``path``) is the file whose size and
    modification time it records (the store under its temporary name, before the rename)."""
    stat = Path(file or path).stat()
    meta = _meta_path(path)
    tmp = meta.with_name(f"{meta.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"min_id": minimum, "max_id": maximum, "size": stat.st_size,
                               "mtime_ns": stat.st_mtime_ns}))
    os.replace(tmp, meta)


def _write_token_store(documents, tokenizer, path, num_documents, verbose, what,
                       end_of_text=END_OF_TEXT) -> None:
    if callable(documents):
        documents = documents()
    eot = tokenizer.token_to_id(end_of_text)
    vocabulary_size = tokenizer.vocabulary_size()
    dtype = np.dtype(np.uint16 if vocabulary_size <= 2**16 else np.uint32)
    for stale in path.parent.glob(path.name + ".tmp*"):  # a crashed builder's leftover
        stale.unlink()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    progress = None
    if verbose:
        print(f"Tokenizing into {path.name} (once; later runs reuse it)", flush=True)
        progress = keras.utils.Progbar(num_documents, unit_name="document")
    length = done = 0
    minimum, maximum = 0, -1  # of the stream, recorded beside the store
    documents = iter(documents)
    with open(tmp, "wb") as out:
        out.write(_npy_header(dtype, 0))
        while chunk := list(itertools.islice(documents, _ENCODE_CHUNK)):
            done += len(chunk)
            texts = [d for d in chunk if d.strip()]  # blank documents are left out
            pieces = []
            for ids in tokenizer.tokenize(texts) if texts else []:
                pieces += [np.asarray(ids, dtype=np.int64), np.asarray([eot], dtype=np.int64)]
            if pieces:
                array = np.concatenate(pieces)
                # Checked before the cast to the store's dtype, which would wrap an id.
                low, high = int(array.min()), int(array.max())
                if low < 0 or high >= vocabulary_size:
                    bad = np.flatnonzero((array < 0) | (array >= vocabulary_size))[0]
                    out.close()
                    tmp.unlink(missing_ok=True)
                    check_id_range(
                        low, high, vocabulary_size, what or f"The token store {path.name}",
                        fix=f"The tokenizer produced id {int(array[bad])} at token "
                            f"{length + int(bad):,} of the stream (documents {done - len(chunk)}"
                            f"-{done - 1}); the tokenizer and its vocabulary_size() disagree.",
                    )
                minimum, maximum = ((low, high) if not length
                                    else (min(minimum, low), max(maximum, high)))
                array = array.astype(dtype)
                out.write(array.tobytes())
                length += array.size
            if progress is not None:
                progress.update(done)
        out.seek(0)
        out.write(_npy_header(dtype, length))
        out.flush()
        os.fsync(out.fileno())
    if verbose:
        print(f"{done:,} documents, {length:,} tokens", flush=True)
    _write_meta(path, minimum, maximum, file=tmp)  # first: a finished store has its metadata
    os.replace(tmp, path)
