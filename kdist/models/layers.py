"""Transformer building blocks shared by kdist models.

Shapes: B batch, T query length, S key length, D hidden (embed), N query heads, K key/value
heads, H head dim, F MLP width. Weight names are stable (explicit layer names) because the
sharding tables match on weight paths.
"""

from __future__ import annotations

import keras
from keras import layers, ops
from keras_hub.layers import RotaryEmbedding

from kdist.distribution import shard_batch
from kdist.models.attention import chunked_attention


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


@keras.saving.register_keras_serializable(package="kdist")
class CausalSelfAttention(layers.Layer):
    """Causal self-attention: multi-head or grouped-query, learned or rotary positions.

    Projections are ``EinsumDense`` with kernels shaped ``(D, N, H)`` (query), ``(D, K, H)``
    (key, value) and ``(N, H, D)`` (output), so tensor parallelism splits the head axes and
    XLA reduces the output projection's partial sums. Attention itself is
    ``keras.ops.dot_product_attention`` (grouped-query natively; cuDNN flash attention on
    GPU where available; logits and softmax in float32 under ``mixed_bfloat16``).

    Args:
        num_heads: query heads N.
        head_dim: H.
        num_key_value_heads: K (N must divide by K); None means N (multi-head attention).
        rotary_max_wavelength: if set, queries and keys are rotated by position (RoPE,
            keras-hub's ``RotaryEmbedding``) with this base wavelength.
        use_bias: biases on the four projections.
        causal: mask future keys (decoder). ``False`` gives bidirectional attention
            (encoder, BERT), where only ``attention_mask`` restricts which keys are seen.
        fused_qkv: one ``qkv`` projection with kernel ``(D, K, N/K + 2, H)`` (each key/value
            head's query heads, then its key, then its value) instead of ``query``, ``key``
            and ``value``: one matmul instead of three. Off by default (weight names differ).
        attention_chunk_size: if set, training and evaluation attend through
            :func:`kdist.models.attention.chunked_attention` over chunks of this many keys:
            the ``(B, N, T, T)`` probabilities are never kept for the backward pass (for
            backends without a fused attention kernel: CPU, or document masks). None:
            ``keras.ops.dot_product_attention`` (cuDNN flash attention on a GPU).

    Example:
        >>> attn = CausalSelfAttention(num_heads=4, head_dim=16, num_key_value_heads=2,
        ...                            rotary_max_wavelength=10000.0)
        >>> attn(keras.ops.ones((2, 8, 64))).shape
        (2, 8, 64)
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_key_value_heads: int | None = None,
        rotary_max_wavelength: float | None = None,
        use_bias: bool = True,
        initializer_range: float = 0.02,
        output_initializer_range: float | None = None,
        causal: bool = True,
        fused_qkv: bool = False,
        attention_chunk_size: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if attention_chunk_size is not None and (
                not isinstance(attention_chunk_size, int) or attention_chunk_size < 1):
            raise ValueError(f"attention_chunk_size must be None (Keras' attention) or a "
                             f"positive int (keys per chunk); got {attention_chunk_size!r}.")
        self.fused_qkv = fused_qkv
        self.attention_chunk_size = attention_chunk_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_key_value_heads = num_key_value_heads
        self.rotary_max_wavelength = rotary_max_wavelength
        self.use_bias = use_bias
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.causal = causal
        kv_heads = num_key_value_heads or num_heads
        if num_heads % kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_key_value_heads={kv_heads} "
                f"(each key/value head serves num_heads / num_key_value_heads query heads)."
            )
        self.rotary = (
            RotaryEmbedding(max_wavelength=rotary_max_wavelength, dtype=self.dtype_policy)
            if rotary_max_wavelength
            else None
        )

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_heads

    def build(self, input_shape):
        hidden_dim = input_shape[-1]

        def projection(name, heads):
            layer = layers.EinsumDense(
                "btd,dnh->btnh",
                output_shape=(None, heads, self.head_dim),
                bias_axes="nh" if self.use_bias else None,
                kernel_initializer=_normal(self.initializer_range),
                dtype=self.dtype_policy,
                name=name,
            )
            layer.build(input_shape)
            return layer

        if self.fused_qkv:
            groups = self.num_heads // self.kv_heads
            self.qkv = layers.EinsumDense(
                "btd,dkgh->btkgh",
                output_shape=(None, self.kv_heads, groups + 2, self.head_dim),
                bias_axes="kgh" if self.use_bias else None,
                kernel_initializer=_normal(self.initializer_range),
                dtype=self.dtype_policy,
                name="qkv",
            )
            self.qkv.build(input_shape)
        else:
            self.query = projection("query", self.num_heads)
            self.key = projection("key", self.kv_heads)
            self.value = projection("value", self.kv_heads)
        self.attention_output = layers.EinsumDense(
            "btnh,nhd->btd",
            output_shape=(None, hidden_dim),
            bias_axes="d" if self.use_bias else None,
            kernel_initializer=_normal(self.output_initializer_range or self.initializer_range),
            dtype=self.dtype_policy,
            name="attention_output",
        )
        self.attention_output.build((None, None, self.num_heads, self.head_dim))

    def project_qkv(self, x):
        """``x (B, T, D)`` to queries ``(B, T, N, H)``, keys and values ``(B, T, K, H)``."""
        if not self.fused_qkv:
            return self.query(x), self.key(x), self.value(x)
        qkv = self.qkv(x)  # (B, T, K, G + 2, H), G = N / K query heads per key/value head
        groups = self.num_heads // self.kv_heads
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        # Query head n = k * G + g serves key/value head k, as in grouped-query attention.
        q = ops.reshape(qkv[:, :, :, :groups], (batch, length, self.num_heads, self.head_dim))
        return q, qkv[:, :, :, groups], qkv[:, :, :, groups + 1]

    def rotate(self, x, start_index=0, positions=None):
        """RoPE on ``(B, T, heads, H)`` at positions ``start_index + t`` or ``positions``."""
        if self.rotary is None:
            return x
        return self.rotary(x, start_index=start_index, positions=positions)

    def call(self, x, attention_mask=None, positions=None, cache=None, cache_index=None):
        """``x (B, T, D) -> (B, T, D)``.

        Args:
            attention_mask: optional boolean mask broadcastable to ``(B, 1, T, T)``, True where
                a query may attend a key (documents of a packed sequence; ``(B, 1, 1, T)`` for
                padding); causality is applied on top when ``causal``.
            positions: optional ``(B, T)`` positions for RoPE (restarting per document).
            cache: ``(B, 2, S, K, H)`` keys and values so far; then ``x`` holds the tokens at
                ``cache_index ...`` and the call also returns the updated cache.
        """
        q, k, v = self.project_qkv(x)  # (B, T, N|K, H)
        if cache is None:
            q, k = self.rotate(q, positions=positions), self.rotate(k, positions=positions)
            # Keras infers output shapes with symbolic batch and length; the chunking needs
            # concrete ones, and the shapes are the same either way.
            if self.attention_chunk_size and all(isinstance(d, int) for d in k.shape[:2]):
                out = chunked_attention(q, k, v, mask=attention_mask, is_causal=self.causal,
                                        chunk_size=self.attention_chunk_size)
            else:
                out = ops.dot_product_attention(q, k, v, mask=attention_mask,
                                                is_causal=self.causal)
            return self.attention_output(out)  # (B, T, N, H) -> (B, T, D)
        q, k = self.rotate(q, cache_index), self.rotate(k, cache_index)
        start = [0, cache_index, 0, 0]
        k = ops.slice_update(cache[:, 0], start, ops.cast(k, cache.dtype))  # (B, S, K, H)
        v = ops.slice_update(cache[:, 1], start, ops.cast(v, cache.dtype))
        # Query t (at absolute position cache_index + t) sees keys 0 .. cache_index + t.
        query_pos = cache_index + ops.arange(ops.shape(x)[1])  # (T,)
        key_pos = ops.arange(ops.shape(k)[1])  # (S,)
        visible = key_pos[None, :] <= query_pos[:, None]  # (T, S)
        out = ops.dot_product_attention(q, k, v, mask=visible[None, None])  # (B, T, N, H)
        return self.attention_output(out), ops.stack([k, v], axis=1)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "num_key_value_heads": self.num_key_value_heads,
            "rotary_max_wavelength": self.rotary_max_wavelength,
            "use_bias": self.use_bias,
            "initializer_range": self.initializer_range,
            "output_initializer_range": self.output_initializer_range,
            "causal": self.causal,
            "fused_qkv": self.fused_qkv,
            "attention_chunk_size": self.attention_chunk_size,
        }


@keras.saving.register_keras_serializable(package="kdist")
class MLP(layers.Layer):
    """The position-wise feed-forward network.

    ``activation="gelu"``: ``down(gelu(up(x)))`` (GPT-2). ``activation="swiglu"``:
    ``down(silu(gate(x)) * up(x))`` (Llama).

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
        **kwargs,
    ):
        super().__init__(**kwargs)
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"Unknown MLP activation '{activation}'. Use 'gelu' or 'swiglu'.")
        self.intermediate_dim = intermediate_dim
        self.activation = activation
        self.use_bias = use_bias
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range

    def _dense(self, units, stddev, name, input_shape):
        layer = layers.Dense(
            units,
            use_bias=self.use_bias,
            kernel_initializer=_normal(stddev),
            dtype=self.dtype_policy,
            name=name,
        )
        layer.build(input_shape)
        return layer

    def build(self, input_shape):
        self.up = self._dense(self.intermediate_dim, self.initializer_range, "up", input_shape)
        if self.activation == "swiglu":
            self.gate = self._dense(
                self.intermediate_dim, self.initializer_range, "gate", input_shape
            )
        self.down = self._dense(
            input_shape[-1],
            self.output_initializer_range or self.initializer_range,
            "down",
            tuple(input_shape[:-1]) + (self.intermediate_dim,),
        )

    def call(self, x):
        # x: (B, T, D) -> (B, T, F) -> (B, T, D)
        if self.activation == "swiglu":
            return self.down(keras.activations.silu(self.gate(x)) * self.up(x))
        return self.down(keras.activations.gelu(self.up(x), approximate=True))

    def get_config(self):
        return {
            **super().get_config(),
            "intermediate_dim": self.intermediate_dim,
            "activation": self.activation,
            "use_bias": self.use_bias,
            "initializer_range": self.initializer_range,
            "output_initializer_range": self.output_initializer_range,
        }


