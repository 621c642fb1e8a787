"""FLOPs per token of a Transformer, the dense peak of a device, and model FLOPs utilisation.

FLOPs are counted per matmul, as MaxText's ``calculate_tflops_training_per_device`` does.
Per token and per layer, with D hidden, N query heads, K key/value heads, H head dim,
F MLP width, V vocabulary, T sequence length (a multiply-add is 2 FLOPs)::

    QKV projections       2 * D * (N + 2K) * H
    attention scores      2 * T * N * H        (q . k for every key)
    attention values      2 * T * N * H        (probabilities . v)
    output projection     2 * N * H * D
    MLP                   2 * D * F * (2, or 3 when gated)
  and once per token, not per layer:
    unembedding (logits)  2 * D * V

Training is 3x the forward pass (the backward pass computes two matmuls per forward
matmul: the gradient of the input and of the weight). Embedding lookups, norms, softmax,
activations, the loss and the optimizer update are not matmuls and are not counted; XLA's
``cost_analysis()`` counts them, which is the few-percent residual between the two (see
:func:`xla_train_step_flops` and ``tests/test_flops.py``).

**The causal convention.** With causal attention a query sees on average half the keys.
``causal_half=True`` (MaxText, Megatron-LM) counts half the attention-score and -value
FLOPs; ``causal_half=False`` (nanoGPT, torchtitan) counts the full ``T x T`` matrices, which
reproduces their ``6N + 12 L N H T`` formula. The former is the work a causal kernel must
do; the latter is what a dense kernel (XLA on CPU) actually executes. State which one you
use next to any MFU figure: :attr:`FlopsPerToken.convention` is that statement.

**Remat.** Rematerialisation recomputes the forward pass of each rematerialised block in
the backward pass. Those FLOPs are "hardware FLOPs" (HFU), never "model FLOPs" (MFU):
:attr:`FlopsPerToken.hardware` adds them, :attr:`FlopsPerToken.training` does not.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Any

# Dense (no sparsity) peak TFLOP/s per JAX device, from the vendors' data sheets:
# (substring of jax's device_kind, lower case; bfloat16 peak; float32 peak).
# float32 on NVIDIA Ampere and later is the TF32 tensor-core peak, because XLA lets float32
# matmuls use TF32 by default; on TPU, default-precision float32 matmuls run as bfloat16
# passes, so the bf16 figure is used. Order matters: the first matching substring wins.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("h200", 989.0, 494.5),  # H200 SXM: same compute as H100 SXM
    ("h100 pcie", 756.0, 378.0),
    ("h100", 989.0, 494.5),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("gh200", 989.0, 494.5),
    ("b200", 2250.0, 1100.0),
    ("a100", 312.0, 156.0),  # SXM and PCIe have the same dense peak
    ("l40s", 362.0, 183.0),
    ("l4", 121.0, 60.0),
    ("a10g", 70.0, 35.0),
    ("tpu v6 lite", 918.0, 918.0),  # v6e (Trillium)
    ("tpu v6e", 918.0, 918.0),
    ("tpu v5 lite", 197.0, 197.0),  # v5e
    ("tpu v5e", 197.0, 197.0),
    ("tpu v5p", 459.0, 459.0),
    ("tpu v5", 459.0, 459.0),  # v5p reports "TPU v5"
    ("tpu v4", 275.0, 275.0),
)


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token, by matmul group, summed over layers.

    ``training`` (3x forward) is what MFU uses; ``hardware`` adds the forward pass that
    remat recomputes (HFU).

    Example:
        >>> f = transformer_flops_per_token(num_layers=2, hidden_dim=64, num_heads=4,
        ...                                 intermediate_dim=256, vocabulary_size=100,
        ...                                 sequence_length=32)
        >>> f.training == 3 * f.forward
        True
    """

    qkv: float
    attention: float
    output_projection: float
    mlp: float
    unembedding: float
    extra: float = 0.0
    causal: bool = True
    causal_half: bool = True
    remat: bool = False
    sequence_length: int = 0

    @property
    def forward(self) -> float:
        """Forward-pass matmul FLOPs per token."""
        return (self.qkv + self.attention + self.output_projection + self.mlp
                + self.unembedding + self.extra)

    @property
    def training(self) -> float:
        """Model FLOPs per trained token: forward + backward (2x forward). Used for MFU."""
        return 3.0 * self.forward

    @property
    def hardware(self) -> float:
        """Training FLOPs plus the blocks' forward pass recomputed by remat (if on)."""
        if not self.remat:
            return self.training
        blocks = self.qkv + self.attention + self.output_projection + self.mlp
        return self.training + blocks

    @property
    def convention(self) -> str:
        """One line saying what was counted, for logs next to every MFU figure."""
        if not self.causal:
            attention = "bidirectional attention (full T x T)"
        elif self.causal_half:
            attention = "causal attention counted as half of T x T (MaxText/Megatron)"
        else:
            attention = "causal attention counted as full T x T (nanoGPT/torchtitan)"
        remat = "; remat recompute excluded from MFU (in HFU)" if self.remat else ""
        return (f"matmul FLOPs only, training = 3 x forward, T = {self.sequence_length}, "
                f"{attention}{remat}")

    def as_dict(self) -> dict[str, Any]:
        """The breakdown and totals as plain numbers (for JSON logs)."""
        out = dataclasses.asdict(self)
        out.update(forward=self.forward, training=self.training, hardware=self.hardware,
                   convention=self.convention)
        return out


