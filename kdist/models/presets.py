"""Named model shapes. Presets are shapes only: no weights are downloaded."""

from __future__ import annotations

# GPT-2 shapes from Radford et al. (2019); max_sequence_length is GPT-2's context.
# Llama 3.x uses RoPE scaling for its 128k context; kdist's presets use plain RoPE.
# `gpt-nano` is sized to learn visibly in minutes on 2 CPU cores. The GPT-2 shapes pad their
# 50257-row token table to 50304 (vocabulary_divisible_by=128, as nanoGPT and Megatron-LM):
# aligned output matmuls (+10-19% tokens/s on an H200) and a table that shards over `model`.
GPT_PRESETS: dict[str, dict] = {
    "gpt-nano": dict(
        vocabulary_size=8192, num_layers=4, num_heads=4, hidden_dim=256,
        intermediate_dim=1024, max_sequence_length=256,
    ),
    "gpt2-small": dict(
        vocabulary_size=50257, num_layers=12, num_heads=12, hidden_dim=768,
        intermediate_dim=3072, max_sequence_length=1024, vocabulary_divisible_by=128,
    ),
    "gpt2-medium": dict(
        vocabulary_size=50257, num_layers=24, num_heads=16, hidden_dim=1024,
        intermediate_dim=4096, max_sequence_length=1024, vocabulary_divisible_by=128,
    ),
    "gpt2-large": dict(
        vocabulary_size=50257, num_layers=36, num_heads=20, hidden_dim=1280,
        intermediate_dim=5120, max_sequence_length=1024, vocabulary_divisible_by=128,
    ),
    "gpt2-xl": dict(
        vocabulary_size=50257, num_layers=48, num_heads=25, hidden_dim=1600,
        intermediate_dim=6400, max_sequence_length=1024, vocabulary_divisible_by=128,
    ),
}

# Mixture of Experts on gpt-nano's width (kdist.models.moe): its 1024-wide GELU MLP (2 x 256
# x 1024 = 524,288 weights) replaced by experts of the same form (GELU, no biases) and the
# same active weights: 16 fine-grained routed experts of width 128, each token through 4
# (4 x 2 x 256 x 128), and one always-on shared expert of 512 (shared_experts=4: 2 x 256 x
# 512); the routed weights 4x those a token uses. Dropless. routed_scale=4: the four
# renormalised weights sum to 1, so unscaled the routed part is the experts' mean, a quarter
# of what it adds as one MLP of their width. Each choice measured against gpt-nano at
# equal tokens (docs/moe.md, "Preset").
GPT_PRESETS["gpt-nano-moe"] = dict(
    GPT_PRESETS["gpt-nano"],
    moe=dict(num_experts=16, experts_per_token=4, expert_dim=128, shared_experts=4,
             routed_scale=4.0, activation="gelu"),
)

# Llama-style decoders: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases.
_LLAMA = dict(position_embedding="rotary", norm="rms_norm", mlp_activation="swiglu",
              use_bias=False, layer_norm_epsilon=1e-5)
