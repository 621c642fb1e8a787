"""Choosing a mesh: every (data, fsdp, expert, seq, model) mesh a model and batch allow
(``expert`` for a Mixture-of-Experts model only) — in each
pipeline stage too, and in each DiLoCo replica group — ranked by the analytic memory and
communication of :mod:`.estimate`, bytes between hosts weighed by :mod:`.traffic`
(``--mesh auto``). Meshes are full axis dicts (:func:`kdist.parallel.mesh.full_mesh`); axes
not searched have size 1.

Example:
    >>> from kdist.planning import choose_mesh
    >>> mesh_spec(choose_mesh("gpt-nano", 8, 2**34, 16, 256)[0])
    'data=8'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from kdist.parallel.config import Parallelism
from kdist.parallel.mesh import full_mesh, mesh_spec
from kdist.parallel.pipeline.settings import bubble_fraction
from kdist.planning import traffic
from kdist.planning.estimate import (
    SPLIT_BY_MODEL_AXIS,
    collective_terms,
    compute_bytes,
    cost_model_of,
    dimensions,
    estimate,
    planned,
)
from kdist.planning.experts import expert_sizes
from kdist.planning.traffic import HOST_LINK_SLOWDOWN
from kdist.planning.units import USABLE_FRACTION, format_bytes


def mesh_devices(spec: str, available: int) -> int:
    """Devices a mesh spec asks for: the product of its sizes, or all if one is -1 (or the
    spec is ``auto`` or a strategy shorthand).

    Example:
        >>> mesh_devices("data=2,model=2", 8), mesh_devices("fsdp=-1", 8), mesh_devices("auto", 8)
        (4, 8, 8)
    """
    sizes = [part.partition("=")[2].strip() for part in spec.split(",")]
    if spec.strip().lower() in ("auto", "dp", "fsdp", "tp") or "-1" in sizes:
        return available
    try:
        return math.prod(int(s) for s in sizes)
    except ValueError:
        return available  # parse_mesh explains what is wrong


# What a 'model' axis splits in every kdist family (the vocabulary too, but GPT pads it).
MODEL_AXIS_SPLITS = ("num_heads", "num_key_value_heads", "intermediate_dim")


def model_axis_sizes(num_devices: int, model: Any) -> list[int]:
    """The ``model`` axis sizes a mesh over ``num_devices`` can have for ``model``: those
    that divide the device count and every dimension the axis splits.

    Example:
        >>> model_axis_sizes(8, {"num_heads": 12, "intermediate_dim": 3072})
        [1, 2, 4]
    """
    dims = dimensions(model) if not isinstance(model, Mapping) else {
        k: v for k, v in model.items() if isinstance(v, int)}
    return [m for m in range(1, num_devices + 1) if num_devices % m == 0
            and all(dims[k] % m == 0 for k in MODEL_AXIS_SPLITS if dims.get(k))]


def check_model_axis(mesh: Mapping[str, int], model: Any, num_devices: int) -> None:
    """A ``ValueError`` before anything is built when the mesh's ``model`` axis does not
    divide a dimension it splits, naming the sizes that would work on these devices (not
    merely the dimension's divisors: 3, 6 or 12 cannot be a mesh axis over 8 devices).

    Example:
        >>> check_model_axis({"model": 8}, {"num_heads": 12}, 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: num_heads=12 does not divide by the 'model' mesh axis of size 8. ...
    """
    size = mesh.get("model", 1)
    dims = dimensions(model) if not isinstance(model, Mapping) else dict(model)
    wrong = [f"{k}={dims[k]}" for k in MODEL_AXIS_SPLITS
             if isinstance(dims.get(k), int) and dims[k] % size]
    if size > 1 and wrong:
        sizes = model_axis_sizes(num_devices, dims)
        raise ValueError(
            f"{', '.join(wrong)} does not divide by the 'model' mesh axis of size {size}. "
            f"Over {num_devices} devices the 'model' axis can be "
            f"{', '.join(map(str, sizes))} for this model; put the other devices on fsdp "
            f"or data (e.g. 'model={sizes[-1]},fsdp=-1').")


def candidate_meshes(num_devices: int, model: Any, global_batch_size: int,
                     grad_accum: int = 1,
                     sequence_length: int | None = None) -> list[dict[str, int]]:
    """Every (data, fsdp, expert, seq, model) mesh over ``num_devices`` that the model and
    batch allow.

    ``model`` (anything :func:`~kdist.planning.estimate.cost_model_of` reads, or None for
    no model constraint): the ``model`` axis must divide its heads, MLP width and
    vocabulary, the ``fsdp`` axis its hidden size; a model that states no dimensions gets
    no ``model`` axis. A ``seq`` axis (context parallelism) is a candidate when
    ``sequence_length`` is given, the model states its heads, and the axis divides the
    sequence (``2 x seq`` for causal models, whose layout is load-balanced). An ``expert``
    axis only for a model with routed experts (its cost model's ``experts``), of the sizes
    that divide them (:func:`~kdist.planning.experts.expert_sizes`), with ``data``,
    ``fsdp`` and one of ``model`` and ``seq`` (``expert x model x seq`` is built but its
    estimate is not checked: not proposed); it splits the batch as data does.

    Example:
        >>> [m["model"] for m in candidate_meshes(4, None, 8)]
        [1, 1, 1, 2, 2, 4]
        >>> [mesh_spec(m) for m in candidate_meshes(8, "gpt-nano", 1, sequence_length=64)]
        ['seq=8', 'seq=4,model=2', 'seq=2,model=4']
    """
    dims = dimensions(model) if model is not None else None
    cost = cost_model_of(model) if model is not None else None
    causal = getattr(cost.flops_per_token(sequence_length or 1), "causal",
                     True) if model is not None else True
    out = []
    for m in range(1, num_devices + 1):
        if num_devices % m:
            continue
        if dims is not None and m > 1 and (
                "hidden_dim" not in dims or "num_layers" not in dims
                or any(dims.get(k) and dims[k] % m for k in SPLIT_BY_MODEL_AXIS)):
            continue
        for s in _seq_sizes(num_devices // m, dims, sequence_length, causal):
            # 'expert' with data and fsdp and one of model and seq: the combinations whose
            # estimate is checked against the compiled step (tests/planning).
            for e in (expert_sizes(cost, num_devices // (m * s)) if m == 1 or s == 1
                      else [1]):
                rest = num_devices // (m * s * e)
                for f in range(1, rest + 1):
                    if rest % f:
                        continue
                    d = rest // f
                    if ((global_batch_size // grad_accum) % (d * f * e)
                            or global_batch_size % grad_accum):
                        continue
                    if dims and f > 1 and dims.get("hidden_dim") and dims["hidden_dim"] % f:
                        continue
                    out.append(full_mesh({"data": d, "fsdp": f, "expert": e, "seq": s,
                                          "model": m}))
    return out


def _seq_sizes(devices: int, dims, sequence_length, causal) -> list[int]:
    if not sequence_length or dims is None or not dims.get("num_heads"):
        return [1]
    unit = 2 if causal else 1
    return [s for s in range(1, devices + 1)
            if devices % s == 0 and sequence_length % (unit * s if s > 1 else 1) == 0]


def pipeline_meshes(num_devices: int, model: Any, global_batch_size: int,
                    grad_accum: int = 1, microbatches: int | None = None,
                    repeats: int = 1, sequence_length: int | None = None
                    ) -> list[dict[str, int]]:
    """Every mesh with a ``stage`` axis (> 1) over ``num_devices`` that the model's layers
    and the batch allow: stages divide the layers (x repeats), and each replica group's
    micro-batch divides into the microbatches (default: one per stage). Inside a stage,
    every mesh of :func:`candidate_meshes` (a ``seq`` axis too, given
    ``sequence_length``; ``expert`` with ``data`` only).

    Example:
        >>> sorted({m["stage"] for m in pipeline_meshes(8, "gpt-nano", 16)})
        [2, 4]
        >>> "stage=2,seq=4" in {mesh_spec(m) for m in pipeline_meshes(8, "gpt-nano", 2,
        ...                                                          sequence_length=64)}
        True
    """
    layers = dimensions(model).get("num_layers") if model is not None else None
    out = []
    for stages in range(2, num_devices + 1):
        if num_devices % stages or not layers or layers % (stages * repeats):
            continue
        micro = microbatches or stages
        if micro < stages:
            continue
        for mesh in candidate_meshes(num_devices // stages, model, global_batch_size,
                                     grad_accum, sequence_length):
            if (global_batch_size // grad_accum) % (
                    mesh["data"] * mesh["fsdp"] * mesh["expert"] * micro):
                continue
            # 'expert' in a stage with data only: where the stages' estimate of experts
            # is checked (test_plan_expert_combinations.py); not beside fsdp/model/seq.
            if mesh["expert"] > 1 and mesh["fsdp"] * mesh["model"] * mesh["seq"] > 1:
                continue
            out.append(full_mesh({**mesh, "stage": stages}))
    return out


def replica_counts(num_devices: int, devices_per_host: int | None,
                   global_batch_size: int) -> list[int]:
    """The numbers of DiLoCo replica groups the search tries: the divisors (> 1) of the
    host count, so a group is one or more whole hosts — DiLoCo trades synchronous
    training for less traffic, which pays only across the slow link between hosts — and
    on one host 2 groups (an emulation: nothing is saved). Each must divide the batch.

    Example:
        >>> replica_counts(32, 8, 64), replica_counts(8, None, 16)
        ([2, 4], [2])
    """
    hosts = num_devices // devices_per_host if devices_per_host else 1
    counts = [r for r in range(2, hosts + 1) if hosts % r == 0] if hosts > 1 else [2]
    return [r for r in counts if num_devices % r == 0 and global_batch_size % r == 0]


def choose_schedule(model: Any, mesh: Mapping[str, int] | Parallelism, device_memory: float,
                    global_batch_size: int, sequence_length: int, *,
                    precision: str = "float32", remat: bool = False, grad_accum: int = 1,
                    **settings) -> tuple[str, str]:
    """``pipeline_schedule="auto"`` for ``mesh`` (a :class:`~kdist.parallel.config.
    Parallelism`, or axis sizes with the distribution's ``settings``: ``context_parallel``,
    ``pipeline_microbatches``, ``pipeline_repeats``, ``sync_every``; its own schedule is
    not read): GPipe if its analytic estimate fits in
    ``device_memory`` (it recomputes nothing and sends half the activations), else the
    1F1B of the same chunks (``1f1b``, or ``interleaved_1f1b`` with ``pipeline_repeats``
    > 1), whose activations do not grow with the microbatches, if the mesh allows it; if
    neither fits, the one that needs less (with an ``expert`` axis the 1F1B one only: GPipe
    x expert's estimate is not checked). Returns ``(schedule, why)``; ``"gpipe"`` for a
    mesh without stages or a task that cannot run its loss inside the schedule (BERT's).

    Example:
        >>> choose_schedule("gpt-nano", {"stage": 4, "data": 2}, 2**34, 64, 256,
        ...                 pipeline_microbatches=16)[0]
        'gpipe'
        >>> choose_schedule("gpt-nano", {"stage": 4, "data": 2}, 2**27, 64, 256,
        ...                 pipeline_microbatches=16)[0]
        '1f1b'
    """
    config = planned(mesh, settings)
    mesh = config.mesh
    if mesh["stage"] == 1:
        return "gpipe", "no pipeline"
    cost = cost_model_of(model)
    if not getattr(cost, "loss_in_schedule", False):
        return "gpipe", (f"the 1F1B schedules need the loss inside the schedule, which "
                         f"{type(cost).__name__}'s task does not compute there yet")
    if mesh["seq"] > 1 and not getattr(cost, "per_token_targets", False):
        return "gpipe", (f"under 'seq' the 1F1B schedules compute the loss on each device's "
                         f"tokens, which needs one target per token; "
                         f"{type(cost).__name__}'s task has others (masked positions)")
    budget = device_memory * USABLE_FRACTION
    memory = {}
    # With an 'expert' axis GPipe is not weighed: its estimate is not checked (choose_mesh)
    kinds = ("gpipe",) * (mesh["expert"] == 1) + (
        "1f1b" if config.repeats == 1 else "interleaved_1f1b",)
    for schedule in kinds:
        scheduled = dataclasses.replace(
            config, pipeline=dataclasses.replace(config.pipeline, schedule=schedule))
        if checked(scheduled) is None:
            continue
        memory[schedule] = estimate(
            cost, scheduled, global_batch_size, sequence_length, precision=precision,
            remat=remat, grad_accum=grad_accum)["total"]
    if not memory:  # the distribution refuses the mesh whatever the schedule
        return "gpipe", f"mesh {mesh_spec(mesh)} is refused"
    fitting = [s for s in memory if memory[s] <= budget]
    chosen = fitting[0] if fitting else min(memory, key=memory.get)
    shown = ", ".join(f"{s} {format_bytes(b)}" for s, b in memory.items())
    if chosen == "gpipe" and fitting:
        why = f"gpipe fits ({shown} estimated of {format_bytes(budget)} usable per device)"
    elif fitting:
        why = (f"{chosen}: gpipe does not fit and {chosen} does ({shown} estimated of "
               f"{format_bytes(budget)} usable per device)")
    else:
        why = (f"{chosen}: nothing fits {format_bytes(budget)} usable per device; it needs "
               f"the least ({shown} estimated)")
    if len(memory) == 1 and chosen == "gpipe":
        why += f"; the 1F1B schedules do not run on mesh {mesh_spec(mesh)} yet"
    if mesh["expert"] > 1:
        why += "; with an 'expert' axis gpipe is not weighed (its estimate is not checked)"
    return chosen, why


def checked(config: Parallelism) -> Parallelism | None:
    """``config`` as the distribution builds it (:meth:`Parallelism.build` of its spec and
    settings: the combination table, every setting checked), or None if it refuses it.

    Example:
        >>> checked(Parallelism.unchecked({"replica": 2, "data": 4})) is None  # no sync_every
        True
    """
    try:
        return Parallelism.build(config.spec, math.prod(config.mesh.values()),
                                 **config.settings)
    except ValueError:
        return None


def choose_mesh(model: Any, num_devices: int, device_memory: int, global_batch_size: int,
                sequence_length: int, *, precision: str = "float32", remat: bool = False,
                grad_accum: int = 1, devices_per_host: int | None = None,
                pipeline_schedule: str = "gpipe",
                host_link_slowdown: float = HOST_LINK_SLOWDOWN, boundary: str = "hosts",
                **settings) -> tuple[dict[str, int], list[dict], str]:
    """The mesh that fits in memory with the least communication per step (analytic).

    ``model`` is a preset name, a task, a cost model (or a GPT config dict); see
    :func:`~kdist.planning.estimate.cost_model_of`. ``settings``: the distribution's
    (:meth:`~kdist.parallel.config.Parallelism.build`'s keywords: ``context_parallel``,
    ``pipeline_microbatches``, ``pipeline_repeats``, ``sync_every``); each candidate mesh
    is planned as the :class:`~kdist.parallel.config.Parallelism` the distribution builds
    of them. Returns ``(mesh, table, why)``: the table has one row per candidate (its
    ``parallelism``, estimated bytes, wire bytes per axis, the axes that cross hosts,
    ranking cost, fits).

    The search: every (data, fsdp, expert, seq, model) mesh (:func:`candidate_meshes`;
    ``expert`` for a model with routed experts, with data, fsdp and one of model and
    seq); only if none fits, every pipeline (:func:`pipeline_meshes`: a stage axis with
    data, fsdp, seq and model inside, or expert with data, ``pipeline_microbatches``,
    ``pipeline_repeats`` and ``pipeline_schedule``, which may narrow the meshes a pipeline
    can have; never GPipe, or kdist's gradient reduction, with ``expert``). With
    ``sync_every`` (DiLoCo), every mesh has a ``replica`` axis of :func:`replica_counts`
    groups, each group's mesh searched the same way over its devices and batch share.
    A candidate the distribution itself would refuse
    (:meth:`kdist.parallel.config.Parallelism.build`: the combination table, the settings)
    is never returned.

    The ranking: the wire bytes per axis (:func:`kdist.planning.traffic.by_axis`), tensor
    parallelism's activation all-reduces, the keys and values crossing a ``seq`` axis and
    the experts' all-to-alls over ``expert`` counted twice (they sit on each layer's
    critical path; the gradient all-reduce and the weight all-gathers overlap with
    compute), the bytes of an axis that crosses hosts
    (``devices_per_host``; None: one host) ``host_link_slowdown`` times; ties go to fewer
    ``model`` shards, then fewer ``seq`` shards. Pipelines rank by their bubble first.
    If nothing fits, the candidate with the least memory is returned and ``why`` says so.

    Example:
        >>> mesh, _, why = choose_mesh("gpt-nano", 8, 2**34, 16, 256)
        >>> mesh_spec(mesh)
        'data=8'
        >>> mesh_spec(choose_mesh("gpt-nano", 16, 2**34, 32, 256, sync_every=50,
        ...                       devices_per_host=8)[0])
        'replica=2,data=8'
    """
    cost = cost_model_of(model)
    moe = getattr(cost, "experts", None) is not None
    dims_source = model if isinstance(model, (str, Mapping)) else cost
    budget = device_memory * USABLE_FRACTION
    value_bytes = compute_bytes(precision)
    micro = global_batch_size // grad_accum
    sync_every = settings.get("sync_every")
    groups = replica_counts(num_devices, devices_per_host, micro) if sync_every else [1]
    # The schedule's settings belong to a pipeline: a mesh without one is built without.
    unstaged = {k: v for k, v in settings.items() if not k.startswith("pipeline_")}

    picked: dict[str, str] = {}

    def schedule_of(mesh):  # "auto": the schedule choose_schedule would pick for the mesh
        if mesh["stage"] == 1 or pipeline_schedule != "auto":
            return pipeline_schedule if mesh["stage"] > 1 else "gpipe"
        spec = mesh_spec(mesh)
        if spec not in picked:
            picked[spec] = choose_schedule(
                cost, mesh, device_memory, global_batch_size, sequence_length,
                precision=precision, remat=remat, grad_accum=grad_accum, **settings)[0]
        return picked[spec]

    def config_of(mesh):  # the distribution's settings on this mesh, nothing checked yet
        if mesh["stage"] == 1:
            return Parallelism.unchecked(mesh, **unstaged)
        return Parallelism.unchecked(mesh, **settings, pipeline_schedule=schedule_of(mesh))

    def axis_bytes(config, activations=True):
        terms = collective_terms(dims_source, config, micro, sequence_length, value_bytes,
                                 activations=activations)
        return {a: b * grad_accum for a, b in traffic.by_axis(terms, config.mesh).items()}

    def row(config):
        mesh = config.mesh
        memory = estimate(cost, config, global_batch_size, sequence_length,
                          precision=precision, remat=remat, grad_accum=grad_accum)["total"]
        per_axis, quiet = axis_bytes(config), axis_bytes(config, activations=False)
        # Tensor parallelism's activation all-reduces, context parallelism's keys and
        # values and the experts' all-to-alls (activations=True's terms) sit on the
        # critical path (each layer waits for them); gradient all-reduces
        # and weight all-gathers overlap with compute. So their bytes weigh double.
        ranked = {a: 2 * b - quiet.get(a, 0.0) for a, b in per_axis.items()}
        crossing = traffic.crossing_fractions(mesh, devices_per_host)
        stages = mesh["stage"]
        bubble = bubble_fraction(stages, config.microbatches or stages, config.repeats)
        return {"mesh": mesh_spec(mesh), "parallelism": config, "memory": memory,
                "wire_bytes": sum(per_axis.values()), "axis_bytes": per_axis,
                "crosses_hosts": {a: round(f, 4) for a, f in crossing.items()},
                "cost": traffic.weighted_bytes(ranked, crossing, host_link_slowdown),
                "fits": memory <= budget, "bubble": bubble, "_mesh": mesh,
                **({"schedule": config.schedule} if stages > 1 else {})}

    def searched(meshes_of):  # a candidate the distribution refuses is never a row
        configs = (checked(config_of(full_mesh({**m, "replica": r}))) for r in groups
                   for m in meshes_of(num_devices // r, global_batch_size // r))
        # Trained, not proposed: expert x GPipe stages (estimate 0.47 of the compiled peak:
        # the scan keeps more experts than stages.memory counts) and a MoE model's stages
        # under kdist's gradient reduction (0.64-0.78: not modelled). 1F1B's is checked.
        return [row(config) for config in configs if config is not None
                and not (config.mesh["stage"] > 1 and (
                    config.mesh["expert"] > 1 and config.schedule == "gpipe"
                    or moe and config.gradients.reduction))]

    rows = searched(lambda n, batch: candidate_meshes(n, dims_source, batch, grad_accum,
                                                      sequence_length))
    if not any(r["fits"] for r in rows):  # then a pipeline, if one fits
        rows += searched(lambda n, batch: pipeline_meshes(
            n, dims_source, batch, grad_accum, settings.get("pipeline_microbatches"),
            settings.get("pipeline_repeats", 1), sequence_length))
    if not rows:
        raise ValueError(
            f"No mesh over {num_devices} devices suits this model and a global batch of "
            f"{global_batch_size}: the batch per step must divide by the data x fsdp axes"
            + (f" of each of the {'/'.join(map(str, groups))} replica groups" if sync_every
               else "") + f". Use a global batch that is a multiple of {num_devices}.")
    fitting = sorted((r for r in rows if r["fits"]),
                     key=lambda r: (r["bubble"], r["cost"], r["_mesh"]["model"],
                                    r["_mesh"]["seq"]))
    for rank, r in enumerate(fitting):  # the order to try them in (kdist.plan verifies)
        r["rank"] = rank
    if fitting:
        best = fitting[0]
        why = (f"{best['mesh']}: fits ({format_bytes(best['memory'])} estimated of "
               f"{format_bytes(budget)} usable per device) with the least communication "
               f"({format_bytes(best['wire_bytes'])} per device per step; tensor- and "
               f"context-parallel bytes" + (" and the experts' all-to-alls" if cost is not None
                                            and getattr(cost, "experts", None) else "")
               + " weigh double"
               + (f", bytes between {boundary} {host_link_slowdown:.3g}x" if devices_per_host
                  and devices_per_host < num_devices else "")
               + f") of the {len(fitting)} fitting meshes out of {len(rows)}")
        if best["crosses_hosts"]:
            why += f"; across {boundary}: " + ", ".join(
                f"{a} ({traffic.percent(f)} of its bytes)"
                for a, f in best["crosses_hosts"].items())
        if best["bubble"]:
            why += (f"; no mesh without a pipeline fits, so it has the smallest bubble "
                    f"({best['bubble']:.0%} of the iterations)")
            if pipeline_schedule == "auto":
                why += f", with pipeline_schedule {best['schedule']!r}"
    else:
        best = min(rows, key=lambda r: r["memory"])
        why = (f"no mesh fits {format_bytes(budget)} usable per device; {best['mesh']} needs "
               f"the least ({format_bytes(best['memory'])} estimated)")
    table = [{k: v for k, v in r.items() if k != "_mesh"} for r in rows]
    return best["_mesh"], table, why