def transformer_flops_per_token(
    num_layers: int,
    hidden_dim: int,
    num_heads: int,
    intermediate_dim: int,
    vocabulary_size: int,
    sequence_length: int,
    *,
    head_dim: int | None = None,
    num_kv_heads: int | None = None,
    causal: bool = True,
    causal_half: bool = True,
    gated_mlp: bool = False,
    remat: bool = False,
    extra_forward_flops: float = 0.0,
) -> FlopsPerToken:
    """Matmul FLOPs per token of a decoder or encoder Transformer (see the module docstring).

    Tied or untied embeddings do not change the count: the input embedding is a lookup
    (no FLOPs) and the output projection is one ``D x V`` matmul either way (tying only
    changes the parameter count; see :func:`matmul_parameters`).

    Args:
        num_layers, hidden_dim, num_heads, intermediate_dim, vocabulary_size: the shape.
        sequence_length: tokens per sequence T (attention cost grows with it).
        head_dim: per-head width; default ``hidden_dim // num_heads``.
        num_kv_heads: key/value heads (grouped-query attention); default ``num_heads``.
        causal: causal (decoder) or bidirectional (encoder, e.g. BERT) attention.
        causal_half: with ``causal``, count half the score/value FLOPs (MaxText) or all
            of them (nanoGPT). Ignored when ``causal=False``.
        gated_mlp: a gated MLP (SwiGLU/GeGLU) has three ``D x F`` matmuls instead of two.
        remat: blocks are rematerialised (only affects :attr:`FlopsPerToken.hardware`).
        extra_forward_flops: other matmul FLOPs per token, e.g. BERT's MLM head transform
            ``2 * D * D``.

    Example:
        >>> f = transformer_flops_per_token(12, 768, 12, 3072, 50257, 1024, causal_half=False)
        >>> round(f.training / 1e9, 3)  # GFLOPs per trained token, GPT-2 small
        0.854
    """
    ints = dict(num_layers=num_layers, hidden_dim=hidden_dim, num_heads=num_heads,
                intermediate_dim=intermediate_dim, vocabulary_size=vocabulary_size,
                sequence_length=sequence_length)
    for name, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}. Pass the model's "
                             f"shape, e.g. transformer_flops_per_token(num_layers=12, ...).")
    head_dim = head_dim or hidden_dim // num_heads
    num_kv_heads = num_kv_heads or num_heads
    d, n, k, h = hidden_dim, num_heads, num_kv_heads, head_dim
    attention = 2 * 2 * sequence_length * n * h  # scores (q.k) + values (p.v)
    if causal and causal_half:
        attention /= 2
    return FlopsPerToken(
        qkv=float(num_layers * 2 * d * (n + 2 * k) * h),
        attention=float(num_layers * attention),
        output_projection=float(num_layers * 2 * n * h * d),
        mlp=float(num_layers * 2 * d * intermediate_dim * (3 if gated_mlp else 2)),
        unembedding=float(2 * d * vocabulary_size),
        extra=float(extra_forward_flops),
        causal=causal,
        causal_half=causal_half,
        remat=remat,
        sequence_length=sequence_length,
    )


