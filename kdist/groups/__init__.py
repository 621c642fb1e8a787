"""DiLoCo's replica groups: in one SPMD program, or as separate JAX jobs that survive each
other (fault-tolerant DiLoCo).

* :mod:`kdist.groups.diloco` — the ``DiLoCo`` optimizer (per-group state; it owns the
  training step through :class:`kdist.parallel.transform.StepOwner`), the per-group step,
  the sync program every ``sync_every`` steps and at ``fit``'s last (the step itself:
  :mod:`kdist.groups.group_step`); :mod:`kdist.groups.outer` the outer optimizer step both
  forms share.

DiLoCo's ``replica`` groups need to talk only once every
``sync_every`` steps, so each group can be its own JAX job — its own processes and, with
several, its own ``jax.distributed`` cluster — and a group that dies cannot hang another's
collectives. The groups exchange their outer gradients through storage (orbax on a shared
directory: a local disk, NFS, a mounted bucket), never through a server of kdist's:

* :mod:`kdist.parallel.group_jobs` — what a group knows of the job (its index, the group
  count, the store, the quorum rule), read from the environment ``python -m kdist.launch
  --replica-groups G`` (or a cluster scheduler) gives each group's processes.
* :mod:`kdist.groups.store` — the store's layout: a round's published outer gradients, its
  quorum record, the outer state, each group's heartbeat, every commit atomic;
  :mod:`kdist.groups.store_io` how it writes its files (once, or waiting out a full store).
* :mod:`kdist.groups.sync` — the outer step between inner steps, on the host: publish, wait
  for the quorum, average in a fixed order, step; join and catch up
  (:mod:`kdist.groups.catch_up`); end with the job's last round (:mod:`kdist.groups.
  job_end`); the arrays' part in :mod:`kdist.groups.outer_arrays`, the
  host's (output that never raises, the heartbeat thread) in :mod:`kdist.groups.host`.
* :mod:`kdist.groups.rejoin` — where a restarted group resumes: the job's step, not its
  own checkpoint's.
* :mod:`kdist.groups.fingerprints` — what must be the same in every group of a job, and
  the words for what differs.
* :mod:`kdist.groups.rounds`, :mod:`kdist.groups.history` — what each outer round cost a
  group (from its throughput log); the groups' part of ``kdist report``.
* :mod:`kdist.groups.supervisor` — the launcher's group mode: starts G groups, restarts a
  failed one or starts a spare in its place, ends the job when fewer than a minimum remain.

A user's script does not change: the same ``kdist.distribution("replica=2,data=4",
sync_every=50)`` trains the two groups in one program on 8 devices, or — launched with
``python -m kdist.launch --replica-groups 2 --devices-per-process 4 SCRIPT`` — as two jobs of
4 devices each, computing the same function when no group fails.
"""

from kdist.groups.rejoin import skip_to_job
from kdist.parallel.group_jobs import JobGroups, from_environment

__all__ = ["JobGroups", "from_environment", "skip_to_job"]
