"""What a scheduled pipeline's compiled program executes, rather than what it contains.

The interpreter of the schedules other than GPipe (:mod:`kdist.parallel.pipeline.interpreter`) runs
each tick's task as one branch of a ``lax.switch`` (idle, F, B, last B, I, last I, W, last
W): the program holds every branch, a device runs one per tick. XLA's counters and
:mod:`kdist.hlo` count a conditional's branches as if each were taken (``cost_analysis()``
the costliest once, a loop body once; :func:`kdist.hlo.executions` every branch at every
run): the FLOPs and the collectives inside the branches (a ``seq`` axis's keys and values,
a ``model`` axis's all-reduces) come out several times what runs — 24x the formula's FLOPs
for gpt2-small on ``stage=4,seq=2``.

Here each branch is weighted by the share of the table's cells (ticks x stages) that run
its task (:func:`branch_weights`): per device on average, what the program executes.
The same per-branch costs give the schedule's step and bubble in time, every tick as long
as its costliest task (:func:`tick_costs`, ``benchmarks/pipeline.py ticks``).

Example:
    >>> from kdist.parallel.pipeline import schedules
    >>> shares = task_shares(schedules.build("1f1b", stages=2, microbatches=2))
    >>> [round(x, 3) for x in shares]  # idle, F, B, last B, I, last I, W, last W
    [0.4, 0.2, 0.2, 0.2, 0.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kdist import hlo
from kdist.parallel.pipeline import interpreter, schedules

ACTIONS = 8  # the interpreter's action codes, IDLE ... LAST_WEIGHT_GRAD: its switch's branches


def table_of(pipeline: dict[str, Any]) -> schedules.Table | None:
    """The table a plan's pipeline summary (:func:`kdist.planning.stages.summary`) runs,
    or None for GPipe (a scan: no switch)."""
    if not pipeline or pipeline.get("schedule", "gpipe") == "gpipe":
        return None
    return schedules.build(pipeline["schedule"], pipeline["stages"], pipeline["microbatches"],
                           pipeline["repeats"])


def task_shares(table: schedules.Table) -> list[float]:
    """Per action code, the share of the table's cells (ticks x stages) that run it: the
    runs of that branch per run of the tick's switch, on average over the devices."""
    action = interpreter.Program(table).action
    return [float((action == code).mean()) for code in range(ACTIONS)]


def branch_weights(hlo_text: str, table: schedules.Table) -> dict[str, float] | None:
    """``{branch computation: share of the ticks that take it}`` of the compiled program's
    tick switch (:func:`kdist.hlo.switch_branches`), for :func:`kdist.hlo.executions`;
    None when the program has no switch of the interpreter's branches (GPipe; or every
    stage running each tick alike, :mod:`kdist.parallel.pipeline.every_stage`)."""
    names = hlo.switch_branches(hlo_text)
    if len(names) != ACTIONS:
        return None
    return dict(zip(names, task_shares(table)))


def flops(compiled, table: schedules.Table) -> dict[str, float] | None:
    """Per device, the executed FLOPs of a scheduled program: ``program`` its matmuls with
    each branch weighted by its share of the ticks; ``xla`` XLA's ``cost_analysis()`` with
    its matmuls replaced by those (its other ops, as for any loop, counted once); and
    ``contained`` the matmuls with every branch counted at every tick (what
    :func:`kdist.hlo.matmul_flops` reads without weights). None without a switch."""
    text = compiled.as_text()
    weights = branch_weights(text, table)
    if weights is None:
        return None
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
        cost = cost[0]
    # cost_analysis() counts a loop body once and a conditional as its costliest branch:
    # its matmuls so counted, to take out before adding the executed ones.
    once = [hlo.matmul_flops(text, per_iteration=False, root=name) for name in weights]
    counted = hlo.matmul_flops(text, per_iteration=False) - sum(once) + max(once)
    program = hlo.matmul_flops(text, branch_weights=weights)
    return {"program": program, "xla": float(cost.get("flops", 0.0)) - counted + program,
            "contained": hlo.matmul_flops(text)}


