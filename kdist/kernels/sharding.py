"""Pallas kernels under a kdist distribution: each device attends its own examples and heads.

A Pallas call is opaque to XLA's partitioner, which would gather its operands onto every
device; :func:`per_device` runs the kernel in a ``shard_map`` over the batch's replica
axes and the ``model`` axis's heads instead. Inside a region of kdist's where axes are
manual already (the explicit gradient reduction, a pipeline stage, a replica group) no
kernel runs: JAX 0.10's Pallas calls do not type their outputs for ``shard_map``'s checks
of what varies between devices, and ``attention_implementation="auto"`` attends by chunks
there.

Example:
    >>> import jax.numpy as jnp
    >>> per_device(lambda q, k, v, s: q, *(jnp.ones((1, 128, 2, 64)),) * 3, None,
    ...            name="a kernel").shape  # no distribution: called as it is
    (1, 128, 2, 64)
"""

from __future__ import annotations

import math

import jax


def per_device(local, q, k, v, segment_ids, *, name: str):
    """``local(q, k, v, segment_ids)`` of ``q (B, T, N, H)``, ``k``/``v (B, S, K, H)``,
    ``segment_ids (B, T)`` or None, run on each device's rows and heads under the active
    distribution (as it is without one). ``name``: the kernel, for the error inside a
    per-device region."""
    from kdist.parallel import region
    from kdist.parallel.layout import active
    from kdist.parallel.mesh import batch_axes

    if region.current().per_device:
        raise ValueError(
            f"{name} cannot run inside a per-device region of kdist's (a pipeline stage, "
            "the explicit gradient reduction, a replica group): in JAX 0.10 Pallas kernels "
            "do not type their outputs for shard_map's checks of what varies between "
            "devices. Use attention_implementation='auto' (chunked attention there) or "
            "'chunked'.")
    dist = active()
    if dist is None:
        return local(q, k, v, segment_ids)
    sizes = dist.mesh_shape
    mesh = dist.device_mesh.backend_mesh
    axes = region.current().automatic(mesh.axis_names)
    if not any(sizes[a] > 1 for a in axes):  # one device
        return local(q, k, v, segment_ids)
    replicas = batch_axes(sizes, among=axes)
    # A batch that does not divide over the replicas is computed whole by each of them.
    rows = replicas if replicas and q.shape[0] % math.prod(sizes[a] for a in replicas) == 0 \
        else None
    model = (sizes["model"] > 1 and "model" in axes
             and q.shape[2] % sizes["model"] == 0 and k.shape[2] % sizes["model"] == 0)
    heads = jax.sharding.PartitionSpec(rows, None, "model" if model else None, None)
    ids = () if segment_ids is None else (segment_ids,)
    in_specs = (heads,) * 3 + (jax.sharding.PartitionSpec(rows, None),) * len(ids)
    # The kernels cannot type what varies between devices (see above): JAX's checks off.
    return region.shard_map(lambda q, k, v, *s: local(q, k, v, s[0] if s else None),
                            mesh=mesh, axes=axes, in_specs=in_specs, out_specs=heads,
                            batch_axes=rows or (), check_vma=False)(q, k, v, *ids)
