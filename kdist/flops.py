"""FLOPs per token of a Transformer: the numerator of model FLOPs utilisation (MFU).

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
:func:`kdist.planning.xla_train_step_flops` and ``tests/test_flops.py``).

**The causal convention.** With causal attention a query sees on average half the keys.
``causal_half=True`` (MaxText, Megatron-LM) counts half the attention-score and -value
FLOPs; ``causal_half=False`` (nanoGPT, torchtitan) counts the full ``T x T`` matrices, which
reproduces their ``6N + 12 L N H T`` formula. The former is the work a causal kernel must
do; the latter is what a dense kernel (XLA on CPU) actually executes. State which one you
use next to any MFU figure: :attr:`FlopsPerToken.convention` is that statement.

**Remat.** Rematerialisation recomputes the forward pass of each rematerialised block in
the backward pass. Those FLOPs are "hardware FLOPs" (HFU), never "model FLOPs" (MFU):
:attr:`FlopsPerToken.hardware` adds them, :attr:`FlopsPerToken.training` does not.

**Which model.** Each kdist model family states its own count in its cost model
(``kdist.models.cost.CostModel.flops_per_token``, built on :func:`transformer_flops_per_token`);
:func:`model_flops_per_token` asks a model for it and never guesses the family. The
denominator of MFU, a device's peak, is in :mod:`kdist.callbacks.peak`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


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
    """FLOPs per token of a model, from its cost model; or of a Transformer config dict.

    ``model`` is a task with a ``cost_model()`` (every kdist task, or your own), a cost
    model itself (``flops_per_token``), or a config dict with the keys ``num_layers,
    hidden_dim, num_heads, intermediate_dim, vocabulary_size`` (optional ``head_dim,
    num_kv_heads`` / ``num_key_value_heads``, ``remat``, ``gated_mlp`` /
    ``mlp_activation="swiglu"``, ``causal``) read by :func:`transformer_flops_per_token`.
    A dict is a causal decoder unless it says ``causal: False`` (or ``causal=False`` is
    passed): no family is guessed from its keys.

    Example:
        >>> from kdist.models import GPT_PRESETS
        >>> f = model_flops_per_token(GPT_PRESETS["gpt-nano"], sequence_length=256)
        >>> f.convention.startswith("matmul FLOPs only")
        True
    """
    if not isinstance(model, Mapping):
        cost = model if callable(getattr(model, "flops_per_token", None)) else None
        if cost is None and callable(getattr(model, "cost_model", None)):
            cost = model.cost_model()
        if cost is None:
            raise TypeError(
                f"Cannot count the FLOPs of a {type(model).__name__}: it has no cost_model(). "
                f"Give your task a cost_model() (kdist.models.cost.CostModel), pass a config "
                f"dict, or give Throughput(flops_per_token=...) the training FLOPs per token.")
        return cost.flops_per_token(sequence_length, causal_half=causal_half)
    config = dict(model)
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
        remat=config.get("remat", False) in (True, "block"),
    )