def collectives(hlo_text: str, table: schedules.Table | None,
                num_devices: int) -> list[hlo.Collective]:
    """The program's collectives (:func:`kdist.hlo.parse_collectives`), those inside the
    tick's switch counted as often as their branch runs (on average over the devices)."""
    weights = branch_weights(hlo_text, table) if table is not None else None
    return hlo.parse_collectives(hlo_text, num_devices, branch_weights=weights)


def tick_costs(hlo_text: str, table: schedules.Table) -> dict[str, Any]:
    """The step of ``table`` with each task as long as its branch's matmul FLOPs in the
    compiled program (:func:`kdist.hlo.branch_flops`): ``branch_flops`` per action code,
    the table's idle share of cells, its ``ticks``, the idle share of the devices' time
    with every tick as long as its costliest task (``lockstep_bubble``) and the step in
    forwards of one stage's layers (``step_forwards``)."""
    cost = hlo.branch_flops(hlo_text)
    program = interpreter.Program(table)
    step = np.asarray(cost, np.float64)[program.action].max(axis=1).sum()
    return {"branch_flops": cost, "table_bubble": table.bubble, "ticks": table.ticks,
            "lockstep_bubble": interpreter.lockstep_bubble(program, cost),
            "step_forwards": step / (table.chunks * cost[interpreter.FORWARD])}


def plan_flops(compiled, table: schedules.Table | None, scale: float, counted: bool,
               formula: float, cost: Any = None, sequence_length: int | None = None
               ) -> dict[str, float]:
    """A plan's ``flops`` (per optimizer step, ``scale`` = devices x gradient-accumulation
    steps): ``xla`` (:func:`kdist.planning.compile.xla_flops`), ``program`` (the matmuls,
    where this machine's XLA compiled the program: ``counted``) and ``formula``; for a
    scheduled pipeline, what runs (:func:`flops`) — with ``contained`` (every branch at
    every tick, what the counters read without the table) and ``schedule_formula`` (the
    formula plus the forwards the schedule's backwards recompute, :func:`recomputed`)."""
    from kdist.planning.compile import xla_flops

    text = compiled.as_text() if counted else ""
    out = {"xla": xla_flops(compiled) * scale,
           "program": hlo.matmul_flops(text) * scale if counted else float("nan"),
           "formula": formula}
    ran = flops(compiled, table) if (table is not None and counted) else None
    if ran is not None:
        out.update({k: v * scale for k, v in ran.items()})
        out["schedule_formula"] = formula + recomputed(cost, table, formula, sequence_length)
    return out


def recomputed(cost: Any, table: schedules.Table, formula: float,
               sequence_length: int | None) -> float:
    """The FLOPs the interpreter's backwards add to the model's: each task's matmuls in
    forwards of its chunk (:data:`kdist.parallel.pipeline.interpreter.TASK_COSTS`: a ``B``
    recomputes its forward, 3; the last virtual stage's, which runs no ``F``, 3) against
    the 3 of training, on the blocks' share of ``formula`` (the cost model's)."""
    if cost is None or not sequence_length:
        return 0.0
    fpt = cost.flops_per_token(sequence_length)
    blocks = (fpt.qkv + fpt.attention + fpt.output_projection + fpt.mlp) / fpt.forward
    action = interpreter.Program(table).action
    forwards = float(np.asarray(interpreter.TASK_COSTS, np.float64)[action].sum())
    trained = 3 * table.microbatches * table.stages * table.chunks  # 3 F per task
    return formula * blocks * (forwards / trained - 1)


def passes(table: schedules.Table) -> tuple[float, float]:
    """``(forwards, backwards)``: the passes through one chunk's layers a device runs per
    step under the interpreter, on average over the stages — every task runs its chunk's
    forward (a backward recomputes it; the last virtual stage's backward is its only
    one), and ``B``, ``I`` and ``W`` a backward each. What the collectives inside the
    layers (a ``model`` axis's all-reduces, a ``seq`` axis's keys and values) run per.

    Example:
        >>> passes(schedules.build("1f1b", stages=4, microbatches=8))
        (14.0, 8.0)
    """
    action = interpreter.Program(table).action
    busy = float((action != interpreter.IDLE).sum()) / table.stages
    back = float((action >= interpreter.BACKWARD).sum()) / table.stages
    return busy, back
