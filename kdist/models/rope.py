"""Rotary position embeddings with Llama 3.1/3.2's frequency scaling (``rope_type="llama3"``).

Plain RoPE in kdist is keras-hub's ``RotaryEmbedding`` (``CausalSelfAttention``); this
module adds what it lacks for Llama 3.1 and 3.2 checkpoints: their ``rope_scaling`` block
rescales each rotation frequency once, by its wavelength ``2 pi / f``, against the
pretraining context ``L`` (``original_max_position_embeddings``):

    wavelength < L / high_freq_factor  ->  f             (high frequencies: unchanged)
    wavelength > L / low_freq_factor   ->  f / factor    (low frequencies: interpolated)
    otherwise                          ->  (1 - s) f / factor + s f,
                                           s = (L / wavelength - low) / (high - low)

which is what Hugging Face ``transformers`` (``_compute_llama3_parameters``) and Meta's
reference compute, at every sequence length. The rotation itself is the rotate-half form
of keras-hub and Hugging Face: ``x cos + rotate_half(x) sin`` over ``[f, f]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import keras
import numpy as np
from keras import ops

ROPE_TYPES = ("llama3",)
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings")


def check_rope_scaling(rope_scaling: Mapping | None) -> dict | None:
    """``rope_scaling`` as a plain dict, or None; a ``ValueError`` naming the problem.

    Example:
        >>> check_rope_scaling({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        ...     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})["factor"]
        8.0
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise TypeError(f"rope_scaling must be None or a dict like Hugging Face's "
                        f"(rope_type='llama3', {', '.join(LLAMA3_FIELDS)}); got "
                        f"{type(rope_scaling).__name__}.")
    scaling = dict(rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type {kind!r} is not supported; kdist supports "
                         f"{ROPE_TYPES} (Llama 3.1/3.2), or no rope_scaling (plain RoPE).")
    missing = [k for k in LLAMA3_FIELDS if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3' needs numbers for {missing}; got "
                         f"{scaling}.")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0 or (
            scaling["factor"] <= 0 or scaling["original_max_position_embeddings"] <= 0):
        raise ValueError(f"rope_scaling needs high_freq_factor > low_freq_factor > 0 and a "
                         f"positive factor and original_max_position_embeddings; got {scaling}.")
    return {"rope_type": kind, **{k: scaling[k] for k in LLAMA3_FIELDS}}


def rope_inverse_frequencies(head_dim: int, max_wavelength: float,
                             rope_scaling: Mapping | None = None) -> np.ndarray:
    """The ``head_dim / 2`` rotation frequencies (float32), Llama-3-scaled when asked.

    Example:
        >>> rope_inverse_frequencies(4, 10000.0).tolist()
        [1.0, 0.009999999776482582]
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inverse = (np.float32(1.0) / np.power(np.float32(max_wavelength), exponent)).astype(
        np.float32)
    scaling = check_rope_scaling(rope_scaling)
    if scaling is None:
        return inverse
    factor, low, high = (np.float32(scaling[k]) for k in LLAMA3_FIELDS[:3])
    context = np.float32(scaling["original_max_position_embeddings"])
    wavelength = np.float32(2 * math.pi) / inverse
    scaled = np.where(wavelength > context / low, inverse / factor, inverse)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


@keras.saving.register_keras_serializable(package="kdist")
class ScaledRotaryEmbedding(keras.layers.Layer):
    """RoPE over ``(B, T, heads, H)`` with Llama 3's scaled frequencies.

    ``call(x, start_index=0, positions=None)`` rotates by positions ``start_index + t``, or
    by ``positions`` ``(B, T)`` (restarting per packed document), like keras-hub's
    ``RotaryEmbedding``; the angles are computed in float32 and applied in the compute
    dtype.

    Example:
        >>> rope = ScaledRotaryEmbedding(500000.0, {"rope_type": "llama3", "factor": 8.0,
        ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        ...     "original_max_position_embeddings": 8192})
        >>> rope(keras.ops.ones((1, 4, 2, 8))).shape
        (1, 4, 2, 8)
    """

    def __init__(self, max_wavelength: float, rope_scaling: Mapping, **kwargs):
        super().__init__(**kwargs)
        self.max_wavelength = max_wavelength
        self.rope_scaling = check_rope_scaling(rope_scaling)

    def call(self, x, start_index=0, positions=None):
        head_dim = x.shape[-1]
        inverse = ops.convert_to_tensor(
            rope_inverse_frequencies(head_dim, self.max_wavelength, self.rope_scaling))
        if positions is None:
            positions = ops.arange(ops.shape(x)[1], dtype="float32")[None] + ops.cast(
                start_index, "float32")  # (1, T)
        angles = ops.cast(positions, "float32")[..., None] * inverse  # (B|1, T, H/2)
        angles = ops.concatenate([angles, angles], axis=-1)[:, :, None, :]  # (B|1, T, 1, H)
        cos = ops.cast(ops.cos(angles), x.dtype)
        sin = ops.cast(ops.sin(angles), x.dtype)
        first, second = ops.split(x, 2, axis=-1)
        return x * cos + ops.concatenate([-second, first], axis=-1) * sin

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "max_wavelength": self.max_wavelength,
                "rope_scaling": self.rope_scaling}
