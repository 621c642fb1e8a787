"""``python -m kdist.launch --replica-groups G``: replica groups as separate jobs, supervised.

    python -m kdist.launch --replica-groups 2 --spare-groups 1 --devices-per-process 4 \\
        recipes/gpt_pretrain.py --mesh replica=2,data=4 --sync-every 10

Starts G groups, each ``--processes-per-group`` processes (its own JAX cluster when more
than one) with ``KDIST_REPLICA_GROUP=<index>`` and the other variables of
:mod:`kdist.parallel.group_jobs` in their environment. When a process of a group fails, the
group's other processes are stopped (SIGTERM, SIGKILL after ``--grace``), its heartbeat is
marked dead (so no round waits for it) and a spare starts in its place — with the failed
group's index, so its data share and its own checkpoints — or, with no spare left, the group
restarts, up to ``--max-restarts`` times. The others never stop: they close their rounds
without it and it joins at the next one from the newest outer state. The job fails only
when fewer than ``--min-groups`` groups are left (running or finished); the outer state of
the last round is durable in the store then. Each failure, restart, spare and end is one
line, ``[groups] ...``, with the group and the round, and one event in
``STORE/events.jsonl`` (``kdist report`` reads it). Output lines are prefixed ``[g<index>]``
(``[g<index>.<rank>]`` with several processes per group). A supervisor killed outright
takes its groups with it: the kernel SIGTERMs every process it started (Linux), and each
saves its step and exits as on any SIGTERM.

On a cluster, start each group as its own job with the same variables and let the scheduler
restart a failed one (Kubernetes JobSet, SLURM ``--requeue``): a group joins and rejoins
through the store alone, without this supervisor (docs/multihost.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

from kdist.groups.store import Store, StoreError, retrying
from kdist.local_processes import copy_output, free_port, process_env, start
from kdist.parallel import group_jobs as groups_job
from kdist.parallel.group_jobs import REFUSED

POLL = 0.05
STORE_WAIT = 5.0  # seconds the supervisor's own writes wait for a full store: it must go on


@dataclasses.dataclass
class _Group:
    index: int
    children: list = dataclasses.field(default_factory=list)
    restarts: int = 0
    spare: int | None = None  # the spare running in this group's place, if one is
    state: str = "running"  # running, finished, lost
    started: float = 0.0


class Supervisor:
    """Runs and watches the groups; see the module's docstring."""

    def __init__(self, command, groups: int, spares: int, processes: int, devices: int,
                 store: str, min_groups: int, deadline: float, mode: str,
                 max_restarts: int, grace: float):
        self.command, self.processes, self.devices = command, processes, devices
        self.store, self.min_groups, self.deadline, self.mode = store, min_groups, deadline, mode
        self.max_restarts, self.grace = max_restarts, grace
        self.spares_left, self.spares_used = spares, 0
        self.groups = [_Group(g) for g in range(groups)]
        self.lock = threading.Lock()
        self.pumps = []
        self.events = Path(store) / "events.jsonl"

    def print(self, text: str) -> None:
        """``[groups] text``; output that cannot be written (a closed pipe) is dropped —
        the supervisor's job is its groups, not its terminal."""
        with self.lock:
            try:
                print(f"[groups] {text}", flush=True)
            except (OSError, ValueError):
                pass

    def say(self, text: str, **event) -> None:
        """A line, and with ``event`` one record in ``events.jsonl``. A store that refuses
        the record is waited for briefly (:data:`STORE_WAIT`), then the record is left out
        with a line saying so: supervising the groups goes on."""
        self.print(text)
        if event:
            event = dict(event, time=time.time(), round=self.round())

            def append():
                with open(self.events, "a", encoding="utf-8") as f:
                    f.write(json.dumps(event) + "\n")

            try:
                retrying(f"the event {event['event']!r}", self.events, append, STORE_WAIT,
                         self.print)
            except (OSError, StoreError) as e:
                self.print(f"event not recorded in {self.events}: {e}")

    def round(self) -> int:
        try:
            closed = Store(self.store, -1).closed_rounds()
        except OSError:
            return 0
        return closed[-1] if closed else 0

    def durable(self) -> str:
        """What a relaunch would resume from: the newest intact outer state, said as it is."""
        where = Path(self.store) / "outer"
        try:
            r = Store(self.store, -1).durable_outer()
        except OSError as e:
            return f"the store could not be read ({e})"
        if r is None:
            return f"no intact outer state is in {where}"
        return f"the outer state of round {r} is durable in {where}"

    def mark_dead(self, group: _Group, pid: int) -> None:
        """Marks ``group``'s heartbeat dead, so no round waits for it. A store that refuses
        the write is waited for briefly; then the others wait for the group up to the
        round's deadline instead (its heartbeat goes stale) — never a crash of the
        supervisor, which would take every group with it."""
        try:
            Store(self.store, group.index, say=self.print).beat(state="dead", pid=pid,
                                                               wait=STORE_WAIT)
        except (OSError, StoreError) as e:
            self.print(f"group {group.index}'s heartbeat not marked dead ({e}); the others "
                       f"wait for it up to the round deadline")

    def environment(self, group: int, rank: int, port: int) -> dict:
        env = process_env(rank, self.processes, self.devices, port)
        env.update({groups_job.GROUP: str(group), groups_job.GROUPS: str(len(self.groups)),
                    groups_job.STORE: str(Path(self.store).resolve()),
                    groups_job.MIN: str(self.min_groups),
                    groups_job.DEADLINE: str(self.deadline), groups_job.MODE: self.mode})
        return env

    def start(self, group: _Group) -> None:
        port = free_port()
        group.children, group.state, group.started = [], "running", time.monotonic()
        for rank in range(self.processes):
            child = start(self.command, self.environment(group.index, rank, port))
            group.children.append(child)
            prefix = f"g{group.index}" if self.processes == 1 else f"g{group.index}.{rank}"
            self.print(f"group {group.index} rank {rank} pid {child.pid}")
            pump = threading.Thread(target=copy_output, args=(prefix, child.stdout, self.lock),
                                    daemon=True)
            pump.start()
            self.pumps.append(pump)

    def stop(self, group: _Group) -> None:
        """Ends every process of ``group``: SIGTERM, then SIGKILL after the grace period."""
        for child in group.children:
            if child.poll() is None:
                child.terminate()
        until = time.monotonic() + self.grace
        while any(c.poll() is None for c in group.children) and time.monotonic() < until:
            time.sleep(POLL)
        for child in group.children:
            if child.poll() is None:
                child.kill()
                child.wait()

    def failed(self, group: _Group, child) -> None:
        """A process of ``group`` failed: stop the rest, then a spare, a restart or lost."""
        rank = group.children.index(child)
        code = child.returncode
        status = 128 - code if code < 0 else code
        self.stop(group)
        self.mark_dead(group, child.pid)
        lived = time.monotonic() - group.started
        where = f"group {group.index} failed at round {self.round()} (rank {rank} exited " \
                f"with status {status} after {lived:.0f} s)"
        if status == REFUSED:
            group.state = "lost"
            self.say(f"{where}: refused by the job (see its message above); not restarted",
                     event="refused", group=group.index, status=status)
        elif self.spares_left:
            self.spares_left -= 1
            group.spare = self.spares_used
            self.spares_used += 1
            self.say(f"{where}; spare {group.spare} starts in its place (group index "
                     f"{group.index}: its data share and checkpoints)",
                     event="failure", group=group.index, status=status, action="spare",
                     spare=group.spare)
            self.start(group)
        elif group.restarts < self.max_restarts:
            group.restarts += 1
            self.say(f"{where}; restarting it (restart {group.restarts} of "
                     f"{self.max_restarts})", event="failure", group=group.index,
                     status=status, action="restart", restart=group.restarts)
            self.start(group)
        else:
            group.state = "lost"
            self.say(f"{where}; no spare left and {self.max_restarts} restarts used: the "
                     f"group is lost", event="failure", group=group.index, status=status,
                     action="lost")

    def run(self) -> int:
        for group in self.groups:
            self.start(group)
        received: list[int] = []

        def forward(signum, _frame):
            received.append(signum)
            for group in self.groups:
                for child in group.children:
                    if child.poll() is None:
                        child.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                for group in self.groups:
                    if group.state != "running":
                        continue
                    codes = [c.poll() for c in group.children]
                    bad = [c for c, code in zip(group.children, codes)
                           if code not in (None, 0)]
                    if bad and not received:
                        self.failed(group, min(bad, key=lambda c: c.returncode >= 0))
                    elif all(code == 0 for code in codes):
                        group.state = "finished"
                        self.say(f"group {group.index} finished at round {self.round()}",
                                 event="finished", group=group.index)
                    elif bad or all(code is not None for code in codes):
                        group.state = "lost"
                left = [g for g in self.groups if g.state in ("running", "finished")]
                if len(left) < self.min_groups and not received:
                    for group in self.groups:
                        self.stop(group)
                    durable = self.durable()
                    self.say(f"only {len(left)} group(s) left, fewer than --min-groups "
                             f"{self.min_groups}: the job ends. {durable[0].upper()}"
                             f"{durable[1:]}", event="job failed", left=len(left))
                    return 1
                if all(g.state != "running" for g in self.groups):
                    break
                time.sleep(POLL)
        finally:
            for group in self.groups:
                for child in group.children:
                    if child.poll() is None:
                        child.kill()
                        child.wait()
            for s, handler in previous.items():
                signal.signal(s, handler)
            for pump in self.pumps:
                pump.join(timeout=5)
        if received:
            return 128 + received[0]
        finished = sum(g.state == "finished" for g in self.groups)
        self.say(f"job done: {finished} of {len(self.groups)} groups finished every step "
                 f"(round {self.round()})", event="job done", finished=finished)
        return 0 if finished >= self.min_groups else 1


