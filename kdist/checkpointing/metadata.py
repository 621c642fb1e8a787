"""``kdist.json``: a step's metadata and commit marker (written here; read by
:func:`kdist.checkpointing.format.read_metadata`).

Small and human-readable: step, data position, loss, model config, mesh, versions, wall time,
every variable's shape and dtype, and the size and SHA-256 of every file of the step's array
store (``files``, ``checksums``; steps written before checksums existed have sizes only).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np

from kdist.checkpointing.format import METADATA_NAME, array_files
from kdist.durable import CHECKSUM, file_checksum


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        return json.loads(json.dumps(x, default=str))


def versions() -> dict[str, str]:
    """The versions of kdist, Keras, JAX and orbax-checkpoint."""
    import orbax.checkpoint as ocp

    # kdist is imported by now (this module is part of it); importing it here would make
    # an import cycle kdist -> callbacks -> checkpointing -> kdist.
    return {"kdist": sys.modules["kdist"].__version__, "keras": keras.__version__,
            "jax": jax.__version__, "orbax-checkpoint": getattr(ocp, "__version__", "?")}


def mesh_description() -> dict[str, Any]:
    """The active Keras distribution's spec, mesh shape and device count."""
    dist = keras.distribution.distribution()
    if dist is None:
        return {"spec": None, "shape": {}, "devices": 1}
    mesh = dist.device_mesh
    return {"spec": getattr(dist, "spec", type(dist).__name__),
            "shape": dict(zip(mesh.axis_names, (int(s) for s in mesh.shape))),
            "devices": int(np.prod(mesh.shape))}


def describe(model: keras.Model, variables: dict[str, keras.Variable], step: int,
             data_step: int | None, epoch: int | None, loss: float | None) -> dict[str, Any]:
    """The metadata of a step about to be saved (files and checksums are added at commit).

    Example:
        >>> describe(model, state_variables(model), 10, 10, 0, 2.5)["step"]  # doctest: +SKIP
        10
    """
    try:
        config = keras.saving.serialize_keras_object(model)
    except Exception as e:  # noqa: BLE001 (a model without get_config still saves)
        config = {"error": f"get_config failed: {e}"}
    return {
        "step": step,
        "data_step": data_step,
        "epoch": epoch,
        "loss": loss,
        "wall_time": time.time(),
        "wall_time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mesh": mesh_description(),
        "process_count": jax.process_count(),
        "versions": versions(),
        "model_config": _jsonable(config),
        "variables": {k: {"path": v.path, "shape": list(v.shape), "dtype": str(v.dtype)}
                      for k, v in variables.items()},
    }


def write_commit_marker(step_root: Path, meta: dict[str, Any]) -> None:
    """Adds every array file's size and checksum to ``meta`` and writes ``kdist.json`` into
    ``step_root`` (orbax's temporary directory, before its rename), fsynced.

    Runs on orbax's background thread, so hashing does not stall training.
    """
    files = array_files(step_root)
    meta["files"] = {str(f.relative_to(step_root)): f.stat().st_size for f in files}
    meta["checksum_algorithm"] = CHECKSUM
    meta["checksums"] = {str(f.relative_to(step_root)): file_checksum(f) for f in files}
    path = step_root / METADATA_NAME
    with open(path, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
