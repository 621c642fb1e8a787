"""What must be the same in every group of a job, and the words for what differs.

A group compares its own fingerprint with the job's (the first group's, in the store's
``manifest.json``) before its first round; a difference refuses it, naming the setting.

Example:
    >>> differences({"sync_every": 2}, {"sync_every": 3})
    ["sync_every: the job's 2, this group's 3"]
"""

from __future__ import annotations

import hashlib
import json

NAMES = {"model": "the model's config", "model_class": "the model class",
         "weights": "the weights (paths, shapes, dtypes)",
         "inner_optimizer": "the optimizer's config", "sync_every": "sync_every",
         "outer": "the outer optimizer (learning rate, momentum, Nesterov)",
         "groups": "the number of groups", "mode": "KDIST_REPLICA_MODE",
         "group_mesh": "each group's mesh", "processes_per_group": "processes per group",
         "batch": "each group's batch (its data share)"}


def digest(value) -> str:
    """A short SHA-256 of ``value``'s JSON (keys sorted)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe(model, job, batch_shape) -> dict:
    """This group's fingerprint: model, optimizers, groups, mesh, batch per group."""
    import jax

    from kdist.parallel.layout import active

    optimizer = model.optimizer
    dist = active()
    return {
        "model": digest(model.get_config()),
        "model_class": type(model).__name__,
        "weights": [[v.path, list(v.shape), str(v.dtype)] for v in model.trainable_variables],
        "inner_optimizer": digest(optimizer.inner().get_config()),
        "sync_every": optimizer.sync_every,
        "outer": [optimizer.outer_learning_rate, optimizer.outer_momentum,
                  optimizer.outer_nesterov],
        "groups": job.count,
        "mode": job.mode,
        "group_mesh": dist.spec if dist is not None else "none",
        "processes_per_group": jax.process_count(),
        "batch": list(batch_shape or ()),
    }


def differences(theirs: dict, ours: dict) -> list[str]:
    """One phrase per setting that differs (short values shown)."""
    found = []
    for key, name in NAMES.items():
        a, b = theirs.get(key), ours.get(key)
        if a != b:
            shown = (f": the job's {a!r}, this group's {b!r}"
                     if not isinstance(a, list) or len(str(a)) < 120 else "")
            found.append(f"{name}{shown}")
    return found
