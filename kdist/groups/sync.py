"""DiLoCo's outer step between separate group jobs, on the host, through the store.

Each group runs DiLoCo on its own mesh with one group (:mod:`kdist.groups.diloco`: its
inner steps unchanged); :class:`OuterSync` replaces the in-program all-reduce of the
outer gradient. Every ``sync_every`` inner steps, and at the last step of ``fit`` (a
partial round: :class:`kdist.groups.diloco.FitEnd`), a round ``r`` (one more than the
last round this group applied):

1. **Publish** ``Δ_g = θ - θ_g`` (orbax, committed with a checksummed marker).
2. **Quorum.** Wait until every *running* group (a fresh heartbeat, state training or
   waiting) has published, or ``deadline`` seconds passed, and at least ``min_groups``
   have; then propose the members (the committed gradients, sorted). The first proposal
   stands (``os.link``): every group reads the same members.
3. **Step.** Read the members' gradients, average them in group order, take the outer
   Nesterov step — every group computes the same ``θ``, member or not (a group whose
   gradient missed the round only loses its own round's work).
4. The lowest member commits the outer state (weights, momentum, round, step, and a
   fingerprint of the weights' bits): a group that starts (a restart, a spare) or fell
   behind loads the newest intact one and replays the rounds closed after it from their
   published gradients.
5. **Check.** Every group compares the fingerprint of the outer state it applied with the
   committed one as soon as that exists (at the latest at its next round; at ``fit``'s last
   round it waits for it): a difference — two closers of one round, a gradient read twice
   with different values — is a :class:`StoreError` naming the round, never weights that
   drift apart in silence. The group then fails, and rejoins from the committed state.

Nothing of a round is written twice (:mod:`kdist.groups.store`): a restarted group whose
killed predecessor committed its gradient of the open round keeps that entry (every reader
uses it) instead of publishing again; an outer state found damaged is moved aside, named,
and rebuilt from the previous one and the round's committed gradients. A group that
rejoined behind the job's step ends with the job's last round (marked ``final`` by the
groups whose ``fit`` ended there) instead of training rounds alone after it.

A (re)started group takes the outer weights and momentum from the store and keeps its
own inner optimizer state — that of its own last checkpoint when the recipe restored one,
fresh otherwise. Why: the outer weights are newer than anything in the group's own
checkpoint and identical in every group, while the inner AdamW moments describe the
group's own data stream (a peer's would do too, but cost a transfer of two more copies of
the weights). Its step is the job's (:func:`kdist.groups.rejoin.skip_to_job`, before
``fit``): the data it skips is what the failure cost.

Asynchronous mode (``KDIST_REPLICA_MODE=async``) never waits: a round closes with the
gradients present when the group syncs (its own included), so a slow or dead group holds
nobody up. Each gradient counts as its group's share ``1 / G`` of an average (so G rounds
of one gradient move the weights as far as one round of G), and one computed against an
older outer state than the round's is *stale* by the number of rounds between: its weight is
divided by ``1 + staleness`` (the staleness-dependent learning rate of Zhang, Gupta, Lian &
Liu, "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016: ``lr / τ``).
"""

from __future__ import annotations

import os
import socket
import time

import jax

from kdist.groups import fingerprints
from kdist.groups import outer_arrays as arrays
from kdist.groups.catch_up import CatchUp
from kdist.groups.host import Heartbeat, agree, alive, guard_output, say
from kdist.groups.job_end import JobEnd
from kdist.groups.store import POLL, STALE_AFTER, Store, StoreError
from kdist.parallel.group_jobs import GroupRefused, JobGroups

KEEP_PENDING = 3  # rounds an applied outer state waits to be checked against its commit


