"""Dynamic symmetric quantizers: a float array to 8-bit codes and float32 scales.

A scale is the absolute maximum over the reduced ``axis`` times the float32 reciprocal of the
format's largest code (127 for int8, 448 for float8 e4m3, 57344 for e5m2), computed in
float32 on every call
("dynamic" / "current" scaling: no history is kept). A slice that is all zeros gets scale
1 (its codes are zeros either way), so no division by zero reaches the codes.
``x ≈ codes * scale`` along the kept axes; the matmuls of :mod:`kdist.precision.matmul`
rescale their integer or float8 products by the outer product of two such scales.

:func:`int8` rounds to nearest; :func:`int8_stochastic` rounds each value down or up with
the probabilities that make its code's expectation the value itself (the gradients of
``matmul_precision="int8-sr"``), its randomness drawn from a key it derives from ``x``.
Every quantizer takes ``axis_names``: mesh axes its maximum is also reduced over, for a
caller inside ``shard_map`` whose reduced axis is split across devices (the fused loss's
quantized head, :mod:`kdist.models.losses`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

INT8_MAX = 127  # symmetric: -128 is never produced, so negation cannot overflow
FP8_FORWARD = jnp.float8_e4m3fn  # more mantissa: weights and activations
FP8_GRADIENT = jnp.float8_e5m2  # more range: gradients


def scale(x, axis, largest: float, axis_names=()):
    """``max |x|`` over ``axis`` (an int or a tuple; kept, size 1) times
    ``float32(1 / largest)``, in float32; 1 where the maximum is 0. ``axis_names``: mesh
    axes (inside ``shard_map``) over which ``x``'s reduced axes are split: the maximum is
    taken over every device's part too (``pmax``), as one device's over the whole axis.

    Example:
        >>> scale(jnp.array([[1.0, -254.0], [0.0, 0.0]]), axis=1, largest=127).tolist()
        [[2.0], [1.0]]
    """
    # The maximum in x's own dtype, then float32: exact either way (abs and max do not
    # round), and no float32 copy of x is made for it beside the codes' pass.
    peak = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
    if axis_names:
        peak = lax.pmax(peak, axis_names)
    # Times the float32 reciprocal, not divided: XLA rewrites a division by a constant into
    # that product anyway, and writing it makes the scale's rounding part of the definition.
    return jnp.where(peak > 0, peak * jnp.float32(1 / largest), jnp.float32(1))


def _reciprocal(s):
    # Codes are x times 1/scale (one float32 division per slice), not x / scale: XLA
    # rewrites a division by a broadcast scale into that product, and a code on a rounding
    # tie (x / s = 63.5) then depends on which one ran; writing it fixes the definition.
    return jnp.float32(1) / s


def int8(x, axis, axis_names=()):
    """Int8 codes of ``x`` and their float32 scales over ``axis``: ``round(x * (1 /
    scale))``, rounding half to even, clipped to ±127.

    Example:
        >>> codes, s = int8(jnp.array([[0.5, -1.0, 0.25]]), axis=1)
        >>> codes.tolist(), s.tolist()
        ([[64, -127, 32]], [[0.007874015718698502]])
    """
    s = scale(x, axis, INT8_MAX, axis_names)
    codes = jnp.clip(jnp.round(x.astype(jnp.float32) * _reciprocal(s)), -INT8_MAX, INT8_MAX)
    return codes.astype(jnp.int8), s


def data_key(x, axis):
    """A threefry key that is a function of ``x``'s values and of ``axis`` only: no seed,
    no state. The values enter as the wrapping ``uint32`` sum of their float32 bit patterns
    (one cheap pass; an integer sum is exact in any order, so a sharded ``x`` hashes as one
    device's), ``axis`` as the product's identity (``dy``'s two products reduce it over
    different axes, so they draw different bits).

    Example:
        >>> x, bits = jnp.array([[0.5, -1.0]]), jax.random.key_data
        >>> (bits(data_key(x, 1)) == bits(data_key(x * 1, 1))).all().item()
        True
        >>> (bits(data_key(x, 1)) == bits(data_key(x, 0))).all().item()
        False
    """
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    # Threefry pinned, not the configured default implementation: its bits are the same on
    # any sharding and on CPU, GPU and TPU (jax.random's table: rbg's differ by backend, and
    # by sharding where made shardable), so a sharded step draws one device's bits for the
    # same dy. With jax_threefry_partitionable (JAX's default since 0.5, on here with 0.10)
    # XLA also partitions the generation: each device computes only its shard's bits, with
    # no communication. (Flipping that flag changes which bits are drawn, not their law.)
    key = jax.random.fold_in(jax.random.key(0, impl="threefry2x32"),
                             jnp.sum(bits, dtype=jnp.uint32))
    for a in (len(axes), *axes):
        key = jax.random.fold_in(key, a)
    return key


def int8_stochastic(x, axis, key=None, axis_names=()):
    """Int8 codes of ``x`` and their float32 scales over ``axis`` (the scales of
    :func:`int8`), each code stochastically rounded: ``floor(v)`` plus one with
    probability ``v - floor(v)`` (``v = x * (1 / scale)``; the same law as
    ``floor(v + u)``, ``u`` uniform in [0, 1)), clipped to ±127. So ``E[codes] = v``:
    unbiased, where round-to-nearest rounds a value below half a step to 0 every time.
    ``key``: a JAX key; None (as the matmuls call it) derives one from ``x`` and ``axis``
    (:func:`data_key`), so it changes whenever ``x`` does.

    Example:
        >>> codes, s = int8_stochastic(jnp.array([[0.5, -1.0, 0.25]]), axis=1)
        >>> codes[0, 1].item(), codes[0, 0].item() in (63, 64), s.tolist()
        (-127, True, [[0.007874015718698502]])
    """
    key = data_key(x, axis) if key is None else key
    s = scale(x, axis, INT8_MAX, axis_names)
    v = x.astype(jnp.float32) * _reciprocal(s)
    down = jnp.floor(v)
    # Down plus a Bernoulli(fraction), not floor(v + u) (the same law): v - floor(v) is
    # exact in float32 and nothing after it rounds, so a code is floor(v) or floor(v) + 1
    # by construction, up with probability the fraction to uniform's 2^-23 grid.
    up = jax.random.uniform(key, v.shape, jnp.float32) < v - down
    codes = jnp.clip(down + up, -INT8_MAX, INT8_MAX)
    return codes.astype(jnp.int8), s


def fp8(x, axis, dtype=FP8_FORWARD, axis_names=()):
    """Float8 codes of ``x`` (``dtype``: e4m3 or e5m2) and their float32 scales over
    ``axis``: ``x * (1 / scale)`` rounded to the nearest float8, the maximum at the format's
    largest finite value.

    Example:
        >>> codes, s = fp8(jnp.array([[0.5, -1.0]]), axis=1)
        >>> codes.astype(jnp.float32).tolist(), s.tolist()
        ([[224.0, -448.0]], [[0.0022321429569274187]])
    """
    largest = float(jnp.finfo(dtype).max)
    s = scale(x, axis, largest, axis_names)
    # Clipped first: float8 e4m3fn has no infinity, so an overflow would become NaN.
    codes = jnp.clip(x.astype(jnp.float32) * _reciprocal(s), -largest, largest)
    return codes.astype(dtype), s
