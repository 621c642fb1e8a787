"""Activation sharding inside a model, and the types of per-device blocks.

* :func:`shard_batch` pins an activation's batch dimension to the replica axes.
* :func:`gathered` constrains a weight to its layout minus ``fsdp``: FSDP's all-gather.
* Inside a per-device region (:mod:`kdist.parallel.region`: explicit gradient reduction,
  a pipeline stage, a replica group) both constrain over the axes still automatic there
  only, since over the manual ones every array is already one device's block;
  :func:`kdist.parallel.region.to_varying` types a scan carry as varying over the manual
  axes like the blocks it meets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import keras
from keras.distribution import TensorLayout

from kdist.parallel import region
from kdist.parallel.layout import BatchLayout, active
from kdist.parallel.mesh import batch_axes


def _constrain(x, axes, dist):
    """``x`` constrained to ``axes`` (one entry per dimension: None, an axis or a tuple),
    the manual axes left out; inside a per-device region, as a bare ``PartitionSpec``
    of the region's mesh (a ``NamedSharding`` of the whole mesh is refused there)."""
    manual = region.current().manual
    if not manual:
        layout = BatchLayout(axes, dist.device_mesh) if any(
            isinstance(a, tuple) for a in axes) else TensorLayout(axes, dist.device_mesh)
        return keras.distribution.distribute_tensor(x, layout)

    def keep(a):
        if isinstance(a, tuple):
            a = tuple(b for b in a if b not in manual)
            return a or None
        return None if a in manual else a

    axes = tuple(map(keep, axes))
    if all(a is None for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*axes))


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
    if dist is None or not isinstance(batch, int):
        return x
    manual = region.current().manual
    axes = batch_axes(dist.mesh_shape, region.current().automatic(dist.mesh_shape))
    seq = dist.mesh_shape.get("seq", 1)
    split = seq > 1 and "seq" not in manual and len(x.shape) > 1 and isinstance(
        x.shape[1], int) and x.shape[1] % seq == 0
    if not (axes or split) or batch % math.prod(dist.mesh_shape[a] for a in axes):
        return x
    spec = [axes or None] + [None] * (len(x.shape) - 1)
    if split:
        spec[1] = "seq"  # (B, T, ...): each device's tokens (kdist.parallel.context)
    return _constrain(x, tuple(spec), dist)


def gathered(x, logical_axes: Sequence[str | None]):
    """Constrains a weight to its layout minus the ``fsdp`` axis: FSDP's all-gather before use.

    XLA inserts this all-gather by itself around matmuls; a gather (embedding lookup) from
    an fsdp-sharded table instead yields an embed-sharded result that XLA can only reshard
    by replicating it. Identity when no kdist distribution is active.
    """
    dist = active()
    if dist is None:
        return x
    axes = tuple(m if m != "fsdp" else None for m in map(dist.mesh_axis_for, logical_axes))
    return _constrain(x, axes, dist)