class OuterSync(CatchUp, JobEnd):
    """The host side of one group's DiLoCo in a job of separate groups.

    :func:`kdist.groups.diloco.make_train_function` calls :meth:`join` before the first
    step and :meth:`round` after each ``sync_every``-th and after ``fit``'s last; both take
    and return Keras' JAX training state ``(trainable, non_trainable, optimizer, metrics)``.
    """

    def __init__(self, model, job: JobGroups):
        self.model, self.job = model, job
        self.store = Store(job.store, job.index, say=say, collective=jax.process_count() > 1)
        self.applied = None  # the last round whose outer step this group holds
        self.heartbeat = None
        self.process = jax.process_index()
        self.rounds: list[dict] = []  # what each round cost here (kdist.groups.rounds)
        self.reported = 0  # of those, how many the throughput log has shown
        # Outer states this group applied, not yet checked against the committed ones:
        # {round: (fingerprint, members)} (kdist.groups.sync's module docstring, step 5).
        self.pending: dict[int, tuple[str, list]] = {}
        self.damaged: dict[int, dict | None] = {}  # set-aside rounds: their old markers
        self.ended = None  # the job's last round, once this group ended with it

    # --- the state's parts ---

    def _parts(self, state):
        parts = self.model.optimizer.groups
        opt = state[2]
        return state[0], [opt[i] for i in parts.momenta], [opt[i] for i in parts.params]

    def _with(self, state, theta, momenta):
        parts = self.model.optimizer.groups
        opt = list(state[2])
        params = arrays.stack(theta, [opt[i] for i in parts.params])
        for i, m in zip(parts.momenta, momenta):
            opt[i] = m
        for i, p in zip(parts.params, params):
            opt[i] = p
        return (list(theta), state[1], opt, state[3])

    # --- joining ---

    def join(self, state, batch_shape=None):
        """Before the first step: checks this group against the job, then takes the
        newest outer state (or, for the job's first group, commits its own start)."""
        guard_output()  # from here on, a closed output pipe cannot stop this group
        self.store.check_writable()
        fingerprint = fingerprints.describe(self.model, self.job, batch_shape)
        manifest = None
        if self.process == 0:
            self._refuse_duplicate()
            self.heartbeat = Heartbeat(self.store)
            self.heartbeat.start()
            manifest, _ = self.store.manifest(fingerprint)
            differences = fingerprints.differences(manifest["fingerprint"], fingerprint)
            if differences:
                raise GroupRefused(
                    f"group {self.job.index} differs from the job in {self.store.root} "
                    f"(started by group {manifest['group']}): {'; '.join(differences)}. "
                    f"Start every group with the same script, flags and data, or give "
                    f"this job another store.")
        self.fingerprint = fingerprint
        wrote = agree(int(self.process == 0 and manifest["group"] == self.job.index
                           and not self.store.outer_rounds()))
        if wrote:  # a new job: its weights at round 0 are this group's initial ones
            theta, momenta, _ = self._parts(state)
            momenta = [m * 0 for m in momenta]
            self._commit(0, theta, momenta, [self.job.index], {},
                         arrays.state_digest(theta, momenta))
            self.applied = 0
            return state
        closed = self.store.closed_rounds()
        state = self._catch_up(state, agree(closed[-1] if closed else 0))
        # How far behind the job this group starts (kdist.groups.skip_to_job chose its step
        # before fit; the job may have gone on while this group compiled): each round it
        # then publishes comes from that many steps fewer than the others'.
        own = int(jax.device_get(state[2][self.model.optimizer.groups.iterations]))
        job_step = self._round_step(self.applied) if self.process == 0 else None
        behind = None if job_step is None else job_step - own
        if self.process == 0:
            self.store.record_join(self.applied, step=own, job_step=job_step)
        self.rounds.append(dict(join=self.applied, group=self.job.index, step=own,
                                behind_steps=behind))
        where = (f" at step {own}, {behind} steps behind the job's step {job_step}"
                 if behind else f" at step {own}, the job's step" if behind == 0 else "")
        say(f"group {self.job.index} joined at round {self.applied}{where} (outer state from "
            f"the store; inner optimizer state its own)")
        return state

    def _round_step(self, r: int) -> int | None:
        """The step (fit batches) the job's groups published round ``r`` from: its outer
        state's members' furthest, else its committed gradients'; None if unknown."""
        meta = self.store.outer_meta_if_readable(r) or {}
        steps = [s for s in meta.get("steps", []) if s is not None]
        if not steps:
            steps = [m.get("step") for m in self.store.published(r).values()
                     if m.get("step") is not None]
        return max(steps, default=None)

    def _refuse_duplicate(self):
        beat = self.store.heartbeats().get(self.job.index)
        if (beat and beat.get("state") in ("starting", "training", "waiting", "publishing")
                and time.time() - beat.get("time", 0) < STALE_AFTER
                and beat.get("pid") != os.getpid()
                and (beat.get("host") != socket.gethostname() or alive(beat.get("pid")))):
            raise GroupRefused(
                f"group {self.job.index} is already running (pid {beat.get('pid')} on "
                f"{beat.get('host')}, heartbeat {time.time() - beat['time']:.1f} s ago): two "
                f"jobs with one {self.job.index} would train the same data share. Check "
                f"KDIST_REPLICA_GROUP.")

    # --- a round ---

    def beat(self, **info):
        """A new state is written at once (an operator, the supervisor and the fault trials
        see a round's publish as it happens); the rest (the step: every step) goes with the
        thread's next beat, without a write per step."""
        if self.ended is not None:  # ended with the job: "finished", and fit stops
            self.model.stop_training = True  # (again: a callback may have reset it)
            info.pop("state", None)
        if self.heartbeat is None:
            return
        if info.get("state", self.heartbeat.info["state"]) != self.heartbeat.info["state"]:
            self.heartbeat.beat(**info)
        else:
            self.heartbeat.info.update(info)

    def round(self, state, step: int):
        """After a round's last inner step: one outer step (see the module)."""
        if self.ended is not None:  # the job is over: no round alone (see _end_with_job)
            self.model.stop_training = True
            return state
        if self.job.mode == "async":
            return self._async_round(state, step)
        r = self.applied + 1
        began = time.monotonic()
        closed = self.store.closed_rounds()
        latest = agree(closed[-1] if closed else 0)  # one answer for the group's processes
        self._verify_pending()  # the outer states applied before, now committed
        # The job's last round is closed (another group's fit ended there): this group
        # takes it and ends, rather than train a round alone after it — also when this is
        # its own last round (a group restarted after the job ended keeps one round).
        if latest >= r - 1 and self._job_ended_at(latest):
            if latest >= r:
                state = self._catch_up(state, latest)
            return self._end_with_job(state, latest, step)
        if latest >= r:  # the job moved on without this group
            state = self._catch_up(state, latest)
            self._record(r, [], began, behind=True)
            say(f"group {self.job.index} was behind: round {r} closed without it; caught up "
                f"to round {self.applied} (its inner steps since round {r - 1} dropped)")
            return state
        theta, momenta, params = self._parts(state)
        delta = arrays.deltas(theta, params)
        self.beat(state="waiting", round=r, step=step)
        self._publish(r, arrays.tree(delta), dict(step=step, base=self.applied, time=time.time(),
                                            final=self._last_round()))
        published_at = time.monotonic()
        record = self._quorum(r, published_at)
        state = self._step(state, r, record)
        self._record(r, record["members"], began, waited=time.monotonic() - published_at)
        if self._last_round():  # nothing after this round checks it: wait for the commit
            self._verify_pending(wait=self.job.deadline)
        elif self._job_ended_at(r):  # the others' last round, not this group's
            return self._end_with_job(state, r, step)
        # "finished": no round waits for this group any more.
        self.beat(state="finished" if self._last_round() else "training", round=r)
        return state

    def _last_round(self) -> bool:
        """Whether this round ends ``fit`` (its schedule counted the last step)."""
        schedule = getattr(getattr(self.model.optimizer, "groups", None), "schedule", None)
        return getattr(schedule, "remaining", None) == 0

    def _attempt(self) -> str:
        """A new attempt id, the same in every process of this group."""
        return f"{agree(int.from_bytes(os.urandom(6), 'big')):012x}"

    def _publish(self, r: int, tree: dict, meta: dict) -> bool:
        """Publishes this group's gradient of round ``r`` unless an earlier attempt of this
        group (killed after committing it) did: that entry stands — every reader uses it —
        and is never rewritten. Returns whether this attempt's gradient is the one."""
        standing = agree(int(self.process == 0 and self.store.committed(r) is not None))
        if standing:
            say(f"group {self.job.index}'s outer gradient of round {r} was committed by an "
                f"earlier attempt (before a restart): it stands, unchanged; this attempt's "
                f"inner steps since round {r - 1} are not published")
            return False
        meta = dict(meta, fingerprint=fingerprints.digest(self.fingerprint))
        self.store.publish(r, tree, meta, self.process, attempt=self._attempt())
        return True

    def _async_round(self, state, step: int):
        """Asynchronous: publish into the next open round and close it at once with what
        is there; if another group closed it first without this gradient, the next one.
        Then replay every round up to it (this group's gradient included, down-weighted
        by its staleness, :func:`kdist.groups.outer_arrays.outer_step`)."""
        began = time.monotonic()
        theta, _, params = self._parts(state)
        delta = arrays.tree(arrays.deltas(theta, params))
        base = self.applied
        self.beat(state="publishing", round=base + 1, step=step)
        self._verify_pending()
        while True:
            closed = self.store.closed_rounds()
            r = agree(max([self.applied, *closed[-1:]]) + 1)
            # An entry of an earlier attempt (killed after committing round r) stands and
            # counts in round r; this gradient then goes into the next round.
            ours = self._publish(r, delta, dict(step=step, base=base, time=time.time(),
                                                final=self._last_round()))
            record = self.store.quorum(r)
            if record is None and self.process == 0:
                record = self.store.propose(r, sorted(self.store.published(r)), waited=0.0)
            while record is None:  # the other processes of this group: process 0 closes it
                time.sleep(POLL)
                record = self.store.quorum(r)
            if ours and self.job.index in record["members"]:
                break
        state = self._catch_up(state, r)
        if self.job.index == record["members"][0]:
            theta, momenta, _ = self._parts(state)
            self._commit(r, theta, momenta, record["members"], self.store.published(r),
                         self.pending.get(r, (None,))[0])
        if self._last_round():
            state = self._end_with_the_others(state, r)
            self._verify_pending(wait=self.job.deadline)
        self._record(r, record["members"], began, behind=r > base + 1)
        self.beat(state="finished" if self._last_round() else "training", round=r)
        return state

    def _record(self, r, members, began, waited=0.0, behind=False):
        entry = dict(round=r, members=members, seconds=time.monotonic() - began,
                     waited=waited, behind=behind, group=self.job.index)
        self.rounds.append(entry)

    def _quorum(self, r: int, published_at: float) -> dict:
        job, store = self.job, self.store
        said = False
        while True:
            record = store.quorum(r)
            if record is not None:
                return record
            waited = time.monotonic() - published_at
            if self.process == 0:
                published = store.published(r)
                if job.mode == "async":
                    ready = True
                else:
                    expected = store.running() | {job.index}
                    if r == 1:  # the job's start: every group not known dead, a deadline long
                        beats = store.heartbeats()
                        expected |= {g for g in range(job.count)
                                     if beats.get(g, {}).get("state") not in ("dead", "exited")}
                    ready = expected <= published.keys() or waited >= job.deadline
                if ready and len(published) >= job.min_groups:
                    return store.propose(r, sorted(published), waited=waited)
                if ready and not said:
                    said = True
                    say(f"round {r}: {len(published)} of the {job.min_groups} groups it needs "
                        f"(KDIST_REPLICA_MIN) have published after {waited:.0f} s; waiting")
            if waited > 10 * job.deadline + 60:
                durable = store.durable_outer() if self.process == 0 else None
                raise StoreError(
                    f"Round {r} did not close within {waited:.0f} s: fewer than "
                    f"{job.min_groups} groups published to {store.root / 'rounds'}. The "
                    f"others are gone; " + (
                        f"the outer state of round {durable} is durable in "
                        f"{store.root / 'outer'}." if durable is not None else
                        f"no intact outer state is in {store.root / 'outer'}."))
            time.sleep(POLL)

    def _step(self, state, r: int, record: dict):
        """The outer step of round ``r`` from its members' gradients."""
        theta, momenta, _ = self._parts(state)
        target = arrays.targets(theta)
        members = record["members"]
        published = self.store.published(r)
        deltas = [arrays.leaves(self.store.read(r, g, arrays.tree(target), record))
                  for g in members]
        theta, momenta = arrays.outer_step(self.model.optimizer, self.job, theta, momenta,
                                           deltas, published, members, r)
        self.applied = r
        digest = self._applied(r, theta, momenta, members)
        if members and self.job.index == members[0]:
            self._commit(r, theta, momenta, members, published, digest)
        return self._with(state, theta, momenta)

    def _commit(self, r, theta, momenta, members, published, digest):
        """Commits the outer state of round ``r`` (every process of the group calls this).
        One committed before (a restarted committer, a group rebuilding a damaged state)
        stands: ours must then be the same, or the groups have diverged."""
        steps = [published[g].get("step") for g in members if g in published]
        attempts = {str(g): published[g].get("attempt") for g in members if g in published}
        standing = self.store.save_outer(
            r, {"theta": arrays.tree(theta), "momenta": arrays.tree(momenta)},
            dict(members=members, steps=steps, attempts=attempts, digest=digest,
                 time=time.time(), group=self.job.index), self.process,
            attempt=self._attempt())
        if self.process == 0:
            self.store.forget_before(r - 2)
            say(f"outer state of round {r} durable in {self.store.root / 'outer'} "
                f"(members {members})")
        del standing  # a standing commit that differs: _verify_pending names the round
        self.pending.setdefault(r, (digest, list(members)))
        self._verify_pending()

    # --- checking what was applied against what was committed ---

    def _applied(self, r: int, theta, momenta, members) -> str:
        """Notes that this group applied round ``r``'s outer state (to be checked against
        the committed one); returns its fingerprint."""
        digest = arrays.state_digest(theta, momenta)
        self.pending[r] = (digest, list(members))
        return digest

    def _verify_pending(self, wait: float = 0.0) -> None:
        """Compares each outer state this group applied with the committed one of its round,
        once that exists (waiting up to ``wait`` seconds for the newest): a
        :class:`StoreError` naming the round if they differ. Process 0 reads the store;
        every process of the group acts on its answer."""
        newest = max(self.pending, default=None)
        for r in sorted(self.pending):
            digest, members = self.pending[r]
            problem, found = None, False
            if self.process == 0:
                until = time.monotonic() + (wait if r == newest else 0.0)
                meta = self.store.outer_meta_if_readable(r)
                while meta is None and time.monotonic() < until:
                    time.sleep(POLL)
                    meta = self.store.outer_meta_if_readable(r)
                found = meta is not None
                if found and (meta.get("digest") not in (None, digest)
                              or meta.get("members") != members):
                    problem = (
                        f"Round {r}: the outer state group {self.job.index} applied (members "
                        f"{members}, fingerprint {digest}) differs from the one committed in "
                        f"{self.store.root / 'outer' / f'{r}.json'} (members "
                        f"{meta.get('members')}, fingerprint {meta.get('digest')}): the "
                        f"groups' weights would diverge. The round was closed or published "
                        f"twice; this group stops and rejoins from the committed state.")
            if agree(int(problem is not None)):
                raise StoreError(problem or f"Round {r}: this group's outer state differs "
                                            f"from the committed one (see process 0).")
            if agree(int(found)) or r < (self.applied or 0) - KEEP_PENDING:
                del self.pending[r]  # checked (or its commit will never come: forgotten)
