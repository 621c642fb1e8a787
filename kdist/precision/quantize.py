"""Dynamic symmetric quantizers: a float array to 8-bit codes and float32 scales.

A scale is the absolute maximum over the reduced ``axis`` times the float32 reciprocal of the
format's largest code (127 for int8, 448 for float8 e4m3, 57344 for e5m2), computed in
float32 on every call
("dynamic" / "current" scaling: no history is kept). A slice that is all zeros gets scale
1 (its codes are zeros either way), so no division by zero reaches the codes.
``x ≈ codes * scale`` along the kept axes; the matmuls of :mod:`kdist.precision.matmul`
rescale their integer or float8 products by the outer product of two such scales.
"""

from __future__ import annotations

import jax.numpy as jnp

INT8_MAX = 127  # symmetric: -128 is never produced, so negation cannot overflow
FP8_FORWARD = jnp.float8_e4m3fn  # more mantissa: weights and activations
FP8_GRADIENT = jnp.float8_e5m2  # more range: gradients


def scale(x, axis, largest: float):
    """``max |x|`` over ``axis`` (an int or a tuple; kept, size 1) times
    ``float32(1 / largest)``, in float32; 1 where the maximum is 0.

    Example:
        >>> scale(jnp.array([[1.0, -254.0], [0.0, 0.0]]), axis=1, largest=127).tolist()
        [[2.0], [1.0]]
    """
    # The maximum in x's own dtype, then float32: exact either way (abs and max do not
    # round), and no float32 copy of x is made for it beside the codes' pass.
    peak = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
    # Times the float32 reciprocal, not divided: XLA rewrites a division by a constant into
    # that product anyway, and writing it makes the scale's rounding part of the definition.
    return jnp.where(peak > 0, peak * jnp.float32(1 / largest), jnp.float32(1))


def _reciprocal(s):
    # Codes are x times 1/scale (one float32 division per slice), not x / scale: XLA
    # rewrites a division by a broadcast scale into that product, and a code on a rounding
    # tie (x / s = 63.5) then depends on which one ran; writing it fixes the definition.
    return jnp.float32(1) / s


def int8(x, axis):
    """Int8 codes of ``x`` and their float32 scales over ``axis``: ``round(x * (1 /
    scale))``, rounding half to even, clipped to ±127.

    Example:
        >>> codes, s = int8(jnp.array([[0.5, -1.0, 0.25]]), axis=1)
        >>> codes.tolist(), s.tolist()
        ([[64, -127, 32]], [[0.007874015718698502]])
    """
    s = scale(x, axis, INT8_MAX)
    codes = jnp.clip(jnp.round(x.astype(jnp.float32) * _reciprocal(s)), -INT8_MAX, INT8_MAX)
    return codes.astype(jnp.int8), s


def fp8(x, axis, dtype=FP8_FORWARD):
    """Float8 codes of ``x`` (``dtype``: e4m3 or e5m2) and their float32 scales over
    ``axis``: ``x * (1 / scale)`` rounded to the nearest float8, the maximum at the format's
    largest finite value.

    Example:
        >>> codes, s = fp8(jnp.array([[0.5, -1.0]]), axis=1)
        >>> codes.astype(jnp.float32).tolist(), s.tolist()
        ([[224.0, -448.0]], [[0.0022321429569274187]])
    """
    largest = float(jnp.finfo(dtype).max)
    s = scale(x, axis, largest)
    # Clipped first: float8 e4m3fn has no infinity, so an overflow would become NaN.
    codes = jnp.clip(x.astype(jnp.float32) * _reciprocal(s), -largest, largest)
    return codes.astype(dtype), s
