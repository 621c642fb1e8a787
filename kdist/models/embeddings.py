"""Embedding layers shared by kdist's model families: tokens, positions, segments.

Each declares its tables' logical axes where it creates them (``kdist.parallel.rules``):
token rows over ``vocab``, every table's width over ``embed``. Lookups all-gather a table
over ``fsdp`` first (``gathered``): a gather from an fsdp-sharded table would otherwise
give an embed-sharded result that XLA can only reshard by replicating it.
"""

from __future__ import annotations

import keras
import numpy as np  # noqa: F401 (used by the docstring examples)
from keras import layers, ops

from kdist.parallel import context, rules
from kdist.parallel.constraints import gathered
from kdist.parallel.layout import current_mesh_shape
from kdist.precision import matmul as quantized
from kdist.precision.policy import check

TOKEN_AXES = ("vocab", "embed")
POSITION_AXES = ("position", "embed")
SEGMENT_AXES = (None, "embed")


class _InheritedBuild:
    """Lets ``rules.build_with_axes`` run a layer's inherited ``build`` (the weights are
    created by Keras' parent class) with the axes declared."""

    def __init__(self, layer, parent):
        self.layer, self.parent = layer, parent

    def build(self, input_shape):
        self.parent.build(self.layer, input_shape)

    @property
    def weights(self):
        return self.layer.weights


