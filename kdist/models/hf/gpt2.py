"""GPT-2 (``model_type: "gpt2"``) <-> kdist's ``GPTBackbone``: config fields and tensors.

GPT-2 stores its projections as ``Conv1D`` weights, already ``(in, out)`` like Keras: no
transposes. Query, key and value sit side by side in one ``c_attn`` tensor ``(D, 3D)`` and
become three kdist kernels ``(D, N, H)``; the output projection ``c_proj`` ``(D, D)`` becomes
``(N, H, D)``. The token table ``wte`` ``(V, D)`` is padded with zero rows to kdist's
``vocabulary_divisible_by`` multiple (128 by default here, as for kdist's GPT-2 presets:
50257 -> 50304, which also lets the table shard over ``model``); the rows are never an
input and are cut from the logits, and export drops them again. The output head is tied to
``wte`` unless the config says ``tie_word_embeddings: false`` (then ``lm_head.weight``).

Keys are read with or without the ``transformer.`` prefix (``GPT2LMHeadModel`` writes it,
the original ``gpt2`` upload and ``GPT2Model`` do not).

A stacked weight (``scan_layers=True``) maps to every layer's tensor through
:func:`~kdist.models.hf.stacked.stacked_map` and :func:`block_tensor_map`.
"""

from __future__ import annotations

import re

from kdist.models.hf import llama
from kdist.models.hf.stacked import StackedMap, stacked_map
from kdist.models.hf.tensors import Pad, Split, TensorMap, Transpose

MODEL_TYPE = "gpt2"
# Fields every gpt2 config.json has (to tell a mislabelled model_type in an error).
REQUIRED = ("n_embd", "n_layer", "n_head", "vocab_size")
PREFIX = "transformer."
# Stored buffers that are not weights: the causal mask of older checkpoints.
IGNORED = re.compile(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias")
OPTIONAL: tuple[str, ...] = ()

_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
                "gelu": "gelu_exact"}


def backbone_config(hf: dict) -> dict:
    """kdist ``GPTBackbone`` arguments of a GPT-2 ``config.json``; a ``ValueError`` for a
    GPT-2 variant kdist does not compute."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"GPT-2 activation_function {activation!r} is not supported; kdist "
                         f"computes {sorted(_ACTIVATIONS)}.")
    for field, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx",
                             False), ("add_cross_attention", False)):
        if hf.get(field, supported) != supported:
            raise ValueError(f"GPT-2 config {field}={hf[field]!r} is not supported by kdist "
                             f"(it computes {field}={supported}).")
    width = hf["n_embd"]
    return dict(
        vocabulary_size=hf["vocab_size"],
        num_layers=hf["n_layer"],
        num_heads=hf["n_head"],
        hidden_dim=width,
        intermediate_dim=hf.get("n_inner") or 4 * width,
        max_sequence_length=hf["n_positions"],
        position_embedding="learned",
        norm="layer_norm",
        mlp_activation=_ACTIVATIONS[activation],
        use_bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=float(hf.get("resid_pdrop", 0.1)),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        vocabulary_divisible_by=128,
    )


def matches(config: dict) -> list[str]:
    """What keeps a kdist GPT config from being a GPT-2 (empty: it is one)."""
    want = dict(position_embedding="learned", norm="layer_norm", use_bias=True,
                num_key_value_heads=None, fused_qkv=False)
    wrong = [f"{k}={config[k]!r} (GPT-2: {v!r})" for k, v in want.items()
             if config[k] != v and not (k == "num_key_value_heads" and config[k] ==
                                        config["num_heads"])]
    if config["mlp_activation"] not in ("gelu", "gelu_exact"):
        wrong.append(f"mlp_activation={config['mlp_activation']!r} (GPT-2: 'gelu')")
    if config.get("moe"):
        wrong.append("moe=... (GPT-2: a dense MLP)")
    return wrong + llama.attention_differences(config, "GPT-2")


def hf_config(config: dict) -> dict:
    """The ``config.json`` of a kdist GPT-2-style backbone config."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": MODEL_TYPE,
        "vocab_size": config["vocabulary_size"],
        "n_embd": config["hidden_dim"],
        "n_layer": config["num_layers"],
        "n_head": config["num_heads"],
        "n_inner": config["intermediate_dim"],
        "n_positions": config["max_sequence_length"],
        "n_ctx": config["max_sequence_length"],
        "activation_function": "gelu_new" if config["mlp_activation"] == "gelu" else "gelu",
        "layer_norm_epsilon": config["layer_norm_epsilon"],
        "resid_pdrop": config["dropout"],
        "embd_pdrop": config["dropout"],
        "attn_pdrop": 0.0,  # kdist has no attention-probability dropout
        "initializer_range": config["initializer_range"],
        "tie_word_embeddings": config["tie_embeddings"],
        "scale_attn_weights": True,
    }


