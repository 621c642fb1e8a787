"""GPT: a decoder-only, pre-norm Transformer — GPT-2 by default, Llama-style by config.

One model, configured: learned or rotary positions, LayerNorm or RMSNorm, GELU or SwiGLU
MLP, multi-head or grouped-query attention, tied or untied output embedding, with or
without biases, and optional document-aware attention over packed sequences.
"""

from __future__ import annotations

import functools
import itertools

import keras
import numpy as np
from keras import layers, ops

from kdist import reduction
from kdist.distribution import (
    check_divisible,
    current_mesh_shape,
    gathered,
    register_logical_axes,
)
from kdist.models.layers import PreNormBlock, document_mask_and_positions, normalization
from kdist.models.presets import GPT_PRESETS, preset_config

# Weight path -> logical axes, for the sharding rules in kdist.distribution.
GPT_LOGICAL_AXES = {
    r"token_embedding/embeddings": ("vocab", "embed"),
    r"token_embedding/reverse_embeddings": ("embed", "vocab"),
    r"position_embedding/embeddings": ("position", "embed"),
    r"block_\d+/attention/query/kernel": ("embed", "heads", "head_dim"),
    r"block_\d+/attention/query/bias": ("heads", "head_dim"),
    r"block_\d+/attention/(key|value)/kernel": ("embed", "kv_heads", "head_dim"),
    r"block_\d+/attention/(key|value)/bias": ("kv_heads", "head_dim"),
    r"block_\d+/attention/qkv/kernel": ("embed", "kv_heads", None, "head_dim"),  # fused_qkv
    r"block_\d+/attention/qkv/bias": ("kv_heads", None, "head_dim"),
    r"block_\d+/attention/attention_output/kernel": ("heads", "head_dim", "embed"),
    r"block_\d+/attention/attention_output/bias": ("norm",),
    r"block_\d+/mlp/(up|gate)/kernel": ("embed", "mlp"),
    r"block_\d+/mlp/(up|gate)/bias": ("mlp",),
    r"block_\d+/mlp/down/kernel": ("mlp", "embed"),
    r"block_\d+/mlp/down/bias": ("norm",),
    r"(block_\d+/(attention_norm|mlp_norm)|final_norm)/(gamma|beta|scale)": ("norm",),
}
register_logical_axes(GPT_LOGICAL_AXES)


