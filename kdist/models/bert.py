"""BERT: a bidirectional, post-norm Transformer encoder with MLM and classification heads.

``BertBackbone`` embeds tokens, positions and segments, then runs post-LayerNorm encoder
blocks (``x = norm(x + attn(x))``, ``x = norm(x + mlp(x))``) whose attention is
bidirectional and ignores padded keys. ``BertMaskedLM`` predicts the original tokens at the
masked positions with a head tied to the token embedding; ``BertClassifier`` classifies the
pooled ``[CLS]`` state. Shapes: B batch, T sequence, P masked positions per sequence,
D hidden, V vocabulary, C classes.

Differences from the original BERT, by design: no attention-probability dropout
(``keras.ops.dot_product_attention`` has none; residual and embedding dropout remain), the
encoder MLP's GELU is the tanh approximation by default (``mlp_activation="gelu_exact"`` is
the original's erf form, what Hugging Face checkpoints get), and there is no
next-sentence-prediction head (RoBERTa showed it unnecessary).
"""

from __future__ import annotations

import math

import keras
import numpy as np  # noqa: F401 (used by the docstring examples)
from keras import layers, ops

from kdist.models.base import Backbone, Task
from kdist.models.bert_cost import BertCostModel
from kdist.models.embeddings import PositionEmbedding, SegmentEmbedding, TokenEmbedding
from kdist.models.layers import NORM_AXES, PostNormBlock
from kdist.models.presets import BERT_PRESETS
from kdist.models.scan import LayerStack, stacking_default
from kdist.parallel import pipeline
from kdist.parallel.dropout import Dropout
from kdist.parallel.layout import check_divisible
from kdist.parallel.pipeline.transform import ScheduleParts
from kdist.parallel.rules import add_weight, build_with_axes

# D x D (pooler, MLM transform) and D x C (classifier) matrices: split over fsdp only.
SQUARE_AXES = dict(kernel=("embed", None), bias=("norm",))


def _normal(stddev: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=stddev)


@keras.saving.register_keras_serializable(package="kdist")
class PaddingMask(layers.Layer):
    """Padding mask ``(B, T)`` (1 = real token) to an attention mask ``(B, 1, 1, T)``:
    every query may attend every real key and no padded one."""

    def call(self, padding_mask):
        return ops.cast(padding_mask, "bool")[:, None, None, :]

    def compute_output_spec(self, padding_mask):
        return keras.KerasTensor((padding_mask.shape[0], 1, 1, padding_mask.shape[1]), "bool")


