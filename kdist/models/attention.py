"""Self-attention: the ``CausalSelfAttention`` layer, which attends by the implementation
its ``attention_implementation`` names (XLA's, kdist's chunked online softmax
(:mod:`kdist.models.chunked_attention`), or a Pallas kernel of :mod:`kdist.kernels`).
"""

from __future__ import annotations

import keras
from keras import layers, ops

from kdist import _keras_compat, accelerators
from kdist.kernels import flash, splash
from kdist.models import remat
from kdist.models.chunked_attention import chunked_attention
from kdist.models.rope import RotaryEmbedding, ScaledRotaryEmbedding, check_rope_scaling
from kdist.parallel import context
from kdist.parallel.rules import build_with_axes
from kdist.precision import layers as precision_layers
from kdist.precision.policy import check as check_precision


def _normal(stddev: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=stddev)


@keras.saving.register_keras_serializable(package="kdist")
class CausalSelfAttention(layers.Layer):
    """Causal self-attention: multi-head or grouped-query, learned or rotary positions.

    Projections are ``EinsumDense`` with kernels shaped ``(D, N, H)`` (query), ``(D, K, H)``
    (key, value) and ``(N, H, D)`` (output), so tensor parallelism splits the head axes and
    XLA reduces the output projection's partial sums. Attention itself is
    chosen by ``attention_implementation`` (by default for the device: kdist's Pallas flash
    kernels on a TPU, ``keras.ops.dot_product_attention`` elsewhere — cuDNN flash
    attention on a GPU; logits and softmax in float32 under ``mixed_bfloat16``).

    Args:
        num_heads: query heads N.
        head_dim: H.
        num_key_value_heads: K (N must divide by K); None means N (multi-head attention).
        rotary_max_wavelength: if set, queries and keys are rotated by position (RoPE,
            :class:`kdist.models.rope.RotaryEmbedding`) with this base wavelength.
        rope_scaling: Llama 3.1/3.2's RoPE frequency scaling (a Hugging Face
            ``rope_scaling`` dict with ``rope_type="llama3"``; :mod:`kdist.models.rope`), or
            None (plain RoPE).
        use_bias: biases on the four projections.
        causal: mask future keys (decoder). ``False`` gives bidirectional attention
            (encoder, BERT), where only ``attention_mask`` restricts which keys are seen.
        fused_qkv: one ``qkv`` projection with kernel ``(D, K, N/K + 2, H)`` (each key/value
            head's query heads, then its key, then its value) instead of ``query``, ``key``
            and ``value``: one matmul instead of three. Off by default (weight names differ).
        attention_implementation: how training and evaluation attend (generation with a
            cache always uses ``keras.ops.dot_product_attention``): ``"auto"`` (default)
            the fastest measured for the device the step is compiled for and the shapes
            (:mod:`kdist.accelerators`: kdist's Pallas flash kernels on a TPU, XLA's
            elsewhere); ``"xla"`` ``keras.ops.dot_product_attention`` (cuDNN flash attention
            on a GPU); ``"chunked"`` :func:`chunked_attention`; ``"splash"``
            :func:`kdist.kernels.splash.splash_attention`; ``"flash"``
            :func:`kdist.kernels.flash.flash_attention` (both interpreted off a TPU: tests).
        attention_chunk_size: keys per chunk of ``"chunked"``; with ``"auto"``, a request
            for ``"chunked"`` where the device has no faster kernel (the ``(B, N, T, T)``
            probabilities are never kept for the backward pass). None: 128 where chunked.
        matmul_precision: ``"bf16"`` (the dtype policy's matmuls), ``"int8"`` or ``"fp8"``:
            the query/key/value (or fused qkv) and output projections' matmuls quantized
            (:mod:`kdist.precision`); attention's own matmuls and softmax are unchanged.
        qk_norm: an RMSNorm over the head axis H of every query and key head, after the
            projections and before RoPE (Qwen3, OLMo 2): weights ``query_norm/scale`` and
            ``key_norm/scale`` ``(H,)``, shared by the heads, in float32 under mixed
            precision. Off by default.
        qk_norm_epsilon: those norms' epsilon (the model's ``layer_norm_epsilon``).

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
        rope_scaling: dict | None = None,
        attention_implementation: str = "auto",
        matmul_precision: str = "bf16",
        qk_norm: bool = False,
        qk_norm_epsilon: float = 1e-6,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.qk_norm, self.qk_norm_epsilon = bool(qk_norm), qk_norm_epsilon
        self.matmul_precision = check_precision(matmul_precision)
        self.attention_implementation = accelerators.check_implementation(
            attention_implementation)
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
        self.rope_scaling = check_rope_scaling(rope_scaling)
        self.rotary = None
        if rotary_max_wavelength and self.rope_scaling is None:
            self.rotary = RotaryEmbedding(max_wavelength=rotary_max_wavelength,
                                          dtype=self.dtype_policy)
        elif rotary_max_wavelength:  # Llama 3.1/3.2: scaled frequencies
            self.rotary = ScaledRotaryEmbedding(rotary_max_wavelength, self.rope_scaling,
                                                dtype=self.dtype_policy)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_heads

    def build(self, input_shape):
        hidden_dim = input_shape[-1]

        def projection(name, heads, heads_axis):
            layer = precision_layers.einsum_dense(
                "btd,dnh->btnh",
                output_shape=(None, heads, self.head_dim),
                matmul_precision=self.matmul_precision,
                bias_axes="nh" if self.use_bias else None,
                kernel_initializer=_normal(self.initializer_range),
                dtype=self.dtype_policy,
                name=name,
            )
            build_with_axes(layer, input_shape, kernel=("embed", heads_axis, "head_dim"),
                            bias=(heads_axis, "head_dim"))
            return layer

        if self.fused_qkv:
            groups = self.num_heads // self.kv_heads
            self.qkv = precision_layers.einsum_dense(
                "btd,dkgh->btkgh",
                output_shape=(None, self.kv_heads, groups + 2, self.head_dim),
                matmul_precision=self.matmul_precision,
                bias_axes="kgh" if self.use_bias else None,
                kernel_initializer=_normal(self.initializer_range),
                dtype=self.dtype_policy,
                name="qkv",
            )
            build_with_axes(self.qkv, input_shape, kernel=("embed", "kv_heads", None, "head_dim"),
                            bias=("kv_heads", None, "head_dim"))
        else:
            self.query = projection("query", self.num_heads, "heads")
            self.key = projection("key", self.kv_heads, "kv_heads")
            self.value = projection("value", self.kv_heads, "kv_heads")
        self.attention_output = precision_layers.einsum_dense(
            "btnh,nhd->btd",
            output_shape=(None, hidden_dim),
            matmul_precision=self.matmul_precision,
            bias_axes="d" if self.use_bias else None,
            kernel_initializer=_normal(self.output_initializer_range or self.initializer_range),
            dtype=self.dtype_policy,
            name="attention_output",
        )
        build_with_axes(self.attention_output, (None, None, self.num_heads, self.head_dim),
                        kernel=("heads", "head_dim", "embed"), bias=("norm",))
        self.query_norm = self.key_norm = None
        if self.qk_norm:  # one (H,) scale per projection, shared by its heads: never over model
            self.query_norm, self.key_norm = (
                layers.RMSNormalization(epsilon=self.qk_norm_epsilon, dtype=self.dtype_policy,
                                        name=name) for name in ("query_norm", "key_norm"))
            for norm, heads in ((self.query_norm, self.num_heads),
                                (self.key_norm, self.kv_heads)):
                build_with_axes(norm, (None, None, heads, self.head_dim), scale=("head_dim",))

    def project_qkv(self, x):
        """``x (B, T, D)`` to queries ``(B, T, N, H)``, keys and values ``(B, T, K, H)``
        (queries and keys normalised per head with ``qk_norm``)."""
        q, k, v = self._project(x)
        if self.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)  # over H, each head alike
        return q, k, v

    def _project(self, x):
        if not self.fused_qkv:
            return self.query(x), self.key(x), self.value(x)
        qkv = self.qkv(x)  # (B, T, K, G + 2, H), G = N / K query heads per key/value head
        groups = self.num_heads // self.kv_heads
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        # Query head n = k * G + g serves key/value head k, as in grouped-query attention.
        q = ops.reshape(qkv[:, :, :, :groups], (batch, length, self.num_heads, self.head_dim))
        return q, qkv[:, :, :, groups], qkv[:, :, :, groups + 1]

    def implementation(self, queries: int, keys: int, arbitrary_mask: bool) -> str:
        """The attention this layer runs for ``queries`` over ``keys`` (``"auto"``
        resolved for the device being compiled for); raises where the choice cannot
        run."""
        device = accelerators.target()
        name = self.attention_implementation
        if not (isinstance(queries, int) and isinstance(keys, int)):  # symbolic lengths
            return "xla" if name in ("auto", "splash", "flash") else name
        if name == "auto":
            return accelerators.attention_for(
                device, queries=queries, keys=keys, head_dim=self.head_dim,
                arbitrary_mask=arbitrary_mask, chunk_size=self.attention_chunk_size,
                groups=self.num_heads // self.kv_heads)
        if name in ("splash", "flash") and (arbitrary_mask or not self._kernel_takes(
                name, queries, keys)):
            if _keras_compat.in_shape_inference():  # Keras' stand-in lengths: same shapes
                return "xla"
            why = ("a mask other than causality and documents (e.g. padded keys)"
                   if arbitrary_mask else f"{queries} queries over {keys} keys at head size "
                   f"{self.head_dim} (its tiles need multiples of {splash.LANES}"
                   + (", and an example's heads whole in VMEM" if name == "flash" else "")
                   + ")")
            raise ValueError(f"attention_implementation={name!r} cannot take {why}. Use "
                             f"'auto', 'xla' or 'chunked' for this model.")
        return name

    def _kernel_takes(self, name: str, queries: int, keys: int) -> bool:
        if name == "splash":
            return splash.supports(queries, keys, self.head_dim)
        groups = self.num_heads // self.kv_heads
        return flash.supports(queries, keys, self.head_dim, groups,
                              accelerators.flash_blocks(accelerators.target(), queries=queries,
                                                        head_dim=self.head_dim))

    def attend(self, q, k, v, attention_mask=None, segment_ids=None):
        """``q (B, T, N, H)`` over ``k``/``v (B, S, K, H)`` by :meth:`implementation`;
        ``attention_mask`` broadcastable to ``(B, 1, T, S)``, ``segment_ids (B, T)``."""
        name = self.implementation(q.shape[1], k.shape[1], attention_mask is not None)
        q, k, v = remat.named((q, k, v), remat.ATTENTION_INPUTS)
        if name in ("splash", "flash"):  # Pallas kernels: interpreted off a TPU (tests)
            device = accelerators.target()
            kernel, tiles = ((splash.splash_attention, accelerators.splash_blocks)
                             if name == "splash" else
                             (flash.flash_attention, accelerators.flash_blocks))
            return kernel(q, k, v, causal=self.causal, segment_ids=segment_ids,
                          blocks=tiles(device, queries=q.shape[1], head_dim=self.head_dim),
                          interpret=device.platform != "tpu")
        if segment_ids is not None:  # (B, 1, T, T): the same document
            same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
            attention_mask = same if attention_mask is None else attention_mask & same
        # Keras infers output shapes with stand-in lengths; the result's shape is the same.
        if name == "chunked" and not _keras_compat.in_shape_inference():
            return chunked_attention(q, k, v, mask=attention_mask, is_causal=self.causal,
                                     chunk_size=self.attention_chunk_size or
                                     accelerators.DEFAULT_CHUNK)
        return ops.dot_product_attention(q, k, v, mask=attention_mask, is_causal=self.causal)

    def rotate(self, x, start_index=0, positions=None):
        """RoPE on ``(B, T, heads, H)`` at positions ``start_index + t`` or ``positions``."""
        if self.rotary is None:
            return x
        return self.rotary(x, start_index=start_index, positions=positions)

    def call(self, x, attention_mask=None, positions=None, cache=None, cache_index=None,
             segment_ids=None):
        """``x (B, T, D) -> (B, T, D)``.

        Args:
            attention_mask: optional boolean mask broadcastable to ``(B, 1, T, T)``, True where
                a query may attend a key (``(B, 1, 1, T)`` for padding); causality is applied
                on top when ``causal``.
            positions: optional ``(B, T)`` positions for RoPE (restarting per document).
            segment_ids: optional ``(B, T)`` document ids of a packed sequence: a query
                attends only its own document's keys.
            cache: ``(B, 2, S, K, H)`` keys and values so far; then ``x`` holds the tokens at
                ``cache_index ...`` and the call also returns the updated cache.
        """
        q, k, v = self.project_qkv(x)  # (B, T, N|K, H)
        if cache is None:
            length = k.shape[1]
            if positions is None:  # true positions of a split sequence's tokens, if needed
                split = context.token_positions(length)
                positions = None if split is None else split[None]  # (1, T)
            q, k = self.rotate(q, positions=positions), self.rotate(k, positions=positions)
            if context.current_layout(length) is not None:  # T split over the seq axis
                if self.attention_implementation in ("splash", "flash"):
                    raise ValueError(
                        f"attention_implementation={self.attention_implementation!r} does not "
                        "split a sequence over the 'seq' axis: context parallelism attends "
                        "with its own online softmax (context_parallel='all_gather' or "
                        "'ring'). Use 'auto' (a Pallas kernel where the sequence is whole, "
                        "context attention where split).")
                out = context.attention(q, k, v, mask=attention_mask, segment_ids=segment_ids,
                                        causal=self.causal,
                                        chunk_size=self.attention_chunk_size)
                return self.attention_output(out)
            out = self.attend(q, k, v, attention_mask, segment_ids)
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
            "rope_scaling": self.rope_scaling,
            "attention_implementation": self.attention_implementation,
            "matmul_precision": self.matmul_precision,
            "qk_norm": self.qk_norm,
            "qk_norm_epsilon": self.qk_norm_epsilon,
        }
