"""Llama (``model_type: "llama"``: Llama 2, 3, 3.1, 3.2) <-> kdist's ``GPTBackbone``.

Llama's projections are ``nn.Linear`` weights ``(out, in)``: each is transposed to Keras'
``(in, out)`` and its head axis split, ``q_proj`` ``(N H, D)`` -> ``(D, N, H)``, ``k_proj`` /
``v_proj`` ``(K H, D)`` -> ``(D, K, H)``, ``o_proj`` ``(D, N H)`` -> ``(N, H, D)``; the MLP's
``gate_proj`` / ``up_proj`` / ``down_proj`` are transposed. Hugging Face's rotate-half RoPE
is what kdist (``kdist.models.rope``, as keras-hub) computes, so no query/key permutation is
needed. ``rope_scaling`` of type ``llama3`` (3.1, 3.2) becomes kdist's ``rope_scaling``;
``rms_norm_eps`` the norms' epsilon; ``tie_word_embeddings`` whether ``lm_head.weight`` is
read. Keys are read with or without the ``model.`` prefix (``LlamaForCausalLM`` /
``LlamaModel``).

A stacked weight (``scan_layers=True``) maps to every layer's tensor through
:func:`~kdist.models.hf.stacked.stacked_map` and :func:`block_tensor_map`.
"""

from __future__ import annotations

import re

from kdist.models.hf.stacked import StackedMap, stacked_map
from kdist.models.hf.tensors import Pad, Split, TensorMap, Transpose
from kdist.models.rope import LLAMA3_FIELDS

MODEL_TYPE = "llama"
# Fields every llama config.json has (to tell a mislabelled model_type in an error).
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps")
PREFIX = "model."
IGNORED = re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
OPTIONAL: tuple[str, ...] = ()


def _rope(hf: dict, name: str = "Llama") -> tuple[float, dict | None]:
    """``(rope_theta, kdist rope_scaling)`` from the classic fields (``rope_theta``,
    ``rope_scaling``) or transformers 5's ``rope_parameters``."""
    parameters = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or parameters)
    theta = hf.get("rope_theta", parameters.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"{name} rope_scaling of type {kind!r} is not supported; kdist computes "
                         f"plain RoPE and 'llama3' (Llama 3.1/3.2).")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_FIELDS}}


