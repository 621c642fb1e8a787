"""``kdist.callbacks.Checkpoint``: the checkpoint callback, which lives in
:mod:`kdist.checkpointing.callback` with the format, verification and inspection it uses.

This module keeps the names it always exported (``from kdist.callbacks.checkpoint import
committed_steps`` and the like) working.

Example:
    >>> from kdist.callbacks.checkpoint import Checkpoint, committed_steps
"""

from kdist.checkpointing import (
                                 Checkpoint,
                                 CheckpointError,
                                 committed_steps,
                                 inspect_directory,
                                 read_metadata,
                                 state_variables,
                                 verify_step,
)

__all__ = ["Checkpoint", "CheckpointError", "committed_steps", "inspect_directory",
           "read_metadata", "state_variables", "verify_step"]