@keras.saving.register_keras_serializable(package="kdist")
class BertBackbone(Backbone, keras.Model):
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
        remat: what each block keeps for the backward pass (:mod:`kdist.models.remat`;
            ``"auto"``: chosen for the device and the batch, as ``GPTBackbone``'s).
        attention_chunk_size: attend over chunks of this many keys without keeping the
            attention probabilities for the backward pass (``CausalSelfAttention``).
        attention_implementation: ``"auto"`` (default: by the device; BERT's padded keys
            are a mask no Pallas kernel takes, so XLA's or chunked attention), ``"xla"``,
            ``"chunked"``, ``"splash"`` or ``"flash"`` (``CausalSelfAttention``).
        mlp_activation: the encoder MLP's GELU: ``"gelu"`` (tanh approximation, kdist's
            default) or ``"gelu_exact"`` (erf: the original BERT and Hugging Face's).
        scan_layers: the encoder blocks as one stacked, scanned ``LayerStack``
            (``encoder_blocks/...``); None: when the distribution has a ``stage`` axis
            (see ``GPTBackbone``).
        matmul_precision: ``"bf16"`` (default), ``"int8"``, ``"int8-sr"`` or ``"fp8"``: the
            encoder blocks' projections quantized (:mod:`kdist.precision`; the pooler and
            MLM head are not).

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

    presets = BERT_PRESETS
    hf_model_types = ("bert",)  # Hugging Face checkpoints (kdist.models.hf)

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
        remat: bool | str = "auto",
        attention_chunk_size: int | None = None,
        mlp_activation: str = "gelu",
        scan_layers: bool | None = None,
        attention_implementation: str = "auto",
        matmul_precision: str = "bf16",
        **kwargs,
    ):
        if mlp_activation not in ("gelu", "gelu_exact"):
            raise ValueError(f"BERT's mlp_activation must be 'gelu' (tanh approximation) or "
                             f"'gelu_exact' (erf); got {mlp_activation!r}.")
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
        self.embeddings_dropout = Dropout(dropout, dtype=dtype, name="embeddings_dropout")
        scan_layers = stacking_default() if scan_layers is None else bool(scan_layers)

        def block(name):
            return PostNormBlock(
                num_heads,
                hidden_dim // num_heads,
                intermediate_dim,
                dropout=dropout,
                layer_norm_epsilon=layer_norm_epsilon,
                initializer_range=initializer_range,
                remat=remat,
                attention_chunk_size=attention_chunk_size,
                mlp_activation=mlp_activation,
                attention_implementation=attention_implementation,
                matmul_precision=matmul_precision,
                dtype=dtype,
                name=name,
            )

        self.blocks = (
            LayerStack(block("encoder_block"), num_layers, dtype=dtype, name="encoder_blocks")
            if scan_layers else [block(f"encoder_block_{i}") for i in range(num_layers)])
        self.pooler = layers.Dense(hidden_dim, activation="tanh",
                                   kernel_initializer=_normal(initializer_range),
                                   dtype=dtype, name="pooler")
        build_with_axes(self.embeddings_norm, (None, None, hidden_dim), **NORM_AXES)
        build_with_axes(self.pooler, (None, hidden_dim), **SQUARE_AXES)

        # === Functional Model ===
        inputs = {
            name: keras.Input(shape=(None,), dtype="int32", name=name)
            for name in ("token_ids", "segment_ids", "padding_mask")
        }
        x = self.embed(inputs["token_ids"], inputs["segment_ids"])  # (B, T, D)
        mask = PaddingMask(name="padding_attention_mask")(inputs["padding_mask"])  # (B,1,1,T)
        for block in ([self.blocks] if scan_layers else self.blocks):
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
        self.mlp_activation = mlp_activation
        self.scan_layers = scan_layers
        self.attention_implementation = attention_implementation
        self.matmul_precision = matmul_precision

    def embed(self, token_ids, segment_ids, training=None):
        """Token + position + segment embeddings, normalised, with dropout: ``(B, T)`` ids
        to ``(B, T, D)`` (``training``: dropout on, where a caller outside the functional
        graph says so)."""
        x = self.token_embedding(token_ids)  # (B, T, D)
        x = x + self.position_embedding(x)  # + (1, T, D)
        x = x + self.segment_embedding(segment_ids)  # + (B, T, D)
        return self.embeddings_dropout(self.embeddings_norm(x), training=training)


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
        self.bias = add_weight(self, "bias", (input_shape[-1],), ("vocab",), initializer="zeros")

    def call(self, x):
        return x + ops.cast(self.bias, x.dtype)


def _sample_weighted_loss():
    # Averaged over the weights (masked positions / real examples), not over every slot.
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight")