def _say(text: str) -> None:
    try:
        print(text, flush=True)
    except (OSError, ValueError):
        pass


def _script_flag(command: list[str], flag: str) -> str | None:
    """The value of ``flag`` among the script's arguments (``--flag V`` or ``--flag=V``)."""
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


def mesh_refusals(command: list[str], groups: int, processes: int, devices: int) -> list[str]:
    """What the script's own flags say against the groups', before any group starts: its
    ``--mesh`` must name ``replica=G`` and, inside a group, as many devices as
    ``--processes-per-group`` x ``--devices-per-process``; a recipe's ``--host-devices``
    must be the devices per process the launcher gives. A mesh that is not all numbers
    (``auto``) is left to the group.

    Example:
        >>> mesh_refusals(["train.py", "--mesh", "replica=2,data=4"], 3, 1, 4)[0][:40]
        'the script\'s --mesh replica=2,data=4 has '
    """
    found = []
    mesh = _script_flag(command, "--mesh")
    sizes = dict(re.findall(r"\s*(\w+)\s*=\s*(\d+)\s*(?:,|$)", mesh or ""))
    if mesh and len(sizes) == mesh.count("=") == len(mesh.split(",")):
        replica = int(sizes.pop("replica", 1))
        if replica != groups:
            found.append(f"the script's --mesh {mesh} has replica={replica} but "
                         f"--replica-groups is {groups}: give the whole job's mesh, "
                         f"replica={groups}")
        inside = math.prod(int(v) for v in sizes.values())
        if inside != processes * devices:
            found.append(f"the script's --mesh {mesh} puts {inside} devices in each group "
                         f"(replica=1 inside a group) but --processes-per-group {processes} x "
                         f"--devices-per-process {devices} gives it {processes * devices}")
    host = _script_flag(command, "--host-devices")
    if host is not None and host != str(devices):
        found.append(f"the script's --host-devices {host} inside groups of "
                     f"--devices-per-process {devices}: leave --host-devices out (the "
                     f"launcher gives each process its devices) or make them agree")
    return found