def matmul_parameters(
    num_layers: int,
    hidden_dim: int,
    num_heads: int,
    intermediate_dim: int,
    vocabulary_size: int,
    *,
    head_dim: int | None = None,
    num_kv_heads: int | None = None,
    gated_mlp: bool = False,
    tied_embeddings: bool = True,
) -> int:
    """Parameters of the matmul weights plus token embedding(s): the ``N`` of ``6N``.

    Biases, norms and position tables are left out (nanoGPT also leaves out positions; its
    biases and norms are a <0.1% difference for GPT-2 sizes). Untied embeddings add a
    second ``V x D`` table that costs no FLOPs, which is why ``6N`` over-counts for them.

    Example:
        >>> matmul_parameters(12, 768, 12, 3072, 50257)  # GPT-2 small, tied
        123532032
    """
    head_dim = head_dim or hidden_dim // num_heads
    num_kv_heads = num_kv_heads or num_heads
    per_layer = (hidden_dim * (num_heads + 2 * num_kv_heads) * head_dim
                 + num_heads * head_dim * hidden_dim
                 + hidden_dim * intermediate_dim * (3 if gated_mlp else 2))
    embeddings = vocabulary_size * hidden_dim * (1 if tied_embeddings else 2)
    return num_layers * per_layer + embeddings


def nanogpt_flops_per_token(
    num_parameters: int, num_layers: int, num_heads: int, head_dim: int, sequence_length: int
) -> float:
    """nanoGPT's / torchtitan's training FLOPs per token: ``6N + 12 * L * H * Q * T``.

    (nanoGPT ``estimate_mfu``; torchtitan ``get_num_flop_per_token``.) Equals
    :attr:`FlopsPerToken.training` with ``causal_half=False`` when ``N`` is
    :func:`matmul_parameters` of a tied-embedding model.

    Example:
        >>> nanogpt_flops_per_token(123532032, 12, 12, 64, 1024) == (
        ...     transformer_flops_per_token(12, 768, 12, 3072, 50257, 1024,
        ...                                 causal_half=False).training)
        True
    """
    return float(6 * num_parameters + 12 * num_layers * num_heads * head_dim * sequence_length)


_CONFIG_KEYS = ("num_layers", "hidden_dim", "num_heads", "intermediate_dim", "vocabulary_size")