@keras.saving.register_keras_serializable(package="kdist")
class TokenEmbedding(keras.layers.ReversibleEmbedding):
    """Keras' reversible embedding that all-gathers its table over ``fsdp`` before lookup
    and refuses sequences longer than ``max_sequence_length``.

    ``call(ids)`` embeds ``(B, T)`` ids to ``(B, T, D)``; ``call(x, reverse=True)`` gives
    logits ``(B, T, V)`` (tied: against the same table; else ``reverse_embeddings``).

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

    def call(self, inputs, reverse=False):
        if reverse:
            logits = super().call(inputs, reverse=True)  # (B, T, rows)
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
        table = gathered(
            ops.convert_to_tensor(self.embeddings), GPT_LOGICAL_AXES["token_embedding/embeddings"]
        )
        return ops.cast(ops.take(table, ops.cast(inputs, "int32"), axis=0), self.compute_dtype)

    def compute_output_spec(self, inputs, reverse=False):
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
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.max_sequence_length, input_shape[-1]),
            initializer=keras.initializers.RandomNormal(stddev=self.initializer_range),
        )

    def call(self, x, start_index=0, positions=None):
        table = ops.convert_to_tensor(self.embeddings)  # (max_sequence_length, D)
        if positions is not None:
            return ops.cast(ops.take(table, positions, axis=0), self.compute_dtype)  # (B, T, D)
        rows = ops.slice(table, [start_index, 0], [ops.shape(x)[1], ops.shape(table)[1]])
        return ops.cast(rows, self.compute_dtype)[None]  # (1, T, D)

    def compute_output_spec(self, x, start_index=0, positions=None):
        batch = 1 if positions is None else positions.shape[0]
        return keras.KerasTensor((batch, x.shape[1], x.shape[2]), self.compute_dtype)

    def get_config(self):
        return {
            **super().get_config(),
            "max_sequence_length": self.max_sequence_length,
            "initializer_range": self.initializer_range,
        }


@keras.saving.register_keras_serializable(package="kdist")
class DocumentMask(layers.Layer):
    """Segment ids ``(B, T)`` to a same-document attention mask ``(B, 1, T, T)`` and
    per-document positions ``(B, T)`` (see ``document_mask_and_positions``)."""

    def call(self, segment_ids):
        return document_mask_and_positions(segment_ids)

    def compute_output_spec(self, segment_ids):
        b, t = segment_ids.shape
        return (keras.KerasTensor((b, 1, t, t), "bool"), keras.KerasTensor((b, t), "int32"))


@keras.saving.register_keras_serializable(package="kdist")
class GPTBackbone(keras.Model):
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
        norm: ``"layer_norm"`` (GPT-2) or ``"rms_norm"`` (Llama).
        mlp_activation: ``"gelu"`` (GPT-2) or ``"swiglu"`` (Llama).
        use_bias: biases on the attention and MLP projections (GPT-2: yes; Llama: no).
        tie_embeddings: output projection = token embedding transposed.
        document_mask: inputs become ``{"token_ids", "segment_ids"}``; attention does not
            cross a document boundary and positions restart per document.
        dropout: residual and embedding dropout rate.
        layer_norm_epsilon: epsilon of every norm.
        initializer_range: stddev of the normal weight initialiser (GPT-2: 0.02); the
            residual output projections use ``initializer_range / sqrt(2 * num_layers)``.
        remat: rematerialise each block in the backward pass: False, True / ``"block"``
            (``keras.remat``: keep only each block's input) or ``"save_dots"`` (keep the
            matmul outputs too; see ``PreNormBlock``).
        fused_qkv: one fused query/key/value projection per block (``.../attention/qkv``)
            instead of three; off by default.
        attention_chunk_size: attend over chunks of this many keys without keeping the
            attention probabilities for the backward pass (``CausalSelfAttention``); for
            CPUs and document masks, where no fused attention kernel runs. None: Keras'
            attention (cuDNN flash attention on a GPU).
        vocabulary_divisible_by: the token table gets ``vocabulary_size`` rounded up to a
            multiple of this many rows (Megatron's ``--make-vocab-size-divisible-by``). The
            extra rows are never an input and are cut from the logits, so the model
            computes the same function; the output matmul gets aligned shapes (GPT-2's
            50257 -> 50304: +10-19% tokens/s on an H200, ``benchmarks/README.md``), and a
            vocabulary with no divisor for the ``model`` axis can be sharded over it (use
            a multiple of that axis).

    Build it after setting the distribution: the constructor checks the shape against the
    active mesh, and every weight is created with its sharded layout.

    Example:
        >>> backbone = GPTBackbone(vocabulary_size=256, num_layers=2, num_heads=2,
        ...                        hidden_dim=32, intermediate_dim=64, max_sequence_length=16)
        >>> backbone(np.zeros((1, 8), "int32")).shape
        (1, 8, 32)
    """

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
        remat: bool | str = False,
        fused_qkv: bool = False,
        vocabulary_divisible_by: int = 1,
        attention_chunk_size: int | None = None,
        **kwargs,
    ):
        if hidden_dim % num_heads:
            raise ValueError(
                f"hidden_dim={hidden_dim} must be divisible by num_heads={num_heads} "
                f"(head_dim = hidden_dim / num_heads)."
            )
        if position_embedding not in ("learned", "rotary"):
            raise ValueError(
                f"Unknown position_embedding '{position_embedding}'. Use 'learned' or 'rotary'."
            )
        check_divisible("num_heads", num_heads)
        check_divisible("num_key_value_heads", num_key_value_heads or num_heads)
        check_divisible("intermediate_dim", intermediate_dim)
        if not isinstance(vocabulary_divisible_by, int) or vocabulary_divisible_by < 1:
            raise ValueError(f"vocabulary_divisible_by must be a positive int (e.g. 128); got "
                             f"{vocabulary_divisible_by!r}.")
        # Not rounded to the mesh: the table's shape must not depend on it (checkpoints
        # move between meshes).
        table_rows = -(-vocabulary_size // vocabulary_divisible_by) * vocabulary_divisible_by
        model_axis = current_mesh_shape()["model"]
        if table_rows % model_axis:
            padded = (f" (padded to {table_rows} rows by vocabulary_divisible_by="
                      f"{vocabulary_divisible_by})" if table_rows != vocabulary_size else "")
            raise ValueError(
                f"vocabulary_size={vocabulary_size}{padded} is not divisible by the 'model' "
                f"mesh axis of size {model_axis}, so the token table cannot be sharded over "
                f"it. Pass vocabulary_divisible_by=128 (or another multiple of {model_axis}) "
                f"to pad the table with rows that are never used, or use another mesh.")
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
        self.embedding_dropout = layers.Dropout(dropout, dtype=dtype, name="embedding_dropout")
        self.blocks = [
            PreNormBlock(
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
                dtype=dtype,
                name=f"block_{i}",
            )
            for i in range(num_layers)
        ]
        self.final_norm = normalization(norm, layer_norm_epsilon, "final_norm", dtype)

        # === Functional Model ===
        token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        mask = positions = None
        if document_mask:
            segment_ids = keras.Input(shape=(None,), dtype="int32", name="segment_ids")
            inputs = {"token_ids": token_ids, "segment_ids": segment_ids}
            mask, positions = DocumentMask(name="document_mask")(segment_ids)
        else:
            inputs = token_ids
        x = self.embed(token_ids, positions=positions)
        for block in self.blocks:
            x = block(x, attention_mask=mask, positions=positions if rotary else None)
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

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_heads

    def embed(self, token_ids, start_index=0, positions=None):
        """Token (plus learned position) embeddings: ``(B, T)`` ids to ``(B, T, D)``."""
        x = self.token_embedding(token_ids)
        if self.position_embedding is not None:
            x = x + self.position_embedding(x, start_index=start_index, positions=positions)
        return self.embedding_dropout(x)

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
            "num_key_value_heads": self.num_key_value_heads,
            "position_embedding": self.position_embedding_type,
            "rotary_max_wavelength": self.rotary_max_wavelength,
            "norm": self.norm,
            "mlp_activation": self.mlp_activation,
            "use_bias": self.use_bias,
            "tie_embeddings": self.tie_embeddings,
            "document_mask": self.document_mask,
            "dropout": self.dropout,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "remat": self.remat,
            "fused_qkv": self.fused_qkv,
            "vocabulary_divisible_by": self.vocabulary_divisible_by,
            "attention_chunk_size": self.attention_chunk_size,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("dtype"), dict):
            config["dtype"] = keras.saving.deserialize_keras_object(config["dtype"])
        return cls(**config)

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> GPTBackbone:
        """A randomly initialised backbone of a preset's shape (see ``GPT_PRESETS``).

        Example:
            >>> GPTBackbone.from_preset("gpt-nano", vocabulary_size=512).num_layers
            4
        """
        return cls(**preset_config(GPT_PRESETS, preset, **overrides))