def tensor_map(path: str, config: dict) -> TensorMap | StackedMap | None:
    """The HF tensor (and steps) a kdist GPT weight path comes from; None if none."""
    stacked = stacked_map(path, config, tensor_map)  # blocks/...: every layer's tensors
    if stacked is not None:
        return stacked
    d, v = config["hidden_dim"], config["vocabulary_size"]
    multiple = config["vocabulary_divisible_by"]
    rows = -(-v // multiple) * multiple  # the token table, padded
    if path == "token_embedding/embeddings":
        return TensorMap(PREFIX + "wte.weight", (v, d), steps=(Pad(0, rows),))
    if path == "token_embedding/reverse_embeddings":
        return TensorMap("lm_head.weight", (v, d), steps=(Transpose((1, 0)), Pad(1, rows)))
    if path == "position_embedding/embeddings":
        return TensorMap(PREFIX + "wpe.weight", (config["max_sequence_length"], d))
    if path in ("final_norm/gamma", "final_norm/beta"):
        return TensorMap(PREFIX + "ln_f." + _PARAM[path.rsplit("/", 1)[1]], (d,))
    found = re.fullmatch(r"block_(\d+)/(.+)", path)
    return block_tensor_map(int(found[1]), found[2], config) if found else None


_PARAM = {"gamma": "weight", "beta": "bias", "kernel": "weight", "bias": "bias"}


def block_tensor_map(layer: int, name: str, config: dict) -> TensorMap | None:
    """Block ``layer``'s weight ``name`` (e.g. ``attention/query/kernel``)."""
    d, f, n = config["hidden_dim"], config["intermediate_dim"], config["num_heads"]
    h = d // n
    at = f"{PREFIX}h.{layer}."
    layer_path, _, param = name.rpartition("/")
    if layer_path in ("attention_norm", "mlp_norm"):
        ln = "ln_1" if layer_path == "attention_norm" else "ln_2"
        return TensorMap(f"{at}{ln}.{_PARAM[param]}", (d,))
    qkv = {"attention/query": 0, "attention/key": 1, "attention/value": 2}
    if layer_path in qkv:
        i = qkv[layer_path]
        if param == "kernel":  # (D, 3D)[:, iD:(i+1)D] -> (D, N, H)
            return TensorMap(f"{at}attn.c_attn.weight", (d, 3 * d),
                             region=((0, d), (i * d, (i + 1) * d)), steps=(Split(1, (n, h)),))
        return TensorMap(f"{at}attn.c_attn.bias", (3 * d,), region=((i * d, (i + 1) * d),),
                         steps=(Split(0, (n, h)),))
    if layer_path == "attention/attention_output":
        if param == "kernel":  # (N*H, D) -> (N, H, D)
            return TensorMap(f"{at}attn.c_proj.weight", (d, d), steps=(Split(0, (n, h)),))
        return TensorMap(f"{at}attn.c_proj.bias", (d,))
    if layer_path == "mlp/up":
        return TensorMap(f"{at}mlp.c_fc.{_PARAM[param]}", (d, f) if param == "kernel" else (f,))
    if layer_path == "mlp/down":
        return TensorMap(f"{at}mlp.c_proj.{_PARAM[param]}", (f, d) if param == "kernel" else (d,))
    return None
