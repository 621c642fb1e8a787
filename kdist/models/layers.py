"""Transformer building blocks shared by kdist models.

Shapes: B batch, T query length, S key length, D hidden (embed), N query heads, K key/value
heads, H head dim, F MLP width. Weight names are stable (explicit layer names: checkpoints
match on weight paths), and each layer declares its weights' logical axes where it builds
them (``kdist.parallel.rules.build_with_axes``).
"""

from __future__ import annotations

import keras
from keras import layers, ops

from kdist.models import remat as remat_policies
from kdist.models.attention import CausalSelfAttention
from kdist.models.moe import MoEFeedForward
from kdist.parallel import context
from kdist.parallel.constraints import shard_batch
from kdist.parallel.dropout import Dropout
from kdist.parallel.rules import build_with_axes
from kdist.precision import layers as precision_layers
from kdist.precision.policy import check as check_precision

# Logical axes of a norm's scale and offset (never sharded over model; split over fsdp).
NORM_AXES = dict(gamma=("norm",), beta=("norm",), scale=("norm",))


def _normal(stddev: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=stddev)


def normalization(kind: str, epsilon: float, name: str, dtype=None) -> layers.Layer:
    """``"layer_norm"`` (GPT-2) or ``"rms_norm"`` (Llama); both compute in float32.

    Example:
        >>> normalization("rms_norm", 1e-5, "norm")(keras.ops.ones((1, 4))).shape
        (1, 4)
    """
    if kind == "layer_norm":
        return layers.LayerNormalization(epsilon=epsilon, dtype=dtype, name=name)
    if kind == "rms_norm":
        return layers.RMSNormalization(epsilon=epsilon, dtype=dtype, name=name)
    raise ValueError(f"Unknown norm '{kind}'. Use 'layer_norm' or 'rms_norm'.")


# "gelu": tanh approximation (GPT-2); "gelu_exact": erf (HF BERT); "swiglu": gated (Llama).
MLP_ACTIVATIONS = ("gelu", "gelu_exact", "swiglu")


@keras.saving.register_keras_serializable(package="kdist")
class MLP(layers.Layer):
    """The position-wise feed-forward network.

    ``activation="gelu"``: ``down(gelu(up(x)))`` with GELU's tanh approximation (GPT-2's
    ``gelu_new``); ``"gelu_exact"``: the exact, erf form (Hugging Face BERT's ``gelu``).
    ``activation="swiglu"``: ``down(silu(gate(x)) * up(x))`` (Llama).
    ``matmul_precision``: ``"bf16"`` (the dtype policy's matmuls), ``"int8"`` or ``"fp8"``
    (:mod:`kdist.precision`: the up/gate/down matmuls quantized, weights unchanged).

    Example:
        >>> MLP(intermediate_dim=128, activation="swiglu")(keras.ops.ones((2, 8, 64))).shape
        (2, 8, 64)
    """

    def __init__(
        self,
        intermediate_dim: int,
        activation: str = "gelu",
        use_bias: bool = True,
        initializer_range: float = 0.02,
        output_initializer_range: float | None = None,
        matmul_precision: str = "bf16",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.matmul_precision = check_precision(matmul_precision)
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"Unknown MLP activation '{activation}'. Use one of "
                             f"{MLP_ACTIVATIONS} ('gelu' is the tanh approximation).")
        self.intermediate_dim = intermediate_dim
        self.activation = activation
        self.use_bias = use_bias
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range

    def _dense(self, units, stddev, name, input_shape, kernel_axes, bias_axes):
        layer = precision_layers.dense(
            units,
            self.matmul_precision,
            use_bias=self.use_bias,
            kernel_initializer=_normal(stddev),
            dtype=self.dtype_policy,
            name=name,
        )
        build_with_axes(layer, input_shape, kernel=kernel_axes, bias=bias_axes)
        return layer

    def build(self, input_shape):
        up = (self.intermediate_dim, self.initializer_range)
        self.up = self._dense(*up, "up", input_shape, ("embed", "mlp"), ("mlp",))
        if self.activation == "swiglu":
            self.gate = self._dense(*up, "gate", input_shape, ("embed", "mlp"), ("mlp",))
        self.down = self._dense(
            input_shape[-1],
            self.output_initializer_range or self.initializer_range,
            "down",
            tuple(input_shape[:-1]) + (self.intermediate_dim,),
            ("mlp", "embed"),
            ("norm",),
        )

    def call(self, x):
        # x: (B, T, D) -> (B, T, F) -> (B, T, D); the hidden pre-activations are what a
        # "minimal" rematerialisation keeps (kdist.models.remat)
        up = remat_policies.named(self.up(x), remat_policies.MLP_HIDDEN)
        if self.activation == "swiglu":
            gate = remat_policies.named(self.gate(x), remat_policies.MLP_HIDDEN)
            return self.down(keras.activations.silu(gate) * up)
        approximate = self.activation == "gelu"  # tanh form; "gelu_exact": erf
        return self.down(keras.activations.gelu(up, approximate=approximate))

    def get_config(self):
        return {
            **super().get_config(),
            "intermediate_dim": self.intermediate_dim,
            "activation": self.activation,
            "use_bias": self.use_bias,
            "initializer_range": self.initializer_range,
            "output_initializer_range": self.output_initializer_range,
            "matmul_precision": self.matmul_precision,
        }


