"""Dropout inside a per-device region that draws the same mask as the whole-batch program.

Keras' dropout draws ``jax.random.bernoulli(seed, keep, x.shape)``. Outside a manual
region ``x`` is the global batch and, since JAX's threefry is *partitionable*
(``jax_threefry_partitionable``, the default since 0.5), element ``i`` of the mask depends
only on the seed and ``i``'s position in the flattened global array: every mesh draws the
mask one device draws. Inside a ``shard_map`` (``kdist.parallel.reduction``,
``kdist.groups.diloco``) ``x`` is one device's block of rows, and Keras would draw the
same block-shaped mask on every device: one mask for all rows blocks, not the global one.

:class:`Dropout` (what kdist's models use) draws, inside a manual region, the device's
block of the *global* mask: the threefry counters are the global flat indices of its rows
(``row_offset * S + j`` for a row of ``S`` elements, 64-bit in two ``uint32`` words as JAX
forms them), so the masks — and the training — equal the 1-device run's, at the cost of
the device's own elements only. Outside a region it is Keras' ``Dropout``.
``tests/test_dropout.py`` holds this to ``jax.random.bernoulli`` bit for bit, so a change
in JAX's counter layout is caught.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.extend.random import threefry2x32_p

from kdist.parallel import region

_U32 = jnp.uint32


def _add_with_carry(hi, lo, addend):
    """``(hi, lo) + addend`` as 64-bit numbers in two ``uint32`` words."""
    total = lo + addend
    return hi + (total < lo).astype(_U32), total


def global_counters(rows, row_size: int, shape):
    """The 64-bit flat indices ``rows[r] * row_size + j`` of a block ``shape`` whose first
    axis holds global rows ``rows`` (``uint32``), as ``(hi, lo)`` ``uint32`` arrays."""
    if not 0 < row_size < 2**32:
        raise ValueError(f"A dropout row of {row_size} elements is beyond the 2^32 this "
                         f"mask generator supports; use a smaller sequence or hidden size.")
    rows = rows.astype(_U32)
    r_hi, r_lo = rows >> 16, rows & 0xFFFF
    s_hi, s_lo = _U32(row_size >> 16), _U32(row_size & 0xFFFF)
    hi, lo = r_hi * s_hi, r_lo * s_lo  # each product < 2^32
    for middle in (r_hi * s_lo, r_lo * s_hi):  # x 2^16: split across the two words
        hi, lo = _add_with_carry(hi + (middle >> 16), lo, middle << 16)
    shape_rest = (1,) * (len(shape) - 1)
    hi, lo = hi.reshape((-1, *shape_rest)), lo.reshape((-1, *shape_rest))
    within = jnp.zeros((1, *shape[1:]), _U32)
    for dim in range(1, len(shape)):  # j: the flat index inside a row
        stride = math.prod(shape[dim + 1:])
        within = within + jax.lax.broadcasted_iota(_U32, (1, *shape[1:]), dim) * _U32(stride)
    hi, lo = _add_with_carry(jnp.broadcast_to(hi, shape), jnp.broadcast_to(lo, shape),
                             jnp.broadcast_to(within, shape))
    return hi, lo


def block_keep_mask(seed, keep_prob: float, shape, first_row):
    """Rows ``first_row ...`` of ``jax.random.bernoulli(seed, keep_prob, global_shape)``
    for a block of ``shape`` (its first axis a block of the global first axis).

    ``seed``: a raw ``uint32[2]`` key (Keras' seed-generator state). Exactly JAX's values:
    threefry of the global counters, ``bits1 ^ bits2``, the uniform float from the top 23
    bits, compared with ``keep_prob``.

    Example:
        >>> seed = jnp.array([7, 3], jnp.uint32)
        >>> full = jax.random.bernoulli(seed, 0.9, (4, 5))
        >>> bool((block_keep_mask(seed, 0.9, (2, 5), 2) == full[2:]).all())
        True
    """
    shape = tuple(shape)
    rows = jnp.asarray(first_row, _U32) + jnp.arange(shape[0], dtype=_U32)
    hi, lo = global_counters(rows, math.prod(shape[1:]), shape)
    key = jnp.asarray(seed).astype(_U32)
    bits1, bits2 = threefry2x32_p.bind(key[0], key[1], hi, lo)
    bits = bits1 ^ bits2
    one = np.array(1.0, np.float32).view(np.uint32)
    uniform = jax.lax.bitcast_convert_type((bits >> 9) | _U32(one), jnp.float32) - 1.0
    return uniform < keep_prob


@keras.saving.register_keras_serializable(package="kdist")
class Dropout(keras.layers.Dropout):
    """Keras' ``Dropout`` that, inside kdist's per-device region, draws the device's rows
    of the global batch's mask (see the module docstring); elsewhere Keras' own.

    Example:
        >>> layer = Dropout(0.5, seed=1)
        >>> layer(np.ones((2, 4), "float32"), training=True).shape
        (2, 4)
    """

    def call(self, inputs, training=False):
        axes = region.current().batch_axes
        if not (training and self.rate > 0 and axes):
            return super().call(inputs, training=training)
        if self.noise_shape is not None:
            raise ValueError(
                f"Dropout '{self.name}' has noise_shape={self.noise_shape}; kdist's "
                f"per-device region draws whole-shape masks only. Build the layer without "
                f"noise_shape or train with gradient_reduction=None.")
        keep = 1.0 - self.rate
        seed = self.seed_generator.next()  # Keras' draw: the same state update
        # Axes of size 1 change no row index; leaving them out keeps the mask (and so the
        # output) typed as varying only where it does, as a pipeline's carry must.
        split = tuple(a for a in axes if jax.lax.axis_size(a) > 1)
        first_row = jax.lax.axis_index(split) * inputs.shape[0] if split else 0
        mask = block_keep_mask(seed, keep, inputs.shape, first_row)
        return jax.lax.select(mask, inputs / keep, jnp.zeros_like(inputs))
