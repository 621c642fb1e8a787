"""A plan from the analytic cost model alone (``method == "estimate"``: an accelerator
there is no compiler for here, or ``--compile none``), and the analytic figures every plan
carries beside the compiled ones: the theoretical collectives, the formula's FLOPs, the link
each mesh axis uses.

Example:
    >>> from kdist.planning.estimate import cost_model_of
    >>> formula_flops(cost_model_of("gpt-nano"), 8, 256, remat=False) > 0
    True
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kdist.parallel.config import Replicas
from kdist.planning import report as _report
from kdist.planning import stages, traffic
from kdist.planning.estimate import collective_terms, compute_bytes, dimensions, estimate
from kdist.planning.report import Plan
from kdist.planning.target import Target


def axis_links(target: Target, sizes: dict[str, int]) -> dict[str, Any]:
    """Which link each mesh axis of size > 1 uses: the fast one, or (some of its bytes) the
    slow one between ``target.link_group``-device groups, with that share."""
    crossing = traffic.crossing_fractions(sizes, target.link_group)
    return {"fast": target.fast_link, "slow": target.slow_link, "group": target.group_name,
            "devices_per_group": target.link_group, "slowdown": target.slowdown,
            "axes": {a: (target.slow_link if a in crossing else target.fast_link)
                     for a, n in sizes.items() if n > 1},
            "slow_share": {a: round(f, 4) for a, f in crossing.items()}}


def estimated_plan(target, model_name, cost, mesh, config, mesh_choice, policy, remat,
                   grad_accum, global_batch_size, sequence_length, schedule_choice,
                   suggest) -> Plan:
    """The plan from the analytic cost model alone (``target.method == "estimate"``): the
    memory of :func:`~kdist.planning.estimate.estimate`, the formula's FLOPs and the
    theoretical collectives, per axis with the link each one uses, of ``config`` (the
    :class:`~kdist.parallel.config.Parallelism` planned, its schedule chosen). Nothing is
    compiled."""
    start = time.perf_counter()
    sizes = config.mesh
    e = estimate(cost, config, global_batch_size, sequence_length, precision=policy,
                 remat=remat, grad_accum=grad_accum)
    named = ("parameters", "optimizer_state", "gradients")
    memory = {k: float(e[k]) for k in named}
    memory["activations_and_temporaries"] = float(e["activations"])
    memory["batch_and_other"] = float(e["total"] - sum(memory.values()))  # pipeline, groups
    memory["total"] = float(e["total"])
    terms = theory_terms(cost, config, global_batch_size // grad_accum, sequence_length,
                         policy, grad_accum)
    result = Plan(
        config=dict(model=model_name, mesh=mesh, global_batch_size=global_batch_size,
                    sequence_length=sequence_length, precision=policy, remat=remat,
                    grad_accum=grad_accum, sync_every=config.sync_every),
        mesh=sizes, parameters=int(cost.parameters), memory=memory, xla_memory={},
        active_parameters=active_parameters(cost, cost.parameters),
        device_memory=target.device_memory,
        flops={"xla": float("nan"), "program": float("nan"),
               "formula": formula_flops(cost, global_batch_size, sequence_length, remat)},
        collectives={}, theoretical_collectives=traffic.by_kind(terms),
        axis_bytes={"theoretical": traffic.by_axis(terms, sizes)},
        crosses_hosts=list(traffic.crossing_axes(sizes, target.link_group)),
        devices_per_host=target.devices_per_host, compile_seconds=0.0,
        mesh_choice=mesh_choice, device_memory_source=target.memory_source,
        target=target.describe(), method=target.method, links=axis_links(target, sizes),
        pipeline=(dict(stages.summary(cost, sizes, global_batch_size, sequence_length,
                                      config.microbatches, config.repeats,
                                      compute_bytes(policy), grad_accum, config.schedule),
                       choice=schedule_choice) if sizes["stage"] > 1 else None),
    )
    result.compile_seconds = time.perf_counter() - start
    if suggest and not result.fits:
        result.suggestion = _report.suggest(
            result, remat_ratio(cost, sequence_length, remat), None)
    return result

def active_parameters(cost, parameters: int) -> int | None:
    """The parameters a token goes through when a cost model states fewer than
    ``parameters`` (a Mixture of Experts' ``active_parameters``), else None: the plan
    shows both for a MoE model (Mixtral 8x7B: 46.7 B, 12.9 B active)."""
    active = getattr(cost, "active_parameters", None)
    return int(active) if active is not None and active < parameters else None


def theory_terms(cost, config, micro, sequence_length, policy, grad_accum) -> list:
    """The theoretical minimum's terms per optimizer step of ``config`` (a
    :class:`~kdist.parallel.config.Parallelism`; none when it cannot be counted: no cost
    model, or one without the dimensions its axes need). Under DiLoCo the program planned
    is a sync step: it counts one sync."""
    sizes = config.mesh
    needs = {"hidden_dim", "num_layers"} | ({"num_heads"} if sizes["seq"] > 1 else set())
    if cost is None or ((sizes["model"] > 1 or sizes["seq"] > 1 or sizes["stage"] > 1)
                        and not needs <= set(dimensions(cost))):
        return []
    if sizes["replica"] > 1:
        config = dataclasses.replace(config, replicas=Replicas(1))
    terms = collective_terms(cost, config, micro, sequence_length, compute_bytes(policy))
    return [traffic.Traffic(t.kind, t.axes, t.bytes * grad_accum) for t in terms]


def formula_flops(cost, global_batch_size, sequence_length, remat) -> float:
    if cost is None or not sequence_length:
        return float("nan")
    per_token = cost.flops_per_token(sequence_length)
    # "block" recomputes the forward's matmuls; "minimal" and "save_dots" (almost) none.
    recomputes = remat in (True, "block")
    return (per_token.hardware if recomputes else per_token.training) * (
        global_batch_size * sequence_length)


def remat_ratio(cost, sequence_length, remat) -> float:
    if cost is None or remat:
        return 1.0
    return (cost.activation_bytes_per_token(sequence_length, 4, True)
            / cost.activation_bytes_per_token(sequence_length, 4, False))