def model_flops_per_token(
    model: Any,
    sequence_length: int,
    *,
    causal: bool | None = None,
    causal_half: bool = True,
) -> FlopsPerToken:
    """:func:`transformer_flops_per_token` for a kdist model, read from its config.

    ``model`` is a task model with a ``backbone`` (``GPTCausalLM``), a backbone
    (``GPTBackbone``) or a config dict with the keys ``num_layers, hidden_dim, num_heads,
    intermediate_dim, vocabulary_size`` (optional ``head_dim, num_kv_heads, remat,
    causal, gated_mlp``). ``causal`` defaults to the config's ``causal``, else True.
    A kdist BERT model or config goes to :func:`bert_flops_per_token` (a ``BertClassifier``
    with its classifier head; otherwise the MLM head at every position — pass
    ``bert_flops_per_token(..., masked_positions=P)`` for the figure of masked-LM training).

    Example:
        >>> from kdist.models import GPT_PRESETS
        >>> f = model_flops_per_token(GPT_PRESETS["gpt-nano"], sequence_length=256)
        >>> f.convention.startswith("matmul FLOPs only")
        True
    """
    if isinstance(model, Mapping):
        config = dict(model)
    else:
        backbone = getattr(model, "backbone", model)
        if not hasattr(backbone, "get_config"):
            raise TypeError(f"model must be a kdist model, backbone or config dict; got "
                            f"{type(model).__name__}. Pass e.g. model.backbone.get_config().")
        config = backbone.get_config()
    if "num_segments" in config and causal is None:  # kdist BERT: an encoder, see there
        return bert_flops_per_token(config, sequence_length,
                                    num_classes=getattr(model, "num_classes", None))
    missing = [key for key in _CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(
            f"Cannot count FLOPs: the model config has no {', '.join(missing)} (it has "
            f"{', '.join(sorted(config))}). Use transformer_flops_per_token(...) with the "
            f"model's shape instead, and pass its .training to Throughput(flops_per_token=...)."
        )
    return transformer_flops_per_token(
        *(int(config[key]) for key in _CONFIG_KEYS),
        sequence_length,
        head_dim=config.get("head_dim"),
        # kdist's GPTBackbone calls these num_key_value_heads and mlp_activation="swiglu".
        num_kv_heads=config.get("num_kv_heads", config.get("num_key_value_heads")),
        causal=config.get("causal", True) if causal is None else causal,
        causal_half=causal_half,
        gated_mlp=bool(config.get("gated_mlp", config.get("mlp_activation") == "swiglu")),
        remat=bool(config.get("remat", False)),
    )


def bert_flops_per_token(
    model: Any,
    sequence_length: int,
    *,
    masked_positions: int | None = None,
    num_classes: int | None = None,
) -> FlopsPerToken:
    """Matmul FLOPs per token of BERT: the encoder plus the head that training runs.

    The encoder is :func:`transformer_flops_per_token` with bidirectional attention (the
    full ``T x T`` scores and values: no causal halving). The head is one of:

    * masked LM (default): BERT's head runs only at the ``masked_positions`` P gathered
      positions of each sequence (kdist's ``BertMaskedLM``), so its transform ``2 D^2``
      and tied unembedding ``2 D V`` count ``P / T`` per token; ``None`` means every
      position (a head over the whole sequence);
    * classifier (``num_classes`` set): pooler ``2 D^2`` and classifier ``2 D C`` once
      per sequence, i.e. divided by T; no unembedding.

    ``model`` is a kdist BERT model, backbone or backbone config dict.

    Example:
        >>> from kdist.models import BERT_PRESETS
        >>> f = bert_flops_per_token(BERT_PRESETS["bert-base"], 128, masked_positions=20)
        >>> f.causal, round(f.unembedding / (2 * 768 * 30522), 4)  # 20 of 128 positions
        (False, 0.1562)
    """
    if isinstance(model, Mapping):
        config = dict(model)
    else:
        config = getattr(model, "backbone", model).get_config()
    shape = [int(config[key]) for key in _CONFIG_KEYS]
    d, t = shape[1], sequence_length
    if num_classes is not None:
        extra, unembedding_share = (2 * d * d + 2 * d * num_classes) / t, 0.0
    else:
        share = 1.0 if masked_positions is None else masked_positions / t
        if not 0 < share <= 1:
            raise ValueError(f"masked_positions must be in 1..sequence_length ({t}); got "
                             f"{masked_positions}.")
        extra, unembedding_share = 2 * d * d * share, share
    encoder = transformer_flops_per_token(
        *shape, sequence_length, causal=False, remat=bool(config.get("remat", False)),
        extra_forward_flops=extra,
    )
    return dataclasses.replace(encoder, unembedding=encoder.unembedding * unembedding_share)


# === Device peaks ===


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's dense peak TFLOP/s and where the figure comes from.

    ``source`` is ``"table"`` (a data-sheet figure from :data:`PEAK_TFLOPS`), ``"measured"``
    (a one-off matmul benchmark: CPU or an unknown device) or ``"override"`` (given by the
    user, e.g. ``--peak-tflops``).

    Example:
        >>> Peak(989.0, "table", "NVIDIA H100 80GB HBM3", "bfloat16").tflops
        989.0
    """

    tflops: float
    source: str
    device_kind: str
    dtype: str

    def describe(self) -> str:
        """E.g. ``"989 TFLOP/s bfloat16 per device (table: NVIDIA H100 80GB HBM3)"``."""
        return (f"{self.tflops:.4g} TFLOP/s {self.dtype} per device "
                f"({self.source}: {self.device_kind})")


def table_peak_tflops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """The data-sheet dense peak for a JAX ``device_kind``, or None if it is not in the table.

    Example:
        >>> table_peak_tflops("NVIDIA H100 80GB HBM3"), table_peak_tflops("TPU v5 lite")
        (989.0, 197.0)
        >>> table_peak_tflops("cpu") is None
        True
    """
    kind = device_kind.lower()
    for key, bf16, fp32 in PEAK_TFLOPS:
        if key in kind:
            return fp32 if dtype in ("float32", "tf32") else bf16
    return None


def device_peak(
    devices: list | None = None,
    dtype: str = "bfloat16",
    override_tflops: float | None = None,
) -> Peak:
    """The peak TFLOP/s of one of ``devices`` (default: all local devices) for ``dtype``.

    Order: ``override_tflops`` if given, else the table, else a measured matmul peak (see
    :func:`measured_peak_tflops`), labelled ``"measured"``.

    Example:
        >>> device_peak(override_tflops=100.0).describe()  # doctest: +ELLIPSIS
        '100 TFLOP/s bfloat16 per device (override: ...)'
    """
    import jax

    devices = list(devices) if devices is not None else jax.local_devices()
    kind = devices[0].device_kind
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"The peak override must be positive TFLOP/s; got "
                             f"{override_tflops}. E.g. --peak-tflops 989 for an H100 in bf16.")
        return Peak(float(override_tflops), "override", kind, dtype)
    tflops = None if devices[0].platform == "cpu" else table_peak_tflops(kind, dtype)
    if tflops is not None:
        return Peak(tflops, "table", kind, dtype)
    return Peak(measured_peak_tflops(tuple(devices), dtype), "measured", kind, dtype)


@functools.cache
def measured_peak_tflops(devices: tuple, dtype: str = "float32", repeats: int = 5) -> float:
    """Best-of-``repeats`` matmul TFLOP/s per device, with all ``devices`` busy at once.

    All devices run at once because host (CPU) devices share the same cores: measured one
    at a time, each would see the whole machine. Cached per (devices, dtype).

    Example:
        >>> import jax
        >>> measured_peak_tflops(tuple(jax.devices()[:1]), "float32") > 0
        True
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    size = 1024 if devices[0].platform == "cpu" else 4096
    mesh = Mesh(np.asarray(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    x = jax.device_put(jnp.ones((len(devices), size, size), dtype), sharding)
    # (n, M, M) @ (n, M, M): each device multiplies its own pair.
    matmul = jax.jit(lambda a: jnp.einsum("nij,njk->nik", a, a), out_shardings=sharding)
    matmul(x).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


# === XLA's count, for checking the formula ===


def xla_train_step_flops(model: Any, batch_size: int, sequence_length: int,
                         batch: Any = None) -> float:
    """FLOPs of one compiled Keras train step, from XLA's ``cost_analysis()``.

    ``model`` must be compiled (loss and optimizer). Lowers the model's own JAX
    ``train_step`` on abstract inputs (``ShapeDtypeStruct``), so only compilation runs,
    and returns XLA's FLOP count for one step of ``batch_size`` sequences. XLA counts every
    op: matmuls, but also norms, softmax, activations, the loss and the optimizer update,
    so it exceeds :func:`transformer_flops_per_token` by a few percent. Run it without a
    distribution (one device) to get the whole step's count. ``batch`` is a sample batch
    (``(x, y)`` or ``(x, y, sample_weight)``, any nesting of arrays: e.g. BERT's input dict)
    whose shapes and dtypes the step is compiled for; by default ``(ids, ids)`` of
    ``batch_size x sequence_length`` int32 token ids, a causal LM's.

    Example:
        >>> from kdist.models import GPTCausalLM
        >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=512, num_layers=1)
        >>> lm.compile(optimizer="adamw")
        >>> xla_train_step_flops(lm, batch_size=2, sequence_length=32) > 0
        True
    """
    import jax
    import numpy as np

    if getattr(model, "optimizer", None) is None:
        raise ValueError("model is not compiled: call model.compile(optimizer=..., loss=...) "
                         "before xla_train_step_flops(model, ...).")
    if batch is None:
        tokens = np.zeros((batch_size, sequence_length), "int32")
        batch = (tokens, tokens)
    batch = tuple(batch)
    model._symbolic_build(data_batch=batch)  # builds loss/metric state, no compute
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
    abstract_batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                                  batch)
    compiled = jax.jit(model.train_step).lower(abstract, abstract_batch).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
        cost = cost[0]
    return float(cost["flops"])
