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
4. The lowest member commits the outer state (weights, momentum, round, step): a group
   that starts (a restart, a spare) or fell behind loads the newest one and replays the
   rounds closed after it from their published gradients.

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

import functools
import os
import socket
import sys
import threading
import time

import jax
import numpy as np

from kdist.groups import fingerprints
from kdist.groups.outer import outer_settings, outer_update
from kdist.groups.store import HEARTBEAT_EVERY, STALE_AFTER, Store, StoreError
from kdist.parallel.group_jobs import JobGroups

POLL = 0.05  # seconds between looks at the store while waiting
REFUSED = 78  # exit status of a group the job refuses (sysexits' EX_CONFIG): not restarted


class GroupRefused(SystemExit):
    """This group cannot join the job (another model, config or data share; its index
    already running). Exits with :data:`REFUSED`, which the supervisor does not restart."""

    def __init__(self, message: str):
        print(f"[groups] refused: {message}", file=sys.stderr, flush=True)
        super().__init__(REFUSED)
        self.message = message


def say(text: str) -> None:
    if jax.process_index() == 0:
        print(f"[groups] {text}", flush=True)


class _Heartbeat:
    """Writes this group's heartbeat every second from a thread (process 0 only): a
    stalled or stopped process goes stale, a busy one (compiling, validating) does not."""

    def __init__(self, store: Store):
        self.store, self.info = store, {"state": "starting", "round": None, "step": None}
        self.token = os.urandom(8).hex()
        self._lock = threading.Lock()  # one writer at a time: a beat never undoes a newer one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kdist-heartbeat")

    def start(self):
        self.beat()
        self._thread.start()
        import atexit

        atexit.register(self.stop)

    def beat(self, **info):
        with self._lock:
            self.info.update(info)
            self.store.beat(token=self.token, **self.info)

    def _run(self):
        while not self._stop.wait(HEARTBEAT_EVERY):
            try:
                self.beat()
            except OSError:
                pass  # the store is gone for a moment: the next beat tries again

    def stop(self):
        if not self._stop.is_set():
            self._stop.set()
            try:
                self.beat(state="exited")
            except OSError:
                pass