@keras.saving.register_keras_serializable(package="kdist")
class GPTCausalLM(keras.Model):
    """Next-token prediction on top of a :class:`GPTBackbone`, with cached generation.

    The output head is the token embedding transposed (or its own matrix when
    ``tie_embeddings=False``); logits are cast to
    float32 so the loss is computed in float32 under ``mixed_bfloat16``. ``compile()``
    defaults to sparse categorical cross-entropy on the logits.

    ``loss_chunk_size``: if set, training with the default loss (and no compiled metrics)
    uses :func:`kdist.models.losses.chunked_cross_entropy` on the final hidden states, in
    chunks of this many positions, so the ``(B, T, V)`` float32 logits and their gradient
    are never materialised; ``predict``/``evaluate`` still give and use full logits.

    Example:
        >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=512, num_layers=1)
        >>> lm.compile(optimizer="adam")
        >>> x = np.random.randint(0, 512, (2, 16)).astype("int32")
        >>> float(lm.train_on_batch(x[:, :-1], x[:, 1:])) > 0
        True
        >>> lm.generate(x[:, :4], max_length=8, sampler="greedy").shape
        (2, 8)
    """

    def __init__(self, backbone: GPTBackbone, loss_chunk_size: int | None = None, **kwargs):
        if loss_chunk_size is not None and (
                not isinstance(loss_chunk_size, int) or loss_chunk_size < 1):
            raise ValueError(f"loss_chunk_size must be None (logits, then Keras' loss) or a "
                             f"positive int (positions per chunk); got {loss_chunk_size!r}.")
        # === Layers ===
        self.backbone = backbone
        self.loss_chunk_size = loss_chunk_size
        self._fused_loss = False  # set by compile(): training skips the logits

        # === Functional Model ===
        token_ids = backbone.input
        hidden = backbone(token_ids)
        logits = backbone.token_embedding(hidden, reverse=True)  # (B, T, V)
        logits = layers.Activation("linear", dtype="float32", name="logits")(logits)
        super().__init__(inputs=token_ids, outputs=logits, **kwargs)
        self._generators = {}  # sampler key -> (sampler, jitted decode loop)

    def compile(self, optimizer="adamw", loss=None, **kwargs):
        # With loss_chunk_size, the default loss trains through the fused, chunked
        # cross-entropy (kdist.models.losses); a loss or metrics of the user's need logits.
        self._fused_loss = (self.loss_chunk_size is not None and _is_default_loss(loss)
                            and not kwargs.get("metrics") and not kwargs.get("weighted_metrics"))
        if loss is None:
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        dist = keras.distribution.distribution()
        if getattr(dist, "gradient_reduction", None):
            reduction.check(dist, self)  # before any compilation
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables,
                                 metrics_variables, x, y, sample_weight, training=False,
                                 optimizer_variables=None):
        # With the distribution's gradient_reduction, training computes the loss per device
        # and reduces each weight's gradient once (kdist.reduction).
        dist = keras.distribution.distribution()
        compute = super().compute_loss_and_updates
        if training and getattr(dist, "gradient_reduction", None):
            return reduction.loss_and_updates(
                self, compute, trainable_variables, non_trainable_variables,
                metrics_variables, x, y, sample_weight, optimizer_variables)
        return compute(trainable_variables, non_trainable_variables, metrics_variables, x, y,
                       sample_weight, training=training, optimizer_variables=optimizer_variables)

    def call(self, inputs, training=None):
        if training and self._fused_loss:
            return self.backbone(inputs, training=training)  # (B, T, D): no logits
        return super().call(inputs, training=training)  # (B, T, V) float32 logits

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if not (training and self._fused_loss):
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        from kdist.models.losses import chunked_cross_entropy

        if sample_weight is not None:
            raise ValueError("The fused cross-entropy takes no sample_weight. Build the model "
                             "with loss_chunk_size=None to train with sample weights.")
        embedding = self.backbone.token_embedding
        table = (ops.convert_to_tensor(embedding.embeddings) if embedding.tie_weights
                 else ops.transpose(ops.convert_to_tensor(embedding.reverse_embeddings)))
        loss = chunked_cross_entropy(y_pred, table, y, self.loss_chunk_size,  # y_pred: hidden
                                     vocabulary_size=embedding.vocabulary_size)
        for extra in self.losses:
            loss = loss + self._aggregate_additional_loss(extra)
        return loss

    def compile_from_config(self, config):
        # Keras skips compiling on load when compile() is overridden; ours takes its config.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "loss_chunk_size": self.loss_chunk_size,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)

    @classmethod
    def from_preset(cls, preset: str, loss_chunk_size: int | None = None,
                    **overrides) -> GPTCausalLM:
        """A randomly initialised causal LM of a preset's shape; overrides replace fields.

        Example:
            >>> GPTCausalLM.from_preset("gpt-nano", vocabulary_size=512).backbone.hidden_dim
            256
        """
        return cls(GPTBackbone.from_preset(preset, **overrides), loss_chunk_size=loss_chunk_size)

    # === Generation ===

    def call_with_cache(self, token_ids, cache, cache_index):
        """One forward pass over ``token_ids`` (B, T) at positions ``cache_index ...``.

        ``cache`` is ``(B, L, 2, S, K, H)``: keys and values of every layer. Returns
        ``(logits (B, T, V) float32, updated cache)``.
        """
        b = self.backbone
        x = b.embed(token_ids, start_index=cache_index)
        caches = []
        for i, block in enumerate(b.blocks):
            x, layer_cache = block(x, cache=cache[:, i], cache_index=cache_index)
            caches.append(layer_cache)
        logits = b.token_embedding(b.final_norm(x), reverse=True)
        return ops.cast(logits, "float32"), ops.stack(caches, axis=1)

    def _generate_step(self, prompt, prompt_length, sampler):
        b = self.backbone
        batch, max_length = ops.shape(prompt)
        cache = ops.zeros(
            (batch, b.num_layers, 2, max_length, b.kv_heads, b.head_dim), self.compute_dtype
        )
        # Fill the cache with the prompt (positions 0 .. prompt_length - 2): the sampler
        # feeds the last prompt token itself.
        _, cache = self.call_with_cache(prompt, cache, 0)

        def next_logits(prompt, cache, index):
            token = ops.slice(prompt, [0, index - 1], [batch, 1])  # (B, 1)
            logits, cache = self.call_with_cache(token, cache, index - 1)
            return logits[:, 0], None, cache

        return sampler(next=next_logits, prompt=prompt, cache=cache, index=prompt_length)

    def generate(
        self,
        prompt_ids,
        max_length: int,
        sampler="top_k",
        seed: int | None = None,
    ) -> np.ndarray:
        """Extends ``prompt_ids`` (B, P) to ``(B, max_length)`` tokens with a key/value cache.

        ``sampler`` is a keras-hub sampler or one of ``"greedy"``, ``"top_k"`` (k=10),
        ``"top_p"`` (p=0.9), ``"random"``. With a ``seed`` the result is reproducible call
        after call; without, each call draws anew. Runs as one compiled program (a
        ``while_loop`` over decode steps, reused across calls with the same sampler and
        shapes) and works under any kdist distribution.

        Example:
            >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
            >>> lm.generate(np.zeros((1, 3), "int32"), max_length=6, sampler="greedy").shape
            (1, 6)
        """
        prompt_ids = np.asarray(prompt_ids, dtype="int32")
        if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
            raise ValueError(
                f"prompt_ids must be a (batch, length >= 1) int array; got shape "
                f"{prompt_ids.shape}."
            )
        prompt_length = prompt_ids.shape[1]
        if not prompt_length < max_length <= self.backbone.max_sequence_length:
            raise ValueError(
                f"max_length={max_length} must exceed the prompt length {prompt_length} and "
                f"be at most the model's max_sequence_length "
                f"{self.backbone.max_sequence_length}."
            )
        key = (sampler, seed) if isinstance(sampler, str) else id(sampler)
        if key not in self._generators:
            self._generators[key] = self._compile_generator(_make_sampler(sampler, seed))
        sampler, run = self._generators[key]
        prompt = np.zeros((prompt_ids.shape[0], max_length), "int32")
        prompt[:, :prompt_length] = prompt_ids
        out, sampler_state = run(
            prompt,
            prompt_length,
            [v.value for v in sampler.variables],
            [w.value for w in self.weights],
        )
        if seed is None:  # unseeded: advance the sampler's RNG so the next call differs
            for variable, value in zip(sampler.variables, sampler_state):
                variable.assign(value)
        return np.asarray(out)

    def _compile_generator(self, sampler):
        """The sampler and a jitted ``run(prompt, prompt_length, sampler_state, weights)``.

        Kept per sampler, so repeated calls reuse the compiled program (jax.jit retraces
        only for a new batch size, prompt length or max_length).
        """
        import jax

        @functools.partial(jax.jit, static_argnums=1)
        def run(prompt, prompt_length, sampler_state, weights):
            mapping = itertools.chain(
                zip(sampler.variables, sampler_state), zip(self.weights, weights)
            )
            with keras.StatelessScope(state_mapping=mapping) as scope:
                out = self._generate_step(prompt, prompt_length, sampler)
            return out, [scope.get_current_value(v) for v in sampler.variables]

        return sampler, run


def _is_default_loss(loss) -> bool:
    """None, or the loss compile() defaults to (as a reloaded model's compile config has it):
    the fused cross-entropy computes exactly that."""
    if loss is None:
        return True
    return (isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
            and loss.get_config().get("from_logits") is True
            and loss.get_config().get("ignore_class") is None
            and loss.reduction == "sum_over_batch_size")


def _make_sampler(sampler, seed):
    import keras_hub

    if not isinstance(sampler, str):
        return sampler
    factories = {
        "greedy": lambda: keras_hub.samplers.GreedySampler(),
        "top_k": lambda: keras_hub.samplers.TopKSampler(k=10, seed=seed),
        "top_p": lambda: keras_hub.samplers.TopPSampler(p=0.9, seed=seed),
        "random": lambda: keras_hub.samplers.RandomSampler(seed=seed),
    }
    if sampler not in factories:
        raise ValueError(
            f"Unknown sampler '{sampler}'. Use one of {sorted(factories)} or pass a "
            f"keras_hub.samplers.Sampler instance."
        )
    return factories[sampler]()