@keras.saving.register_keras_serializable(package="kdist")
class TokenEmbedding(keras.layers.ReversibleEmbedding):
    """Keras' reversible embedding that all-gathers its table over ``fsdp`` before lookup
    and refuses sequences longer than ``max_sequence_length``.

    ``call(ids)`` embeds ``(B, T)`` ids to ``(B, T, D)``; ``call(x, reverse=True)`` gives
    logits ``(B, T, V)`` (tied: against the same table; else ``reverse_embeddings``).
    ``vocabulary_size``: the ids in use when the table has padding rows beyond them (cut
    from the logits). ``call(x, reverse=True, matmul_precision="int8")`` quantizes that
    head matmul (:func:`kdist.precision.matmul.matmul`: ``x`` per token, the table per
    vocabulary row; forward and both backward products); ``"bf16"`` (default) is Keras'.

    Example:
        >>> TokenEmbedding(100, 8, max_sequence_length=4)(np.zeros((2, 3), "int32")).shape
        (2, 3, 8)
    """

    def __init__(self, *args, max_sequence_length: int | None = None,
                 vocabulary_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_sequence_length = max_sequence_length
        # Ids in use; the table may have more rows (padding for aligned matmuls and shards).
        self.vocabulary_size = vocabulary_size or self.input_dim

    def build(self, input_shape=None):
        rules.build_with_axes(_InheritedBuild(self, keras.layers.ReversibleEmbedding),
                              input_shape, embeddings=TOKEN_AXES,
                              reverse_embeddings=TOKEN_AXES[::-1])

    def call(self, inputs, reverse=False, matmul_precision="bf16"):
        if reverse:
            logits = (super().call(inputs, reverse=True) if check(matmul_precision) == "bf16"
                      else self._quantized_logits(inputs, matmul_precision))  # (B, T, rows)
            if self.vocabulary_size == self.input_dim:
                return logits
            return logits[..., : self.vocabulary_size]  # (B, T, V): padding rows cut
        length = inputs.shape[1]
        if isinstance(length, int) and length > (self.max_sequence_length or length):
            raise ValueError(
                f"Sequence length {length} exceeds the model's max_sequence_length "
                f"{self.max_sequence_length}. Use sequences of at most "
                f"{self.max_sequence_length} tokens, or build the model with a larger "
                f"max_sequence_length."
            )
        table = gathered(ops.convert_to_tensor(self.embeddings), TOKEN_AXES)
        return ops.cast(ops.take(table, ops.cast(inputs, "int32"), axis=0), self.compute_dtype)

    def _quantized_logits(self, inputs, matmul_precision):
        if self.reverse_dtype is not None or self.logit_soft_cap is not None:
            raise ValueError("A quantized head (matmul_precision="
                             f"{matmul_precision!r}) takes neither reverse_dtype nor "
                             "logit_soft_cap; leave them None or use 'bf16'.")
        kernel = (ops.transpose(ops.convert_to_tensor(self.embeddings)) if self.tie_weights
                  else ops.convert_to_tensor(self.reverse_embeddings))  # (D, rows), as Keras'
        return quantized.matmul(inputs, kernel, 1, matmul_precision)

    def output_table(self):
        """The output projection as ``(rows, D)``: the table, or the untied one transposed."""
        if self.tie_weights:
            return ops.convert_to_tensor(self.embeddings)
        return ops.transpose(ops.convert_to_tensor(self.reverse_embeddings))

    def compute_output_spec(self, inputs, reverse=False, matmul_precision="bf16"):
        spec = super().compute_output_spec(inputs, reverse=reverse)
        if not reverse:
            return spec
        return keras.KerasTensor((*spec.shape[:-1], self.vocabulary_size), spec.dtype)

    def get_config(self):
        return {**super().get_config(), "max_sequence_length": self.max_sequence_length,
                "vocabulary_size": self.vocabulary_size}


@keras.saving.register_keras_serializable(package="kdist")
class PositionEmbedding(layers.Layer):
    """Learned absolute position embeddings.

    ``call(x)`` gives rows ``start_index ...`` as ``(1, T, D)``; ``call(x, positions=p)``
    gathers rows ``p`` ``(B, T)`` (positions restarting per packed document).

    Example:
        >>> PositionEmbedding(max_sequence_length=16)(keras.ops.ones((2, 8, 32))).shape
        (1, 8, 32)
    """

    def __init__(self, max_sequence_length: int, initializer_range: float = 0.02, **kwargs):
        super().__init__(**kwargs)
        self.max_sequence_length = max_sequence_length
        self.initializer_range = initializer_range

    def build(self, input_shape):
        self.embeddings = rules.add_weight(
            self, "embeddings", (self.max_sequence_length, input_shape[-1]), POSITION_AXES,
            initializer=keras.initializers.RandomNormal(stddev=self.initializer_range),
        )

    def call(self, x, start_index=0, positions=None):
        table = ops.convert_to_tensor(self.embeddings)  # (max_sequence_length, D)
        if positions is None and isinstance(start_index, int) and start_index == 0:
            # A sequence split over seq: its tokens' true positions (None: 0 ... T - 1).
            split = context.token_positions(x.shape[1])
            if split is not None:
                return ops.cast(ops.take(table, split, axis=0), self.compute_dtype)[None]
        if positions is not None:
            return ops.cast(ops.take(table, positions, axis=0), self.compute_dtype)  # (B, T, D)
        rows = ops.slice(table, [start_index, 0], [ops.shape(x)[1], ops.shape(table)[1]])
        return ops.cast(rows, self.compute_dtype)[None]  # (1, T, D)

    def compute_output_spec(self, x, start_index=0, positions=None):
        batch = 1 if positions is None else positions.shape[0]
        return keras.KerasTensor((batch, x.shape[1], x.shape[2]), self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "max_sequence_length": self.max_sequence_length,
                "initializer_range": self.initializer_range}


@keras.saving.register_keras_serializable(package="kdist")
class SegmentEmbedding(layers.Layer):
    """Segment (token type) embeddings: ids ``(B, T)`` in ``[0, num_segments)`` to ``(B, T, D)``.

    The table is all-gathered over ``fsdp`` before the lookup, as for token embeddings.

    Example:
        >>> SegmentEmbedding(2, 8)(np.zeros((2, 3), "int32")).shape
        (2, 3, 8)
    """

    def __init__(self, num_segments: int, hidden_dim: int, initializer_range: float = 0.02,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_segments = num_segments
        self.hidden_dim = hidden_dim
        self.initializer_range = initializer_range

    def build(self, input_shape):
        self.embeddings = rules.add_weight(
            self, "embeddings", (self.num_segments, self.hidden_dim), SEGMENT_AXES,
            initializer=keras.initializers.RandomNormal(stddev=self.initializer_range),
        )

    def call(self, segment_ids):
        table = gathered(ops.convert_to_tensor(self.embeddings), SEGMENT_AXES)
        return ops.cast(ops.take(table, ops.cast(segment_ids, "int32"), axis=0),
                        self.compute_dtype)  # (B, T, D)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.hidden_dim,)

    def get_config(self):
        return {**super().get_config(), "num_segments": self.num_segments,
                "hidden_dim": self.hidden_dim, "initializer_range": self.initializer_range}


def token_table_rows(vocabulary_size: int, divisible_by: int = 1) -> int:
    """The token table's rows: ``vocabulary_size`` padded up to a multiple of
    ``divisible_by`` (never to the mesh: the table's shape must not depend on it, as
    checkpoints move between meshes); a ``ValueError`` when the active mesh's ``model``
    axis does not divide them, saying how to pad.

    Example:
        >>> token_table_rows(50257, 128)
        50304
    """
    if not isinstance(divisible_by, int) or divisible_by < 1:
        raise ValueError(f"vocabulary_divisible_by must be a positive int (e.g. 128); got "
                         f"{divisible_by!r}.")
    rows = -(-vocabulary_size // divisible_by) * divisible_by
    model_axis = current_mesh_shape()["model"]
    if rows % model_axis:
        padded = (f" (padded to {rows} rows by vocabulary_divisible_by={divisible_by})"
                  if rows != vocabulary_size else "")
        raise ValueError(
            f"vocabulary_size={vocabulary_size}{padded} is not divisible by the 'model' "
            f"mesh axis of size {model_axis}, so the token table cannot be sharded over "
            f"it. Pass vocabulary_divisible_by=128 (or another multiple of {model_axis}) "
            f"to pad the table with rows that are never used, or use another mesh.")
    return rows