def agree(value: int) -> int:
    """Process 0's ``value`` in every process of this group."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


class OuterSync:
    """The host side of one group's DiLoCo in a job of separate groups.

    :func:`kdist.groups.diloco.make_train_function` calls :meth:`join` before the first
    step and :meth:`round` after each ``sync_every``-th and after ``fit``'s last; both take
    and return Keras' JAX training state ``(trainable, non_trainable, optimizer, metrics)``.
    """

    def __init__(self, model, job: JobGroups):
        self.model, self.job = model, job
        self.store = Store(job.store, job.index)
        self.applied = None  # the last round whose outer step this group holds
        self.heartbeat = None
        self.process = jax.process_index()
        self.rounds: list[dict] = []  # what each round cost here (kdist.groups.rounds)
        self.reported = 0  # of those, how many the throughput log has shown

    # --- the state's parts ---

    def _parts(self, state):
        parts = self.model.optimizer.groups
        opt = state[2]
        return state[0], [opt[i] for i in parts.momenta], [opt[i] for i in parts.params]

    def _with(self, state, theta, momenta):
        parts = self.model.optimizer.groups
        opt = list(state[2])
        params = _stack(theta, [opt[i] for i in parts.params])
        for i, m in zip(parts.momenta, momenta):
            opt[i] = m
        for i, p in zip(parts.params, params):
            opt[i] = p
        return (list(theta), state[1], opt, state[3])

    # --- joining ---

    def join(self, state, batch_shape=None):
        """Before the first step: checks this group against the job, then takes the
        newest outer state (or, for the job's first group, commits its own start)."""
        self.store.check_writable()
        fingerprint = fingerprints.describe(self.model, self.job, batch_shape)
        manifest = None
        if self.process == 0:
            self._refuse_duplicate()
            self.heartbeat = _Heartbeat(self.store)
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
            self._commit(0, theta, [m * 0 for m in momenta], [self.job.index], {})
            self.applied = 0
            return state
        closed = self.store.closed_rounds()
        state = self._catch_up(state, agree(closed[-1] if closed else 0))
        if self.process == 0:
            self.store.record_join(self.applied)
        self.rounds.append(dict(join=self.applied, group=self.job.index))
        say(f"group {self.job.index} joined at round {self.applied} (outer state from the "
            f"store; inner optimizer state its own)")
        return state

    def _refuse_duplicate(self):
        beat = self.store.heartbeats().get(self.job.index)
        if (beat and beat.get("state") in ("starting", "training", "waiting", "publishing")
                and time.time() - beat.get("time", 0) < STALE_AFTER
                and beat.get("pid") != os.getpid()
                and (beat.get("host") != socket.gethostname() or _alive(beat.get("pid")))):
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
        if self.heartbeat is None:
            return
        if info.get("state", self.heartbeat.info["state"]) != self.heartbeat.info["state"]:
            self.heartbeat.beat(**info)
        else:
            self.heartbeat.info.update(info)

    def round(self, state, step: int):
        """After a round's last inner step: one outer step (see the module)."""
        if self.job.mode == "async":
            return self._async_round(state, step)
        r = self.applied + 1
        began = time.monotonic()
        closed = self.store.closed_rounds()
        latest = agree(closed[-1] if closed else 0)  # one answer for the group's processes
        if latest >= r:  # the job moved on without this group
            state = self._catch_up(state, latest)
            self._record(r, [], began, behind=True)
            say(f"group {self.job.index} was behind: round {r} closed without it; caught up "
                f"to round {self.applied} (its inner steps since round {r - 1} dropped)")
            return state
        theta, momenta, params = self._parts(state)
        delta = _deltas(theta, params)
        self.beat(state="waiting", round=r, step=step)
        self.store.publish(r, _tree(delta), dict(step=step, base=self.applied,
                                                 fingerprint=fingerprints.digest(self.fingerprint),
                                                 time=time.time()), self.process)
        published_at = time.monotonic()
        record = self._quorum(r, published_at)
        state = self._step(state, r, record)
        self.beat(state="training", round=r)
        self._record(r, record["members"], began, waited=time.monotonic() - published_at)
        return state

    def _async_round(self, state, step: int):
        """Asynchronous: publish into the next open round and close it at once with what
        is there; if another group closed it first without this gradient, the next one.
        Then replay every round up to it (this group's gradient included, down-weighted
        by its staleness, :func:`_outer`)."""
        began = time.monotonic()
        theta, _, params = self._parts(state)
        delta = _tree(_deltas(theta, params))
        base = self.applied
        self.beat(state="publishing", round=base + 1, step=step)
        while True:
            closed = self.store.closed_rounds()
            r = agree(max([self.applied, *closed[-1:]]) + 1)
            self.store.publish(r, delta, dict(step=step, base=base, time=time.time(),
                                              fingerprint=fingerprints.digest(self.fingerprint)),
                               self.process)
            record = self.store.quorum(r)
            if record is None and self.process == 0:
                record = self.store.propose(r, sorted(self.store.published(r)), waited=0.0)
            while record is None:  # the other processes of this group: process 0 closes it
                time.sleep(POLL)
                record = self.store.quorum(r)
            if self.job.index in record["members"]:
                break
        state = self._catch_up(state, r)
        if self.job.index == record["members"][0]:
            theta, momenta, _ = self._parts(state)
            self._commit(r, theta, momenta, record["members"], self.store.published(r))
        self._record(r, record["members"], began, behind=r > base + 1)
        self.beat(state="training", round=r)
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
                raise StoreError(
                    f"Round {r} did not close within {waited:.0f} s: fewer than "
                    f"{job.min_groups} groups published to {store.root / 'rounds'}. The "
                    f"others are gone; the outer state of round {self.applied} is durable "
                    f"there.")
            time.sleep(POLL)

    def _step(self, state, r: int, record: dict):
        """The outer step of round ``r`` from its members' gradients."""
        theta, momenta, _ = self._parts(state)
        target = _targets(theta)
        members = record["members"]
        published = self.store.published(r)
        deltas = [_leaves(self.store.read(r, g, _tree(target))) for g in members]
        theta, momenta = _outer(self.model.optimizer, self.job, theta, momenta, deltas,
                                published, members, r)
        self.applied = r
        if members and self.job.index == members[0]:
            self._commit(r, theta, momenta, members, published)
        return self._with(state, theta, momenta)

    def _commit(self, r, theta, momenta, members, published):
        steps = [published[g].get("step") for g in members if g in published]
        self.store.save_outer(r, {"theta": _tree(theta), "momenta": _tree(momenta)},
                              dict(members=members, steps=steps, time=time.time(),
                                   group=self.job.index), self.process)
        if self.process == 0:
            self.store.forget_before(r - 2)
            say(f"outer state of round {r} durable in {self.store.root / 'outer'} "
                f"(members {members})")

    # --- catching up ---

    def _catch_up(self, state, latest: int):
        """Brings this group to round ``latest``: the newest committed outer state at or
        before it, then the closed rounds after that replayed from their gradients."""
        theta, momenta, _ = self._parts(state)
        target = _targets(theta)
        outer = [k for k in self.store.outer_rounds() if k <= latest]
        base = agree(outer[-1] if outer else -1)
        base = None if base < 0 else base
        if base is None or (self.applied is not None and self.applied > base):
            if self.applied is None:  # no outer state to start from: wait for the first
                base = self._wait_for_outer(latest)
            else:
                base = self.applied  # replay on what this group already holds
        if base != self.applied:
            loaded = self.store.load_outer(base, {"theta": _tree(target),
                                                  "momenta": _tree(target)})
            theta, momenta = _leaves(loaded["theta"]), _leaves(loaded["momenta"])
        for r in range(base + 1, latest + 1):
            record = self.store.quorum(r)
            if record is None:
                raise StoreError(f"Round {r} has no quorum record in {self.store.root}, but "
                                 f"round {latest} closed: the store was changed by hand.")
            published = self.store.published(r)
            deltas = [_leaves(self.store.read(r, g, _tree(target)))
                      for g in record["members"]]
            theta, momenta = _outer(self.model.optimizer, self.job, theta, momenta, deltas,
                                    published, record["members"], r)
        self.applied = latest
        return self._with(state, theta, momenta)

    def _wait_for_outer(self, latest: int) -> int:
        deadline = time.monotonic() + self.job.deadline + 60
        while time.monotonic() < deadline:
            outer = [k for k in self.store.outer_rounds() if k <= latest]
            found = agree(outer[-1] if outer else -1)
            if found >= 0:
                return found
            time.sleep(POLL)
        raise StoreError(f"{self.store.root} has closed rounds but no committed outer state "
                         f"to join from after {self.job.deadline + 60:.0f} s.")


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _tree(values) -> dict:
    return {f"w{i:04d}": v for i, v in enumerate(values)}


def _leaves(tree: dict) -> list:
    return [tree[k] for k in sorted(tree)]


def _targets(theta) -> list:
    return [jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding) for t in theta]


