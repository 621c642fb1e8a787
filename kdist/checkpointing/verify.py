"""Integrity of a committed step: every file listed in ``kdist.json`` present, with its size
and (when recorded) its SHA-256 checksum.

SHA-256 because it is the standard and, with the SHA extensions of current x86 and ARM CPUs,
about 1.9 GB/s on one core here (``benchmarks/checkpoint_hashing.py`` measures what it adds
to a save and a restore).
"""

from __future__ import annotations

import os
from pathlib import Path

from kdist.checkpointing.format import METADATA_NAME, CheckpointError, read_metadata
from kdist.durable import CHECKSUM, file_checksum


def verify_step(step_dir: str | os.PathLike, checksums: bool = True) -> list[str]:
    """Integrity problems of a step directory (empty list: intact), each naming a file.

    Checks that the commit marker ``kdist.json`` exists, that every file it lists is present
    with its recorded size and, with ``checksums`` and when the step recorded them (steps
    saved before kdist recorded checksums have sizes only), that its content hashes to the
    recorded SHA-256 (bytes flipped in place fail).

    Example:
        >>> verify_step("runs/gpt/checkpoints/200")  # doctest: +SKIP
        []
    """
    return check_files(step_dir, checksums)[1]


def check_files(step_dir: str | os.PathLike,
                checksums: bool = True) -> tuple[list[dict], list[str]]:
    """What :func:`verify_step` checked, file by file, and the problems it found: one row
    ``{"file", "bytes", "sha256", "ok"}`` per file ``kdist.json`` lists (``sha256``: the
    recorded checksum the file was hashed against, None where the step recorded none or
    ``checksums`` is off) — what ``kdist inspect --read`` prints.

    Example:
        >>> check_files("runs/gpt/checkpoints/200")[0][0]["file"]  # doctest: +SKIP
        'default/manifest.ocdbt'
    """
    step_dir = Path(step_dir)
    try:
        meta = read_metadata(step_dir)
    except CheckpointError as e:
        return [], [str(e)]
    rows, problems = [], []
    sums = meta.get("checksums") or {}
    for rel, size in meta.get("files", {}).items():
        f = step_dir / rel
        problem = None
        if not f.is_file():
            problem = f"{f} is missing"
        elif f.stat().st_size != size:
            problem = (f"{f} has {f.stat().st_size} bytes, {size} were written "
                       f"(truncated or overwritten)")
        elif checksums and rel in sums and file_checksum(f) != sums[rel]:
            problem = (f"{f} has the recorded size but not the recorded {CHECKSUM} "
                       f"checksum (its bytes changed after the save: corrupt)")
        rows.append({"file": rel, "bytes": size, "ok": problem is None,
                     "sha256": sums.get(rel) if checksums else None})
        if problem:
            problems.append(problem)
    if not meta.get("files"):
        problems.append(f"{step_dir / METADATA_NAME} lists no files")
    return rows, problems
