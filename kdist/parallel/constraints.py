"""Activation sharding inside a model, and the per-device (``shard_map``) region.

* :func:`shard_batch` pins an activation's batch dimension to the replica axes.
* :func:`gathered` constrains a weight to its layout minus ``fsdp``: FSDP's all-gather.
* :func:`manual_region` marks the tracing of a per-device computation (explicit gradient
  reduction, a pipeline stage, ring attention): there the constraints above step aside,
  since every array is already one device's block; :func:`to_varying` types a scan carry
  as varying over the manual axes like the blocks it meets.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import jax
import keras
from keras.distribution import TensorLayout

from kdist.parallel.layout import BatchLayout, active
from kdist.parallel.mesh import REPLICA_AXES

_state = threading.local()


@contextlib.contextmanager
def manual_region():
    """Marks the tracing of a per-device computation: kdist's sharding constraints
    (``shard_batch``, ``gathered``) and the fused loss's own ``shard_map`` step aside.

    Example:
        >>> with manual_region():
        ...     assert in_manual_region()
    """
    previous = getattr(_state, "manual", False)
    _state.manual = True
    try:
        yield
    finally:
        _state.manual = previous


def in_manual_region() -> bool:
    """Whether a per-device computation is being traced (see :func:`manual_region`)."""
    return getattr(_state, "manual", False)


def shard_batch(x):
    """Pins an activation's batch dimension to the replica axes, and its sequence dimension
    (the second) to ``seq`` when that axis divides it (the rest replicated).

    Models call this on each block's output. Without it XLA's partitioner propagates the
    weights' fsdp sharding into the activations and reshards them back and forth (measured
    3.5x slower steps under fsdp=8 on CPU). A batch that does not divide by the replicas
    (e.g. generating one sequence) is left to XLA. Identity without a kdist distribution.
    """
    dist = active()
    batch = x.shape[0]
    if dist is None or not isinstance(batch, int) or in_manual_region():
        return x
    if batch % dist.num_model_replicas:
        return x
    axes = [REPLICA_AXES] + [None] * (len(x.shape) - 1)
    seq = dist.mesh_shape.get("seq", 1)
    if seq > 1 and len(x.shape) > 1 and isinstance(x.shape[1], int) and x.shape[1] % seq == 0:
        axes[1] = "seq"  # (B, T, ...): each device's tokens (kdist.parallel.context)
    return keras.distribution.distribute_tensor(x, BatchLayout(tuple(axes), dist.device_mesh))


def gathered(x, logical_axes: Sequence[str | None]):
    """Constrains a weight to its layout minus the ``fsdp`` axis: FSDP's all-gather before use.

    XLA inserts this all-gather by itself around matmuls; a gather (embedding lookup) from
    an fsdp-sharded table instead yields an embed-sharded result that XLA can only reshard
    by replicating it. Identity when no kdist distribution is active.
    """
    dist = active()
    if dist is None or in_manual_region():
        return x
    axes = tuple(m if m != "fsdp" else None for m in map(dist.mesh_axis_for, logical_axes))
    return keras.distribution.distribute_tensor(x, TensorLayout(axes, dist.device_mesh))


def varying_axes(x) -> frozenset:
    """The manual axes over which ``x`` may differ between devices (JAX's type of it)."""
    aval = jax.typeof(x)
    return aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying  # jax >= 0.9


def to_varying(x, axes):
    """``x`` typed as varying over ``axes`` too (a scan's initial carry must have the type
    of the carry it returns; outside ``shard_map`` there are no axes and nothing changes)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