@keras.saving.register_keras_serializable(package="kdist")
class BertMaskedLM(Task, keras.Model):
    """Masked-language-model pretraining on a :class:`BertBackbone`.

    Inputs are the backbone's plus ``mask_positions`` ``(B, P)``; outputs are float32
    logits ``(B, P, V)`` at those positions only (the vocabulary projection is not computed
    for the other 85% of tokens). The head is BERT's: dense + GELU + LayerNorm, then the
    token embedding transposed (tied) plus a per-token output bias. Train with labels
    ``mask_ids`` ``(B, P)`` and sample weights ``mask_weights`` ``(B, P)`` (0 at padded
    slots), as :func:`kdist.data.mlm_dataset` yields them; ``compile()`` defaults to the
    cross-entropy averaged over masked tokens and reports ``masked_accuracy`` — except
    under ``pipeline_schedule='1f1b'``/``'interleaved_1f1b'``, which compute that loss
    inside the schedule (:meth:`schedule_parts`, :meth:`head_loss`) and report the loss
    alone unless ``compile`` is given metrics (their logits cost one more forward pass).
    ``check_token_ids``: check token ids and labels in the compiled step (``GPTCausalLM``).

    Example:
        >>> lm = BertMaskedLM.from_preset("bert-tiny", vocabulary_size=512, num_layers=1)
        >>> lm.compile(optimizer="adam")
        >>> ids = np.ones((2, 16), "int32")
        >>> x = {"token_ids": ids, "segment_ids": 0 * ids, "padding_mask": ids,
        ...      "mask_positions": np.zeros((2, 3), "int32")}
        >>> lm(x).shape
        (2, 3, 512)
    """

    backbone_class = BertBackbone
    # No fused loss (the head is not tied-only); sequences split over seq (not reordered:
    # attention is bidirectional, and mask_positions index the sequence); a pipelined
    # encoder, the loss inside a 1F1B schedule.
    step_features = frozenset({"gradient_reduction", "context_parallel", "pipeline",
                               "scheduled_pipeline"})
    token_id_labels = True  # mask_ids are token ids

    def __init__(self, backbone: BertBackbone, check_token_ids: bool = False, **kwargs):
        # === Layers ===
        self.backbone = backbone
        self.check_token_ids = check_token_ids  # in the step: see GPTCausalLM
        self.transform = layers.Dense(
            backbone.hidden_dim, activation="gelu",
            kernel_initializer=_normal(backbone.initializer_range),
            dtype=backbone.dtype_policy, name="mlm_transform")
        self.transform_norm = layers.LayerNormalization(
            epsilon=backbone.layer_norm_epsilon, dtype=backbone.dtype_policy, name="mlm_norm")
        self.output_bias = OutputBias(dtype=backbone.dtype_policy, name="mlm_output_bias")
        hidden_shape = (None, None, backbone.hidden_dim)
        build_with_axes(self.transform, hidden_shape, **SQUARE_AXES)
        build_with_axes(self.transform_norm, hidden_shape, **NORM_AXES)

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
        schedule = pipeline.scheduled_name()
        if schedule != "gpipe":
            if loss is not None:
                raise ValueError(
                    f"pipeline_schedule={schedule!r} computes the default loss (cross-entropy "
                    f"averaged over the mask weights) inside the pipeline, microbatch by "
                    f"microbatch; this compile() asks for another loss. Leave the loss out "
                    f"(metrics are fine), or use pipeline_schedule='gpipe'.")
            # No default metric here: its logits would cost one more forward pass a step
            # (kdist.parallel.pipeline.transform); metrics asked for are computed.
            super().compile(optimizer=optimizer, loss=_sample_weighted_loss(),
                            weighted_metrics=weighted_metrics, **kwargs)
            return
        super().compile(
            optimizer=optimizer,
            loss=loss or _sample_weighted_loss(),
            weighted_metrics=weighted_metrics or [
                keras.metrics.SparseCategoricalAccuracy(name="masked_accuracy")],
            **kwargs,
        )

    def schedule_parts(self, inputs, y, sample_weight=None):
        """The masked LM cut for a pipeline schedule (``Task.schedule_parts``): the
        embeddings and the padding mask before it, on every stage; the gather at the masked
        positions, the head (dense + GELU + LayerNorm, the tied table, the output bias) and
        the cross-entropy of one microbatch's float32 logits at a time inside it, weighted
        by ``sample_weight`` ``(B, P)``. Divided by the weights' sum (without weights:
        ``B P``) it is ``compile()``'s default loss (``"mean_with_sample_weight"``)."""
        backbone = self.backbone
        # Called outside Keras' functional graph, which would pass `training` on.
        hidden = backbone.embed(inputs["token_ids"], inputs["segment_ids"], training=True)
        mask = backbone.get_layer("padding_attention_mask")(inputs["padding_mask"])
        if sample_weight is None:
            weights, total = ops.ones(y.shape, "float32"), float(math.prod(y.shape))
        else:
            weights = ops.cast(sample_weight, "float32")
            total = ops.sum(weights)  # over the global batch, before the schedule
        targets = {"labels": y, "weights": weights,
                   "positions": ops.cast(inputs["mask_positions"], "int32")}
        head_layers = (self.transform, self.transform_norm, backbone.token_embedding,
                       self.output_bias)
        return ScheduleParts(hidden, {"attention_mask": mask}, backbone.blocks, head_layers,
                             targets, total)

    def head_loss(self, weights, hidden, targets):
        """``(b, T, D)`` -> the summed weighted cross-entropy at the masked positions."""
        x = self.get_layer("masked_positions")(hidden, targets["positions"])  # (b, P, D)
        x, _ = self.transform.stateless_call(weights[0], [], x)
        x, _ = self.transform_norm.stateless_call(weights[1], [], x)
        logits, _ = self.backbone.token_embedding.stateless_call(weights[2], [], x,
                                                                 reverse=True)  # (b, P, V)
        logits, _ = self.output_bias.stateless_call(weights[3], [], logits)
        cross_entropy = keras.losses.sparse_categorical_crossentropy(
            targets["labels"], ops.cast(logits, "float32"), from_logits=True)
        return ops.sum(cross_entropy * targets["weights"])

    @classmethod
    def cost_model_for(cls, backbone_config, masked_positions: int | None = None,
                       **task_args) -> BertCostModel:
        """:class:`BertCostModel` with the MLM head at ``masked_positions`` per sequence
        (None: every position).

        Example:
            >>> BertMaskedLM.cost_model_for(BERT_PRESETS["bert-base"]).parameters
            110104890
        """
        return BertCostModel(BertBackbone.full_config(backbone_config),
                             masked_positions=masked_positions)


