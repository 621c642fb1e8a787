"""How a group job ends with the job (:class:`kdist.groups.sync.OuterSync`'s part that
ends): never training rounds alone after the job's last round, so every group that
finishes holds the job's last outer weights.

Quorum rounds: every group trains the same steps, so a round published from a group's
last step is the job's last; a group that rejoined behind the job's step ends there
(:meth:`JobEnd._end_with_job`), its remaining steps untrained. Asynchronous rounds close
as each group syncs, so after its own last round a group waits for the others still
training to close theirs, then takes the newest (:meth:`JobEnd._end_with_the_others`).

Example:
    >>> from kdist.groups import job_end, sync
    >>> issubclass(sync.OuterSync, job_end.JobEnd)
    True
"""

from __future__ import annotations

import time

from kdist.groups.host import agree, say
from kdist.groups.store import POLL, STALE_AFTER


class JobEnd:
    """Methods of :class:`kdist.groups.sync.OuterSync` (its ``store``, ``job``, ``model``,
    ``process``, ``heartbeat`` and ``ended`` round) that end a group with the job."""

    def _job_ended_at(self, r: int) -> bool:
        """Whether round ``r`` was the job's last: a member published it from the last step
        of its ``fit`` (quorum rounds, where every group trains the same steps)."""
        if r < 1 or self.job.mode != "quorum":
            return False
        ended = False
        if self.process == 0:
            record = self.store.quorum(r) or {}
            published = self.store.published(r)
            ended = any(published.get(g, {}).get("final") for g in record.get("members", []))
        return bool(agree(int(ended)))

    def _end_with_job(self, state, r: int, step: int):
        """The job ended at round ``r`` while this group, which joined behind the job's
        step, still has steps of its ``fit`` left: it ends with the job's outer state
        instead of training rounds alone (which would leave its final weights unlike every
        other group's), and stops ``fit``; the steps left are what its late rejoin cost."""
        theta, momenta, _ = self._parts(state)
        state = self._with(state, theta, momenta)  # the inner weights back to the job's
        self.ended = r
        self.model.stop_training = True
        self._verify_pending(wait=self.job.deadline)  # no later round checks this one
        if self._last_round():
            say(f"group {self.job.index}: the job ended at round {r}; this group ends with "
                f"it at its last step {step}, with the job's outer weights")
        else:
            say(f"group {self.job.index}: the job ended at round {r} (the other groups' "
                f"last step); this group ends with it at its step {step}, with the job's "
                f"outer weights (its steps after step {step} not trained: it rejoined "
                f"behind the job's step)")
        if self.heartbeat is not None:
            self.heartbeat.beat(state="finished", round=r)
        return state

    def _end_with_the_others(self, state, r: int):
        """Asynchronous, after this group's last round ``r``: the other groups close rounds
        after it — even all of theirs, when one started late — so it waits until each has
        its last gradient in a closed round, or is gone (:meth:`_gone`), and then takes the
        newest closed round, the job's last: every group that finishes ends with the same
        outer weights."""
        said, finished, scanned = False, set(), set()
        began = time.monotonic()
        while True:
            left = []
            if self.process == 0:
                for k in set(self.store.closed_rounds()) - scanned:
                    members = (self.store.quorum(k) or {}).get("members", [])
                    finished |= {g for g, meta in self.store.published(k).items()
                                 if meta.get("final") and g in members}
                    scanned.add(k)
                beats = self.store.heartbeats()
                left = [g for g in range(self.job.count) if g != self.job.index
                        and g not in finished and not self._gone(beats.get(g), began)]
            if not agree(len(left)) or time.monotonic() - began > 10 * self.job.deadline + 60:
                break  # (a group that hangs alive is not waited for beyond that)
            if not said:
                said = True
                say(f"group {self.job.index}: its last round was {r}; waiting for group(s) "
                    f"{left} to close theirs, to end with the job's last outer state")
            time.sleep(4 * POLL)
        closed = self.store.closed_rounds()
        latest = agree(closed[-1] if closed else r)
        # (a group gone meanwhile may be restarted and train on: it then ends after this one)
        if latest > r:
            state = self._catch_up(state, latest)
            say(f"group {self.job.index}: ends with round {latest}, the job's last (its own "
                f"last was {r})")
        return state

    def _gone(self, beat: dict | None, began: float) -> bool:
        """Whether a group with heartbeat ``beat`` will not publish again: stopped (dead,
        exited, finished) or silent (a stale heartbeat, or none ``deadline + 60`` s after the
        wait began: never started). Starting — importing, compiling — is not gone."""
        if beat is None:
            return time.monotonic() - began > self.job.deadline + 60
        return (beat.get("state") not in ("starting", "training", "waiting", "publishing")
                or time.time() - beat.get("time", 0) >= STALE_AFTER)