@keras.saving.register_keras_serializable(package="kdist")
class PreNormBlock(layers.Layer):
    """A pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Norms compute in float32 under mixed precision (Keras does this for
    ``LayerNormalization`` and ``RMSNormalization``). ``remat`` is one of
    :mod:`kdist.models.remat`'s policies: what the forward pass keeps for the backward pass
    (``False``: everything; ``"minimal"``, ``"save_dots"``, ``"block"``/``True``: less,
    recomputing more; ``"auto"``: the device's choice for the step's shapes).
    (``keras.RematScope(mode="full")`` cannot be used here: Keras 3.15
    checkpoints ``Layer.__call__`` with every keyword argument traced, so
    ``training=False`` becomes a tracer and Dropout's ``if training`` fails.)

    Example:
        >>> block = PreNormBlock(num_heads=4, head_dim=16, intermediate_dim=128)
        >>> block(keras.ops.ones((2, 8, 64))).shape
        (2, 8, 64)
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        intermediate_dim: int,
        num_key_value_heads: int | None = None,
        rotary_max_wavelength: float | None = None,
        norm: str = "layer_norm",
        mlp_activation: str = "gelu",
        use_bias: bool = True,
        dropout: float = 0.0,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        output_initializer_range: float | None = None,
        remat: bool | str = False,
        fused_qkv: bool = False,
        attention_chunk_size: int | None = None,
        rope_scaling: dict | None = None,
        attention_implementation: str = "auto",
        matmul_precision: str = "bf16",
        moe: dict | None = None,
        qk_norm: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        remat_policies.check(remat)
        self.qk_norm = qk_norm  # CausalSelfAttention's per-head query/key RMSNorm (Qwen3)
        self.matmul_precision = check_precision(matmul_precision)
        self.moe = moe
        self.fused_qkv = fused_qkv
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.intermediate_dim = intermediate_dim
        self.num_key_value_heads = num_key_value_heads
        self.rotary_max_wavelength = rotary_max_wavelength
        self.norm = norm
        self.mlp_activation = mlp_activation
        self.use_bias = use_bias
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.remat = remat
        self.attention_chunk_size = attention_chunk_size
        self.rope_scaling = rope_scaling
        self.attention_implementation = attention_implementation
        dtype = self.dtype_policy
        self.attention_norm = normalization(norm, layer_norm_epsilon, "attention_norm", dtype)
        self.attention = CausalSelfAttention(
            num_heads,
            head_dim,
            num_key_value_heads=num_key_value_heads,
            rotary_max_wavelength=rotary_max_wavelength,
            use_bias=use_bias,
            initializer_range=initializer_range,
            output_initializer_range=output_initializer_range,
            fused_qkv=fused_qkv,
            attention_chunk_size=attention_chunk_size,
            rope_scaling=rope_scaling,
            attention_implementation=attention_implementation,
            matmul_precision=matmul_precision,
            qk_norm=qk_norm,
            qk_norm_epsilon=layer_norm_epsilon,
            dtype=dtype,
            name="attention",
        )
        self.mlp_norm = normalization(norm, layer_norm_epsilon, "mlp_norm", dtype)
        # `moe`: routed experts in place of the MLP (kdist.models.moe, MoEFeedForward's args)
        self.mlp = MoEFeedForward(
            **moe, initializer_range=initializer_range,
            output_initializer_range=output_initializer_range,
            matmul_precision=matmul_precision, dtype=dtype, name="moe",
        ) if moe else MLP(
            intermediate_dim,
            activation=mlp_activation,
            use_bias=use_bias,
            initializer_range=initializer_range,
            output_initializer_range=output_initializer_range,
            matmul_precision=matmul_precision,
            dtype=dtype,
            name="mlp",
        )
        self.attention_dropout = Dropout(dropout, dtype=dtype)
        self.mlp_dropout = Dropout(dropout, dtype=dtype)

    def build(self, input_shape):
        build_with_axes(self.attention_norm, input_shape, **NORM_AXES)
        self.attention.build(input_shape)
        build_with_axes(self.mlp_norm, input_shape, **NORM_AXES)
        self.mlp.build(input_shape)

    def call(
        self, x, attention_mask=None, positions=None, cache=None, cache_index=None, training=None,
        segment_ids=None,
    ):
        """``(B, T, D) -> (B, T, D)``; with a cache, also returns the updated cache.
        ``segment_ids (B, T)``: documents of a packed sequence (attention stays in each)."""
        if cache is not None:
            h, cache = self.attention(self.attention_norm(x), cache=cache, cache_index=cache_index)
            x, _ = self._mlp_residual(x + h, training)
            return x, cache

        def forward(x):
            h = self.attention(
                self.attention_norm(x), attention_mask=attention_mask, positions=positions,
                segment_ids=segment_ids,
            )
            x = x + self.attention_dropout(h, training=training)
            return self._mlp_residual(remat_policies.named(x, remat_policies.MIDPOINT), training)

        x, stats = remat_policies.rematerialised(
            forward, remat_policies.effective(self.remat))(x)
        if stats is not None:  # outside the checkpoint: Keras' losses must not be its tracers
            self.mlp.record(stats, training)
        return x

    def _mlp_residual(self, x, training):
        """``(B, T, D)`` -> ``((B, T, D), MoEStats or None)``."""
        h, stats = self.mlp_norm(x), None
        if self.moe:
            h, stats = self.mlp.forward(h)
        else:
            h = self.mlp(h)
        x = x + self.mlp_dropout(h, training=training)
        return shard_batch(x), stats  # (B, T, D), B split over data x fsdp

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "intermediate_dim": self.intermediate_dim,
            "num_key_value_heads": self.num_key_value_heads,
            "rotary_max_wavelength": self.rotary_max_wavelength,
            "norm": self.norm,
            "mlp_activation": self.mlp_activation,
            "use_bias": self.use_bias,
            "dropout": self.dropout,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "output_initializer_range": self.output_initializer_range,
            "remat": self.remat,
            "fused_qkv": self.fused_qkv,
            "attention_chunk_size": self.attention_chunk_size,
            "rope_scaling": self.rope_scaling,
            "attention_implementation": self.attention_implementation,
            "matmul_precision": self.matmul_precision,
            "moe": self.moe,
            "qk_norm": self.qk_norm,
        }


@keras.saving.register_keras_serializable(package="kdist")
class PostNormBlock(layers.Layer):
    """A post-norm encoder block: ``x = norm(x + attn(x))`` then ``x = norm(x + mlp(x))``.

    Attention is bidirectional (kdist's ``CausalSelfAttention`` with ``causal=False``);
    ``attention_mask`` ``(B, 1, 1, T)`` hides padded keys. Norms compute in float32 under
    mixed precision. ``remat`` is a :mod:`kdist.models.remat` policy (``True``: keep only
    the block input);
    ``attention_chunk_size`` and ``attention_implementation`` are ``CausalSelfAttention``'s;
    ``mlp_activation`` is ``MLP``'s ``"gelu"`` (tanh) or ``"gelu_exact"`` (HF BERT's erf);
    ``matmul_precision`` (``"bf16"``, ``"int8"``, ``"fp8"``) quantizes the projections.

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
        remat: bool | str = False,
        attention_chunk_size: int | None = None,
        mlp_activation: str = "gelu",
        attention_implementation: str = "auto",
        matmul_precision: str = "bf16",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.matmul_precision = check_precision(matmul_precision)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.remat = remat_policies.check(remat)
        self.attention_chunk_size = attention_chunk_size
        self.mlp_activation = mlp_activation
        self.attention_implementation = attention_implementation
        dtype = self.dtype_policy
        self.attention = CausalSelfAttention(
            num_heads, head_dim, causal=False, initializer_range=initializer_range,
            attention_chunk_size=attention_chunk_size,
            attention_implementation=attention_implementation,
            matmul_precision=matmul_precision, dtype=dtype, name="attention",
        )
        self.attention_norm = layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=dtype, name="attention_norm")
        self.mlp = MLP(intermediate_dim, activation=mlp_activation,
                       initializer_range=initializer_range, matmul_precision=matmul_precision,
                       dtype=dtype, name="mlp")
        self.mlp_norm = layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=dtype, name="mlp_norm")
        self.attention_dropout = Dropout(dropout, dtype=dtype)
        self.mlp_dropout = Dropout(dropout, dtype=dtype)

    def build(self, input_shape):
        self.attention.build(input_shape)
        build_with_axes(self.attention_norm, input_shape, **NORM_AXES)
        self.mlp.build(input_shape)
        build_with_axes(self.mlp_norm, input_shape, **NORM_AXES)

    def call(self, x, attention_mask=None, training=None):
        """``(B, T, D) -> (B, T, D)``."""

        def forward(x):
            h = self.attention(x, attention_mask=attention_mask)  # (B, T, D)
            x = self.attention_norm(x + self.attention_dropout(h, training=training))
            x = remat_policies.named(x, remat_policies.MIDPOINT)
            x = self.mlp_norm(x + self.mlp_dropout(self.mlp(x), training=training))
            return shard_batch(x)  # B split over data x fsdp

        return remat_policies.rematerialised(forward, remat_policies.effective(self.remat))(x)

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
            "mlp_activation": self.mlp_activation,
            "attention_implementation": self.attention_implementation,
            "matmul_precision": self.matmul_precision,
        }