GPT_PRESETS.update({
    # CPU-minutes size; untied output like Llama 3 8B.
    "llama-nano": dict(
        _LLAMA, vocabulary_size=8192, num_layers=4, num_heads=8, num_key_value_heads=2,
        hidden_dim=256, intermediate_dim=768, max_sequence_length=256,
        rotary_max_wavelength=10000.0, tie_embeddings=False,
    ),
    # The largest that trains with AdamW on one 16 GiB accelerator (TPU v5e) at T = 2048:
    # 554 M parameters (float32 weights and Adam's two moments: 8.9 GB with the gradients),
    # 128-wide heads and a 32768-token vocabulary (multiples of the TPU's 128 lanes).
    "llama-550m": dict(
        _LLAMA, vocabulary_size=32768, num_layers=20, num_heads=12, num_key_value_heads=4,
        hidden_dim=1536, intermediate_dim=4096, max_sequence_length=2048,
        rotary_max_wavelength=500000.0, tie_embeddings=True,
    ),
    # Shapes of Llama 3.2 1B / 3B (tied embeddings) and Llama 3.1 8B (untied), as published.
    "llama-1b": dict(
        _LLAMA, vocabulary_size=128256, num_layers=16, num_heads=32, num_key_value_heads=8,
        hidden_dim=2048, intermediate_dim=8192, max_sequence_length=131072,
        rotary_max_wavelength=500000.0, tie_embeddings=True,
    ),
    "llama-3b": dict(
        _LLAMA, vocabulary_size=128256, num_layers=28, num_heads=24, num_key_value_heads=8,
        hidden_dim=3072, intermediate_dim=8192, max_sequence_length=131072,
        rotary_max_wavelength=500000.0, tie_embeddings=True,
    ),
    "llama-8b": dict(
        _LLAMA, vocabulary_size=128256, num_layers=32, num_heads=32, num_key_value_heads=8,
        hidden_dim=4096, intermediate_dim=14336, max_sequence_length=131072,
        rotary_max_wavelength=500000.0, tie_embeddings=False,
    ),
    # Mixtral 8x7B's shape as published (Jiang et al. 2024; HF config of v0.1): 8 experts
    # of width 14336, top-2, every block, softmax router, no sliding window. For planning.
    "mixtral-8x7b": dict(
        _LLAMA, vocabulary_size=32000, num_layers=32, num_heads=32, num_key_value_heads=8,
        hidden_dim=4096, intermediate_dim=14336, max_sequence_length=32768,
        rotary_max_wavelength=1000000.0, tie_embeddings=False,
        moe=dict(num_experts=8, experts_per_token=2, expert_dim=14336),
    ),
    # Qwen3-30B-A3B's shape (HF config): head_dim 128 (wider than 2048 / 32), per-head
    # query/key RMSNorms, 128 experts of width 768, top-8 renormalised, every block. For
    # planning (30.5 B parameters, 3.3 B active).
    "qwen3-30b-a3b": dict(
        _LLAMA, vocabulary_size=151936, num_layers=48, num_heads=32, num_key_value_heads=4,
        hidden_dim=2048, intermediate_dim=6144, max_sequence_length=40960,
        rotary_max_wavelength=1000000.0, tie_embeddings=False, layer_norm_epsilon=1e-6,
        head_dim=128, qk_norm=True,
        moe=dict(num_experts=128, experts_per_token=8, expert_dim=768),
    ),
})

# BERT encoder shapes as published (Devlin et al. 2019; the small ones from Turc et al. 2019,
# "Well-Read Students Learn Better"): intermediate 4 x hidden, 512 positions, 2 segment
# types, the uncased English WordPiece vocabulary size. Pass vocabulary_size= for your own.
BERT_PRESETS: dict[str, dict] = {
    name: dict(
        vocabulary_size=30522, num_layers=layers, num_heads=heads, hidden_dim=hidden,
        intermediate_dim=4 * hidden, max_sequence_length=512, num_segments=2,
    )
    for name, (layers, hidden, heads) in {
        "bert-tiny": (2, 128, 2),
        "bert-mini": (4, 256, 4),
        "bert-small": (4, 512, 8),
        "bert-base": (12, 768, 12),
        "bert-large": (24, 1024, 16),
    }.items()
}


def preset_config(presets: dict[str, dict], name: str, **overrides) -> dict:
    """The config of a preset with overrides applied; unknown names fail with the choices.

    Example:
        >>> preset_config(GPT_PRESETS, "gpt-nano", vocabulary_size=4096)["vocabulary_size"]
        4096
    """
    if name not in presets:
        raise ValueError(
            f"Unknown preset '{name}'. Available presets: {', '.join(presets)}."
        )
    return {**presets[name], **overrides}
