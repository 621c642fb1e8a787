"""Plan before you pay: per-device memory, FLOPs and collectives of a train step, compiled
on abstract inputs, with a verdict and the smallest change that fits.

===================  ======================================================================
``units``            memory sizes: parse, print, a device's memory, the usable share
``estimate``         analytic per-device memory and minimum collective bytes, from the model's
                     cost model (``kdist.models.cost.CostModel``) — any family
``search``           candidate meshes and ``--mesh auto`` (:func:`choose_mesh`)
``compile``          abstract build, the real train step compiled on abstract inputs, XLA's
                     memory and FLOP counts
``report``           the :class:`Plan` record, its text, suggestions
``target``           what a plan is for (this machine, or ``--device tpu-v5e`` x N) and how
                     its figures are obtained: compiled here, by the TPU compiler ahead of
                     time, or estimated
``analytic``         the plan from the cost model alone; the theory every plan carries
``traffic``          bytes per mesh axis, and the axes that cross the slow link
``planned_model``    the model a plan is of (a preset or a function) and its cost model
``stages``           a pipeline's memory, bytes between stages, bubble and timeline
``experts``          a Mixture of Experts: its experts' weights over ``expert``, the dispatch
                     buffers and the all-to-alls
``schedule_memory``  the memory of a step run by the pipeline interpreter
``executed``         what a scheduled pipeline's program runs: each branch of its tick's
                     switch counted as often as the schedule's table takes it
===================  ======================================================================

:func:`plan` builds the model with **no weights materialised**, compiles the model's own
train step (what ``fit`` runs) for the mesh, and reads XLA's ``memory_analysis()``,
``cost_analysis()`` and the collectives of the optimized HLO (:mod:`kdist.hlo`). A gpt2-xl
(1.5 B parameters) plans on a CPU with a few GB of RAM. The plan is checked against real
runs in ``tests/test_plan.py`` and ``benchmarks/plan_accuracy.py``. Mesh choice
(``mesh="auto"``) and suggestions use the analytic model; the chosen mesh or suggested
change is then compiled to confirm it. For an accelerator this machine does not have
(``device="tpu-v5e"``, 256 chips), the program is compiled by the TPU compiler for the
slice's topology where libtpu is installed, else estimated — and the report says which.

``kdist.plan`` (the former module's name) is this package.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras

from kdist import hlo
from kdist.parallel.config import Parallelism
from kdist.parallel.mesh import mesh_spec, parse_mesh
from kdist.planning import executed, stages, traffic
from kdist.planning import report as _report
from kdist.planning.analytic import (
    active_parameters,
    axis_links,
    estimated_plan,
    formula_flops,
    remat_ratio,
    theory_terms,
)
from kdist.planning.compile import (
    abstract_batch,
    build_abstract,
    compile_plan,
    compile_train_step,
    memory_breakdown,
    xla_flops,
    xla_memory,
    xla_train_step_flops,
)
from kdist.planning.estimate import (
    compute_bytes,
    cost_model_of,
    dimensions,
    estimate,
    precision_policy,
    preset_backbone_config,
    theoretical_collective_bytes,
)
from kdist.planning.planned_model import cost_of_function, resolve_model, task_cost_model
from kdist.planning.report import Plan
from kdist.planning.search import (
    candidate_meshes,
    check_model_axis,
    choose_mesh,
    choose_schedule,
    mesh_devices,
    model_axis_sizes,
)
from kdist.planning.target import resolve
from kdist.planning.units import (
    USABLE_FRACTION,
    default_device_memory,
    device_memory_source,
    format_bytes,
    parse_bytes,
)

AUTO_TRIES = 3  # meshes mesh="auto" compiles at most before it says none fits

__all__ = [
    "USABLE_FRACTION", "Plan", "abstract_batch", "build_abstract", "candidate_meshes",
    "check_model_axis", "choose_mesh", "choose_schedule", "compile_plan",
    "compile_train_step", "compute_bytes", "cost_model_of", "model_axis_sizes",
    "default_device_memory", "device_memory_source", "dimensions", "estimate",
    "format_bytes", "memory_breakdown",
    "mesh_devices", "mesh_spec", "parse_bytes", "plan", "precision_policy",
    "preset_backbone_config", "theoretical_collective_bytes", "xla_flops",
    "xla_memory", "xla_train_step_flops",
]


def plan(
    model: str | Callable[[], keras.Model] = "gpt-nano",
    mesh: str = "auto",
    global_batch_size: int = 8,
    sequence_length: int | None = None,
    *,
    precision: str = "float32",
    remat: bool | str = False,
    grad_accum: int = 1,
    device_memory: int | str | None = None,
    devices: Sequence | None = None,
    optimizer: Callable[[], Any] | None = None,
    batch: tuple | None = None,
    suggest: bool = True,
    verify: bool = True,
    model_overrides: dict | None = None,
    auto_shard: bool = False,
    gradient_reduction: str | None = None,
    pipeline_microbatches: int | None = None,
    pipeline_repeats: int = 1,
    pipeline_schedule: str = "gpipe",
    context_parallel: str = "all_gather",
    load_balance: bool = True,
    sync_every: int | None = None,
    devices_per_host: int | None = None,
    device: str | None = None,
    num_devices: int | None = None,
    slices: int | None = None,
    compile: str = "auto",
) -> Plan:
    """Compiles one train step on abstract inputs and reports what it needs per device.

    Args:
        model: a kdist preset name (any family: ``"gpt2-xl"``, ``"bert-base"``), or a
            function returning a Keras model (built under the plan's distribution, weights
            never materialised; compiled with ``optimizer`` and sparse categorical
            cross-entropy unless already compiled). A model with a ``cost_model()`` (every
            kdist task, or your own) gets the formula FLOPs, the theoretical collectives
            and ``mesh="auto"``.
        mesh: a mesh spec (``"fsdp=8"``, ``"data=2,model=4"``) or ``"auto"``: choose the
            mesh that fits with the least communication (:func:`choose_mesh`).
        global_batch_size, sequence_length: sequences (and tokens each) per optimizer step.
        precision: ``"float32"`` or ``"bf16"`` (Keras ``mixed_bfloat16``).
        remat: a :mod:`kdist.models.remat` policy (``True`` / ``"block"``: keep each block's
            input only; ``"auto"`` is planned as ``False``).
        grad_accum: micro-batches per step (Keras ``gradient_accumulation_steps``).
        device_memory: bytes (or ``"80GiB"``) per device; default: the device's own.
        batch: ``(x, y)`` arrays or shape structs of one micro-batch; default: token ids
            for a one-input model, else read from the model's inputs
            (:func:`~kdist.planning.compile.abstract_batch`).
        suggest, verify: if it does not fit, look for the smallest change that does, and
            compile that change to confirm it.
        model_overrides: config fields replacing the preset's (e.g. ``num_layers``); its
            task's own arguments (``head_matmul_precision``) go to the task.
        auto_shard: shard weights no kdist table names by structure and shape
            (:mod:`kdist.parallel.auto`): for keras-hub or your own models.
        gradient_reduction: the distribution's (``kdist.distribution``): None, ``"float32"``,
            ``"bfloat16"``, ``"float8"`` or ``"int8"`` (the theoretical minimum then counts
            one byte per gradient value, whatever the collectives' kinds).
        pipeline_microbatches, pipeline_repeats: the distribution's, for a mesh with a
            ``stage`` axis (:mod:`kdist.parallel.pipeline`); the plan then also reports the
            bubble, each stage's share and the bytes between stages
            (:mod:`kdist.planning.stages`). ``pipeline_schedule``: the distribution's
            (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``): the
            program runs it, and the report draws its timeline; ``"auto"``: the one
            :func:`~kdist.planning.search.choose_schedule` picks for the mesh (GPipe if it
            fits, else 1F1B), and the report says why.
        context_parallel, load_balance: the distribution's, for a mesh with a ``seq`` axis
            (``"all_gather"`` or ``"ring"``; load-balanced causal layout).
        sync_every: the distribution's, for a mesh with a ``replica`` axis (DiLoCo groups;
            the sync step is compiled); with ``mesh="auto"``, the search gives every mesh
            a ``replica`` axis (:func:`~kdist.planning.search.replica_counts`).
        devices_per_host: devices per host, for the axes that cross hosts (reported, and
            weighed :data:`~kdist.planning.traffic.HOST_LINK_SLOWDOWN` x by ``auto``);
            default: the devices of ``devices[0]``'s process (with ``device``: one JAX
            process's chips on such a slice or cluster, from the table).
        device, num_devices, slices, compile: plan for ``num_devices`` of an accelerator of
            :mod:`kdist.accelerators` (``"tpu-v5e"``, ``"h100"``, ...) instead of this
            machine's ``devices``: its HBM, its fast link inside a slice (ICI) or server
            (NVLink) and its slow link between them (DCN, InfiniBand), weighed by their
            bandwidths; ``slices`` TPU slices (default: the fewest that hold the chips).
            ``compile`` says how the figures are obtained: ``"auto"`` (the TPU compiler
            ahead of time where libtpu is installed, else this machine's devices if they
            are that accelerator, else the analytic estimate), ``"tpu"``, ``"host"`` (XLA
            here, standing in) or ``"none"`` (the estimate) —
            :mod:`kdist.planning.target`; the report names the method.

    Example:
        >>> p = plan("gpt-nano", mesh="fsdp=8", global_batch_size=16, sequence_length=128,
        ...          model_overrides={"vocabulary_size": 512})  # doctest: +SKIP
        >>> p.fits, p.memory["parameters"] < p.parameters * 4 / 4  # doctest: +SKIP
        (True, True)
    """
    arguments = dict(locals())  # every parameter, to plan again for a named device
    import jax

    from kdist import accelerators
    from kdist.optim import adamw

    if device is not None and accelerators.target().device_kind.lower() not in \
            accelerators.accelerator(device).kinds:
        # Planned for a named device: everything traced or estimated makes its choices
        # (attention kernel, what XLA keeps), on whatever machine plans. The same call,
        # inside the assumption (the first argument line captured every parameter).
        entry = accelerators.accelerator(device)
        with accelerators.assume(entry.kinds[0], entry.platform):
            return plan(**arguments)
    if remat not in (False, True, None, "none", "auto", "block", "minimal", "save_dots"):
        raise ValueError(f"remat must be one of kdist.models.remat's policies (False/'none', "
                         f"'minimal', 'save_dots', True/'block'); got {remat!r}.")
    remat = {None: False, "none": False, "auto": False, True: "block"}.get(remat, remat)
    policy = precision_policy(precision)
    if grad_accum < 1 or global_batch_size % grad_accum:
        raise ValueError(f"grad_accum={grad_accum} must be a positive divisor of "
                         f"global_batch_size={global_batch_size}.")
    if device is None and devices is None and num_devices is None:
        devices = jax.devices()
    if num_devices is None:
        num_devices = len(devices) if devices is not None else mesh_devices(mesh, 8)
    target = resolve(device, num_devices, compile=compile, slices=slices,
                     devices_per_host=devices_per_host, device_memory=device_memory,
                     devices=devices)
    device_memory, devices = target.device_memory, list(target.devices or ())
    model_name, model_fn, cost, sequence_length = resolve_model(
        model, model_overrides, batch, sequence_length)
    if not target.compiled and cost is None:
        cost = cost_of_function(model_fn)
        if cost is None:
            raise ValueError(f"{target.how}; an estimate needs the model's cost model (a "
                             f"kdist preset, or a model with a cost_model() method).")

    # The distribution's settings, once: what the search weighs of them, and the rest.
    # (gradient_reduction too: the experts' padding in the per-device loss, experts.py.)
    settings = dict(context_parallel=context_parallel,
                    pipeline_microbatches=pipeline_microbatches,
                    pipeline_repeats=pipeline_repeats, sync_every=sync_every,
                    gradient_reduction=gradient_reduction)
    mesh_choice = None
    if mesh.strip().lower() == "auto":
        if cost is None:
            cost = cost_of_function(model_fn)
        if cost is None:
            raise ValueError("mesh='auto' needs the model's cost model (a kdist preset, or a "
                             "model with a cost_model() method); for other models pass an "
                             "explicit mesh such as 'fsdp=8'.")
        chosen, table, mesh_choice = choose_mesh(
            cost, target.num_devices, device_memory, global_batch_size, sequence_length,
            precision=policy, remat=remat, grad_accum=grad_accum,
            devices_per_host=target.link_group, pipeline_schedule=pipeline_schedule,
            host_link_slowdown=target.slowdown, boundary=f"{target.group_name}s",
            **settings)
        mesh = mesh_spec(chosen)
        auto_candidates = sorted((r for r in table if r.get("rank") is not None),
                                 key=lambda r: r["rank"])[:AUTO_TRIES]
    sizes = _check_mesh(mesh, target.num_devices, global_batch_size, grad_accum)
    if cost is not None:  # before compiling, with the sizes that can work here
        check_model_axis(sizes, cost, target.num_devices)
    if sizes["seq"] > 1 and sequence_length:  # before compiling: the layout's own check
        from kdist.parallel.context import SequenceLayout

        causal = cost is None or getattr(cost.flops_per_token(sequence_length), "causal", True)
        SequenceLayout(sequence_length, sizes["seq"], balanced=causal and load_balance)

    if pipeline_schedule == "auto" and cost is None:
        cost = cost_of_function(model_fn)
        if cost is None and sizes["stage"] > 1:
            raise ValueError("pipeline_schedule='auto' needs the model's cost model (a kdist "
                             "preset, or a model with a cost_model() method); for other "
                             "models name the schedule, e.g. pipeline_schedule='1f1b'.")

    def schedule_for(sizes, remat, grad_accum):  # (schedule, why "auto" chose it, or None)
        if sizes["stage"] == 1:
            return "gpipe", None
        if pipeline_schedule != "auto":
            return pipeline_schedule, None
        return choose_schedule(cost, sizes, device_memory, global_batch_size, sequence_length,
                               precision=policy, remat=remat, grad_accum=grad_accum,
                               **settings)

    def settings_for(sizes, remat, grad_accum):  # every setting, for this mesh
        staged = sizes["stage"] > 1  # (a mesh "auto" chose may have no stage axis)
        return dict(settings, gradient_reduction=gradient_reduction, load_balance=load_balance,
                    pipeline_microbatches=pipeline_microbatches if staged else None,
                    pipeline_repeats=pipeline_repeats if staged else 1,
                    pipeline_schedule=schedule_for(sizes, remat, grad_accum)[0])

    def parallelism_for(sizes, remat, grad_accum):  # the distribution's one settings object
        return Parallelism.build(mesh_spec(sizes), math.prod(sizes.values()),
                                 **settings_for(sizes, remat, grad_accum))

    def run(sizes, remat, grad_accum):
        # A preset is rebuilt with the remat asked for; a model function as it is.
        fn = model_fn(remat) if isinstance(model, str) else model_fn
        return compile_plan(fn, parallelism_for(sizes, remat, grad_accum), devices, policy,
                            global_batch_size // grad_accum, sequence_length, grad_accum,
                            optimizer or adamw, batch, auto_shard)

    if not target.compiled:  # the figures of the settings as given; then the checked object
        assumed = Parallelism.unchecked(sizes, **settings_for(sizes, remat, grad_accum))
        result = estimated_plan(target, model_name, cost, mesh, assumed, mesh_choice, policy,
                                remat, grad_accum, global_batch_size, sequence_length,
                                schedule_for(sizes, remat, grad_accum)[1], suggest)
        result.parallelism = parallelism_for(sizes, remat, grad_accum)
        return result

    start = time.perf_counter()
    compiled, state, model_obj = run(sizes, remat, grad_accum)
    if mesh_choice is not None and verify:  # an estimate can be wrong: compile to confirm
        mesh, sizes, compiled, state, model_obj, mesh_choice = _verified_auto(
            auto_candidates, (mesh, sizes, compiled, state, model_obj), mesh_choice,
            device_memory, devices, global_batch_size, grad_accum, run, remat)
    seconds = time.perf_counter() - start
    if cost is None:
        cost = task_cost_model(model_obj)
    num = math.prod(sizes.values())
    config = parallelism_for(sizes, remat, grad_accum)
    schedule_choice = schedule_for(sizes, remat, grad_accum)[1]
    # The program compiled under DiLoCo is a sync step: its theory counts one sync.
    terms = theory_terms(cost, config, global_batch_size // grad_accum, sequence_length,
                         policy, grad_accum)
    # kdist.hlo reads XLA:CPU's collectives; a TPU program's are asynchronous, decomposed
    # and looped (collective matmuls), which it does not count right yet: the theoretical
    # figures stand alone there, and the report says so.
    summary = (dict(stages.summary(cost, sizes, global_batch_size, sequence_length,
                                   config.microbatches, config.repeats, compute_bytes(policy),
                                   grad_accum, config.schedule),
                    choice=schedule_choice)
               if sizes.get("stage", 1) > 1 and cost is not None else None)
    # An interpreted schedule's branches counted as often as the table runs them
    # (kdist.planning.executed), not each at every tick.
    table = executed.table_of(summary)
    found = (executed.collectives(compiled.as_text(), table, num) if target.method == "host"
             else [])
    parameters = int(sum(math.prod(s.shape) for s in state[0]))
    result = Plan(
        config=dict(model=model_name, mesh=mesh, global_batch_size=global_batch_size,
                    sequence_length=sequence_length, precision=policy, remat=remat,
                    grad_accum=grad_accum, sync_every=sync_every),
        mesh=sizes,
        parameters=parameters,
        memory=memory_breakdown(compiled, state),
        xla_memory=xla_memory(compiled),
        device_memory=device_memory,
        flops=executed.plan_flops(compiled, table, num * grad_accum, target.method == "host",
                                  formula_flops(cost, global_batch_size, sequence_length,
                                                remat), cost, sequence_length),
        collectives=_collectives(found, grad_accum),
        theoretical_collectives=traffic.by_kind(terms),
        axis_bytes={"compiled": {a: b * grad_accum for a, b in
                                 traffic.measured_by_axis(found, sizes).items()},
                    "theoretical": traffic.by_axis(terms, sizes)},
        crosses_hosts=list(traffic.crossing_axes(sizes, target.link_group)),
        devices_per_host=target.devices_per_host,
        compile_seconds=seconds,
        mesh_choice=mesh_choice,
        device_memory_source=target.memory_source,
        target=target.describe(), method=target.method, links=axis_links(target, sizes),
        pipeline=summary, parallelism=config,
        active_parameters=active_parameters(cost, parameters),
    )
    if suggest and not result.fits:
        result.suggestion = _report.suggest(
            result, remat_ratio(cost, sequence_length, remat), run if verify else None)
    return result


def _verified_auto(candidates, first, why, device_memory, devices, global_batch_size,
                   grad_accum, run, remat):
    """``mesh="auto"``: the planner's choice compiled; if the compiled program does not fit
    although the estimate did, the next candidates in the planner's order (at most
    :data:`AUTO_TRIES` in all), the first that fits — and ``why`` says what was tried."""
    budget = device_memory * USABLE_FRACTION
    tried, best = [], None
    if not candidates:  # nothing was estimated to fit: choose_mesh's why says so
        return (*first, why)
    for n, row in enumerate(candidates):
        if n == 0:
            mesh, sizes, compiled, state, model_obj = first
        else:
            mesh = row["mesh"]
            sizes = _check_mesh(mesh, len(devices), global_batch_size, grad_accum)
            compiled, state, model_obj = run(sizes, remat, grad_accum)
        total = memory_breakdown(compiled, state)["total"]
        if best is None or total < best[0]:
            best = (total, (mesh, sizes, compiled, state, model_obj))
        if total <= budget:
            break
        tried.append(f"{mesh} (estimated {format_bytes(row.get('memory', float('nan')))}, "
                     f"compiled {format_bytes(total)}: does not fit)")
    else:
        if tried:
            why += "; compiled, none of the first fitting estimates fits: " + "; ".join(tried)
        return (*best[1], why)
    if tried:
        why = (f"{mesh}: the estimate's first choices did not fit once compiled — "
               + "; ".join(tried) + f" — so the next one, {mesh}, compiled to "
               f"{format_bytes(total)}, fits. Analytic ranking: {why}")
    return mesh, sizes, compiled, state, model_obj, why


def _check_mesh(mesh: str, num_devices: int, global_batch_size: int,
                grad_accum: int) -> dict[str, int]:
    sizes = parse_mesh(mesh, mesh_devices(mesh, num_devices))
    num = math.prod(sizes.values())
    if num > num_devices:
        raise ValueError(
            f"Mesh {mesh!r} needs {num} devices but this process has {num_devices}. On CPU, "
            f"call kdist.force_host_devices({num}) before jax starts (the `kdist plan` "
            f"command does this itself).")
    micro = global_batch_size // grad_accum
    shards = sizes["replica"] * sizes["data"] * sizes["fsdp"]
    if micro % shards:
        raise ValueError(
            f"The micro-batch ({global_batch_size} / {grad_accum} = {micro}) must divide by the "
            f"replica x data x fsdp batch shards ({shards}) of mesh {mesh!r}.")
    return sizes


def _collectives(found, grad_accum) -> dict:
    collectives = hlo.summarize_collectives(found)
    for row in collectives.values():
        row.update(bytes=row["bytes"] * grad_accum, wire_bytes=row["wire_bytes"] * grad_accum)
    return collectives