def document_mask_and_positions(segment_ids):
    """Attention mask and per-document positions for packed sequences.

    ``segment_ids`` (B, T) are non-decreasing document indices within each row. Returns a
    ``(B, 1, T, T)`` boolean mask, True where query and key belong to the same document,
    and ``(B, T)`` positions that restart at 0 at every document start.

    Example:
        >>> mask, pos = document_mask_and_positions(keras.ops.convert_to_tensor([[0, 0, 1]]))
        >>> keras.ops.convert_to_numpy(pos).tolist()
        [[0, 1, 0]]
    """
    segment_ids = ops.cast(segment_ids, "int32")
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None], document_positions(
        segment_ids)  # (B, 1, T, T), (B, T)


def document_positions(segment_ids):
    """Per-document positions ``(B, T)`` of packed sequences: each token's position minus
    that of its document's first token (``segment_ids`` non-decreasing within each row).
    A sequence split over ``seq`` gets the same from its tokens' true positions
    (``kdist.parallel.context``).

    Example:
        >>> pos = document_positions(keras.ops.convert_to_tensor([[0, 0, 1, 1, 1]]))
        >>> keras.ops.convert_to_numpy(pos).tolist()
        [[0, 1, 0, 1, 2]]
    """
    segment_ids = ops.cast(segment_ids, "int32")
    layout = context.current_layout(segment_ids.shape[1])
    if layout is not None:
        return context.document_positions(segment_ids, layout)
    # Tokens of earlier documents precede the current one: position = t - their count.
    earlier = ops.sum(ops.cast(segment_ids[:, None, :] < segment_ids[:, :, None], "int32"), -1)
    return ops.arange(ops.shape(segment_ids)[1])[None, :] - earlier  # (B, T)
