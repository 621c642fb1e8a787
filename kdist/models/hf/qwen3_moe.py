"""Qwen3-MoE (``model_type: "qwen3_moe"``, ``Qwen3MoeForCausalLM``) <-> kdist's
``GPTBackbone`` with ``moe=``, ``qk_norm=True`` and its own ``head_dim``.

Qwen3-MoE is Llama's blocks (:mod:`.llama`'s maps: projections, norms, RoPE, a dense
SwiGLU MLP where a block has no experts) with three differences, each a kdist option:

* ``head_dim`` need not be ``hidden_size / num_attention_heads`` (Qwen3-30B-A3B: 128 at
  2048 wide with 32 heads): kdist's ``head_dim=``.
* ``q_norm`` / ``k_norm``: an RMSNorm ``(head_dim,)`` over every query and key head after
  the projections and before RoPE: kdist's ``qk_norm=True`` (weights
  ``attention/query_norm/scale``, ``attention/key_norm/scale``), epsilon ``rms_norm_eps``.
* the MoE block (``mlp.gate.weight`` ``(E, D)``; per expert ``mlp.experts.j.gate_proj``,
  ``up_proj`` ``(F, D)``, ``down_proj`` ``(D, F)``, as the Hub's checkpoints and
  transformers 5's ``save_pretrained`` store them) is kdist's :class:`MoEFeedForward`
  with the ``"softmax"`` router: softmax over all experts, the top k, divided by their
  sum only when ``norm_topk_prob`` is true (kdist's ``moe["renormalize"]``).

Which blocks have experts: transformers makes block ``i`` sparse when ``(i + 1) %
decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers`` — kdist's
``moe["every"]``, the dense blocks' width ``intermediate_size`` (``intermediate_dim``),
the experts' ``moe_intermediate_size`` (``moe["expert_dim"]``). An ``mlp_only_layers``
that makes a block dense that ``every`` would not is refused (kdist has no per-layer list).
The balance loss's ``router_aux_loss_coef`` is mapped as Mixtral's (:mod:`.mixtral`), over
the MoE blocks; Qwen3-MoE has no shared expert and no z-loss.

Example:
    >>> hf = dict(vocab_size=304, hidden_size=64, intermediate_size=96, head_dim=24,
    ...           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    ...           rms_norm_eps=1e-6, moe_intermediate_size=48, num_experts=4,
    ...           num_experts_per_tok=2, norm_topk_prob=True)
    >>> config = backbone_config(hf)
    >>> config["head_dim"], config["qk_norm"], config["moe"]["expert_dim"]
    (24, True, 48)
"""

from __future__ import annotations

import re

from kdist.models.hf import llama, mixtral
from kdist.models.hf.stacked import StackedMap, stacked_map
from kdist.models.hf.tensors import TensorMap

MODEL_TYPE = "qwen3_moe"
NAME = "Qwen3-MoE"
REQUIRED = ("hidden_size", "num_hidden_layers", "moe_intermediate_size",
            "num_experts_per_tok")
PREFIX = llama.PREFIX
IGNORED = llama.IGNORED
OPTIONAL: tuple[str, ...] = ()
STATISTICS = mixtral.STATISTICS
_EXPERT_TENSORS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _sparse_layers(layers: int, every: int, dense: tuple[int, ...] = ()) -> list[int]:
    """The blocks transformers gives experts (``Qwen3MoeDecoderLayer``)."""
    return [i for i in range(layers) if (i + 1) % every == 0 and i not in dense]


