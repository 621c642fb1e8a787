"""Mixtral (``model_type: "mixtral"``) <-> kdist's ``GPTBackbone`` with ``moe=``.

Mixtral is Llama's attention and norms (:mod:`.llama`'s maps) with every MLP replaced by a
sparse MoE block, which is kdist's :class:`~kdist.models.moe.MoEFeedForward` with the
``"softmax"`` router: transformers' ``MixtralTopKRouter`` takes the softmax over all
experts, the top k, and divides them by their sum — kdist's ``route`` step for step.

Tensors, as the Hub's checkpoints store them (and transformers 5's ``save_pretrained``
writes them back from its fused ``gate_up_proj``): per layer ``block_sparse_moe.gate.weight``
``(E, D)`` -> ``moe/router`` ``(D, E)``; per expert ``j`` the ``nn.Linear`` weights
``experts.j.w1`` (gate) and ``w3`` (up) ``(F, D)`` and ``w2`` (down) ``(D, F)``, each
transposed into row ``j`` of kdist's stacked ``moe/gate``, ``moe/up`` ``(E, D, F)`` and
``moe/down`` ``(E, F, D)``. The stacked expert weight is a
:class:`~kdist.models.hf.stacked.StackedMap` over experts (as a ``scan_layers`` stack is
over layers), so under an ``expert`` mesh axis each device reads only its own experts.

Training-only fields: transformers adds ``router_aux_loss_coef`` times its balance loss
only with ``output_router_logits``, and computes that loss once over every layer's tokens
(the scale of one layer's); kdist adds each MoE layer's, so the coefficient is divided by
the number of layers (0 without ``output_router_logits``); Mixtral has no z-loss (0).
"""

from __future__ import annotations

import re
import warnings

from kdist.models.hf import llama
from kdist.models.hf.stacked import StackedMap, stacked_map
from kdist.models.hf.tensors import TensorMap, Transpose
from kdist.models.moe import MOE_DEFAULTS

MODEL_TYPE = "mixtral"
REQUIRED = ("hidden_size", "num_hidden_layers", "num_local_experts", "num_experts_per_tok")
PREFIX = llama.PREFIX
IGNORED = llama.IGNORED
OPTIONAL: tuple[str, ...] = ()
# A MoE layer's load statistics (kdist.models.moe): variables, not weights of the model.
STATISTICS = re.compile(r"(.*/)?moe/(expert_load|dropped_tokens)")
_MOE = "block_sparse_moe."
_EXPERT_TENSORS = {"gate": "w1", "up": "w3", "down": "w2"}


def backbone_config(hf: dict) -> dict:
    """kdist ``GPTBackbone`` arguments of a Mixtral ``config.json``."""
    config = llama.backbone_config(hf, name="Mixtral")
    window = hf.get("sliding_window")
    if window is not None and window < config["max_sequence_length"]:
        raise ValueError(f"Mixtral sliding_window={window} (below max_position_embeddings="
                         f"{config['max_sequence_length']}) is not supported: kdist's "
                         f"attention is full causal attention. Mixtral 8x7B/8x22B set "
                         f"sliding_window: null.")
    if hf.get("router_jitter_noise"):
        # Only transformers' training multiplies the MoE input by this noise; the function
        # a checkpoint computes is the same, so loading stays allowed.
        warnings.warn(f"Mixtral router_jitter_noise={hf['router_jitter_noise']} is not "
                      f"applied by kdist (transformers applies it in training only): "
                      f"inference is identical, fine-tuning runs without the noise.",
                      stacklevel=2)
    layers = config["num_layers"]
    coefficient = float(hf.get("router_aux_loss_coef", 0.001))
    config["moe"] = dict(
        num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
        router="softmax", aux_loss_weight=(coefficient / layers if
                                           hf.get("output_router_logits") else 0.0),
        z_loss_weight=0.0)
    return config


def full_moe(config: dict) -> dict:
    """The backbone config's ``moe`` dict with kdist's defaults filled in (a config given
    by hand may leave them out)."""
    moe = {**MOE_DEFAULTS, **config["moe"]}
    return {**moe, "expert_dim": moe["expert_dim"] or config["intermediate_dim"]}


def matches(config: dict) -> list[str]:
    """What keeps a kdist GPT config from being a Mixtral (empty: it is one)."""
    wrong = llama.matches({**config, "moe": None})
    if not config.get("moe"):
        return wrong + ["moe=None (Mixtral: routed experts)"]
    moe = full_moe(config)
    want = dict(router="softmax", shared_experts=0, every=1, renormalize=True, routed_scale=1.0,
                activation="swiglu")
    return wrong + [f"moe['{k}']={moe[k]!r} (Mixtral: {v!r})" for k, v in want.items()
                    if moe[k] != v]


def hf_config(config: dict) -> dict:
    """The ``config.json`` of a kdist Mixtral-style backbone config."""
    moe, layers = full_moe(config), config["num_layers"]
    hf = llama.hf_config(config)
    for key in ("mlp_bias", "pretraining_tp", "attention_bias"):  # not Mixtral fields
        hf.pop(key)
    coefficient = float(f"{moe['aux_loss_weight'] * layers:.12g}")  # (kdist's is per layer)
    return {**hf, "architectures": ["MixtralForCausalLM"], "model_type": MODEL_TYPE,
            "intermediate_size": moe["expert_dim"], "num_local_experts": moe["num_experts"],
            "num_experts_per_tok": moe["experts_per_token"], "sliding_window": None,
            "router_jitter_noise": 0.0, "router_aux_loss_coef": coefficient,
            "output_router_logits": coefficient > 0}


def tensor_map(path: str, config: dict) -> TensorMap | StackedMap | None:
    """The HF tensor(s) a kdist Mixtral-style GPT weight path comes from."""
    stacked = stacked_map(path, config, tensor_map)  # blocks/...: every layer's tensors
    if stacked is not None:
        return stacked
    found = re.fullmatch(r"block_(\d+)/moe/(.+)", path)
    if not found:
        return llama.tensor_map(path, config)
    return expert_tensor_map(f"{PREFIX}layers.{found[1]}.{_MOE}", found[2], config,
                             _EXPERT_TENSORS)


def expert_tensor_map(at: str, name: str, config: dict,
                      expert_names: dict[str, str]) -> TensorMap | StackedMap | None:
    """A MoE layer's weight ``name`` (``router``, ``gate``, ``up``, ``down``) from the
    tensors under ``at``: the router ``at + "gate.weight"``, expert ``j``'s
    ``at + "experts.j.<expert_names[name]>.weight"`` (Mixtral's ``w1``, Qwen3-MoE's
    ``gate_proj``...), stacked over the experts."""
    moe = full_moe(config)
    d, f, e = config["hidden_dim"], moe["expert_dim"], moe["num_experts"]
    linear = (Transpose((1, 0)),)  # nn.Linear (out, in) -> (in, out)
    if name == "router":
        return TensorMap(at + "gate.weight", (e, d), steps=linear)
    if name not in expert_names:
        return None
    shape = (d, f) if name == "down" else (f, d)
    return StackedMap(tuple(TensorMap(f"{at}experts.{j}.{expert_names[name]}.weight", shape,
                                      steps=linear) for j in range(e)))
