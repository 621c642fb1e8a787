"""The cost model of a GPT (:class:`GPTCostModel`): exact parameters, FLOPs and activation
bytes per token, from a backbone config alone (planning builds no model). Build one with
``GPTCausalLM.cost_model_for(config)``, which fills the constructor's defaults in."""

from __future__ import annotations

from kdist import flops
from kdist.models.base import CostModel


class GPTCostModel(CostModel):
    """Parameters, FLOPs and activation bytes per token of a GPT (GPT-2 or Llama-style).

    FLOPs: :func:`kdist.flops.transformer_flops_per_token` with causal attention
    (``causal_half``: MaxText's half of ``T x T``, or nanoGPT's full matrix), the output
    projection over the real vocabulary (padding rows not counted), a third MLP matmul for
    SwiGLU, fewer key/value FLOPs for grouped-query attention.

    Example:
        >>> from kdist.models import GPT_PRESETS, GPTBackbone
        >>> cost = GPTCostModel(GPTBackbone.full_config(GPT_PRESETS["gpt-nano"]))
        >>> round(cost.flops_per_token(256).training / 1e6, 1)
        33.0
    """

    loss_in_schedule = True  # GPTCausalLM's "scheduled_pipeline" step feature
    per_token_targets = True  # the next token at every position

    def __init__(self, backbone_config):
        """``backbone_config``: every ``GPTBackbone`` argument (``GPTBackbone.full_config``)."""
        self.config = dict(backbone_config)

    @property
    def parameters(self) -> int:
        """Trainable parameters (exact), padding rows of the token table included."""
        c = self.config
        d, f, n = c["hidden_dim"], c["intermediate_dim"], c["num_heads"]
        multiple = c["vocabulary_divisible_by"]
        v = -(-c["vocabulary_size"] // multiple) * multiple  # token table rows
        k = c["num_key_value_heads"] or n
        h = d // n
        bias = c["use_bias"]
        gated = c["mlp_activation"] == "swiglu"
        norm = 2 * d if c["norm"] == "layer_norm" else d
        attention = d * (n + 2 * k) * h + n * h * d + (bias and (n + 2 * k) * h + d)
        mlp = d * f * (3 if gated else 2) + (bias and f * (2 if gated else 1) + d)
        blocks = c["num_layers"] * (attention + mlp + 2 * norm)
        embeddings = v * d * (1 if c["tie_embeddings"] else 2)
        positions = 0 if c["position_embedding"] == "rotary" else c["max_sequence_length"] * d
        return int(blocks + embeddings + positions + norm)

    def flops_per_token(self, sequence_length: int, causal_half: bool = True):
        c = self.config
        return flops.transformer_flops_per_token(
            c["num_layers"], c["hidden_dim"], c["num_heads"], c["intermediate_dim"],
            c["vocabulary_size"], sequence_length, num_kv_heads=c["num_key_value_heads"],
            causal=True, causal_half=causal_half, gated_mlp=c["mlp_activation"] == "swiglu",
            remat=bool(c["remat"]))

    def activation_bytes_per_token(self, sequence_length: int, bytes_per_value: int = 4,
                                   remat: bool = False) -> float:
        """Per layer and token: block input and two norm outputs (3D), q/k/v (3D), attention
        scores and probabilities (2NT; 2N with ``attention_chunk_size``), attention output
        and projection (2D), MLP up and activation (2F, 3F gated), down (D). Once: float32
        logits and their gradient (2V x 4). ``remat``: block inputs plus one block's."""
        c = self.config
        d, f, n, v = c["hidden_dim"], c["intermediate_dim"], c["num_heads"], c["vocabulary_size"]
        gated = c["mlp_activation"] == "swiglu"
        attention = 2 * n * (1 if c["attention_chunk_size"] else sequence_length)
        per_layer = bytes_per_value * (9 * d + attention + (3 if gated else 2) * f)
        logits = 2 * v * 4
        if remat:
            return c["num_layers"] * bytes_per_value * d + per_layer + logits
        return c["num_layers"] * per_layer + logits
