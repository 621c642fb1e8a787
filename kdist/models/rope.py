"""Rotary position embeddings (RoPE): plain, and with Llama 3.1/3.2's frequency scaling.

:class:`RotaryEmbedding` is plain RoPE (``CausalSelfAttention``), computing exactly what
keras-hub's ``keras_hub.layers.RotaryEmbedding`` computes (its default ``"linear"`` kind,
the one kdist uses; ``tests/models/test_rope.py`` compares the two) without importing
keras-hub, which would load TensorFlow. :class:`ScaledRotaryEmbedding` adds what it lacks
for Llama 3.1 and 3.2 checkpoints: their ``rope_scaling`` block rescales each rotation
frequency once, by its wavelength ``2 pi / f``, against the pretraining context ``L``
(``original_max_position_embeddings``):

    wavelength < L / high_freq_factor  ->  f             (high frequencies: unchanged)
    wavelength > L / low_freq_factor   ->  f / factor    (low frequencies: interpolated)
    otherwise                          ->  (1 - s) f / factor + s f,
                                           s = (L / wavelength - low) / (high - low)

which is what Hugging Face ``transformers`` (``_compute_llama3_parameters``) and Meta's
reference compute, at every sequence length. Both rotate the same way
(:func:`rotate`), the rotate-half form of keras-hub and Hugging Face:
``x cos + rotate_half(x) sin`` over ``[f, f]``.
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


def rotate(x, angles, dtype):
    """``x`` ``(B, T, ..., H)`` rotated by ``angles`` ``(B|1, T, H/2)`` (float32):
    ``x cos + rotate_half(x) sin`` with the angles repeated as ``[f, f]`` and cos/sin cast to
    ``dtype``; written op for op as keras-hub's ``RotaryEmbedding`` (stack and reshape, not
    ``concatenate``), so its results are bit-identical.

    Example:
        >>> rotate(keras.ops.ones((1, 1, 2)), keras.ops.zeros((1, 1, 1)), "float32").tolist()
        [[[1.0, 1.0]]]
    """
    embedding = ops.stack((angles, angles), axis=-2)  # (B|1, T, 2, H/2)
    embedding = ops.reshape(embedding, (*ops.shape(angles)[:-1], ops.shape(angles)[-1] * 2))
    for axis in range(2, len(x.shape) - 1):  # a size-1 axis per middle axis (heads)
        embedding = ops.expand_dims(embedding, axis)
    cos = ops.cast(ops.cos(embedding), dtype)
    sin = ops.cast(ops.sin(embedding), dtype)
    first, second = ops.split(x, 2, axis=-1)
    half_rotated = ops.reshape(ops.stack((-second, first), axis=-2), ops.shape(x))
    return x * cos + half_rotated * sin


@keras.saving.register_keras_serializable(package="kdist")
class RotaryEmbedding(keras.layers.Layer):
    """RoPE as keras-hub's ``RotaryEmbedding`` computes it, with its config keys.

    ``call(inputs, start_index=0, positions=None)`` rotates each feature pair of the
    ``feature_axis`` by positions ``start_index + t`` along ``sequence_axis``, or by
    ``positions`` (``(T,)`` or ``(B, T)``: restarting per packed document); frequency ``i``
    is ``max_wavelength ** (-2i / H) / scaling_factor``. Angles are computed in float32 and
    applied in the compute dtype. keras-hub's other kinds (``rope_type`` "dynamic" and
    "yarn") are not built: kdist's models never use them.

    Example:
        >>> rope = RotaryEmbedding(max_wavelength=10000)
        >>> rope(keras.ops.ones((2, 4, 3, 8))).shape  # (batch, length, heads, head_dim)
        (2, 4, 3, 8)
    """

    def __init__(self, max_wavelength=10000, scaling_factor=1.0, sequence_axis=1,
                 feature_axis=-1, **kwargs):
        super().__init__(**kwargs)
        self.max_wavelength = max_wavelength
        self.scaling_factor = scaling_factor
        self.sequence_axis = sequence_axis
        self.feature_axis = feature_axis
        self.built = True  # no weights

    def _axes(self, rank: int) -> tuple[int, int]:
        sequence_axis, feature_axis = self.sequence_axis, self.feature_axis
        if not (-rank <= sequence_axis < rank and -rank <= feature_axis < rank) or (
                sequence_axis % rank == feature_axis % rank):
            raise ValueError(f"RotaryEmbedding needs two different axes of its rank-{rank} "
                             f"input; got sequence_axis={sequence_axis}, "
                             f"feature_axis={feature_axis}.")
        return sequence_axis % rank, feature_axis % rank

    def inverse_frequencies(self, rotary_dim: int):
        """The ``rotary_dim / 2`` frequencies, float32, as keras-hub computes them."""
        exponent = ops.arange(0, rotary_dim, 2, dtype="float32") / ops.cast(rotary_dim,
                                                                            "float32")
        inverse = ops.power(ops.cast(self.max_wavelength, "float32"), -exponent)
        return inverse / ops.cast(self.scaling_factor, "float32")

    def call(self, inputs, start_index=0, positions=None):
        sequence_axis, feature_axis = self._axes(len(inputs.shape))
        rotary_dim = inputs.shape[feature_axis]
        if rotary_dim % 2:
            raise ValueError(f"RotaryEmbedding rotates feature pairs: the feature axis must "
                             f"be even; got {rotary_dim}. Use an even head_dim.")
        x = ops.moveaxis(inputs, (feature_axis, sequence_axis), (-1, 1))  # (B, T, ..., H)
        if positions is None:
            positions = ops.arange(ops.shape(x)[1], dtype="float32") + ops.cast(
                start_index, "float32")
        positions = ops.cast(positions, "float32")
        if len(positions.shape) == 1:
            positions = ops.expand_dims(positions, axis=0)  # (1, T)
        angles = ops.einsum("bi,j->bij", positions, self.inverse_frequencies(rotary_dim))
        out = rotate(x, angles, self.compute_dtype)
        return ops.moveaxis(out, (-1, 1), (feature_axis, sequence_axis))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "max_wavelength": self.max_wavelength,
                "scaling_factor": self.scaling_factor, "sequence_axis": self.sequence_axis,
                "feature_axis": self.feature_axis}


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
        return rotate(x, angles, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "max_wavelength": self.max_wavelength,
                "rope_scaling": self.rope_scaling}
