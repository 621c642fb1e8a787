"""Analytic per-device memory and minimum collective bytes of a training step.

Everything here reads a model through its **cost model** (``kdist.models.base.CostModel``:
``parameters``, ``flops_per_token``, ``activation_bytes_per_token``), so the same code plans
a GPT, a BERT or a user's own family. :func:`cost_model_of` turns what a caller has (a
preset name, a task, a cost model) into one. The mesh search (:mod:`.search`) and the
suggestions (:mod:`.report`) rank candidates with these figures; :mod:`.compile` then
confirms the chosen one on the compiled program.

Example:
    >>> from kdist.planning import estimate
    >>> e = estimate("gpt-nano", {"data": 1, "fsdp": 8, "model": 1}, 16, 256)
    >>> e["optimizer_state"] == 2 * e["parameters"]
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kdist.planning import stages

# Transformer dimensions the tensor-parallel (``model``) axis splits; a cost model that
# states them (through its ``config``) gets model-axis meshes in the search.
SPLIT_BY_MODEL_AXIS = ("num_heads", "num_key_value_heads", "intermediate_dim",
                       "vocabulary_size")
DIMENSIONS = ("hidden_dim", "num_layers", *SPLIT_BY_MODEL_AXIS)


def precision_policy(precision: str) -> str:
    """The Keras dtype policy of a plan's precision name.

    Example:
        >>> precision_policy("bf16"), precision_policy("f32")
        ('mixed_bfloat16', 'float32')
    """
    names = {"f32": "float32", "float32": "float32", "bf16": "mixed_bfloat16",
             "bfloat16": "mixed_bfloat16", "mixed_bfloat16": "mixed_bfloat16"}
    if precision not in names:
        raise ValueError(f"Unknown precision {precision!r}. Use 'float32' (or 'f32') or "
                         f"'bfloat16' (or 'bf16', Keras mixed_bfloat16).")
    return names[precision]


def compute_bytes(precision: str) -> int:
    """Bytes per activation value: 2 under bfloat16 compute, else 4.

    Example:
        >>> compute_bytes("bf16"), compute_bytes("float32")
        (2, 4)
    """
    return 2 if precision in ("bf16", "bfloat16", "mixed_bfloat16") else 4


def preset_backbone_config(preset: str, **overrides) -> dict:
    """The backbone config of any kdist preset (its task's ``backbone_class.presets``),
    with ``overrides`` applied.

    Example:
        >>> preset_backbone_config("gpt-nano", num_layers=2)["num_layers"]
        2
    """
    from kdist.models import task_for_preset
    from kdist.models.presets import preset_config

    return preset_config(task_for_preset(preset).backbone_class.presets, preset, **overrides)


def cost_model_of(model: Any, **overrides) -> Any:
    """The cost model of ``model``: a preset name (its task's ``cost_model_for``), a built
    task (``model.cost_model()``), or a cost model itself. A plain config dict is read as a
    kdist GPT backbone config (the form of ``GPT_PRESETS``' entries, kept for existing
    callers); ``overrides`` replace a preset's or a config's fields.

    Example:
        >>> cost_model_of("gpt-nano").parameters > 0
        True
    """
    if hasattr(model, "activation_bytes_per_token") and hasattr(model, "flops_per_token"):
        return model
    if isinstance(model, str):
        from kdist.models import task_for_preset

        return task_for_preset(model).cost_model_for(preset_backbone_config(model, **overrides))
    if isinstance(model, Mapping):
        from kdist.models import GPTCausalLM

        return GPTCausalLM.cost_model_for({**model, **overrides})
    if callable(getattr(model, "cost_model", None)):
        return model.cost_model()
    raise TypeError(
        f"Cannot read the costs of a {type(model).__name__}: pass a kdist preset name, a task "
        f"with a cost_model() method or a kdist.models.base.CostModel (parameters, "
        f"flops_per_token, activation_bytes_per_token).")


def dimensions(model: Any) -> dict[str, int]:
    """The Transformer dimensions a model states (``hidden_dim``, ``num_layers``,
    ``num_heads``, ...): a preset's or a config dict's own, else its cost model's
    ``config`` or attributes. Empty when it states none: such a model is planned without
    a ``model`` axis (its activation all-reduces cannot be estimated).

    Example:
        >>> dimensions({"hidden_dim": 64, "num_layers": 2, "dropout": 0.1})
        {'hidden_dim': 64, 'num_layers': 2}
    """
    if isinstance(model, str):
        model = preset_backbone_config(model)
    if not isinstance(model, Mapping):
        cost = cost_model_of(model)
        config = getattr(cost, "config", None)
        model = dict(config) if isinstance(config, Mapping) else {
            key: getattr(cost, key) for key in DIMENSIONS if hasattr(cost, key)}
    return {key: model[key] for key in DIMENSIONS
            if isinstance(model.get(key), int) and not isinstance(model[key], bool)
            and model[key] > 0}


def _ring(n: int) -> float:
    return (n - 1) / n


def theoretical_collective_bytes(model: Any, mesh: dict[str, int], global_batch_size: int,
                                 sequence_length: int, compute_bytes: int = 4,
                                 parameter_bytes: int = 4,
                                 gradient_bytes: int | None = None,
                                 context_parallel: str = "all_gather",
                                 activations: bool = True,
                                 pipeline_microbatches: int | None = None,
                                 pipeline_repeats: int = 1) -> dict[str, float]:
    """The minimum ring wire bytes per device per step, by collective kind, for a strategy.

    ``model`` is anything :func:`cost_model_of` reads. With P the parameter bytes, d/f/m
    the data/fsdp/model axis sizes and ``ring(n) = (n-1)/n``:

    * fsdp: all-gather the weights for the forward and again for the backward pass
      (``2 ring(f) P/m``), reduce-scatter the gradients (``ring(f) P/m``);
    * data: all-reduce the (fsdp- and model-sharded) gradients: ``2 ring(d) P/(f m)``;
    * model (Megatron): per layer, all-reduce the activations ``B T D`` after the attention
      output and the MLP down projection in the forward pass, and the input gradients of
      the query/key/value and MLP up projections in the backward pass (4 all-reduces of
      ``2 ring(m) x B_local T D`` bytes), plus the vocabulary-parallel embedding's forward and
      backward all-reduce (2 more), with ``B_local`` the per-replica batch.

    * seq (context parallelism, weights replicated over it): the gradient all-reduce runs
      over ``data x seq``; per layer, the keys and values of ``B_local x T`` tokens
      (``K/m`` key/value heads) cross the axis — ``"all_gather"``: all-gathered forward and
      their gradients reduce-scattered backward (``2 ring(s)`` each); ``"ring"``:
      ``2(s-1)`` blocks of ``T/s`` tokens forward, ``2(s-1)`` again and ``2s`` float32
      gradient blocks backward (:func:`kdist.parallel.context.cost.ring_bytes`), as
      collective-permutes. Tensor parallelism's all-reduces carry ``T/s`` tokens.
    * stage (a pipeline of ``pipeline_microbatches`` and ``pipeline_repeats``): counted by
      :func:`kdist.planning.stages.collectives` — activations between stages
      (``collective-permute``), each stage's weights gathered once (``activations`` does
      not apply).

    ``activations=False`` leaves out the model and seq axes' per-layer activation traffic
    (the weights' and gradients' only). Gradients are reduced in ``gradient_bytes`` per
    value (default: ``parameter_bytes``; 2 with ``gradient_reduction="bfloat16"``). Small
    all-reduces (loss, gradient norm, softmax statistics) are not counted.

    Example:
        >>> c = theoretical_collective_bytes("gpt-nano", {"data": 8}, 16, 256)
        >>> c["all-reduce"] == 2 * 7 / 8 * cost_model_of("gpt-nano").parameters * 4
        True
    """
    cost = cost_model_of(model)
    if mesh.get("stage", 1) > 1:
        dims = dimensions(model)
        return stages.collectives(cost, mesh, global_batch_size, sequence_length,
                                  compute_bytes, dims.get("hidden_dim", 0),
                                  dims.get("num_layers", 0), pipeline_microbatches,
                                  pipeline_repeats, parameter_bytes, gradient_bytes)
    d, f, m = mesh.get("data", 1), mesh.get("fsdp", 1), mesh.get("model", 1)
    s = mesh.get("seq", 1)
    p = cost.parameters * parameter_bytes
    g = cost.parameters * (gradient_bytes or parameter_bytes)
    out = {"all-gather": 2 * _ring(f) * p / m, "reduce-scatter": _ring(f) * g / m,
           "all-reduce": 2 * _ring(d * s) * g / (f * m)}
    local_batch = global_batch_size / (d * f)
    tensor, context = activations and m > 1, activations and s > 1
    if tensor or context:
        dims = dimensions(model)
        if "hidden_dim" not in dims or "num_layers" not in dims or (
                context and "num_heads" not in dims):
            raise ValueError(
                "A model or seq axis needs the model's hidden_dim and num_layers (and, for "
                "seq, num_heads) to estimate its activation traffic; this cost model states "
                "them not (give it a config with them), or plan a mesh without those axes.")
    if tensor:
        activation = local_batch * sequence_length / s * dims["hidden_dim"] * compute_bytes
        out["all-reduce"] += (4 * dims["num_layers"] + 2) * 2 * _ring(m) * activation
    if context:
        for kind, n in _context_bytes(dims, s, m, local_batch, sequence_length, compute_bytes,
                                      context_parallel).items():
            out[kind] = out.get(kind, 0.0) + n
    return {k: v for k, v in out.items() if v > 0}


def _context_bytes(dims, s, m, local_batch, length, value_bytes, variant) -> dict[str, float]:
    """Keys and values crossing the seq axis per step (all layers), by collective kind."""
    heads = dims["num_heads"]
    kv_heads = dims.get("num_key_value_heads") or heads
    width = kv_heads / m * (dims["hidden_dim"] // heads)  # K/m heads of H per token
    layers = dims["num_layers"]
    if variant == "ring":  # kdist.parallel.context.cost.ring_bytes, for every layer
        block = local_batch * length / s * width
        return {"collective-permute": layers * (4 * (s - 1) * block * value_bytes
                                                + 2 * s * block * 4)}
    gathered = local_batch * length * width * value_bytes  # one layer's keys (or values)
    return {"all-gather": layers * 2 * _ring(s) * gathered,
            "reduce-scatter": layers * 2 * _ring(s) * gathered}


def estimate(model: Any, mesh: dict[str, int], global_batch_size: int, sequence_length: int,
             *, precision: str = "float32", remat: bool = False, grad_accum: int = 1,
             context_parallel: str = "all_gather", pipeline_microbatches: int | None = None,
             pipeline_repeats: int = 1) -> dict:
    """Analytic per-device bytes (weights, optimizer, gradients, activations) of a model on
    a mesh. ``model`` is anything :func:`cost_model_of` reads. Weights are float32 (mixed
    precision keeps float32 variables); activations use the compute dtype (the cost
    model's ``activation_bytes_per_token``); gradient accumulation adds a float32
    accumulator per weight. A ``seq`` axis keeps ``1/seq`` of each sequence's tokens per
    device, and no ``T x T`` attention scores (an online softmax: the cost model's bytes at
    length 1, where its only length-dependent term vanishes), plus, with
    ``context_parallel="all_gather"``, every layer's gathered keys and values. A ``stage``
    axis: :func:`kdist.planning.stages.memory` (blocks split over stages, the schedule's
    bubble and buffers, the head on every stage).

    Example:
        >>> e = estimate("gpt2-small", {"data": 1, "fsdp": 8, "model": 1}, 64, 1024)
        >>> e["parameters"] == cost_model_of("gpt2-small").parameters * 4 / 8
        True
    """
    cost = cost_model_of(model)
    if mesh.get("stage", 1) > 1:
        return stages.memory(cost, mesh, global_batch_size, sequence_length,
                             compute_bytes(precision), remat, grad_accum,
                             pipeline_microbatches, pipeline_repeats,
                             dimensions(model).get("hidden_dim"))
    shards = mesh.get("fsdp", 1) * mesh.get("model", 1)
    weights = cost.parameters * 4 / shards
    micro_batch = global_batch_size / grad_accum / (mesh.get("data", 1) * mesh.get("fsdp", 1))
    s, value_bytes = mesh.get("seq", 1), compute_bytes(precision)
    per_token = cost.activation_bytes_per_token(sequence_length if s == 1 else 1, value_bytes,
                                                remat)
    activations = micro_batch * sequence_length / s * per_token / mesh.get("model", 1)
    if s > 1 and context_parallel == "all_gather":
        dims = dimensions(model)
        kv = dims.get("num_key_value_heads") or dims["num_heads"]
        kept = 1 if remat else dims["num_layers"]
        head_dim = dims["hidden_dim"] // dims["num_heads"]
        activations += (kept * micro_batch * sequence_length * 2 * kv / mesh.get("model", 1)
                        * head_dim * value_bytes)
    out = {
        "parameters": weights,
        "optimizer_state": 2 * weights + (weights if grad_accum > 1 else 0),
        "gradients": weights,
        "activations": activations,
    }
    out["total"] = sum(out.values())
    return out
