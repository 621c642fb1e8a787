"""Checkpoints of a training run: format, metadata, verification, inspection; the callback.

* :mod:`~kdist.checkpointing.format` — step directories, what counts as committed, moving a
  damaged step aside, fsync, the writability check.
* :mod:`~kdist.checkpointing.metadata` — ``kdist.json``, the commit marker.
* :mod:`~kdist.checkpointing.verify` — sizes and SHA-256 checksums of a step's files.
* :mod:`~kdist.checkpointing.state` — the training state as checkpoint keys; reading it back.
* :mod:`~kdist.checkpointing.restore` — the newest intact step to resume from; initial weights.
* :mod:`~kdist.checkpointing.layer_layout` — restoring across layer layouts (unstacked <->
  stacked blocks, a pipeline's repeats).
* :mod:`~kdist.checkpointing.agreement` — decisions every process takes alike (host
  all-gather).
* :mod:`~kdist.checkpointing.inspect` — ``kdist inspect``.
* :mod:`~kdist.checkpointing.callback` — the ``Checkpoint`` Keras callback (also exported as
  ``kdist.callbacks.Checkpoint``).

Why not Keras' ``OrbaxCheckpoint`` / ``BackupAndRestore``: they replay the batches of an
interrupted epoch, number steps by epoch or by batch depending on ``save_freq``, swallow
the failure of the last asynchronous save (keras issue 23609) and delete their backup when
``TerminateOnNaN`` stops training (keras issue 21771). Here:

* **Exact resume.** Training step, data position (the dataset's ``start_step``), optimizer
  state, RNG states and metric accumulators are restored; ``fit`` starts at the right epoch
  and the interrupted epoch runs only its remaining steps. Bit-identical on the same mesh.
* **Only durable steps are announced.** "step N committed", ``on_checkpoint`` and
  ``committed_step`` come after orbax renamed the step into place and every file, the step
  directory and its parent were fsynced: a kill at any moment after it resumes from step N.
* **Integrity.** Every file's size and SHA-256 are recorded at commit (hashed on orbax's
  background thread) and checked before a restore; a damaged newest step is moved aside
  (``<step>.damaged-<time>``, with a warning) and the next older intact one is used.
* **Loud, early failures.** An unwritable directory fails before the first step. A failed
  asynchronous save raises ``CheckpointError`` from the next save or from ``fit``; a
  non-finite loss or weight skips the save (and so never rotates a good one out).
* **Preemption.** On SIGTERM or SIGINT the current step is saved and committed at the end of
  the batch, the epoch-end validation is skipped, and the process exits with status
  ``128 + signal`` (a second SIGINT interrupts at once).
* **Resharding.** Arrays are restored straight into the current variables' shardings.

Multiple processes (``jax.process_count() > 1``): construct the callback identically in
every process with the same (shared-filesystem) directory. Every process writes its own
shards; process 0 writes ``kdist.json`` and orbax commits after a barrier; only process 0
deletes partial steps or moves damaged ones aside. Decisions that could differ between
processes — a signal arrived, ``save_every_seconds`` elapsed, the directory is writable —
are agreed with a host all-gather, so all processes save the same step.
Example:
    >>> from kdist.checkpointing import committed_steps
    >>> committed_steps("/nonexistent")
    []
"""

from kdist.checkpointing.callback import Checkpoint
from kdist.checkpointing.format import CheckpointError, committed_steps, read_metadata
from kdist.checkpointing.inspect import inspect_directory
from kdist.checkpointing.state import state_variables
from kdist.checkpointing.verify import verify_step

__all__ = ["Checkpoint", "CheckpointError", "committed_steps", "inspect_directory",
           "read_metadata", "state_variables", "verify_step"]
