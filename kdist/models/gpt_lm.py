"""GPTCausalLM: next-token prediction on a :class:`~kdist.models.gpt.GPTBackbone`, with
cached generation (:mod:`kdist.models.generation`) and the fused cross-entropy loss."""

from __future__ import annotations

import math

import keras
import numpy as np  # noqa: F401  (the docstrings' examples)
from keras import layers, ops

from kdist.models import losses
from kdist.models.base import Task
from kdist.models.generation import CachedGeneration
from kdist.models.gpt import GPTBackbone
from kdist.models.gpt_cost import GPTCostModel
from kdist.models.presets import GPT_PRESETS  # noqa: F401  (the docstrings' examples)
from kdist.parallel import pipeline
from kdist.parallel.pipeline.transform import ScheduleParts
from kdist.precision.policy import check as check_precision


@keras.saving.register_keras_serializable(package="kdist")
class GPTCausalLM(CachedGeneration, Task, keras.Model):
    """Next-token prediction on top of a :class:`GPTBackbone`, with cached generation.

    The output head is the token embedding transposed (or its own matrix when
    ``tie_embeddings=False``); logits are cast to float32 so the loss is computed in
    float32 under ``mixed_bfloat16``. ``compile()`` defaults to sparse categorical
    cross-entropy on the logits.

    Args:
        backbone: a :class:`GPTBackbone`.
        loss_chunk_size: how training computes the default loss (``compile()`` with no
            ``loss`` or the default one, and no metrics). ``"auto"`` (default): the fused
            cross-entropy (:func:`kdist.models.losses.chunked_cross_entropy`, from the
            final hidden states, never materialising the ``(B, T, V)`` float32 logits)
            where it was measured faster, with a chunk size chosen by shape, else logits
            and Keras' loss (:func:`kdist.models.losses.auto_chunk_size` states the rule).
            A positive int: always the fused loss, with chunks of that many positions.
            ``None`` or ``0``: always logits and Keras' loss. ``predict``/``evaluate``
            always give and use full logits; a ``sample_weight`` in training computes the
            logits from the hidden states and Keras' weighted loss.
        check_token_ids: check in the compiled step that every token id (inputs and
            labels) lies in ``[0, vocabulary_size)``: a bad id makes the loss and outputs
            NaN (never a silent 0.0), and ``fit``/``evaluate``/``predict`` raise a
            ``ValueError`` naming the range at the next batch end (``Task.token_id_alarm``).
            For inputs that are not NumPy arrays (datasets, generators), which those
            methods cannot check on the host. Off by default: one reduction over the ids.
        head_matmul_precision: the vocabulary head's matmul (``hidden @ table.T``, forward
            and both backward products; :mod:`kdist.precision`): ``"bf16"`` (default: the
            dtype policy's, unquantized), ``"int8"``, ``"int8-sr"`` or ``"fp8"``, in the
            logits path, the fused loss (chunk by chunk, inside its VJP), pipeline schedules
            and generation; the softmax and loss stay float32. Independent of the
            backbone's ``matmul_precision`` and off by default: the logits are the most
            precision-sensitive matmul. ``"int8"`` rounds the gradient's small
            probabilities to zero (gpt-nano trained 15.6 % worse); ``"int8-sr"`` keeps
            them on average and trained as bf16 did (docs/precision.md).

    Example:
        >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=512, num_layers=1)
        >>> lm.compile(optimizer="adam")
        >>> x = np.random.randint(0, 512, (2, 16)).astype("int32")
        >>> float(lm.train_on_batch(x[:, :-1], x[:, 1:])) > 0
        True
        >>> lm.generate(x[:, :4], max_length=8, sampler="greedy").shape
        (2, 8)
    """

    backbone_class = GPTBackbone
    step_features = frozenset({"gradient_reduction", "fused_loss", "context_parallel",
                               "token_reordering", "pipeline", "scheduled_pipeline",
                               "expert_parallel"})
    token_id_labels = True

    def __init__(self, backbone: GPTBackbone, loss_chunk_size: int | str | None = "auto",
                 check_token_ids: bool = False, head_matmul_precision: str = "bf16",
                 **kwargs):
        if not (loss_chunk_size in (None, 0, "auto") or (
                isinstance(loss_chunk_size, int) and not isinstance(loss_chunk_size, bool)
                and loss_chunk_size > 0)):
            raise ValueError(f"loss_chunk_size must be 'auto' (chosen by shape), a positive "
                             f"int (positions per chunk of the fused loss) or None/0 (logits, "
                             f"then Keras' loss); got {loss_chunk_size!r}.")
        check_precision(head_matmul_precision, "head_matmul_precision")
        # === Layers ===
        self.backbone = backbone
        self.loss_chunk_size = loss_chunk_size
        self.check_token_ids = check_token_ids
        self.head_matmul_precision = head_matmul_precision
        self._fused_loss = False  # set by compile(): the default loss, no metrics

        # === Functional Model ===
        token_ids = backbone.input
        hidden = backbone(token_ids)
        logits = backbone.token_embedding(hidden, reverse=True,  # (B, T, V)
                                          matmul_precision=head_matmul_precision)
        logits = layers.Activation("linear", dtype="float32", name="logits")(logits)
        super().__init__(inputs=token_ids, outputs=logits, **kwargs)
        self._generators = {}  # sampler key -> (sampler, jitted decode loop)

    def compile(self, optimizer="adamw", loss=None, **kwargs):
        # The fused cross-entropy computes exactly the default loss; a loss or metrics of
        # the user's need logits.
        default = (losses.is_default_loss(loss) and not kwargs.get("metrics")
                   and not kwargs.get("weighted_metrics"))
        self._fused_loss = self.loss_chunk_size not in (None, 0) and default
        schedule = pipeline.scheduled_name()
        if schedule != "gpipe" and not losses.is_default_loss(loss):
            raise ValueError(
                f"pipeline_schedule={schedule!r} computes the default loss (sparse categorical "
                f"cross-entropy on the logits) inside the pipeline, microbatch by microbatch; "
                f"this compile() asks for another loss. Leave the loss out (metrics are "
                f"fine), or use pipeline_schedule='gpipe'.")
        if loss is None:
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def fused_loss_chunk_size(self, batch, length) -> int | None:
        """Positions per chunk of the fused loss for a training batch of ``(batch, length)``
        token ids, or None when training computes logits (see ``loss_chunk_size``).

        Example:
            >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=512, num_layers=1)
            >>> lm.compile(optimizer="adam")
            >>> lm.fused_loss_chunk_size(2, 16) is None  # tiny logits: Keras' loss
            True
        """
        if not self._fused_loss:
            return None
        if self.loss_chunk_size != "auto":
            return self.loss_chunk_size
        embedding = self.backbone.token_embedding
        return losses.auto_chunk_size(batch, length, embedding.vocabulary_size,
                                      embedding.input_dim, self.backbone.hidden_dim)

    def schedule_parts(self, inputs, y, sample_weight=None):
        """The causal LM cut for a pipeline schedule (``Task.schedule_parts``): the
        embedding before it, on every stage; the final norm and the (tied) head with the
        cross-entropy of one microbatch's float32 logits at a time inside it. Divided by the
        label count, it is Keras' default loss (the mean over every label of the batch)."""
        if sample_weight is not None:
            raise ValueError(
                f"pipeline_schedule={pipeline.scheduled_name()!r} computes the unweighted "
                f"default loss inside the pipeline; fit() was given a sample_weight. Leave it "
                f"out, or use pipeline_schedule='gpipe'.")
        backbone = self.backbone
        token_ids = inputs["token_ids"] if isinstance(inputs, dict) else inputs
        segments = inputs["segment_ids"] if backbone.document_mask else None
        positions = None if segments is None else backbone.get_layer(
            "document_positions")(segments)
        # Called outside Keras' functional graph, which would pass `training` on.
        hidden = backbone.embed(token_ids, positions=positions, training=True)  # (B, T, D)
        rotary = backbone.position_embedding is None
        return ScheduleParts(
            hidden, {"segment_ids": segments, "positions": positions if rotary else None},
            backbone.blocks, (backbone.final_norm, backbone.token_embedding), y,
            math.prod(y.shape))

    def head_loss(self, weights, hidden, labels):
        """``(b, T, D)``, ``(b, T)`` -> the summed token cross-entropy (``Task.head_loss``)."""
        norm, embedding = self.backbone.final_norm, self.backbone.token_embedding
        hidden, _ = norm.stateless_call(weights[0], [], hidden)
        logits, _ = embedding.stateless_call(weights[1], [], hidden, reverse=True,  # (b,T,V)
                                             matmul_precision=self.head_matmul_precision)
        cross_entropy = keras.losses.sparse_categorical_crossentropy(
            labels, ops.cast(logits, "float32"), from_logits=True)
        return ops.sum(cross_entropy)

    def call(self, inputs, training=None, mask=None):
        token_ids = inputs["token_ids"] if isinstance(inputs, dict) else inputs
        if training and self.fused_loss_chunk_size(*token_ids.shape):
            hidden = self.backbone(inputs, training=training)  # (B, T, D): no logits
            return self.input_alarm(inputs, hidden)
        return super().call(inputs, training=training, mask=mask)  # (B, T, V) float32 logits

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        chunk_size = training and y is not None and self.fused_loss_chunk_size(*y.shape)
        if chunk_size and sample_weight is not None:
            # The fused loss takes no weights: the logits from the hidden states, as the
            # plain path computes them, then Keras' weighted loss.
            y_pred = ops.cast(self.backbone.token_embedding(
                y_pred, reverse=True, matmul_precision=self.head_matmul_precision), "float32")
            chunk_size = None
        if not chunk_size:
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        embedding = self.backbone.token_embedding
        loss = losses.chunked_cross_entropy(
            y_pred, embedding.output_table(), y, chunk_size,  # y_pred: hidden states
            vocabulary_size=embedding.vocabulary_size,
            matmul_precision=self.head_matmul_precision)
        return self.finish_loss(y, loss)

    @classmethod
    def cost_model_for(cls, backbone_config, **task_args) -> GPTCostModel:
        """:class:`GPTCostModel` of ``backbone_config`` (e.g. ``GPT_PRESETS["gpt-nano"]``).

        Example:
            >>> GPTCausalLM.cost_model_for(GPT_PRESETS["gpt2-small"]).parameters
            124475904
        """
        return GPTCostModel(GPTBackbone.full_config(backbone_config))