# Block rematerialisation: False (none), True or "block" (keep the block input only),
# "save_dots" (also keep matmul outputs without batch dimensions: projections and MLP).
REMAT_POLICIES = (False, True, "block", "save_dots")


def rematerialised(fn, remat: bool | str):
    """``fn`` wrapped for rematerialisation under one of :data:`REMAT_POLICIES`.

    Example:
        >>> rematerialised(lambda x: x * 2, "save_dots")(keras.ops.ones(2)).shape
        (2,)
    """
    if remat == "save_dots":
        import jax

        return jax.checkpoint(
            fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return keras.remat(fn)


@keras.saving.register_keras_serializable(package="kdist")
class PreNormBlock(layers.Layer):
    """A pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Norms compute in float32 under mixed precision (Keras does this for
    ``LayerNormalization`` and ``RMSNormalization``). With ``remat=True`` the forward pass
    is wrapped in ``keras.remat`` (``jax.checkpoint``): only the block input is kept for the
    backward pass. ``remat="block"`` is the same; ``remat="save_dots"`` keeps the outputs of
    the projection and MLP matmuls too (``jax.checkpoint_policies.
    dots_with_no_batch_dims_saveable``), so the backward pass recomputes only the
    element-wise ops and attention — less memory saved, less recompute.
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
        **kwargs,
    ):
        super().__init__(**kwargs)
        if remat not in REMAT_POLICIES:
            raise ValueError(f"Unknown remat {remat!r}. Use one of {REMAT_POLICIES} (True means "
                             f"'block').")
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
            dtype=dtype,
            name="attention",
        )
        self.mlp_norm = normalization(norm, layer_norm_epsilon, "mlp_norm", dtype)
        self.mlp = MLP(
            intermediate_dim,
            activation=mlp_activation,
            use_bias=use_bias,
            initializer_range=initializer_range,
            output_initializer_range=output_initializer_range,
            dtype=dtype,
            name="mlp",
        )
        self.attention_dropout = layers.Dropout(dropout, dtype=dtype)
        self.mlp_dropout = layers.Dropout(dropout, dtype=dtype)

    def build(self, input_shape):
        for sublayer in (self.attention_norm, self.attention, self.mlp_norm, self.mlp):
            sublayer.build(input_shape)

    def call(
        self, x, attention_mask=None, positions=None, cache=None, cache_index=None, training=None
    ):
        """``(B, T, D) -> (B, T, D)``; with a cache, also returns the updated cache."""
        if cache is not None:
            h, cache = self.attention(self.attention_norm(x), cache=cache, cache_index=cache_index)
            return self._mlp_residual(x + h, training), cache

        def forward(x):
            h = self.attention(
                self.attention_norm(x), attention_mask=attention_mask, positions=positions
            )
            return self._mlp_residual(x + self.attention_dropout(h, training=training), training)

        return rematerialised(forward, self.remat)(x) if self.remat else forward(x)

    def _mlp_residual(self, x, training):
        x = x + self.mlp_dropout(self.mlp(self.mlp_norm(x)), training=training)
        return shard_batch(x)  # (B, T, D), B split over data x fsdp

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
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
    # Tokens of earlier documents precede the current one: position = t - their count.
    earlier = ops.sum(ops.cast(segment_ids[:, None, :] < segment_ids[:, :, None], "int32"), -1)
    positions = ops.arange(ops.shape(segment_ids)[1])[None, :] - earlier  # (B, T)
    return same[:, None], positions