def backbone_config(hf: dict, name: str = "Llama", free_head_dim: bool = False) -> dict:
    """kdist ``GPTBackbone`` arguments of a Llama ``config.json`` (``name``: the family
    its errors name; Mixtral's attention and norms are Llama's; ``free_head_dim``: the
    family's ``head_dim`` is its own, not hidden_size / heads, and its caller maps it)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name} hidden_act {hf['hidden_act']!r} is not supported; kdist's "
                         f"SwiGLU MLP computes 'silu'.")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{name} configs with attention_bias or mlp_bias are not supported: "
                         f"kdist's Llama-style blocks have no biases.")
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    if not free_head_dim and (hf.get("head_dim") not in (None, width // heads)
                              or width % heads):
        raise ValueError(f"{name} head_dim={hf.get('head_dim')} with hidden_size={width} and "
                         f"{heads} heads is not supported: kdist maps {name}'s heads as "
                         f"hidden_size / num_attention_heads wide (GPTBackbone's head_dim= is "
                         f"read from Qwen3-MoE checkpoints only).")
    if hf.get("pretraining_tp", 1) != 1:
        raise ValueError(f"{name} pretraining_tp != 1 (a sliced MLP) is not supported.")
    theta, scaling = _rope(hf, name)
    kv = hf.get("num_key_value_heads") or heads
    return dict(
        vocabulary_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_key_value_heads=None if kv == heads else kv,
        hidden_dim=width,
        intermediate_dim=hf["intermediate_size"],
        max_sequence_length=hf.get("max_position_embeddings", 2048),
        position_embedding="rotary",
        rotary_max_wavelength=theta,
        rope_scaling=scaling,
        norm="rms_norm",
        mlp_activation="swiglu",
        use_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dropout=0.0,  # Llama has no residual dropout; attention_dropout has no kdist analogue
        layer_norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        vocabulary_divisible_by=128,
    )


def matches(config: dict) -> list[str]:
    """What keeps a kdist GPT config from being a Llama (empty: it is one)."""
    want = dict(position_embedding="rotary", norm="rms_norm", mlp_activation="swiglu",
                use_bias=False, fused_qkv=False)
    wrong = [f"{k}={config[k]!r} (Llama: {v!r})" for k, v in want.items() if config[k] != v]
    if config.get("moe"):  # routed experts: a Mixtral (mixtral.py), not a Llama
        wrong.append("moe=... (Llama: a dense MLP)")
    return wrong + attention_differences(config, "Llama")


def attention_differences(config: dict, name: str) -> list[str]:
    """A kdist config's attention options that a family with hidden_size / heads wide heads
    and no query/key norms (GPT-2, Llama, Mixtral) cannot express."""
    wrong = []
    derived = config["hidden_dim"] // config["num_heads"]
    if config.get("head_dim") not in (None, derived):
        wrong.append(f"head_dim={config['head_dim']} ({name}: hidden_dim / num_heads = "
                     f"{derived})")
    if config.get("qk_norm"):
        wrong.append(f"qk_norm=True ({name}: no query/key norms)")
    return wrong


def hf_config(config: dict) -> dict:
    """The ``config.json`` of a kdist Llama-style backbone config."""
    heads = config["num_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": config["vocabulary_size"],
        "hidden_size": config["hidden_dim"],
        "intermediate_size": config["intermediate_dim"],
        "num_hidden_layers": config["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": config["num_key_value_heads"] or heads,
        "head_dim": config["hidden_dim"] // heads,
        "hidden_act": "silu",
        "max_position_embeddings": config["max_sequence_length"],
        "rms_norm_eps": config["layer_norm_epsilon"],
        "rope_theta": config["rotary_max_wavelength"],
        "rope_scaling": config["rope_scaling"],
        "tie_word_embeddings": config["tie_embeddings"],
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": config["initializer_range"],
        "pretraining_tp": 1,
    }


def tensor_map(path: str, config: dict) -> TensorMap | StackedMap | None:
    """The HF tensor (and steps) a kdist Llama-style GPT weight path comes from."""
    stacked = stacked_map(path, config, tensor_map)  # blocks/...: every layer's tensors
    if stacked is not None:
        return stacked
    d, v = config["hidden_dim"], config["vocabulary_size"]
    multiple = config["vocabulary_divisible_by"]
    rows = -(-v // multiple) * multiple
    if path == "token_embedding/embeddings":
        return TensorMap(PREFIX + "embed_tokens.weight", (v, d), steps=(Pad(0, rows),))
    if path == "token_embedding/reverse_embeddings":  # lm_head (V, D) -> (D, rows)
        return TensorMap("lm_head.weight", (v, d), steps=(Transpose((1, 0)), Pad(1, rows)))
    if path == "final_norm/scale":
        return TensorMap(PREFIX + "norm.weight", (d,))
    found = re.fullmatch(r"block_(\d+)/(.+)", path)
    return block_tensor_map(int(found[1]), found[2], config) if found else None


def block_tensor_map(layer: int, name: str, config: dict) -> TensorMap | None:
    """Block ``layer``'s weight ``name`` (e.g. ``attention/key/kernel``)."""
    d, f, n = config["hidden_dim"], config["intermediate_dim"], config["num_heads"]
    k, h = config["num_key_value_heads"] or n, config.get("head_dim") or d // n
    at = f"{PREFIX}layers.{layer}."
    linear = (Transpose((1, 0)),)  # nn.Linear (out, in) -> (in, out)
    maps = {
        "attention_norm/scale": TensorMap(f"{at}input_layernorm.weight", (d,)),
        "mlp_norm/scale": TensorMap(f"{at}post_attention_layernorm.weight", (d,)),
        "attention/query/kernel": TensorMap(f"{at}self_attn.q_proj.weight", (n * h, d),
                                            steps=linear + (Split(1, (n, h)),)),
        "attention/key/kernel": TensorMap(f"{at}self_attn.k_proj.weight", (k * h, d),
                                          steps=linear + (Split(1, (k, h)),)),
        "attention/value/kernel": TensorMap(f"{at}self_attn.v_proj.weight", (k * h, d),
                                            steps=linear + (Split(1, (k, h)),)),
        "attention/attention_output/kernel": TensorMap(
            f"{at}self_attn.o_proj.weight", (d, n * h), steps=linear + (Split(0, (n, h)),)),
        "mlp/gate/kernel": TensorMap(f"{at}mlp.gate_proj.weight", (f, d), steps=linear),
        "mlp/up/kernel": TensorMap(f"{at}mlp.up_proj.weight", (f, d), steps=linear),
        "mlp/down/kernel": TensorMap(f"{at}mlp.down_proj.weight", (d, f), steps=linear),
    }
    return maps.get(name)