def backbone_config(hf: dict) -> dict:
    """kdist ``GPTBackbone`` arguments of a Qwen3-MoE ``config.json``."""
    config = llama.backbone_config(hf, name=NAME, free_head_dim=True)
    layers, max_length = config["num_layers"], config["max_sequence_length"]
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") and window is not None and window < max_length:
        raise ValueError(f"{NAME} use_sliding_window with sliding_window={window} (below "
                         f"max_position_embeddings={max_length}) is not supported: kdist's "
                         f"attention is full causal attention. Qwen3-MoE checkpoints set "
                         f"use_sliding_window: false.")
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or width // heads
    if hf.get("head_dim") is None and width % heads:
        raise ValueError(f"{NAME} config has no head_dim and hidden_size={width} does not "
                         f"divide by num_attention_heads={heads}; add head_dim.")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"{NAME} config.json has neither num_experts nor num_local_experts; "
                         f"add the checkpoint's expert count (the number of "
                         f"mlp.experts.<j> per layer).")
    if not experts:
        raise ValueError(f"{NAME} num_experts={experts!r}: a model without experts is a dense "
                         f"Qwen3 (model_type 'qwen3'), which kdist does not load yet.")
    every = hf.get("decoder_sparse_step", 1)
    if not isinstance(every, int) or not 1 <= every <= layers:
        raise ValueError(f"{NAME} decoder_sparse_step={every!r} must be an int in [1, "
                         f"num_hidden_layers={layers}] (kdist's moe['every']).")
    dense = tuple(hf.get("mlp_only_layers") or ())
    if _sparse_layers(layers, every, dense) != _sparse_layers(layers, every):
        raise ValueError(f"{NAME} mlp_only_layers={list(dense)} makes blocks dense that "
                         f"decoder_sparse_step={every} gives experts; kdist's moe['every'] "
                         f"chooses MoE blocks by period only, so this checkpoint cannot be "
                         f"loaded. (Entries naming blocks the step leaves dense are accepted.)")
    moe_layers = len(_sparse_layers(layers, every))
    coefficient = float(hf.get("router_aux_loss_coef", 0.001))
    config.update(
        head_dim=None if head_dim * heads == width else head_dim,
        qk_norm=True,
        moe=dict(num_experts=experts, experts_per_token=hf["num_experts_per_tok"],
                 expert_dim=hf["moe_intermediate_size"], every=every, router="softmax",
                 renormalize=bool(hf.get("norm_topk_prob", False)),
                 aux_loss_weight=(coefficient / moe_layers if hf.get("output_router_logits")
                                  else 0.0),
                 z_loss_weight=0.0))
    return config


def matches(config: dict) -> list[str]:
    """What keeps a kdist GPT config from being a Qwen3-MoE (empty: it is one)."""
    wrong = llama.matches({**config, "moe": None, "head_dim": None, "qk_norm": False})
    if not config.get("qk_norm"):
        wrong.append(f"qk_norm=False ({NAME}: query/key norms)")
    if not config.get("moe"):
        return wrong + [f"moe=None ({NAME}: routed experts)"]
    moe = mixtral.full_moe(config)
    want = dict(router="softmax", shared_experts=0, routed_scale=1.0, activation="swiglu")
    return wrong + [f"moe['{k}']={moe[k]!r} ({NAME}: {v!r})" for k, v in want.items()
                    if moe[k] != v]


def hf_config(config: dict) -> dict:
    """The ``config.json`` of a kdist Qwen3-MoE-style backbone config."""
    moe, layers = mixtral.full_moe(config), config["num_layers"]
    hf = llama.hf_config(config)
    for key in ("mlp_bias", "pretraining_tp"):  # not Qwen3-MoE fields
        hf.pop(key)
    moe_layers = len(_sparse_layers(layers, moe["every"]))
    coefficient = float(f"{moe['aux_loss_weight'] * moe_layers:.12g}")  # kdist's: per layer
    return {**hf, "architectures": ["Qwen3MoeForCausalLM"], "model_type": MODEL_TYPE,
            "head_dim": config.get("head_dim") or config["hidden_dim"] // config["num_heads"],
            "intermediate_size": config["intermediate_dim"],
            "moe_intermediate_size": moe["expert_dim"], "num_experts": moe["num_experts"],
            "num_experts_per_tok": moe["experts_per_token"],
            "norm_topk_prob": moe["renormalize"], "decoder_sparse_step": moe["every"],
            "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": layers, "router_aux_loss_coef": coefficient,
            "output_router_logits": coefficient > 0}


def tensor_map(path: str, config: dict) -> TensorMap | StackedMap | None:
    """The HF tensor(s) a kdist Qwen3-MoE-style GPT weight path comes from."""
    stacked = stacked_map(path, config, tensor_map)  # blocks/...: every layer's tensors
    if stacked is not None:
        return stacked
    found = re.fullmatch(r"block_(\d+)/(.+)", path)
    if not found:
        return llama.tensor_map(path, config)
    at, name = f"{PREFIX}layers.{found[1]}.", found[2]
    norm = re.fullmatch(r"attention/(query|key)_norm/scale", name)
    if norm:
        h = config.get("head_dim") or config["hidden_dim"] // config["num_heads"]
        return TensorMap(f"{at}self_attn.{norm[1][0]}_norm.weight", (h,))
    if name.startswith("moe/"):
        return mixtral.expert_tensor_map(at + "mlp.", name[4:], config, _EXPERT_TENSORS)
    return llama.block_tensor_map(int(found[1]), name, config)
