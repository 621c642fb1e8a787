"""Analytic per-device memory and minimum collective bytes of a training step.

Everything here reads a model through its **cost model** (``kdist.models.cost.CostModel``:
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

import dataclasses
from collections.abc import Mapping
from typing import Any

from kdist.parallel.config import Parallelism
from kdist.planning import experts, stages, traffic

# Transformer dimensions the tensor-parallel (``model``) axis splits; a cost model that
# states them (through its ``config``) gets model-axis meshes in the search.
SPLIT_BY_MODEL_AXIS = ("num_heads", "num_key_value_heads", "intermediate_dim",
                       "vocabulary_size")
DIMENSIONS = ("hidden_dim", "num_layers", *SPLIT_BY_MODEL_AXIS)
# Bytes per gradient value a distribution's gradient_reduction sends (None: the weights').
GRADIENT_BYTES = {"bfloat16": 2, "float8": 1, "int8": 1}


def planned(mesh: Mapping[str, int] | Parallelism, settings: dict) -> Parallelism:
    """The settings a figure is of, as one object: ``mesh`` itself when it is a
    :class:`~kdist.parallel.config.Parallelism` (then no ``settings``), else the axis sizes
    ``mesh`` with ``settings`` — :meth:`~kdist.parallel.config.Parallelism.build`'s
    keywords — unchecked (:meth:`~kdist.parallel.config.Parallelism.unchecked`: a figure
    may be asked of a mesh the distribution refuses).

    Example:
        >>> planned({"stage": 2, "data": 4}, {"pipeline_microbatches": 8}).microbatches
        8
    """
    if isinstance(mesh, Parallelism):
        if settings:
            raise TypeError(f"{', '.join(sorted(settings))} given with a Parallelism, which "
                            f"holds every setting: pass the Parallelism alone, or a mesh "
                            f"dict with the settings.")
        return mesh
    return Parallelism.unchecked(mesh, **settings)


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
        f"with a cost_model() method or a kdist.models.cost.CostModel (parameters, "
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


def theoretical_collective_bytes(model: Any, mesh: Mapping[str, int] | Parallelism,
                                 global_batch_size: int, sequence_length: int,
                                 compute_bytes: int = 4, parameter_bytes: int = 4,
                                 gradient_bytes: int | None = None, *,
                                 activations: bool = True, **settings) -> dict[str, float]:
    """The minimum ring wire bytes per device per step, by collective kind, for a strategy:
    :func:`collective_terms` summed per kind (its arguments; per axis:
    :func:`kdist.planning.traffic.by_axis` of the same terms).

    Example:
        >>> c = theoretical_collective_bytes("gpt-nano", {"data": 8}, 16, 256)
        >>> c["all-reduce"] == 2 * 7 / 8 * cost_model_of("gpt-nano").parameters * 4
        True
    """
    return traffic.by_kind(collective_terms(
        model, mesh, global_batch_size, sequence_length, compute_bytes, parameter_bytes,
        gradient_bytes, activations=activations, **settings))


def collective_terms(model: Any, mesh: Mapping[str, int] | Parallelism,
                     global_batch_size: int, sequence_length: int, compute_bytes: int = 4,
                     parameter_bytes: int = 4, gradient_bytes: int | None = None, *,
                     activations: bool = True, **settings) -> list[traffic.Traffic]:
    """The minimum ring wire bytes per device per step of a strategy, one
    :class:`~kdist.planning.traffic.Traffic` term (kind, axes, bytes) per collective.

    ``model`` is anything :func:`cost_model_of` reads; ``mesh`` a
    :class:`~kdist.parallel.config.Parallelism`, or axis sizes with the distribution's
    ``settings`` (:func:`planned`: ``context_parallel``, ``pipeline_microbatches``,
    ``pipeline_repeats``, ``pipeline_schedule``, ``sync_every``, ``gradient_reduction``);
    ``global_batch_size`` the sequences of one (micro-)step over all groups. With P the
    parameter bytes, r/d/f/s/m the replica/data/fsdp/seq/model axis sizes and
    ``ring(n) = (n-1)/n``:

    * fsdp: all-gather the weights for the forward and again for the backward pass
      (``2 ring(f) P/m``), reduce-scatter the gradients (``ring(f) P/m``);
    * data (and seq, whose devices hold whole weights too): all-reduce the (fsdp- and
      model-sharded) gradients over ``data x seq``: ``2 ring(d s) P/(f m)``;
    * model (Megatron): per layer, all-reduce the activations ``B T D`` after the attention
      output and the MLP down projection in the forward pass, and the input gradients of
      the query/key/value and MLP up projections in the backward pass (4 all-reduces of
      ``2 ring(m) x B_local T/s D`` bytes), plus the vocabulary-parallel embedding's forward
      and backward all-reduce (2 more), with ``B_local`` the per-replica batch;
    * seq (context parallelism): per layer, the keys and values of ``B_local x T`` tokens
      (``K/m`` key/value heads) cross the axis — ``"all_gather"``: all-gathered forward and
      their gradients reduce-scattered backward (``2 ring(s)`` each); ``"ring"``:
      ``2(s-1)`` blocks of ``T/s`` tokens forward, ``2(s-1)`` again and ``2s`` float32
      gradient blocks backward (:func:`kdist.parallel.context.cost.ring_bytes`), as
      collective-permutes;
    * expert (a Mixture of Experts, :mod:`kdist.planning.experts`): it splits the batch as
      data does and the routed experts' weights ``P_e`` (``1/e`` of them per device): the
      other weights' gradients are all-reduced over ``data x expert x seq``
      (``2 ring(d e s) (P - P_e)/(f m)``), the experts' over ``data x seq`` only
      (``2 ring(d s) P_e/(e f m)``); fsdp gathers ``(P - P_e) + P_e/e``; and per MoE layer
      the ``(E, C, D)`` dispatch buffer of a device's ``n = B_local T`` tokens crosses the
      axis four times (dispatch and combine, forward and backward):
      ``4 ring(e) E C D`` value bytes, ``C = n k`` for a dropless layer, ``ceil(c n k /
      E)`` with a capacity factor c (counted with the activations: each layer waits);
      with a ``model`` axis, the experts' rows ``R = E C`` all-reduced over it in place
      of the dense MLP's tokens (:func:`kdist.planning.experts.model_axis_terms`);
    * stage (a pipeline of ``pipeline_microbatches`` and ``pipeline_repeats``):
      :func:`kdist.planning.stages.collective_terms` — activations between stages
      (``collective-permute``), each stage's weights gathered once, the seq axis's keys
      and values for every iteration of the stage's blocks;
    * replica (DiLoCo groups, ``sync_every`` = H): each group's batch is ``B / r``; every H
      steps the float32 outer gradient of a device's weight shard is all-reduced across
      groups: ``2 ring(r) P_device / H`` per step. Nothing else crosses groups.

    ``activations=False`` leaves out the model and seq axes' per-layer activation traffic
    (the weights' and gradients' only). Gradients are reduced in ``gradient_bytes`` per
    value (default: :data:`GRADIENT_BYTES` of the ``gradient_reduction``, else
    ``parameter_bytes``: 2 with ``gradient_reduction="bfloat16"``). Small
    all-reduces (loss, gradient norm, softmax statistics) are not counted.

    Example:
        >>> [t.axes for t in collective_terms("gpt-nano", {"data": 2, "seq": 2}, 4, 64)]
        [('data', 'seq'), ('seq',), ('seq',)]
    """
    config = planned(mesh, settings)
    mesh, cost = config.mesh, cost_model_of(model)
    r = mesh["replica"]
    if r > 1 and not config.sync_every:
        raise ValueError(f"A 'replica' axis of {r} groups trains with DiLoCo and needs "
                         f"sync_every (the steps between syncs) to count its traffic.")
    gradient_bytes = gradient_bytes or GRADIENT_BYTES.get(config.gradients.reduction)
    group_batch = global_batch_size / r
    dims = dimensions(model)
    if mesh["stage"] > 1:
        terms = stages.collective_terms(
            cost, mesh, group_batch, sequence_length, compute_bytes, dims,
            config.microbatches, config.repeats, parameter_bytes, gradient_bytes,
            config.context_variant, activations, config.schedule)
    else:
        terms = _terms(cost, dims, mesh, group_batch, sequence_length, compute_bytes,
                       parameter_bytes, gradient_bytes, config.context_variant, activations)
    if r > 1:
        one_group = dataclasses.replace(config, sizes=tuple({**mesh, "replica": 1}.items()))
        held = estimate(cost, one_group, group_batch, sequence_length)["parameters"]
        terms.append(traffic.Traffic("all-reduce", ("replica",),
                                     2 * _ring(r) * held / config.sync_every))
    return [t for t in terms if t.bytes > 0]


def _terms(cost, dims, mesh, batch, length, value_bytes, parameter_bytes, gradient_bytes,
           context_parallel, activations) -> list[traffic.Traffic]:
    """:func:`collective_terms` of one replica group without a pipeline."""
    d, f, m = mesh.get("data", 1), mesh.get("fsdp", 1), mesh.get("model", 1)
    s, e = mesh.get("seq", 1), mesh.get("expert", 1)
    routed = experts.routed_parameters(cost)
    # Per device: every weight's 1/(f m), the routed experts' 1/(e f m) (experts.py).
    held = experts.weight_values(cost, mesh) * f * m  # fsdp gathers the model shard
    p, g = held * parameter_bytes, held * (gradient_bytes or parameter_bytes)
    dense_g = (cost.parameters - routed) * (gradient_bytes or parameter_bytes)
    routed_g = routed / e * (gradient_bytes or parameter_bytes)
    terms = [traffic.Traffic("all-gather", ("fsdp",), 2 * _ring(f) * p / m),
             traffic.Traffic("reduce-scatter", ("fsdp",), _ring(f) * g / m),
             # expert splits the batch as data does: the other weights' gradients are
             # summed over it too, the routed experts' (split over it) are not.
             traffic.Traffic("all-reduce", ("data", "expert", "seq") if e > 1 else
                             ("data", "seq"),
                             2 * _ring(d * e * s) * dense_g / (f * m)),
             traffic.Traffic("all-reduce", ("data", "seq"),
                             2 * _ring(d * s) * routed_g / (f * m))]
    local_batch = batch / (d * f * e)
    traffic.needs_dimensions(dims, mesh, activations)
    if activations and m > 1:
        activation = local_batch * length / s * dims["hidden_dim"] * value_bytes
        terms.append(traffic.Traffic("all-reduce", ("model",), (4 * dims["num_layers"] + 2)
                                     * 2 * _ring(m) * activation))
    if activations and s > 1:
        terms += traffic.context_terms(dims, s, m, local_batch, length, value_bytes,
                                       context_parallel)
    if activations:
        terms += experts.all_to_all_terms(cost, mesh, local_batch * length / s, value_bytes)
        terms += experts.model_axis_terms(cost, mesh, local_batch * length / s, value_bytes)
    return terms


def estimate(model: Any, mesh: Mapping[str, int] | Parallelism, global_batch_size: int,
             sequence_length: int, *, precision: str = "float32", remat: bool = False,
             grad_accum: int = 1, **settings) -> dict:
    """Analytic per-device bytes (weights, optimizer, gradients, activations) of a model on a
    mesh. ``model`` is anything :func:`cost_model_of` reads; ``mesh`` a
    :class:`~kdist.parallel.config.Parallelism`, or axis sizes with the distribution's
    ``settings`` (:func:`planned`: ``context_parallel``, ``pipeline_microbatches``,
    ``pipeline_repeats``, ``pipeline_schedule``). Weights are float32 (mixed
    precision keeps float32 variables); activations use the compute dtype (the cost model's
    ``activation_bytes_per_token``); gradient accumulation adds a float32 accumulator per
    weight. A ``seq`` axis keeps ``1/seq`` of each sequence's tokens per device, and no
    ``T x T`` attention scores (an online softmax: the cost model's bytes at length 1,
    where its only length-dependent term vanishes), plus, with
    ``context_parallel="all_gather"``, every layer's gathered keys and values. A ``stage``
    axis: :func:`kdist.planning.stages.memory` (blocks split over stages, the schedule's
    bubble and buffers, the head on every stage; under a ``pipeline_schedule`` other than
    GPipe the inputs of the microbatches in flight and one microbatch's recomputed
    blocks). A ``replica`` axis (DiLoCo groups): each group trains on ``1/r`` of the
    batch and a device holds, beside the outer weights and its inner optimizer's state,
    its group's weights, the outer momentum and (in the sync step) the outer gradient:
    ``replica_groups``, 3 x its weight shard (the compiled ``replica=2,data=4`` gpt-nano
    step: optimizer state 4.0 x, temporaries +0.98 x the weights against ``data=8``). An
    ``expert`` axis (a Mixture of Experts) splits the batch as ``data`` does and the
    routed experts' weights, gradients and Adam state ``e`` ways more (``P_e/(e f m)``
    beside ``(P - P_e)/(f m)``); the MoE layers' dispatch buffers and per-expert
    activations replace the dense MLP's the cost model counted
    (:func:`kdist.planning.experts.activation_bytes`; the compiled ``expert=2,data=4``
    gpt-nano-moe step of 2 layers, batch 16 x 64: 78.01 MiB estimated, 77.94 MiB
    compiled), and under ``fsdp`` the experts' weights and gradients held whole in their
    region (:func:`kdist.planning.experts.gathered_bytes`); with kdist's
    ``gradient_reduction``, the experts' gradient a second time
    (:func:`kdist.planning.experts.padded_gradient_bytes`).

    Example:
        >>> e = estimate("gpt2-small", {"data": 1, "fsdp": 8, "model": 1}, 64, 1024)
        >>> e["parameters"] == cost_model_of("gpt2-small").parameters * 4 / 8
        True
        >>> d = estimate("gpt2-small", {"replica": 2, "fsdp": 4}, 64, 1024)
        >>> d["replica_groups"] == 3 * d["parameters"]
        True
    """
    config = planned(mesh, settings)
    mesh, cost = config.mesh, cost_model_of(model)
    r = mesh["replica"]
    group_batch = global_batch_size / r
    if mesh["stage"] > 1:
        out = stages.memory(cost, mesh, group_batch, sequence_length, compute_bytes(precision),
                            remat, grad_accum, config.microbatches, config.repeats,
                            dimensions(model), config.context_variant, config.schedule)
    else:
        out = _memory(cost, dimensions(model), mesh, group_batch, sequence_length, precision,
                      remat, grad_accum, config.context_variant)
    if r > 1:
        out["replica_groups"] = 3 * out["parameters"]
    if mesh["stage"] == 1:  # kdist's per-device loss pads the experts (experts.py)
        out["activations"] += experts.padded_gradient_bytes(cost, mesh,
                                                            config.gradients.reduction)
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def _memory(cost, dims, mesh, batch, length, precision, remat, grad_accum,
            context_parallel) -> dict[str, float]:
    """:func:`estimate` of one replica group without a pipeline."""
    from kdist import accelerators

    weights = experts.weight_values(cost, mesh) * 4
    micro_batch = batch / grad_accum / (mesh.get("data", 1) * mesh.get("fsdp", 1)
                                        * mesh.get("expert", 1))
    s, value_bytes = mesh.get("seq", 1), compute_bytes(precision)
    # For a TPU (the target device: kdist.accelerators.target), what its compiler keeps:
    # element-wise work fused (GPTCostModel's ``fused``), splash attention's statistics.
    fused = accelerators.target().platform == "tpu"
    extra = {}
    if fused and s == 1 and hasattr(cost, "config"):
        extra = {"fused": True, "scores_kept": accelerators.defaults.attention_keeps_scores(
            cost.config, length)}
    per_token = cost.activation_bytes_per_token(length if s == 1 else 1, value_bytes, remat,
                                                **extra)
    activations = micro_batch * length / s * per_token / mesh.get("model", 1)
    if s > 1 and context_parallel == "all_gather":
        activations += traffic.gathered_kv_bytes(dims, micro_batch, length, mesh.get("model", 1),
                                         value_bytes, 1 if remat else dims["num_layers"])
    activations += experts.activation_bytes(cost, micro_batch * length / s, value_bytes,
                                            remat, mesh.get("expert", 1), mesh.get("model", 1))
    activations += experts.gathered_bytes(cost, mesh)  # the experts' region under fsdp
    if extra and value_bytes < 4 and cost.config.get("scan_layers"):
        # A TPU's compiler casts a scanned stack's weights to the compute dtype once, before
        # its loops, and keeps that copy through both (GPTCostModel: 0.16 GiB at gpt2-small).
        activations += value_bytes * getattr(cost, "stacked_parameters", 0) / (
            mesh.get("fsdp", 1) * mesh.get("model", 1))
    return {
        "parameters": weights,
        "optimizer_state": 2 * weights + (weights if grad_accum > 1 else 0),
        # A TPU's compiler consumes each gradient as the backward pass makes it (its
        # temporaries measured as activations and logits alone: GPTCostModel's ``fused``).
        "gradients": 0.0 if extra else weights,
        "activations": activations,
    }
