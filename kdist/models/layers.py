"""Transformer building blocks shared by kdist models.

Shapes: B batch, T query length, S key length, D hidden (embed), N heads, H head dim,
F MLP width. Weight names are stable (explicit layer names) because the sharding tables
match on weight paths.
"""

from __future__ import annotations

import keras
from keras import layers, ops

from kdist.distribution import shard_batch


def _normal(stddev: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=stddev)


@keras.saving.register_keras_serializable(package="kdist")
class CausalSelfAttention(layers.Layer):
    """Multi-head causal self-attention with an optional key/value cache.

    Projections are ``EinsumDense`` with kernels shaped ``(D, N, H)`` (query/key/value)
    and ``(N, H, D)`` (output), so tensor parallelism splits the head axis and the output
    projection's partial sums are reduced by XLA. Attention itself is
    ``keras.ops.dot_product_attention`` (cuDNN flash attention on GPU when available;
    logits and softmax in float32 under ``mixed_bfloat16``).

    Example:
        >>> attn = CausalSelfAttention(num_heads=4, head_dim=16)
        >>> attn(keras.ops.ones((2, 8, 64))).shape
        (2, 8, 64)
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        initializer_range: float = 0.02,
        output_initializer_range: float | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range

    def build(self, input_shape):
        hidden_dim = input_shape[-1]
        dtype = self.dtype_policy

        def projection(name):
            return layers.EinsumDense(
                "btd,dnh->btnh",
                output_shape=(None, self.num_heads, self.head_dim),
                bias_axes="nh",
                kernel_initializer=_normal(self.initializer_range),
                dtype=dtype,
                name=name,
            )

        self.query, self.key, self.value = (projection(n) for n in ("query", "key", "value"))
        for proj in (self.query, self.key, self.value):
            proj.build(input_shape)
        self.attention_output = layers.EinsumDense(
            "btnh,nhd->btd",
            output_shape=(None, hidden_dim),
            bias_axes="d",
            kernel_initializer=_normal(self.output_initializer_range or self.initializer_range),
            dtype=dtype,
            name="attention_output",
        )
        self.attention_output.build((None, None, self.num_heads, self.head_dim))

    def call(self, x, cache=None, cache_index=None):
        # x: (B, T, D); cache: (B, 2, S, N, H) keys and values of the whole sequence so far.
        q, k, v = self.query(x), self.key(x), self.value(x)  # (B, T, N, H) each
        if cache is None:
            out = ops.dot_product_attention(q, k, v, is_causal=True)  # (B, T, N, H)
            return self.attention_output(out)  # (B, T, D)
        start = [0, cache_index, 0, 0]
        k = ops.slice_update(cache[:, 0], start, ops.cast(k, cache.dtype))  # (B, S, N, H)
        v = ops.slice_update(cache[:, 1], start, ops.cast(v, cache.dtype))
        # Query t (at absolute position cache_index + t) sees keys 0 .. cache_index + t.
        query_pos = cache_index + ops.arange(ops.shape(x)[1])  # (T,)
        key_pos = ops.arange(ops.shape(k)[1])  # (S,)
        mask = key_pos[None, :] <= query_pos[:, None]  # (T, S)
        out = ops.dot_product_attention(q, k, v, mask=mask[None, None])  # (B, T, N, H)
        return self.attention_output(out), ops.stack([k, v], axis=1)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "initializer_range": self.initializer_range,
            "output_initializer_range": self.output_initializer_range,
        }


@keras.saving.register_keras_serializable(package="kdist")
class MLP(layers.Layer):
    """The position-wise feed-forward network: ``down(gelu(up(x)))``.

    Example:
        >>> MLP(intermediate_dim=128)(keras.ops.ones((2, 8, 64))).shape
        (2, 8, 64)
    """

    def __init__(
        self,
        intermediate_dim: int,
        initializer_range: float = 0.02,
        output_initializer_range: float | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.intermediate_dim = intermediate_dim
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range

    def build(self, input_shape):
        self.up = layers.Dense(
            self.intermediate_dim,
            kernel_initializer=_normal(self.initializer_range),
            dtype=self.dtype_policy,
            name="up",
        )
        self.up.build(input_shape)
        self.down = layers.Dense(
            input_shape[-1],
            kernel_initializer=_normal(self.output_initializer_range or self.initializer_range),
            dtype=self.dtype_policy,
            name="down",
        )
        self.down.build(tuple(input_shape[:-1]) + (self.intermediate_dim,))

    def call(self, x):
        # x: (B, T, D) -> (B, T, F) -> (B, T, D)
        return self.down(keras.activations.gelu(self.up(x), approximate=True))

    def get_config(self):
        return {
            **super().get_config(),
            "intermediate_dim": self.intermediate_dim,
            "initializer_range": self.initializer_range,
            "output_initializer_range": self.output_initializer_range,
        }


@keras.saving.register_keras_serializable(package="kdist")
class PreLNBlock(layers.Layer):
    """A pre-LayerNorm decoder block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    Layer norms compute in float32 under mixed precision (Keras does this for
    ``LayerNormalization``). With ``remat=True`` the block's forward pass is wrapped in
    ``keras.remat`` (``jax.checkpoint``): only the block input is kept for the backward
    pass. (``keras.RematScope(mode="full")`` cannot be used here: Keras 3.15 checkpoints
    ``Layer.__call__`` with every keyword argument traced, so ``training=False`` becomes a
    tracer and Dropout's ``if training`` fails.)

    Example:
        >>> block = PreLNBlock(num_heads=4, head_dim=16, intermediate_dim=128)
        >>> block(keras.ops.ones((2, 8, 64))).shape
        (2, 8, 64)
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        intermediate_dim: int,
        dropout: float = 0.0,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        output_initializer_range: float | None = None,
        remat: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.intermediate_dim = intermediate_dim
        self.remat = remat
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.attention_norm = layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="attention_norm"
        )
        self.attention = CausalSelfAttention(
            num_heads,
            head_dim,
            initializer_range,
            output_initializer_range,
            dtype=self.dtype_policy,
            name="attention",
        )
        self.mlp_norm = layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="mlp_norm"
        )
        self.mlp = MLP(
            intermediate_dim,
            initializer_range,
            output_initializer_range,
            dtype=self.dtype_policy,
            name="mlp",
        )
        self.attention_dropout = layers.Dropout(dropout, dtype=self.dtype_policy)
        self.mlp_dropout = layers.Dropout(dropout, dtype=self.dtype_policy)

    def build(self, input_shape):
        for sublayer in (self.attention_norm, self.attention, self.mlp_norm, self.mlp):
            sublayer.build(input_shape)

    def call(self, x, cache=None, cache_index=None, training=None):
        """``(B, T, D) -> (B, T, D)``; with a cache, also returns the updated cache."""
        if cache is not None:
            h, cache = self.attention(self.attention_norm(x), cache=cache, cache_index=cache_index)
            return self._mlp_residual(x + h, training), cache

        def forward(x):
            h = self.attention(self.attention_norm(x))
            return self._mlp_residual(x + self.attention_dropout(h, training=training), training)

        return keras.remat(forward)(x) if self.remat else forward(x)

    def _mlp_residual(self, x, training):
        x = x + self.mlp_dropout(self.mlp(self.mlp_norm(x)), training=training)
        return shard_batch(x)  # (B, T, D), B split over data x fsdp

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "intermediate_dim": self.intermediate_dim,
            "dropout": self.dropout,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "output_initializer_range": self.output_initializer_range,
            "remat": self.remat,
        }
