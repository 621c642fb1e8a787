"""What a replica group knows of the job it belongs to, from its environment.

``python -m kdist.launch --replica-groups G`` gives every process of group ``g`` these
variables (a cluster scheduler can set the same ones; see docs/multihost.md):

==========================  =============================================================
``KDIST_REPLICA_GROUP``     this group's index, ``0 <= g < G`` (its share of each batch)
``KDIST_REPLICA_GROUPS``    G, the groups of the job (the mesh spec's ``replica=G``)
``KDIST_REPLICA_STORE``     the directory the groups exchange through (shared by all)
``KDIST_REPLICA_MIN``       the fewest groups a round may close with (default 1)
``KDIST_REPLICA_DEADLINE``  seconds a round waits for a live group's outer gradient
``KDIST_REPLICA_MODE``      ``quorum`` (default) or ``async``
==========================  =============================================================

Example:
    >>> job = from_environment({"KDIST_REPLICA_GROUP": "1", "KDIST_REPLICA_GROUPS": "2",
    ...                         "KDIST_REPLICA_STORE": "/tmp/store"})
    >>> job.index, job.count, job.mode
    (1, 2, 'quorum')
    >>> local_spec("replica=2,data=4", job)
    'replica=1,data=4'
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys

GROUP, GROUPS, STORE = "KDIST_REPLICA_GROUP", "KDIST_REPLICA_GROUPS", "KDIST_REPLICA_STORE"
MIN, DEADLINE, MODE = "KDIST_REPLICA_MIN", "KDIST_REPLICA_DEADLINE", "KDIST_REPLICA_MODE"
VARIABLES = (GROUP, GROUPS, STORE, MIN, DEADLINE, MODE)
MODES = ("quorum", "async")
DEFAULT_DEADLINE = 60.0
REFUSED = 78  # exit status of a group the job refuses (sysexits' EX_CONFIG): not restarted


class GroupRefused(SystemExit):
    """This group cannot join the job (another model, config or data share; its index
    already running). Exits with :data:`REFUSED`, which the supervisor does not restart:
    the same group would be refused again."""

    def __init__(self, message: str):
        try:  # said here: an uncaught SystemExit prints nothing of its own
            print(f"[groups] refused: {message}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        super().__init__(REFUSED)
        self.message = message

    def __str__(self):
        return self.message


class GroupConfigError(GroupRefused, ValueError):
    """A wrong setting found inside a group (its environment, its mesh against the job's):
    a ``ValueError`` to code that catches one, and — uncaught — exit status
    :data:`REFUSED`, so that the supervisor does not restart a group that would fail the
    same way every time.

    Example:
        >>> issubclass(GroupConfigError, ValueError)
        True
    """


@dataclasses.dataclass(frozen=True)
class JobGroups:
    """This process's group among the job's separate group jobs.

    Args:
        index: this group's index (its share of every global batch).
        count: the job's groups (G).
        store: the shared directory of rounds, outer states and heartbeats.
        min_groups: a round closes only once at least this many groups published.
        deadline: seconds a round waits for a live group that has not published.
        mode: ``"quorum"`` (a round waits for every live group, up to the deadline) or
            ``"async"`` (a group never waits; see :mod:`kdist.groups.sync`).
    """

    index: int
    count: int
    store: str
    min_groups: int = 1
    deadline: float = DEFAULT_DEADLINE
    mode: str = "quorum"


def _integer(env, name: str, low: int, high: int | None = None) -> int:
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise GroupConfigError(f"{name}={text!r} must be an integer {bound}.")
    return value


def from_environment(env=None) -> JobGroups | None:
    """The group this process belongs to, or None when it is not a separate group job
    (no ``KDIST_REPLICA_GROUP``). Every value is checked, naming the variable."""
    env = os.environ if env is None else env
    if GROUP not in env:
        stray = [name for name in VARIABLES[1:] if name in env]
        if stray:
            raise GroupConfigError(f"{', '.join(stray)} set without {GROUP}: a separate "
                                   f"replica group needs its index too (python -m "
                                   f"kdist.launch --replica-groups G sets them all).")
        return None
    for name in (GROUPS, STORE):
        if not env.get(name):
            raise GroupConfigError(f"{GROUP} is set but {name} is not: a separate replica "
                                   f"group needs the group count and the store directory "
                                   f"(python -m kdist.launch --replica-groups G "
                                   f"--replica-store DIR).")
    count = _integer(env, GROUPS, 1)
    index = _integer(env, GROUP, 0, count - 1)
    min_groups = _integer(env, MIN, 1, count) if env.get(MIN) else 1
    deadline = DEFAULT_DEADLINE
    if env.get(DEADLINE):
        try:
            deadline = float(env[DEADLINE])
        except ValueError:
            deadline = math.nan
        if not math.isfinite(deadline) or deadline <= 0:
            raise GroupConfigError(f"{DEADLINE}={env[DEADLINE]!r} must be a finite number of "
                                   f"seconds > 0 (python -m kdist.launch --round-deadline).")
    mode = env.get(MODE) or "quorum"
    if mode not in MODES:
        raise GroupConfigError(f"{MODE}={mode!r} must be one of {', '.join(MODES)}.")
    return JobGroups(index, count, env[STORE], min_groups, deadline, mode)


def local_spec(spec: str, job: JobGroups) -> str:
    """The mesh spec of this group's own job: ``replica=G`` becomes ``replica=1`` (the other
    groups are other jobs). Refuses a spec whose ``replica`` is not the job's G."""
    found = re.findall(r"(?:^|,)\s*replica\s*=\s*(\d+)\s*(?=,|$)", str(spec))
    if len(found) != 1:
        raise GroupConfigError(
            f"This process is replica group {job.index} of {job.count} separate jobs "
            f"({GROUP} is set), but mesh spec {spec!r} names no 'replica=N' axis. Give the "
            f"whole job's mesh, e.g. 'replica={job.count},data=4', and sync_every=H.")
    if int(found[0]) != job.count:
        raise GroupConfigError(
            f"Mesh spec {spec!r} has replica={found[0]} but the job was started with "
            f"{job.count} replica groups ({GROUPS}={job.count}, python -m kdist.launch "
            f"--replica-groups {job.count}). Make them agree.")
    return re.sub(r"((?:^|,)\s*replica\s*=\s*)\d+", r"\g<1>1", str(spec))


def job_mesh(spec: str, num_devices: int, env=None) -> tuple[dict[str, int], dict[str, int]]:
    """``(the whole job's axis sizes, this process's job's)``: equal unless this process is
    one of separate group jobs, whose own mesh has ``replica=1`` on its ``num_devices``.

    Example:
        >>> job_mesh("replica=2,data=4", 4, dict(EXAMPLE_ENV))[0]["replica"]
        2
    """
    from kdist.parallel.mesh import parse_mesh

    job = from_environment(env)
    if job is None:
        sizes = parse_mesh(spec, num_devices)
        return sizes, sizes
    own = parse_mesh(local_spec(spec, job), num_devices)
    return dict(own, replica=job.count), own


EXAMPLE_ENV = {GROUP: "0", GROUPS: "2", STORE: "/tmp/store"}
