"""``kdist inspect``: a report on a checkpoint directory (steps, sizes, config, integrity)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kdist.checkpointing.format import (
    METADATA_NAME,
    CheckpointError,
    damaged_dirs,
    read_metadata,
    step_dirs,
)
from kdist.checkpointing.state import restore_tree
from kdist.checkpointing.verify import check_files


def inspect_directory(directory: str | os.PathLike, read_arrays: bool = False) -> tuple[str, bool]:
    """A report on a checkpoint directory: steps, sizes, config, integrity. Returns
    ``(text, ok)``; ``ok`` is False when a committed step is damaged. Given a directory
    without steps, such as a run's output directory, it reports the checkpoint directories
    found below it (:func:`checkpoint_directories`); none found is a ``ValueError``.

    Every committed step is verified from its recorded sizes and SHA-256 checksums (steps
    saved without checksums: sizes only). With ``read_arrays``, every array of every step
    is also read back (onto one device), and each file's size and verified SHA-256 are
    listed under its step. Only committed steps (renamed into place, with ``kdist.json``)
    are listed as steps; partial saves and steps moved aside as damaged are listed as such.
    A relative ``directory`` is read from the current directory.

    Example:
        >>> text, ok = inspect_directory("runs/gpt_pretrain/checkpoints")  # doctest: +SKIP
    """
    directory = Path(directory).expanduser().absolute()  # orbax reads absolute paths only
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory. Pass a checkpoint directory "
                         f"(the recipes' --checkpoint-dir, default OUTPUT_DIR/checkpoints).")
    found = checkpoint_directories(directory)
    if not found:
        raise ValueError(f"No checkpoints in {directory}, nor in the directories below it. "
                         f"Pass the directory a run saved them to (the recipes' "
                         f"--checkpoint-dir, default OUTPUT_DIR/checkpoints).")
    if found == [directory]:
        return _inspect(directory, read_arrays)
    reports = [_inspect(d, read_arrays) for d in found]  # e.g. a run's OUTPUT_DIR
    names = ", ".join(str(d.relative_to(directory)) for d in found)
    return "\n".join([f"{directory} holds no checkpoints itself; found below it: {names}"]
                     + [text for text, _ in reports]), all(ok for _, ok in reports)


def checkpoint_directories(directory: Path) -> list[Path]:
    """``directory`` if it holds steps (committed, partial or moved aside as damaged), else
    the directories one or two levels below it that do: a run's ``OUTPUT_DIR/checkpoints``,
    separate replica group jobs' ``OUTPUT_DIR/group-*/checkpoints``.

    Example:
        >>> checkpoint_directories(Path("/nonexistent"))
        []
    """
    def holds_steps(d: Path) -> bool:
        final, partial = step_dirs(d)
        return bool(final or partial or damaged_dirs(d))

    if holds_steps(directory):
        return [directory]
    for pattern in ("*", "*/*"):
        found = sorted(d for d in directory.glob(pattern) if d.is_dir() and holds_steps(d))
        if found:
            return found
    return []


def _inspect(directory: Path, read_arrays: bool) -> tuple[str, bool]:
    """:func:`inspect_directory`'s report on one directory that holds steps."""
    final, partial = step_dirs(directory)
    aside = damaged_dirs(directory)
    lines, ok, newest = [f"checkpoint directory {directory}"], True, None
    lines.append(f"{'step':>8}  {'size':>10}  {'loss':>9}  {'saved (UTC)':20}  status")
    for s, p in final.items():
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        files, problems = check_files(p)
        meta = {}
        if (p / METADATA_NAME).is_file():
            try:
                meta = read_metadata(p)
            except CheckpointError:
                pass
        if not problems and read_arrays:
            problems = _read_check(p, meta)
        status = "ok" if not problems else "DAMAGED: " + "; ".join(problems)
        if not problems and not meta.get("checksums"):
            status = "ok (sizes only: saved without checksums)"
        ok &= not problems
        if not problems:
            newest = meta
        loss = meta.get("loss")
        lines.append(f"{s:>8}  {size / 2**20:>8.1f}MB  "
                     f"{'' if loss is None else f'{loss:.4f}':>9}  "
                     f"{meta.get('wall_time_utc', ''):20}  {status}")
        if read_arrays:
            lines += [f"{'':>10}{row['file']}  {row['bytes']:,} bytes  "
                      + (f"sha256 {row['sha256']} " if row["sha256"] else "size only, ")
                      + ("verified" if row["ok"] else "DAMAGED") for row in files]
    for p in partial:
        lines.append(f"{'':>8}  partial save {p.name} (ignored; removed on the next run)")
    for p in aside:
        lines.append(f"{'':>8}  moved aside as damaged: {p.name} (ignored; kept for "
                     f"inspection, delete it when done)")
    if newest:
        config = newest.get("model_config", {})
        inner = config.get("config", {}) if isinstance(config, dict) else {}
        backbone = inner.get("backbone", {}).get("config", inner) if isinstance(inner, dict) else {}
        lines.append(f"newest intact: step {newest['step']}, data position "
                     f"{newest.get('data_step')}, mesh {newest.get('mesh', {}).get('spec')} "
                     f"{newest.get('mesh', {}).get('shape')}, {newest.get('process_count')} "
                     f"process(es), versions {newest.get('versions')}")
        lines.append(f"model: {config.get('class_name', '?') if isinstance(config, dict) else '?'} "
                     + json.dumps({k: v for k, v in backbone.items()
                                   if isinstance(v, (int, float, str, bool))}))
        n = sum(int(np.prod(v["shape"])) for k, v in newest.get("variables", {}).items()
                if k.startswith("params."))
        lines.append(f"parameters: {n:,}")
    return "\n".join(lines), ok


def _read_check(step_dir, meta) -> list[str]:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {k: jax.ShapeDtypeStruct(tuple(v["shape"]), jnp.dtype(v["dtype"]), sharding=device)
            for k, v in meta["variables"].items()}
    try:
        restore_tree(step_dir, tree)
    except Exception as e:  # noqa: BLE001
        return [f"reading the arrays of {step_dir} failed: {e}"]
    return []
