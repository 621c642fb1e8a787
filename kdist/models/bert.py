"""BERT: a bidirectional, post-norm Transformer encoder with MLM and classification heads.

``BertBackbone`` embeds tokens, positions and segments, then runs post-LayerNorm encoder
blocks (``x = norm(x + attn(x))``, ``x = norm(x + mlp(x))``) whose attention is
bidirectional and ignores padded keys. ``BertMaskedLM`` predicts the original tokens at the
masked positions with a head tied to the token embedding; ``BertClassifier`` classifies the
pooled ``[CLS]`` state. Shapes: B batch, T sequence, P masked positions per sequence,
D hidden, V vocabulary, C classes.

Differences from the original BERT, by design: no attention-probability dropout
(``keras.ops.dot_product_attention`` has none; residual and embedding dropout remain), the
encoder MLP's GELU is the tanh approximation (kdist's shared ``MLP``), and there is no
next-sentence-prediction head (RoBERTa showed it unnecessary).
"""

from __future__ import annotations

import keras
import numpy as np  # noqa: F401 (used by the docstring examples)
from keras import layers, ops

from kdist import reduction
from kdist.distribution import check_divisible, gathered, register_logical_axes, shard_batch
from kdist.models.gpt import PositionEmbedding, TokenEmbedding
from kdist.models.layers import MLP, CausalSelfAttention
from kdist.models.presets import BERT_PRESETS, preset_config

# Weight path -> logical axes, for the sharding rules in kdist.distribution. The token and
# position tables share GPT's names (and axes); everything else is BERT's own.
BERT_LOGICAL_AXES = {
    r"token_embedding/embeddings": ("vocab", "embed"),
    r"position_embedding/embeddings": ("position", "embed"),
    r"segment_embedding/embeddings": (None, "embed"),
    r"embeddings_norm/(gamma|beta)": ("norm",),
    r"encoder_block_\d+/attention/query/kernel": ("embed", "heads", "head_dim"),
    r"encoder_block_\d+/attention/query/bias": ("heads", "head_dim"),
    r"encoder_block_\d+/attention/(key|value)/kernel": ("embed", "kv_heads", "head_dim"),
    r"encoder_block_\d+/attention/(key|value)/bias": ("kv_heads", "head_dim"),
    r"encoder_block_\d+/attention/attention_output/kernel": ("heads", "head_dim", "embed"),
    r"encoder_block_\d+/attention/attention_output/bias": ("norm",),
    r"encoder_block_\d+/mlp/up/kernel": ("embed", "mlp"),
    r"encoder_block_\d+/mlp/up/bias": ("mlp",),
    r"encoder_block_\d+/mlp/down/kernel": ("mlp", "embed"),
    r"encoder_block_\d+/mlp/down/bias": ("norm",),
    r"encoder_block_\d+/(attention_norm|mlp_norm)/(gamma|beta)": ("norm",),
    # D x D (pooler, MLM transform) and D x C (classifier) matrices: split over fsdp only.
    r"pooler/kernel": ("embed", None),
    r"pooler/bias": ("norm",),
    r"mlm_transform/kernel": ("embed", None),
    r"mlm_transform/bias": ("norm",),
    r"mlm_norm/(gamma|beta)": ("norm",),
    r"mlm_output_bias/bias": ("vocab",),
    r"classifier_head/kernel": ("embed", None),
    r"classifier_head/bias": (None,),
}
register_logical_axes(BERT_LOGICAL_AXES)


def _normal(stddev: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=stddev)


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
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.num_segments, self.hidden_dim),
            initializer=_normal(self.initializer_range),
        )

    def call(self, segment_ids):
        table = gathered(ops.convert_to_tensor(self.embeddings),
                         BERT_LOGICAL_AXES["segment_embedding/embeddings"])
        return ops.cast(ops.take(table, ops.cast(segment_ids, "int32"), axis=0),
                        self.compute_dtype)  # (B, T, D)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.hidden_dim,)

    def get_config(self):
        return {**super().get_config(), "num_segments": self.num_segments,
                "hidden_dim": self.hidden_dim, "initializer_range": self.initializer_range}