@jax.jit
def _deltas(theta, params):
    return [t - p[0] for t, p in zip(theta, params)]


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _outer_jit(settings, theta, momenta, deltas, weights, divisor):
    # quorum mode: every weight 1 and divisor n, a sum then / n, as the in-program mean
    mean = [functools.reduce(lambda a, b: a + b,
                             (d if w == 1.0 else w * d for w, d in zip(weights, ds))) / divisor
            for ds in zip(*deltas)]
    stepped = [outer_update(settings, t, m, d) for t, m, d in zip(theta, momenta, mean)]
    return [t for t, _ in stepped], [m for _, m in stepped]


def _outer(optimizer, job, theta, momenta, deltas, published, members, r):
    """The outer step of round ``r`` from its members' gradients. Quorum mode: their mean.
    Async: each gradient is its group's share ``1 / G`` of an average, times
    ``1 / (1 + staleness)``, staleness = rounds between its base and ``r - 1``."""
    if job.mode == "async":
        weights = tuple(1.0 / (1 + max(0, r - 1 - int(published.get(g, {}).get("base", r - 1))))
                        for g in members)
        divisor = job.count
    else:
        weights, divisor = (1.0,) * len(members), len(members)
    return _outer_jit(outer_settings(optimizer), list(theta), list(momenta), deltas, weights,
                      divisor)


def _stack(theta, like):
    """``theta`` with the replica dimension of the stacked parameters, in their layout."""
    return [jax.device_put(t[None], p.sharding) for t, p in zip(theta, like)]
