"""Where a (re)started group resumes: the job's step, not its own checkpoint's.

A group restarted after a failure (or a spare in its place) restores its own last
checkpoint, which may be many rounds behind the job: killed again before it saved, or
with no checkpoint at all. Were it to train on from there, it would repeat steps the job
has passed, fall behind by as many rounds and, once the others finished, train its last
rounds alone. :func:`skip_to_job` moves it to the step of the job's newest outer state
instead — the outer weights it joins with are that state's — so the group goes on in step
with the others; the data of the steps it skips is what the failure cost (torchft's
recovering replica, too, takes the step from its healthy peers).
"""

from __future__ import annotations

from kdist.groups.store import Store, StoreError
from kdist.parallel.group_jobs import from_environment


def job_step(job) -> int:
    """The step (``fit`` batches) of the job's newest committed outer state: the furthest
    of its members' published steps; 0 for a new job."""
    store = Store(job.store, job.index)
    for r in reversed(store.outer_rounds()):
        try:
            meta = store.outer_meta(r) or {}
        except StoreError:  # a damaged marker: the join sets it aside; the one before counts
            continue
        return max((s for s in meta.get("steps", []) if s is not None), default=0)
    return 0


def skip_to_job(checkpoint, model, total_steps: int) -> int:
    """After ``checkpoint.restore(model)``: in a separate group job whose newest outer state
    is ahead of the restored step, moves the run on to it (``Checkpoint.skip_to``), keeping
    at least one round of the ``total_steps`` (``fit`` batches) to train so the group still
    joins and ends with the job's outer weights. Returns the step to continue from (the
    restored one outside a group job, or when nothing is to skip).

    Example:
        >>> start = kdist.groups.skip_to_job(checkpoint, model, total_steps=2000)  # doctest: +SKIP
    """
    from kdist.groups.host import agree, say  # (JAX: not at the launcher's import)

    job = from_environment()
    restored = checkpoint.step
    if job is None:
        return restored
    optimizer = model.optimizer
    period = optimizer.sync_every * optimizer.accumulation  # fit batches per round
    reached = agree(job_step(job))  # one answer for the group's processes
    target = min(reached, max(total_steps - period, 0))
    target -= target % period
    if target <= restored:
        return restored
    say(f"group {job.index} restored step {restored}; the job's newest outer state is at "
        f"step {reached}: it continues from step {target} (its data share of steps "
        f"{restored + 1}-{target} skipped)")
    return checkpoint.skip_to(target, model)