def supervise(command: list[str], groups: int, spares: int = 0, processes: int = 1,
              devices: int = 4, store: str = "replica-store", min_groups: int = 1,
              deadline: float = groups_job.DEFAULT_DEADLINE, mode: str = "quorum",
              max_restarts: int = 3, grace: float = 10.0) -> int:
    """Runs ``command`` as ``groups`` supervised replica groups; returns the job's status.
    Every argument is checked before anything starts, naming its flag."""
    checks = [(groups >= 1, f"--replica-groups must be at least 1; got {groups}."),
              (spares >= 0, f"--spare-groups must be 0 or more; got {spares}."),
              (processes >= 1, f"--processes-per-group must be at least 1; got {processes}."),
              (devices >= 1, f"--devices-per-process must be at least 1; got {devices}."),
              (1 <= min_groups <= groups, f"--min-groups must be between 1 and "
                                          f"--replica-groups ({groups}); got {min_groups}."),
              (math.isfinite(deadline) and deadline > 0,
               f"--round-deadline must be a finite number of seconds > 0; got {deadline}."),
              (mode in groups_job.MODES, f"--replica-mode must be one of "
                                         f"{', '.join(groups_job.MODES)}; got {mode!r}."),
              (max_restarts >= 0, f"--max-restarts must be 0 or more; got {max_restarts}.")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    refusals = mesh_refusals(command, groups, processes, devices)
    if refusals:
        raise ValueError("; ".join(refusals) + ".")
    try:
        Store(store, -1).check_writable()
    except StoreError as e:
        raise ValueError(f"--replica-store: {e}") from None
    _say(f"[groups] {groups} replica groups of {processes} process(es) x {devices} "
          f"device(s), {spares} spare(s), store {Path(store).resolve()}, {mode} rounds "
          f"(deadline {deadline:g} s, at least {min_groups} group(s))")
    os.environ.pop(groups_job.GROUP, None)  # this process is the supervisor, not a group
    return Supervisor(command, groups, spares, processes, devices, store, min_groups,
                      deadline, mode, max_restarts, grace).run()
