"""GPT: a decoder-only, pre-norm Transformer — GPT-2 by default, Llama-style by config.

One model, configured: learned or rotary positions, LayerNorm or RMSNorm, GELU or SwiGLU
MLP, multi-head or grouped-query attention, tied or untied output embedding, with or
without biases, and optional document-aware attention over packed sequences. Its cost
model is :class:`~kdist.models.gpt_cost.GPTCostModel`; its language-model task is
:class:`~kdist.models.gpt_lm.GPTCausalLM`; generation is :mod:`kdist.models.generation`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers

from kdist.models.base import Backbone
from kdist.models.embeddings import PositionEmbedding, TokenEmbedding, token_table_rows
from kdist.models.layers import (
    NORM_AXES,
    PreNormBlock,
    document_positions,
    normalization,
)
from kdist.models.moe import block_moe, check_moe
from kdist.models.presets import GPT_PRESETS
from kdist.models.scan import LayerStack, stacking_default
from kdist.parallel.dropout import Dropout
from kdist.parallel.layout import check_divisible
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
        hidden_dim: model width D (must divide by ``num_heads`` unless ``head_dim`` is
            given).
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
        matmul_precision: ``"bf16"`` (default: the dtype policy's matmuls), ``"int8"``,
            ``"int8-sr"`` (int8, gradients stochastically rounded) or ``"fp8"``: every
            block's attention and MLP projections (or MoE experts) quantized forward and
            backward (:mod:`kdist.precision`); embeddings, head, norms, softmax, the MoE
            router and the loss unchanged (the head: ``GPTCausalLM``'s
            ``head_matmul_precision``).
        head_dim: each attention head's width H (Qwen3: 128 at D=2048 with 32 heads); None
            (default): ``hidden_dim // num_heads``. Queries are ``N x H`` wide, which need
            not equal D: the output projection maps ``(N, H)`` back to D.
        qk_norm: an RMSNorm over each query and key head (weights ``query_norm`` and
            ``key_norm`` ``(H,)``, epsilon ``layer_norm_epsilon``) after the projections
            and before RoPE (Qwen3, OLMo 2). Off by default.
        moe: routed experts in place of the MLP (:mod:`kdist.models.moe`): a dict with
            ``num_experts`` and optionally ``experts_per_token``, ``expert_dim``, ``every``,
            ``router``, ``shared_experts``, ``capacity_factor``, ``aux_loss_weight``,
            ``z_loss_weight``, ``balance_bias_rate``, ``renormalize``, ``routed_scale``
            (``MOE_DEFAULTS``).
            None (default): dense MLPs.

    Build it after setting the distribution: the constructor checks the shape against the
    active mesh, and every weight is created with its sharded layout.

    Example:
        >>> backbone = GPTBackbone(vocabulary_size=256, num_layers=2, num_heads=2,
        ...                        hidden_dim=32, intermediate_dim=64, max_sequence_length=16)
        >>> backbone(np.zeros((1, 8), "int32")).shape
        (1, 8, 32)
    """

    presets = GPT_PRESETS
    config_attributes = {"position_embedding": "position_embedding_type",
                         "head_dim": "given_head_dim"}
    # Hugging Face checkpoints (kdist.models.hf); an export takes the first that fits.
    hf_model_types = ("gpt2", "llama", "mixtral", "qwen3_moe")

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
        head_dim: int | None = None,
        qk_norm: bool = False,
        **kwargs,
    ):
        moe = check_moe(moe, num_layers, intermediate_dim, scan_layers)
        if head_dim is None and hidden_dim % num_heads:
            raise ValueError(
                f"hidden_dim={hidden_dim} must be divisible by num_heads={num_heads} "
                f"(head_dim = hidden_dim / num_heads), or pass head_dim explicitly."
            )
        if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(
                head_dim, int) or head_dim < 1 or (position_embedding == "rotary"
                                                   and head_dim % 2)):
            raise ValueError(f"head_dim must be None (hidden_dim // num_heads) or a positive "
                             f"int (even with rotary positions: RoPE rotates pairs); got "
                             f"{head_dim!r}.")
        if not isinstance(qk_norm, bool):
            raise ValueError(f"qk_norm must be True (per-head query/key RMSNorms: Qwen3) or "
                             f"False; got {qk_norm!r}.")
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
        given_head_dim, head_dim = head_dim, head_dim or hidden_dim // num_heads
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
                qk_norm=qk_norm,
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
        self.given_head_dim = given_head_dim
        self.qk_norm = qk_norm

    @property
    def head_dim(self) -> int:
        return self.given_head_dim or self.hidden_dim // self.num_heads

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
