"""The outer step on a group job's arrays (:mod:`kdist.groups.sync`): the gradient a group
publishes, the members' weighted mean and the outer optimizer step (one jitted program),
and the outer state's fingerprint — bit-exact, whatever the mesh and sharding.

Example:
    >>> sorted(tree([1, 2]))
    ['w0000', 'w0001']
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from kdist.groups import fingerprints
from kdist.groups.outer import outer_settings, outer_update


def _as_bits(x):
    """``x``'s bits as uint32 (wider types split, narrower widened): what the fingerprint
    sums, so that equal fingerprints mean equal bits, not merely close values."""
    import jax.numpy as jnp

    size = x.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size > 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # a trailing axis of halves
    narrow = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)


@jax.jit
def _fingerprint_sums(arrays):
    """Two wrapping uint32 sums per array: of the bits, and of the bits weighted by an odd
    function of their position (so a moved value shows). Integer sums do not depend on
    the order of summation: every mesh and sharding gives the same answer."""
    import jax.numpy as jnp

    sums = []
    for x in arrays:
        bits = _as_bits(x).reshape(-1)
        position = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761)
        sums.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                               jnp.sum(bits * (position | jnp.uint32(1)), dtype=jnp.uint32)]))
    return jnp.stack(sums)


def state_digest(theta, momenta) -> str:
    """The fingerprint of an outer state (weights and outer momenta): equal in every group
    that holds the same bits."""
    sums = _fingerprint_sums(list(theta) + list(momenta))
    return fingerprints.digest(np.asarray(sums.addressable_data(0)).tolist())


def tree(values) -> dict:
    return {f"w{i:04d}": v for i, v in enumerate(values)}


def leaves(tree: dict) -> list:
    return [tree[k] for k in sorted(tree)]


def targets(theta) -> list:
    return [jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding) for t in theta]


@jax.jit
def deltas(theta, params):
    return [t - p[0] for t, p in zip(theta, params)]


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _outer_jit(settings, theta, momenta, deltas, weights, divisor):
    # quorum mode: every weight 1 and divisor n, a sum then / n, as the in-program mean
    mean = [functools.reduce(lambda a, b: a + b,
                             (d if w == 1.0 else w * d for w, d in zip(weights, ds))) / divisor
            for ds in zip(*deltas)]
    stepped = [outer_update(settings, t, m, d) for t, m, d in zip(theta, momenta, mean)]
    return [t for t, _ in stepped], [m for _, m in stepped]


def outer_step(optimizer, job, theta, momenta, deltas, published, members, r):
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


def stack(theta, like):
    """``theta`` with the replica dimension of the stacked parameters, in their layout."""
    return [jax.device_put(t[None], p.sharding) for t, p in zip(theta, like)]
