"""Text corpora as lists of documents, split deterministically by document.

The embedded default corpus, ``"python-stdlib"``, is the source of the Python standard
library installed with the running interpreter: real text present on every machine, read
with no download. Each ``.py`` file is one document; test suites and ``site-packages`` are
left out. A file goes to validation when a hash of its relative path says so, so the split
is the same on every run and machine with the same Python.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import hashlib
import os
import sysconfig
from pathlib import Path

from kdist.data.checks import decode_text

STDLIB = "python-stdlib"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents of one source, split into train and validation.

    Attributes:
        name: the source name (used in cache keys).
        train: training documents.
        validation: held-out documents (whole files: no text is shared with train).
        fingerprint: a hash of the names and sizes of every document, for cache keys.
    """

    name: str
    train: list[str]
    validation: list[str]
    fingerprint: str


def is_validation(relative_path: str, validation_fraction: float) -> bool:
    """Deterministic by-document split: a stable hash of the path picks the side."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < validation_fraction


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's root and its ``.py`` files, sorted, without tests/site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return root, files


def canonical_encoding(encoding: str) -> str:
    """The codec's canonical name (``"latin-1"`` -> ``"iso8859-1"``); ``ValueError`` if unknown."""
    try:
        return codecs.lookup(encoding).name
    except (LookupError, TypeError):
        raise ValueError(
            f"Unknown text encoding {encoding!r} (encoding=, --encoding). Use a Python codec "
            f"name such as 'utf-8', 'latin-1' or 'cp1252'."
        ) from None


def load_corpus(
    source: str = STDLIB, validation_fraction: float = 0.05, encoding: str = "utf-8"
) -> Corpus:
    """Loads a corpus: ``"python-stdlib"``, or a local text file, directory or glob.

    Local sources use every file matched (directories recursively, ``*.txt``, ``*.md``,
    ``*.py``), one document per file; a single file is cut at line boundaries into
    ``_PIECES_OF_ONE_FILE`` documents so that it can still be split. Local files are decoded
    with ``encoding`` (the standard library is UTF-8); bytes not valid in it are counted and
    warned about, and a file with more than 0.1% of them is refused
    (:func:`kdist.data.checks.decode_text`).

    Example:
        >>> corpus = load_corpus("python-stdlib")
        >>> len(corpus.train) > 10 * len(corpus.validation) > 0
        True
    """
    if not 0 < validation_fraction < 1:
        raise ValueError(
            f"validation_fraction must be in (0, 1); got {validation_fraction}."
        )
    encoding = canonical_encoding(encoding)
    if source == STDLIB:
        root, files = stdlib_files()
        encoding = "utf-8"
    else:
        root, files = local_files(source)
    train, validation = [], []
    # The encoding is part of the key (another decoding is another text); UTF-8 keeps the
    # key that stores written before the encoding option have.
    fingerprint = hashlib.sha256(
        source.encode() + (b"" if encoding == "utf-8" else f"|{encoding}".encode()))
    for relative, text in _documents(root, files, encoding):
        if not text.strip():
            continue
        fingerprint.update(f"{relative}:{len(text)}\n".encode())
        (validation if is_validation(relative, validation_fraction) else train).append(text)
    if not train or not validation:
        raise ValueError(
            f"Corpus {source!r} gave {len(train)} training and {len(validation)} validation "
            f"documents; both must be non-empty. Provide more files, or change "
            f"validation_fraction ({validation_fraction})."
        )
    return Corpus(source, train, validation, fingerprint.hexdigest()[:16])


_PIECES_OF_ONE_FILE = 100


def read_text(path: Path, encoding: str = "utf-8") -> str:
    """A text file's contents, decoded with ``encoding``, undecodable bytes counted (a
    warning naming the file) and refused above 0.1% of its bytes."""
    return decode_text(path.read_bytes(), str(path), encoding)


def _documents(root: Path, files: list[Path], encoding: str = "utf-8"):
    """(relative name, text) per document."""
    if len(files) == 1:
        lines = read_text(files[0], encoding).splitlines(keepends=True)
        step = max(1, -(-len(lines) // _PIECES_OF_ONE_FILE))
        for k in range(0, len(lines), step):
            yield f"{files[0].name}#{k // step}", "".join(lines[k : k + step])
        return
    for path in files:
        yield str(path.relative_to(root)), read_text(path, encoding)


def local_files(source: str) -> tuple[Path, list[Path]]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in {".txt", ".md", ".py"}
        )
        return path, files
    if path.is_file():
        return path.parent, [path]
    matches = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
    if not matches:
        raise ValueError(
            f"Corpus source {source!r} is neither {STDLIB!r} nor an existing file, directory "
            f"or glob with matches. Pass a path to local text, or use {STDLIB!r}."
        )
    return Path(os.path.commonpath([p.parent for p in matches])), matches
