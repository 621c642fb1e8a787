"""The cost model of a GPT (:class:`GPTCostModel`): exact parameters, FLOPs and activation
bytes per token, from a backbone config alone (planning builds no model). Build one with
``GPTCausalLM.cost_model_for(config)``, which fills the constructor's defaults in."""

from __future__ import annotations

import dataclasses

from kdist import flops
from kdist.models.cost import CostModel, Experts


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

    def preset(self) -> str | None:
        """The name of the GPT preset of this shape (its length aside), or None."""
        from kdist.models.presets import GPT_PRESETS

        def same_experts(preset):  # (a built model's moe has every default filled in)
            mine, theirs = self.config.get("moe") or {}, preset.get("moe") or {}
            return bool(mine) == bool(theirs) and all(mine.get(k) == v
                                                      for k, v in theirs.items())

        return next((name for name, preset in GPT_PRESETS.items()
                     if same_experts(preset) and all(
                         self.config.get(k) == v for k, v in preset.items()
                         if k not in ("max_sequence_length", "moe"))), None)

    @property
    def parameters(self) -> int:
        """Trainable parameters (exact), padding rows of the token table included."""
        c = self.config
        d, f, n = c["hidden_dim"], c["intermediate_dim"], c["num_heads"]
        multiple = c["vocabulary_divisible_by"]
        v = -(-c["vocabulary_size"] // multiple) * multiple  # token table rows
        k = c["num_key_value_heads"] or n
        h = c.get("head_dim") or d // n
        bias = c["use_bias"]
        gated = c["mlp_activation"] == "swiglu"
        norm = 2 * d if c["norm"] == "layer_norm" else d
        attention = (d * (n + 2 * k) * h + n * h * d + (bias and (n + 2 * k) * h + d)
                     + (2 * h if c.get("qk_norm") else 0))  # per-head query/key norms
        mlp = d * f * (3 if gated else 2) + (bias and f * (2 if gated else 1) + d)
        blocks = c["num_layers"] * (attention + mlp + 2 * norm)
        embeddings = v * d * (1 if c["tie_embeddings"] else 2)
        positions = 0 if c["position_embedding"] == "rotary" else c["max_sequence_length"] * d
        experts = self._moe_blocks() and self._moe_blocks() * (
            self._moe_weights(c["moe"]["num_experts"]) - mlp)  # MoE blocks' MLP replaced
        return int(blocks + embeddings + positions + norm + experts)

    @property
    def stacked_parameters(self) -> int:
        """The decoder blocks' parameters, experts included: what ``scan_layers`` stacks
        (all but the token and position tables and the final norm)."""
        c = self.config
        d, multiple = c["hidden_dim"], c["vocabulary_divisible_by"]
        rows = -(-c["vocabulary_size"] // multiple) * multiple
        tables = rows * d * (1 if c["tie_embeddings"] else 2) + (
            0 if c["position_embedding"] == "rotary" else c["max_sequence_length"] * d)
        return self.parameters - tables - (2 * d if c["norm"] == "layer_norm" else d)

    def _moe_blocks(self) -> int:
        """How many blocks are MoE (``moe["every"]``: blocks k-1, 2k-1, ...)."""
        moe = self.config.get("moe")
        return 0 if not moe else self.config["num_layers"] // moe.get("every", 1)

    def _expert_matrices(self) -> int:
        """Each expert's ``D x F`` matrices: 3 SwiGLU (gate, up, down), 2 GELU (up, down)."""
        return 2 if self.config["moe"].get("activation") == "gelu" else 3

    def _moe_weights(self, experts: int) -> int:
        """A MoE layer's weights with ``experts`` routed experts: the router, the experts'
        (3 D x F each SwiGLU, 2 GELU) and the shared experts' (no biases)."""
        d, moe = self.config["hidden_dim"], self.config["moe"]
        f = moe.get("expert_dim") or self.config["intermediate_dim"]
        return d * moe["num_experts"] + self._expert_matrices() * d * f * (
            experts + moe.get("shared_experts", 0))

    @property
    def experts(self) -> Experts | None:
        """The routed experts (None for a dense model): ``parameters`` is ``3 D F E`` per MoE
        block (``gate``, ``up`` ``(E, D, F)`` and ``down`` ``(E, F, D)``; GELU experts
        ``2 D F E``, no gate).

        Example:
            >>> from kdist.models import GPT_PRESETS, GPTBackbone
            >>> GPTCostModel(GPTBackbone.full_config(GPT_PRESETS["gpt-nano-moe"])).experts.layers
            4
        """
        moe = self.config.get("moe")
        if not self._moe_blocks():
            return None
        d = self.config["hidden_dim"]
        f = moe.get("expert_dim") or self.config["intermediate_dim"]
        return Experts(self._moe_blocks(), moe["num_experts"], moe.get("experts_per_token", 2),
                       d, f, moe.get("capacity_factor"),
                       self._moe_blocks() * self._expert_matrices() * d * f * moe["num_experts"],
                       self._expert_matrices(), f * moe.get("shared_experts", 0))

    @property
    def active_parameters(self) -> int:
        """Parameters one token goes through: the unchosen experts of every MoE layer left
        out (``parameters`` for a dense model). Mixtral 8x7B: 12.9 B of 46.7 B.

        Example:
            >>> from kdist.models import GPT_PRESETS, GPTBackbone
            >>> cost = GPTCostModel(GPTBackbone.full_config(GPT_PRESETS["mixtral-8x7b"]))
            >>> round(cost.parameters / 1e9, 1), round(cost.active_parameters / 1e9, 1)
            (46.7, 12.9)
        """
        moe = self.config.get("moe")
        if not moe:
            return self.parameters
        unchosen = moe["num_experts"] - moe.get("experts_per_token", 2)
        return self.parameters - self._moe_blocks() * (self._moe_weights(unchosen)
                                                       - self._moe_weights(0))

    def flops_per_token(self, sequence_length: int, causal_half: bool = True):
        """As a dense model's, a MoE block's MLP FLOPs replaced by its active experts'
        (k routed plus the shared, ``2 x 3 D F`` each, GELU's ``2 x 2 D F``) and the router's
        ``2 D E``."""
        c = self.config
        dense = self._dense_flops(sequence_length, causal_half)
        if not self._moe_blocks():
            return dense
        moe, d = c["moe"], c["hidden_dim"]
        per_layer_dense = 2 * d * c["intermediate_dim"] * (
            3 if c["mlp_activation"] == "swiglu" else 2)
        active = (self._moe_weights(moe.get("experts_per_token", 2))
                  - d * moe["num_experts"])  # the k chosen experts' and shared weights
        change = self._moe_blocks() * (2 * active - per_layer_dense)
        return dataclasses.replace(dense, mlp=dense.mlp + change,
                                   extra=dense.extra + self._moe_blocks() * 2 * d
                                   * moe["num_experts"])

    def _dense_flops(self, sequence_length: int, causal_half: bool):
        c = self.config
        return flops.transformer_flops_per_token(
            c["num_layers"], c["hidden_dim"], c["num_heads"], c["intermediate_dim"],
            c["vocabulary_size"], sequence_length, num_kv_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim"), causal=True, causal_half=causal_half,
            gated_mlp=c["mlp_activation"] == "swiglu", remat=c["remat"] in (True, "block"))

    def activation_bytes_per_token(self, sequence_length: int, bytes_per_value: int = 4,
                                   remat=False, scores_kept: bool | None = None,
                                   logits: bool = True, fused: bool = False) -> float:
        """What the backward pass keeps per token, by rematerialisation policy
        (:mod:`kdist.models.remat`), per layer: ``False`` the block input and two norm
        outputs (3D), q/k/v (3Q; Q = N x H, which is D unless ``head_dim`` says
        otherwise), attention scores and probabilities (2NT, or the 2N softmax statistics
        where ``scores_kept`` is False: chunked or splash attention; None: as
        ``attention_chunk_size`` says), attention output and projection (Q + D), MLP up
        and activation (2F, 3F gated), down (D); ``"minimal"`` the block input, q/k/v
        (Q + 2 x key/value width), attention output (Q) and statistics, the residual between
        attention and MLP, the MLP's hidden pre-activations (F, 2F gated); ``"save_dots"``
        the projections' and MLP's matmul outputs; ``"block"``/``True`` the block inputs
        plus one block's ``False``. Once: with ``logits``, the float32 logits and their
        gradient (2V x 4).

        ``fused``: as a TPU's compiler keeps them (calibrated on TPU v5e programs compiled
        for the chip, gpt2-small, gpt2-medium, llama-550m: within -7..+16 % of their
        temporaries where memory is not short): it fuses element-wise work into the
        matmuls around it, so ``False`` keeps ``"minimal"``'s set; splash attention's
        statistics are 128 lanes wide (N x 512 bytes), kdist's flash kernel's one float32
        per head (its ``(B, N, 1, T)`` log-sum-exp); the logits are two bfloat16 (2V x 2
        bytes). A scanned stack (``scan_layers``) keeps exactly its policy's set
        (:func:`kdist.models.remat.in_scan`) — the compiler's heap, which is what
        :class:`kdist.compiled_step.ProgramMemory` reports for a TPU — and the compiler
        adds a copy of the stacked weights in the compute dtype
        (:meth:`stacked_parameters`; the planner counts it)."""
        c = self.config
        d, f, n, v = c["hidden_dim"], c["intermediate_dim"], c["num_heads"], c["vocabulary_size"]
        h = c.get("head_dim") or d // n
        q, kv = n * h, (c["num_key_value_heads"] or n) * h  # query and key/value widths
        up = (2 if c["mlp_activation"] == "swiglu" else 1) * f
        if scores_kept is None:
            scores_kept = not c["attention_chunk_size"]
        statistics = 2 * n * (sequence_length if scores_kept else 1)  # in float32 values
        everything = bytes_per_value * (5 * d + 4 * q + statistics + f + up)
        lanes = 0 if scores_kept else (512 * n if fused else 4 * n)  # softmax statistics
        if fused and not scores_kept and _attention(c, sequence_length) == "flash":
            lanes = 4 * n  # the log-sum-exp, (B, N, 1, T) float32: no lanes padded
        minimal = bytes_per_value * (3 * d + q + (q + 2 * kv) + up) + lanes
        kept = {False: minimal if fused else everything, "minimal": minimal,
                "save_dots": bytes_per_value * (2 * d + q + 2 * kv + up)}
        head = (2 * v * (2 if fused else 4)) if logits else 0
        if remat in (True, "block"):
            return c["num_layers"] * bytes_per_value * d + everything + head
        return c["num_layers"] * kept[remat] + head


def _attention(config: dict, length: int) -> str:
    """The attention the target device runs for ``config`` (:mod:`kdist.accelerators`)."""
    from kdist.accelerators import defaults

    return defaults.attention_of(config, length)
