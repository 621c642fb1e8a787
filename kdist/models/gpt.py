"""GPT: a decoder-only, pre-norm Transformer — GPT-2 by default, Llama-style by config.

One model, configured: learned or rotary positions, LayerNorm or RMSNorm, GELU or SwiGLU
MLP, multi-head or grouped-query attention, tied or untied output embedding, with or
without biases, and optional document-aware attention over packed sequences. Its cost
model is :class:`~kdist.models.gpt_cost.GPTCostModel`; generation is :mod:`kdist.models.generation`.
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import layers, ops

from kdist.models import losses
from kdist.models.base import Backbone, Task
from kdist.models.embeddings import PositionEmbedding, TokenEmbedding, token_table_rows
from kdist.models.generation import CachedGeneration
from kdist.models.gpt_cost import GPTCostModel
from kdist.models.layers import (
    NORM_AXES,
    PreNormBlock,
    document_positions,
    normalization,
)
from kdist.models.moe import block_moe, check_moe
from kdist.models.presets import GPT_PRESETS
from kdist.models.scan import LayerStack, stacking_default
from kdist.parallel import pipeline
from kdist.parallel.dropout import Dropout
from kdist.parallel.layout import check_divisible
from kdist.parallel.pipeline.transform import ScheduleParts
from kdist.parallel.rules import build_with_axes


@keras.saving.register_keras_serializable(package="kdist")
class DocumentPositions(layers.Layer):
    """Segment ids ``(B, T)`` to per-document positions ``(B, T)`` (``document_positions``);
    attention keeps to each document from the segment ids themselves."""

    def call(self, segment_ids):
        return document_positions(segment_ids)

    def compute_output_spec(self, segment_ids):
        return keras.KerasTensor(segment_ids.shape, "int32")


@keras.saving.register_keras_serializable(package="kdist")
class GPTBackbone(Backbone, keras.Model):
    """The GPT Transformer: token ids ``(B, T)`` to final hidden states ``(B, T, D)``.

    Args:
        vocabulary_size: number of token ids.
        num_layers: number of decoder blocks.
        num_heads: query heads per block.
        hidden_dim: model width D (must divide by ``num_heads``).
        intermediate_dim: MLP width F.
        max_sequence_length: the longest sequence accepted (and the learned position
            table's length).
        num_key_value_heads: key/value heads for grouped-query attention (None: as many as
            query heads). Under tensor parallelism it must divide by the ``model`` axis:
            kdist refuses rather than silently replicating key/value heads.
        position_embedding: ``"learned"`` (GPT-2) or ``"rotary"`` (RoPE, Llama).
        rotary_max_wavelength: RoPE base (Llama 3: 500000).
        rope_scaling: Llama 3.1/3.2's RoPE frequency scaling, a Hugging Face
            ``rope_scaling`` dict (``rope_type="llama3"``, ``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``); None: plain RoPE.
        norm: ``"layer_norm"`` (GPT-2) or ``"rms_norm"`` (Llama).
        mlp_activation: ``"gelu"`` (GPT-2's tanh approximation), ``"gelu_exact"`` (erf) or
            ``"swiglu"`` (Llama).
        use_bias: biases on the attention and MLP projections (GPT-2: yes; Llama: no).
        tie_embeddings: output projection = token embedding transposed.
        document_mask: inputs become ``{"token_ids", "segment_ids"}``; attention does not
            cross a document boundary and positions restart per document.
        dropout: residual and embedding dropout rate.
        layer_norm_epsilon: epsilon of every norm.
        initializer_range: stddev of the normal weight initialiser (GPT-2: 0.02); the
            residual output projections use ``initializer_range / sqrt(2 * num_layers)``.
        remat: what each block keeps for the backward pass (:mod:`kdist.models.remat`):
            ``"auto"`` (default: nothing recomputed on a CPU; on an accelerator the least
            recompute whose step fits the device's memory, decided at each batch shape),
            ``False``, ``"minimal"``, ``"save_dots"`` or ``"block"``/``True``.
        fused_qkv: one fused query/key/value projection per block (``.../attention/qkv``)
            instead of three; off by default.
        attention_implementation: ``"auto"`` (default: the fastest measured for the
            device the step is compiled for — kdist's Pallas flash kernels on a TPU, Keras'
            attention elsewhere, cuDNN flash attention on a GPU; :mod:`kdist.accelerators`),
            ``"xla"``, ``"chunked"``, ``"splash"`` or ``"flash"`` (``CausalSelfAttention``).
        attention_chunk_size: keys per chunk of ``"chunked"`` attention, which never keeps
            the attention probabilities for the backward pass; with ``"auto"``, a request
            for it where the device has no faster kernel (CPUs).
        vocabulary_divisible_by: the token table gets ``vocabulary_size`` rounded up to a
            multiple of this many rows (Megatron's ``--make-vocab-size-divisible-by``). The
            extra rows are never an input and are cut from the logits, so the model
            computes the same function; the output matmul gets aligned shapes (GPT-2's
            50257 -> 50304: +10-19% tokens/s on an H200, ``benchmarks/README.md``), and a
            vocabulary with no divisor for the ``model`` axis can be sharded over it (use
            a multiple of that axis).
        scan_layers: hold the blocks as one :class:`kdist.models.scan.LayerStack`: each
            block weight stacked on a leading layer axis (``blocks/...`` of shape ``(L,
            ...)`` instead of ``block_<i>/...``), the forward pass one ``lax.scan`` (XLA
            compiles one block, not L), and the layers splittable into pipeline stages
            (the ``stage`` mesh axis). None (default): stacked when the distribution has
            a ``stage`` axis. ``kdist.models.stacking`` converts weights between the two.
        matmul_precision: ``"bf16"`` (default: the dtype policy's matmuls), ``"int8"`` or
            ``"fp8"``: every block's attention and MLP projections quantized forward and
            backward (:mod:`kdist.precision`); embeddings, head, norms, softmax, loss unchanged.
        moe: routed experts in place of the MLP (:mod:`kdist.models.moe`): a dict with
            ``num_experts`` and optionally ``experts_per_token``, ``expert_dim``, ``every``,
            ``router``, ``shared_experts``, ``capacity_factor``, ``aux_loss_weight``,
            ``z_loss_weight``, ``balance_bias_rate`` (``MOE_DEFAULTS``). None (default): dense
            MLPs.

    Build it after setting the distribution: the constructor checks the shape against the
    active mesh, and every weight is created with its sharded layout.

    Example:
        >>> backbone = GPTBackbone(vocabulary_size=256, num_layers=2, num_heads=2,
        ...                        hidden_dim=32, intermediate_dim=64, max_sequence_length=16)
        >>> backbone(np.zeros((1, 8), "int32")).shape
        (1, 8, 32)
    """

    presets = GPT_PRESETS
    config_attributes = {"position_embedding": "position_embedding_type"}
    hf_model_types = ("gpt2", "llama", "mixtral")  # Hugging Face checkpoints (kdist.models.hf)

    def __init__(
        self,
        vocabulary_size: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        intermediate_dim: int,
        max_sequence_length: int,
        num_key_value_heads: int | None = None,
        position_embedding: str = "learned",
        rotary_max_wavelength: float = 10000.0,
        norm: str = "layer_norm",
        mlp_activation: str = "gelu",
        use_bias: bool = True,
        tie_embeddings: bool = True,
        document_mask: bool = False,
        dropout: float = 0.0,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        remat: bool | str = "auto",
        fused_qkv: bool = False,
        vocabulary_divisible_by: int = 1,
        attention_chunk_size: int | None = None,
        rope_scaling: dict | None = None,
        scan_layers: bool | None = None,
        attention_implementation: str = "auto",
        matmul_precision: str = "bf16",
        moe: dict | None = None,
        **kwargs,
    ):
        moe = check_moe(moe, num_layers, intermediate_dim, scan_layers)
        if moe and matmul_precision != "bf16":
            raise ValueError(
                f"matmul_precision={matmul_precision!r} quantizes the attention and MLP "
                f"projections, but the MoE experts (moe=...) have no quantized grouped matmul "
                f"yet. Use matmul_precision='bf16' with moe, or a dense model with it.")
        if hidden_dim % num_heads:
            raise ValueError(
                f"hidden_dim={hidden_dim} must be divisible by num_heads={num_heads} "
                f"(head_dim = hidden_dim / num_heads)."
            )
        if position_embedding not in ("learned", "rotary"):
            raise ValueError(
                f"Unknown position_embedding '{position_embedding}'. Use 'learned' or 'rotary'."
            )
        if rope_scaling is not None and position_embedding != "rotary":
            raise ValueError("rope_scaling scales rotary position embeddings; pass "
                             "position_embedding='rotary' with it, or rope_scaling=None.")
        check_divisible("num_heads", num_heads)
        check_divisible("num_key_value_heads", num_key_value_heads or num_heads)
        check_divisible("intermediate_dim", intermediate_dim)
        table_rows = token_table_rows(vocabulary_size, vocabulary_divisible_by)
        dtype = kwargs.pop("dtype", None)
        head_dim = hidden_dim // num_heads
        rotary = position_embedding == "rotary"

        # === Layers ===
        self.token_embedding = TokenEmbedding(
            table_rows,
            hidden_dim,
            vocabulary_size=vocabulary_size,
            tie_weights=tie_embeddings,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=initializer_range),
            max_sequence_length=max_sequence_length,
            dtype=dtype,
            name="token_embedding",
        )
        self.position_embedding = None if rotary else PositionEmbedding(
            max_sequence_length, initializer_range, dtype=dtype, name="position_embedding"
        )
        self.embedding_dropout = Dropout(dropout, dtype=dtype, name="embedding_dropout")
        scan_layers = stacking_default() if scan_layers is None else bool(scan_layers)

        def block(name, index=0):
            return PreNormBlock(
                num_heads,
                head_dim,
                intermediate_dim,
                num_key_value_heads=num_key_value_heads,
                rotary_max_wavelength=rotary_max_wavelength if rotary else None,
                norm=norm,
                mlp_activation=mlp_activation,
                use_bias=use_bias,
                dropout=dropout,
                layer_norm_epsilon=layer_norm_epsilon,
                initializer_range=initializer_range,
                output_initializer_range=initializer_range / np.sqrt(2 * num_layers),
                remat=remat,
                fused_qkv=fused_qkv,
                attention_chunk_size=attention_chunk_size,
                rope_scaling=rope_scaling if rotary else None,
                attention_implementation=attention_implementation,
                matmul_precision=matmul_precision,
                moe=block_moe(moe, index),
                dtype=dtype,
                name=name,
            )

        self.blocks = (LayerStack(block("block"), num_layers, dtype=dtype, name="blocks")
                       if scan_layers else [block(f"block_{i}", i) for i in range(num_layers)])
        self.final_norm = normalization(norm, layer_norm_epsilon, "final_norm", dtype)
        build_with_axes(self.final_norm, (None, None, hidden_dim), **NORM_AXES)

        # === Functional Model ===
        token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        segments = positions = None
        if document_mask:
            segments = keras.Input(shape=(None,), dtype="int32", name="segment_ids")
            inputs = {"token_ids": token_ids, "segment_ids": segments}
            positions = DocumentPositions(name="document_positions")(segments)
        else:
            inputs = token_ids
        x = self.embed(token_ids, positions=positions)
        for block in ([self.blocks] if scan_layers else self.blocks):
            x = block(x, segment_ids=segments, positions=positions if rotary else None)
        outputs = self.final_norm(x)
        super().__init__(inputs=inputs, outputs=outputs, dtype=dtype, **kwargs)

        # === Config ===
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.max_sequence_length = max_sequence_length
        self.num_key_value_heads = num_key_value_heads
        self.position_embedding_type = position_embedding
        self.rotary_max_wavelength = rotary_max_wavelength
        self.norm = norm
        self.mlp_activation = mlp_activation
        self.use_bias = use_bias
        self.tie_embeddings = tie_embeddings
        self.document_mask = document_mask
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.remat = remat
        self.fused_qkv = fused_qkv
        self.vocabulary_divisible_by = vocabulary_divisible_by
        self.attention_chunk_size = attention_chunk_size
        self.rope_scaling = rope_scaling
        self.scan_layers = scan_layers
        self.attention_implementation = attention_implementation
        self.matmul_precision = matmul_precision
        self.moe = moe

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_heads

    def embed(self, token_ids, start_index=0, positions=None, training=None):
        """Token (plus learned position) embeddings: ``(B, T)`` ids to ``(B, T, D)``
        (``training``: dropout on, where a caller outside the functional graph says so)."""
        x = self.token_embedding(token_ids)
        if self.position_embedding is not None:
            x = x + self.position_embedding(x, start_index=start_index, positions=positions)
        return self.embedding_dropout(x, training=training)


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
                 check_token_ids: bool = False, **kwargs):
        if not (loss_chunk_size in (None, 0, "auto") or (
                isinstance(loss_chunk_size, int) and not isinstance(loss_chunk_size, bool)
                and loss_chunk_size > 0)):
            raise ValueError(f"loss_chunk_size must be 'auto' (chosen by shape), a positive "
                             f"int (positions per chunk of the fused loss) or None/0 (logits, "
                             f"then Keras' loss); got {loss_chunk_size!r}.")
        # === Layers ===
        self.backbone = backbone
        self.loss_chunk_size = loss_chunk_size
        self.check_token_ids = check_token_ids
        self._fused_loss = False  # set by compile(): the default loss, no metrics

        # === Functional Model ===
        token_ids = backbone.input
        hidden = backbone(token_ids)
        logits = backbone.token_embedding(hidden, reverse=True)  # (B, T, V)
        logits = layers.Activation("linear", dtype="float32", name="logits")(logits)
        super().__init__(inputs=token_ids, outputs=logits, **kwargs)
        self._generators = {}  # sampler key -> (sampler, jitted decode loop)
        if backbone.moe:  # a per-device loss would balance each device's tokens, not the batch's
            self.step_features = self.step_features - {"gradient_reduction"}

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
        logits, _ = embedding.stateless_call(weights[1], [], hidden, reverse=True)  # (b,T,V)
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
            y_pred = ops.cast(self.backbone.token_embedding(y_pred, reverse=True), "float32")
            chunk_size = None
        if not chunk_size:
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        embedding = self.backbone.token_embedding
        loss = losses.chunked_cross_entropy(
            y_pred, embedding.output_table(), y, chunk_size,  # y_pred: hidden states
            vocabulary_size=embedding.vocabulary_size)
        return self.finish_loss(y, loss)

    @classmethod
    def cost_model_for(cls, backbone_config, **task_args) -> GPTCostModel:
        """:class:`GPTCostModel` of ``backbone_config`` (e.g. ``GPT_PRESETS["gpt-nano"]``).

        Example:
            >>> GPTCausalLM.cost_model_for(GPT_PRESETS["gpt2-small"]).parameters
            124475904
        """
        return GPTCostModel(GPTBackbone.full_config(backbone_config))
