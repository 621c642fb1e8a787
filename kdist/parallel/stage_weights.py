"""A pipeline stage's weights under ``fsdp`` in the interpreter's region
(:mod:`kdist.parallel.interpreter`): gathered whole once before the schedule, their
gradient summed over the batch axes and scattered back into blocks once after it — as
GPipe's stages do (:func:`kdist.parallel.pipeline.pipelined`), ZeRO-3 once per step
rather than once per tick.

Example (inside a ``shard_map`` where ``fsdp`` is manual):
    >>> w = gather(block, ("stage", "fsdp"), ("fsdp",))  # doctest: +SKIP
    >>> g = reduce(grad, ("stage", "fsdp"), ("fsdp",))  # doctest: +SKIP
"""

from __future__ import annotations

import jax


def sharded_dims(axes, batch_axes) -> list[tuple[int, str]]:
    """A weight's dimensions split over a batch axis (``fsdp``): ``(dimension, axis)``."""
    return [(d, a) for d, a in enumerate(axes) if a is not None and a in batch_axes]


def gather(w, axes, batch_axes):
    """One device's block of a weight whole over its batch axes (ZeRO-3's gather)."""
    for d, a in sharded_dims(axes, batch_axes):
        w = jax.lax.all_gather(w, a, axis=d, tiled=True)
    return w


def reduce(g, axes, batch_axes):
    """A weight's gradient summed over the batch axes: reduce-scattered back into the
    weight's blocks over the axes it is split on, all-reduced over the others."""
    sharded = sharded_dims(axes, batch_axes)
    split = {axis for _, axis in sharded}
    rest = tuple(a for a in batch_axes if a not in split)
    if rest:
        g = jax.lax.psum(g, rest)
    for d, a in sharded:
        g = jax.lax.psum_scatter(g, a, scatter_dimension=d, tiled=True)
    return g