@keras.saving.register_keras_serializable(package="kdist")
class PaddingMask(layers.Layer):
    """Padding mask ``(B, T)`` (1 = real token) to an attention mask ``(B, 1, 1, T)``:
    every query may attend every real key and no padded one."""

    def call(self, padding_mask):
        return ops.cast(padding_mask, "bool")[:, None, None, :]

    def compute_output_spec(self, padding_mask):
        return keras.KerasTensor((padding_mask.shape[0], 1, 1, padding_mask.shape[1]), "bool")


@keras.saving.register_keras_serializable(package="kdist")
class PostNormBlock(layers.Layer):
    """A post-norm encoder block: ``x = norm(x + attn(x))`` then ``x = norm(x + mlp(x))``.

    Attention is bidirectional (kdist's ``CausalSelfAttention`` with ``causal=False``);
    ``attention_mask`` ``(B, 1, 1, T)`` hides padded keys. Norms compute in float32 under
    mixed precision. ``remat=True`` wraps the block in ``keras.remat``;
    ``attention_chunk_size`` is ``CausalSelfAttention``'s (probabilities not kept).

    Example:
        >>> block = PostNormBlock(num_heads=4, head_dim=16, intermediate_dim=128)
        >>> block(keras.ops.ones((2, 8, 64))).shape
        (2, 8, 64)
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        intermediate_dim: int,
        dropout: float = 0.0,
        layer_norm_epsilon: float = 1e-12,
        initializer_range: float = 0.02,
        remat: bool = False,
        attention_chunk_size: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.remat = remat
        self.attention_chunk_size = attention_chunk_size
        dtype = self.dtype_policy
        self.attention = CausalSelfAttention(
            num_heads, head_dim, causal=False, initializer_range=initializer_range,
            attention_chunk_size=attention_chunk_size, dtype=dtype, name="attention",
        )
        self.attention_norm = layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=dtype, name="attention_norm")
        self.mlp = MLP(intermediate_dim, activation="gelu", initializer_range=initializer_range,
                       dtype=dtype, name="mlp")
        self.mlp_norm = layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=dtype, name="mlp_norm")
        self.attention_dropout = layers.Dropout(dropout, dtype=dtype)
        self.mlp_dropout = layers.Dropout(dropout, dtype=dtype)

    def build(self, input_shape):
        for sublayer in (self.attention, self.attention_norm, self.mlp, self.mlp_norm):
            sublayer.build(input_shape)

    def call(self, x, attention_mask=None, training=None):
        """``(B, T, D) -> (B, T, D)``."""

        def forward(x):
            h = self.attention(x, attention_mask=attention_mask)  # (B, T, D)
            x = self.attention_norm(x + self.attention_dropout(h, training=training))
            x = self.mlp_norm(x + self.mlp_dropout(self.mlp(x), training=training))
            return shard_batch(x)  # B split over data x fsdp

        return keras.remat(forward)(x) if self.remat else forward(x)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "intermediate_dim": self.intermediate_dim,
            "dropout": self.dropout,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "remat": self.remat,
            "attention_chunk_size": self.attention_chunk_size,
        }


@keras.saving.register_keras_serializable(package="kdist")
class BertBackbone(keras.Model):
    """The BERT encoder: ``{"token_ids", "segment_ids", "padding_mask"}`` (each ``(B, T)``) to
    ``{"sequence_output": (B, T, D), "pooled_output": (B, D)}``.

    ``padding_mask`` is 1 at real tokens and 0 at padding; padded keys are invisible to
    every query, so outputs at real positions do not depend on how much padding follows.
    ``pooled_output`` is ``tanh(dense(sequence_output[:, 0]))``, the ``[CLS]`` state.

    Args:
        vocabulary_size: number of token ids (BERT's English vocabulary: 30522).
        num_layers, num_heads, hidden_dim, intermediate_dim: the encoder's shape.
        max_sequence_length: the learned position table's length (BERT: 512).
        num_segments: segment (token type) ids (BERT: 2, for sentence A and B).
        dropout: embedding and residual dropout rate (BERT: 0.1).
        layer_norm_epsilon: epsilon of every LayerNorm (BERT: 1e-12).
        initializer_range: stddev of the normal initialiser (BERT: 0.02).
        remat: rematerialise each block in the backward pass.
        attention_chunk_size: attend over chunks of this many keys without keeping the
            attention probabilities for the backward pass (``CausalSelfAttention``).

    Build it after setting the distribution: the constructor checks the shape against the
    active mesh, and every weight is created with its sharded layout.

    Example:
        >>> backbone = BertBackbone(vocabulary_size=100, num_layers=2, num_heads=2,
        ...                         hidden_dim=32, intermediate_dim=64, max_sequence_length=16)
        >>> ids = np.ones((1, 8), "int32")
        >>> out = backbone({"token_ids": ids, "segment_ids": 0 * ids, "padding_mask": ids})
        >>> out["sequence_output"].shape, out["pooled_output"].shape
        ((1, 8, 32), (1, 32))
    """

    def __init__(
        self,
        vocabulary_size: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        intermediate_dim: int,
        max_sequence_length: int = 512,
        num_segments: int = 2,
        dropout: float = 0.0,
        layer_norm_epsilon: float = 1e-12,
        initializer_range: float = 0.02,
        remat: bool = False,
        attention_chunk_size: int | None = None,
        **kwargs,
    ):
        if hidden_dim % num_heads:
            raise ValueError(
                f"hidden_dim={hidden_dim} must be divisible by num_heads={num_heads} "
                f"(head_dim = hidden_dim / num_heads)."
            )
        check_divisible("num_heads", num_heads)
        check_divisible("intermediate_dim", intermediate_dim)
        check_divisible("vocabulary_size", vocabulary_size)
        dtype = kwargs.pop("dtype", None)

        # === Layers ===
        self.token_embedding = TokenEmbedding(
            vocabulary_size,
            hidden_dim,
            tie_weights=True,
            embeddings_initializer=_normal(initializer_range),
            max_sequence_length=max_sequence_length,
            dtype=dtype,
            name="token_embedding",
        )
        self.position_embedding = PositionEmbedding(
            max_sequence_length, initializer_range, dtype=dtype, name="position_embedding")
        self.segment_embedding = SegmentEmbedding(
            num_segments, hidden_dim, initializer_range, dtype=dtype, name="segment_embedding")
        self.embeddings_norm = layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=dtype, name="embeddings_norm")
        self.embeddings_dropout = layers.Dropout(dropout, dtype=dtype, name="embeddings_dropout")
        self.blocks = [
            PostNormBlock(
                num_heads,
                hidden_dim // num_heads,
                intermediate_dim,
                dropout=dropout,
                layer_norm_epsilon=layer_norm_epsilon,
                initializer_range=initializer_range,
                remat=remat,
                attention_chunk_size=attention_chunk_size,
                dtype=dtype,
                name=f"encoder_block_{i}",
            )
            for i in range(num_layers)
        ]
        self.pooler = layers.Dense(hidden_dim, activation="tanh",
                                   kernel_initializer=_normal(initializer_range),
                                   dtype=dtype, name="pooler")

        # === Functional Model ===
        inputs = {
            name: keras.Input(shape=(None,), dtype="int32", name=name)
            for name in ("token_ids", "segment_ids", "padding_mask")
        }
        x = self.token_embedding(inputs["token_ids"])  # (B, T, D)
        x = x + self.position_embedding(x)  # + (1, T, D)
        x = x + self.segment_embedding(inputs["segment_ids"])  # + (B, T, D)
        x = self.embeddings_dropout(self.embeddings_norm(x))
        mask = PaddingMask(name="padding_attention_mask")(inputs["padding_mask"])  # (B,1,1,T)
        for block in self.blocks:
            x = block(x, attention_mask=mask)
        pooled = self.pooler(x[:, 0, :])  # (B, D): the [CLS] position
        super().__init__(
            inputs=inputs,
            outputs={"sequence_output": x, "pooled_output": pooled},
            dtype=dtype,
            **kwargs,
        )

        # === Config ===
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.max_sequence_length = max_sequence_length
        self.num_segments = num_segments
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.remat = remat
        self.attention_chunk_size = attention_chunk_size

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.saving.serialize_keras_object(self.dtype_policy),
            "vocabulary_size": self.vocabulary_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "hidden_dim": self.hidden_dim,
            "intermediate_dim": self.intermediate_dim,
            "max_sequence_length": self.max_sequence_length,
            "num_segments": self.num_segments,
            "dropout": self.dropout,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "remat": self.remat,
            "attention_chunk_size": self.attention_chunk_size,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("dtype"), dict):
            config["dtype"] = keras.saving.deserialize_keras_object(config["dtype"])
        return cls(**config)

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> BertBackbone:
        """A randomly initialised backbone of a preset's shape (see ``BERT_PRESETS``).

        Example:
            >>> BertBackbone.from_preset("bert-tiny", vocabulary_size=512).hidden_dim
            128
        """
        return cls(**preset_config(BERT_PRESETS, preset, **overrides))


@keras.saving.register_keras_serializable(package="kdist")
class MaskedPositions(layers.Layer):
    """Gathers the hidden states at the masked positions: ``(B, T, D), (B, P) -> (B, P, D)``."""

    def call(self, hidden, positions):
        positions = ops.cast(positions, "int32")[:, :, None]  # (B, P, 1)
        return ops.take_along_axis(hidden, positions, axis=1)

    def compute_output_spec(self, hidden, positions):
        return keras.KerasTensor((hidden.shape[0], positions.shape[1], hidden.shape[2]),
                                 hidden.dtype)


@keras.saving.register_keras_serializable(package="kdist")
class OutputBias(layers.Layer):
    """Adds a learned bias of the last dimension's size (the MLM head's per-token bias)."""

    def build(self, input_shape):
        self.bias = self.add_weight(name="bias", shape=(input_shape[-1],), initializer="zeros")

    def call(self, x):
        return x + ops.cast(self.bias, x.dtype)


def _sample_weighted_loss():
    # Averaged over the weights (masked positions / real examples), not over every slot.
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight")


@keras.saving.register_keras_serializable(package="kdist")
class BertMaskedLM(keras.Model):
    """Masked-language-model pretraining on a :class:`BertBackbone`.

    Inputs are the backbone's plus ``mask_positions`` ``(B, P)``; outputs are float32
    logits ``(B, P, V)`` at those positions only (the vocabulary projection is not computed
    for the other 85% of tokens). The head is BERT's: dense + GELU + LayerNorm, then the
    token embedding transposed (tied) plus a per-token output bias. Train with labels
    ``mask_ids`` ``(B, P)`` and sample weights ``mask_weights`` ``(B, P)`` (0 at padded
    slots), as :func:`kdist.data.mlm_dataset` yields them; ``compile()`` defaults to the
    cross-entropy averaged over masked tokens and reports ``masked_accuracy``.

    Example:
        >>> lm = BertMaskedLM.from_preset("bert-tiny", vocabulary_size=512, num_layers=1)
        >>> lm.compile(optimizer="adam")
        >>> ids = np.ones((2, 16), "int32")
        >>> x = {"token_ids": ids, "segment_ids": 0 * ids, "padding_mask": ids,
        ...      "mask_positions": np.zeros((2, 3), "int32")}
        >>> lm(x).shape
        (2, 3, 512)
    """

    def __init__(self, backbone: BertBackbone, **kwargs):
        # === Layers ===
        self.backbone = backbone
        self.transform = layers.Dense(
            backbone.hidden_dim, activation="gelu",
            kernel_initializer=_normal(backbone.initializer_range),
            dtype=backbone.dtype_policy, name="mlm_transform")
        self.transform_norm = layers.LayerNormalization(
            epsilon=backbone.layer_norm_epsilon, dtype=backbone.dtype_policy, name="mlm_norm")
        self.output_bias = OutputBias(dtype=backbone.dtype_policy, name="mlm_output_bias")

        # === Functional Model ===
        inputs = {**backbone.input, "mask_positions": keras.Input(
            shape=(None,), dtype="int32", name="mask_positions")}
        hidden = backbone({k: v for k, v in inputs.items() if k != "mask_positions"})
        x = MaskedPositions(name="masked_positions")(
            hidden["sequence_output"], inputs["mask_positions"])  # (B, P, D)
        x = self.transform_norm(self.transform(x))
        logits = self.output_bias(backbone.token_embedding(x, reverse=True))  # (B, P, V)
        logits = layers.Activation("linear", dtype="float32", name="logits")(logits)
        super().__init__(inputs=inputs, outputs=logits, **kwargs)

    def compile(self, optimizer="adamw", loss=None, weighted_metrics=None, **kwargs):
        reduction.refuse(self)
        super().compile(
            optimizer=optimizer,
            loss=loss or _sample_weighted_loss(),
            weighted_metrics=weighted_metrics or [
                keras.metrics.SparseCategoricalAccuracy(name="masked_accuracy")],
            **kwargs,
        )

    def compile_from_config(self, config):
        # Keras skips compiling on load when compile() is overridden; ours takes its config.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable,
                "backbone": keras.saving.serialize_keras_object(self.backbone)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> BertMaskedLM:
        """A randomly initialised MLM of a preset's shape; overrides replace fields.

        Example:
            >>> BertMaskedLM.from_preset("bert-mini", vocabulary_size=512).backbone.num_layers
            4
        """
        return cls(BertBackbone.from_preset(preset, **overrides))


@keras.saving.register_keras_serializable(package="kdist")
class BertClassifier(keras.Model):
    """Sequence classification: the pooled ``[CLS]`` state -> dropout -> ``num_classes`` logits.

    ``classifier_dropout`` is the head's dropout rate (the backbone has its own ``dropout``).

    Inputs are the backbone's; outputs float32 logits ``(B, C)``. ``compile()`` defaults to
    cross-entropy and ``accuracy``, both weighted by sample weights when given (the
    validation batches of :func:`kdist.data.classification_dataset` weight fill rows 0).
    Initialise the backbone from pretraining with
    :func:`kdist.models.load_backbone_weights`.

    Example:
        >>> clf = BertClassifier.from_preset("bert-tiny", num_classes=3, vocabulary_size=512)
        >>> ids = np.ones((2, 16), "int32")
        >>> clf({"token_ids": ids, "segment_ids": 0 * ids, "padding_mask": ids}).shape
        (2, 3)
    """

    def __init__(self, backbone: BertBackbone, num_classes: int,
                 classifier_dropout: float = 0.1, **kwargs):
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2; got {num_classes!r}.")
        # === Layers ===
        self.backbone = backbone
        self.dropout_layer = layers.Dropout(classifier_dropout, dtype=backbone.dtype_policy,
                                            name="classifier_dropout")
        self.head = layers.Dense(num_classes, kernel_initializer=_normal(
            backbone.initializer_range), dtype=backbone.dtype_policy, name="classifier_head")

        # === Functional Model ===
        inputs = dict(backbone.input)
        pooled = backbone(inputs)["pooled_output"]  # (B, D)
        logits = self.head(self.dropout_layer(pooled))  # (B, C)
        logits = layers.Activation("linear", dtype="float32", name="logits")(logits)
        super().__init__(inputs=inputs, outputs=logits, **kwargs)

        # === Config ===
        self.num_classes = num_classes
        self.classifier_dropout = classifier_dropout

    def compile(self, optimizer="adamw", loss=None, weighted_metrics=None, **kwargs):
        reduction.refuse(self)
        super().compile(
            optimizer=optimizer,
            loss=loss or _sample_weighted_loss(),
            weighted_metrics=weighted_metrics or [
                keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            **kwargs,
        )

    def compile_from_config(self, config):
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable,
                "backbone": keras.saving.serialize_keras_object(self.backbone),
                "num_classes": self.num_classes, "classifier_dropout": self.classifier_dropout}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)

    @classmethod
    def from_preset(cls, preset: str, num_classes: int, classifier_dropout: float = 0.1,
                    **overrides) -> BertClassifier:
        """A randomly initialised classifier of a preset's shape; overrides go to the backbone.

        Example:
            >>> BertClassifier.from_preset("bert-tiny", num_classes=2).num_classes
            2
        """
        return cls(BertBackbone.from_preset(preset, **overrides), num_classes, classifier_dropout)