@keras.saving.register_keras_serializable(package="kdist")
class BertClassifier(Task, keras.Model):
    """Sequence classification: the pooled ``[CLS]`` state -> dropout -> ``num_classes`` logits.

    ``classifier_dropout`` is the head's dropout rate (the backbone has its own ``dropout``);
    ``check_token_ids`` checks the token ids in the compiled step (see ``GPTCausalLM``).

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

    backbone_class = BertBackbone
    step_features = frozenset({"gradient_reduction", "context_parallel", "pipeline"})

    def __init__(self, backbone: BertBackbone, num_classes: int,
                 classifier_dropout: float = 0.1, check_token_ids: bool = False, **kwargs):
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2; got {num_classes!r}.")
        # === Layers ===
        self.backbone = backbone
        self.check_token_ids = check_token_ids  # in the step: see GPTCausalLM
        self.dropout_layer = Dropout(classifier_dropout, dtype=backbone.dtype_policy,
                                            name="classifier_dropout")
        self.head = layers.Dense(num_classes, kernel_initializer=_normal(
            backbone.initializer_range), dtype=backbone.dtype_policy, name="classifier_head")
        build_with_axes(self.head, (None, backbone.hidden_dim), kernel=("embed", None),
                        bias=(None,))

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
        super().compile(
            optimizer=optimizer,
            loss=loss or _sample_weighted_loss(),
            weighted_metrics=weighted_metrics or [
                keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            **kwargs,
        )

    @classmethod
    def cost_model_for(cls, backbone_config, num_classes: int = 2,
                       **task_args) -> BertCostModel:
        """:class:`BertCostModel` with the pooled classifier head of ``num_classes``."""
        return BertCostModel(BertBackbone.full_config(backbone_config), num_classes=num_classes)
