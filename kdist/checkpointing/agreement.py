"""Decisions every process of a job must take alike, agreed with a host all-gather.

With several processes, a decision taken locally — a signal arrived, ``save_every_seconds``
elapsed, the directory is writable — could differ between processes, and one process would
then wait for the others in a collective or an orbax barrier (minutes, until a timeout).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from kdist.checkpointing.format import CheckpointError, check_writable


def any_process(flags: list[bool]) -> list[bool]:
    """Each flag OR-ed over every process (a host all-gather; as is with one process).

    Example:
        >>> any_process([True, False])
        [True, False]
    """
    if jax.process_count() == 1:
        return flags
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.array(flags, np.int32))
    return [bool(x) for x in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0)]


def check_writable_everywhere(directory: Path) -> None:
    """:func:`~kdist.checkpointing.format.check_writable` in every process; all raise
    ``CheckpointError`` together if any fails.

    Example:
        >>> check_writable_everywhere(Path("runs/gpt/ckpt"))  # doctest: +SKIP
    """
    error = None
    try:
        check_writable(directory)
    except CheckpointError as e:
        error = e
    if any_process([error is not None])[0]:
        raise error or CheckpointError(
            f"The checkpoint directory {directory} is not writable from another process of "
            f"this job; fix it on every host.")


def save_failed(directory: Path, e: BaseException) -> CheckpointError:
    """The error of a failed save: what failed, the steps still there, where a rerun resumes."""
    from kdist.checkpointing.format import committed_steps
    from kdist.checkpointing.verify import verify_step

    # Sizes only (no hashing on the error path): the step a rerun would resume from.
    intact = [s for s in committed_steps(directory)
              if not verify_step(directory / str(s), checksums=False)]
    disk_full = (isinstance(e, OSError) and e.errno == 28) or \
        "RESOURCE_EXHAUSTED" in str(e) or "No space left" in str(e)  # 28: ENOSPC
    return CheckpointError(
        f"Saving a checkpoint to {directory} failed{' (disk full)' if disk_full else ''}: "
        f"{type(e).__name__}: {e}. Committed steps still there: {intact}. Free space or fix "
        f"the directory, then rerun: training resumes from step {intact[-1] if intact else 0}."
    )
