"""Choosing the step to resume from (the newest intact one) and reading initial weights."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import keras

from kdist.checkpointing.format import (
    METADATA_NAME,
    CheckpointError,
    committed_steps,
    move_aside,
    read_metadata,
)
from kdist.checkpointing.state import check_compatible, read_arrays
from kdist.checkpointing.verify import verify_step


def newest_intact(directory: Path, variables: dict[str, keras.Variable], candidates: list[int],
                  explicit: bool):
    """``(step_dir, metadata, arrays)`` of the newest of ``candidates`` that verifies (sizes
    and checksums) and reads, newest first.

    A damaged step is skipped with a warning naming the file, and moved aside (process 0)
    once an older intact step is found, so training can save that step number again; with
    no intact step nothing is moved and ``CheckpointError`` lists every problem. With
    ``explicit`` (one candidate the user asked for), damage raises at once.

    Example:
        >>> newest_intact(Path("runs/ckpt"), variables, [4, 8], False)  # doctest: +SKIP
    """
    failures, damaged = [], []
    for s in reversed(candidates):
        step_dir = directory / str(s)
        problems = verify_step(step_dir)
        if not problems:
            meta = read_metadata(step_dir)
            # An incompatible model is the user's to fix, not a reason to fall back.
            check_compatible(meta, variables, step_dir)
            try:
                values = read_arrays(step_dir, variables, keys=list(variables))
            except Exception as e:  # noqa: BLE001 (TensorStore raises ValueError, ...)
                problems = [f"{step_dir}: reading the arrays failed: {e}"]
        if not problems:
            break
        failures.append(f"step {s}: " + "; ".join(problems))
        if explicit:
            raise CheckpointError(f"Checkpoint step {s} is damaged: " + "; ".join(problems))
        damaged.append((step_dir, problems))
    else:
        raise CheckpointError(f"No intact checkpoint in {directory}: " + " | ".join(failures)
                              + ". Move the damaged step directories aside (or delete them) "
                              "to start over.")
    for bad, problems in damaged:
        aside = move_aside(bad) if jax.process_index() == 0 else f"{bad}.damaged-*"
        warnings.warn(f"Checkpoint step {bad.name} is damaged; moved it aside to {aside} "
                      f"(kept for inspection) and resumed from step {s} instead: "
                      + "; ".join(problems), stacklevel=3)
    return step_dir, meta, values


def load_initial_weights(model: keras.Model, variables: dict[str, keras.Variable],
                         source: Path) -> Path:
    """Weights only (``params.*``, ``state.*``) from a checkpoint directory, one of its step
    directories, or a ``.keras`` / ``.weights.h5`` file. Returns what was read.

    Example:
        >>> load_initial_weights(model, variables, Path("runs/a/ckpt"))  # doctest: +SKIP
    """
    if source.is_file():
        with warnings.catch_warnings():  # weights only, by design: no optimizer state
            warnings.filterwarnings("ignore", "Skipping variable loading for optimizer")
            model.load_weights(str(source))
        return source
    if source.is_dir() and not (source / METADATA_NAME).is_file():
        steps = committed_steps(source)
        if not steps:
            raise CheckpointError(f"init_from={source} holds no committed checkpoint.")
        source = source / str(steps[-1])
    problems = verify_step(source)
    if problems:
        raise CheckpointError(f"init_from={source} is damaged: " + "; ".join(problems))
    keys = [k for k in variables if k.startswith(("params.", "state."))]
    check_compatible(read_metadata(source), variables, source, keys)
    values = read_arrays(source, variables, keys)
    for k in keys:
        variables[k].assign(values[k])
    return source
