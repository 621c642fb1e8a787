"""One SPMD program that runs any schedule table (:mod:`kdist.parallel.pipeline.schedules`):
forwards and backwards interleaved per the table, so 1F1B keeps about ``S`` microbatches'
inputs on a stage where GPipe's scan keeps ``M`` microbatches' residuals.

Today's GPipe (:mod:`kdist.parallel.pipeline`) lets JAX differentiate a scan over the
schedule, so every iteration's residuals live until the backward scan. A schedule that
starts microbatch 0's backward before microbatch ``S``'s forward cannot be a gradient of
a forward program: the backward of a microbatch needs its loss, so the loss joins the
schedule, and the interpreter computes the gradients itself — one ``lax.scan`` over the
table's ticks in which every stage runs its tick's task:

- ``F``: the stage's layers on the microbatch's input (from the inputs on virtual stage 0,
  else from the buffer the previous stage's activation was written into); the input stays
  in the buffer until the task's ``B``. The last virtual stage has no ``F`` in the table:
  its ``B`` computes the forward with the loss.
- ``B``: ``jax.vjp`` of the stage's layers at the buffered input — the forward recomputed,
  not its residuals kept — applied to the cotangent the next stage sent back (on the last
  virtual stage: the vjp of layers + loss, at cotangent 1). The weights' gradient
  accumulates on the device; the input's cotangent goes back to the previous stage.
- ``I`` and ``W`` (zero-bubble): ``B`` in two — the vjp in the input alone (the cotangent
  sent back, on the critical path), then, at a later tick, the vjp in the weights alone;
  the input and the cotangent stay in their buffers until ``W``. Each recomputes the
  forward, and ``W`` the layers' input gradients too (a scanned stack's backward computes
  both for every layer): in matmul FLOPs ``I`` costs 2 forwards and ``W`` 3, against 3 for
  1F1B's ``B`` (``tests/parallel/test_interpreter.py``): here zero-bubble computes 6
  forwards per microbatch and stage against 1F1B's 4, and its ticks mix kinds.

Every tick lasts as long as its costliest task (:func:`lockstep_bubble`), so 1F1B's and
interleaved's tables run forwards-only and backwards-only ticks
(:data:`kdist.parallel.pipeline.schedules.LOCKSTEP`): their step lasts GPipe's
``(v M + S - 1) (F + B)`` less one forward. So every stage can also run each tick's kind
of task, idle ones on zeros, when the layers hold collectives among all devices (ring
attention's permutes over ``seq``): :mod:`kdist.parallel.pipeline.every_stage`.

At the end of every tick each stage sends its ``F`` output forward and its input cotangent
backward (one collective-permute each, zeros when it had none) and writes what arrived into
a buffer slot the table assigned (:class:`Program`): slots are reused as soon as their
microbatch's ``B`` has read them, so a buffer holds what the schedule keeps in flight and
what arrived while the stage was busy: at most ``2 S - 3`` inputs under 1F1B, whatever
``M``.

Why recompute rather than keep residuals: a stage's vjp residuals include its weights (and
their casts under mixed precision); kept per in-flight microbatch they would cost ``S``
copies of the stage's weights, where recomputing costs one extra forward per microbatch
and stage (the compute of full rematerialisation, which a pipeline pays at scale anyway).

Example:
    >>> from kdist.parallel.pipeline import schedules
    >>> program = Program(schedules.build("1f1b", stages=4, microbatches=8))
    >>> program.input_slots, program.cotangent_slots  # buffer entries per stage
    (5, 1)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kdist.parallel.pipeline import every_stage as alike
from kdist.parallel.region import to_varying, varying_axes

AXIS = "stage"
(IDLE, FORWARD, BACKWARD, LAST_BACKWARD, INPUT_GRAD, LAST_INPUT_GRAD, WEIGHT_GRAD,
 LAST_WEIGHT_GRAD) = range(8)
ACTIONS = {"F": (FORWARD, IDLE), "B": (BACKWARD, LAST_BACKWARD),  # (a stage, the last)
           "I": (INPUT_GRAD, LAST_INPUT_GRAD), "W": (WEIGHT_GRAD, LAST_WEIGHT_GRAD)}


@dataclasses.dataclass(frozen=True)
class Program:
    """A table compiled to per-tick, per-stage integer arrays ``(ticks, stages)``:

    ``action`` (:data:`IDLE`, :data:`FORWARD`, :data:`BACKWARD`, :data:`LAST_BACKWARD`),
    ``microbatch``, ``chunk``; ``read`` (the input-buffer slot a task's input is in; -1:
    the schedule's inputs), ``cotangent`` (the slot its cotangent is in); ``write`` and
    ``write_cotangent`` (the slot what arrives at the end of the tick goes into; -1: none).
    ``input_slots`` and ``cotangent_slots``: the buffers' sizes (the most any stage holds).
    """

    table: object
    action: np.ndarray = None
    microbatch: np.ndarray = None
    chunk: np.ndarray = None
    read: np.ndarray = None
    cotangent: np.ndarray = None
    write: np.ndarray = None
    write_cotangent: np.ndarray = None
    input_slots: int = 0
    cotangent_slots: int = 0

    def __post_init__(self):
        t = self.table
        S, V, shape = t.stages, t.stages * t.chunks, (t.ticks, t.stages)
        arrays = {name: np.full(shape, fill, np.int32) for name, fill in (
            ("action", IDLE), ("microbatch", 0), ("chunk", 0), ("read", -1),
            ("cotangent", 0), ("write", -1), ("write_cotangent", -1))}
        when = {}
        for tick, row in enumerate(t.cells):
            for s, task in enumerate(row):
                if task is None:
                    continue
                k = task.chunk * S + s
                when[(task.action, task.microbatch, k)] = tick
                arrays["microbatch"][tick, s] = task.microbatch
                arrays["chunk"][tick, s] = task.chunk
                if task.action not in ACTIONS:
                    raise ValueError(f"the interpreter runs F, B, I and W tasks; got {task}")
                # (the last virtual stage's forward waits for its B or I: IDLE)
                arrays["action"][tick, s] = ACTIONS[task.action][k == V - 1]
        # An input arrives at the end of the previous virtual stage's F and is read by this
        # one's F and B (I and W); a cotangent arrives at the end of the next one's B (I),
        # read by this one's B (I and W).
        backward = ("B",) if ("B", 0, 0) in when else ("I", "W")
        inputs = [(k % S, when[("F", m, k - 1)], when[(backward[-1], m, k)],
                   [when[(a, m, k)] for a in ("F",) * (k < V - 1) + backward])
                  for m in range(t.microbatches) for k in range(1, V)]
        cotangents = [(k % S, when[(backward[0], m, k + 1)], when[(backward[-1], m, k)],
                       [when[(a, m, k)] for a in backward])
                      for m in range(t.microbatches) for k in range(V - 1)]
        sizes = {}
        for name, write, read, intervals in (("input", "write", "read", inputs),
                                             ("cotangent", "write_cotangent", "cotangent",
                                              cotangents)):
            sizes[name] = _assign_slots(intervals, arrays[write], arrays[read])
        for name, value in arrays.items():
            value.setflags(write=False)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "input_slots", sizes["input"])
        object.__setattr__(self, "cotangent_slots", sizes["cotangent"])


# Per action code, a task's matmul FLOPs in forwards of its chunk's layers, as compiled
# (tests/parallel/test_interpreter.py holds them): a backward recomputes its forward; the
# head's share on the last stage is left out.
TASK_COSTS = (0, 1, 3, 3, 2, 2, 3, 3)


def step_forwards(program: Program, cost=TASK_COSTS) -> float:
    """The step's length in forwards of one stage's layers (all its chunks'), every tick
    as long as its costliest task; ``cost`` per action code in forwards of one chunk.

    Example:
        >>> from kdist.parallel.pipeline import schedules
        >>> step_forwards(Program(schedules.build("1f1b", stages=4, microbatches=8)))
        43.0
    """
    per_cell = np.asarray(cost, dtype=np.float64)[program.action]  # (ticks, stages)
    return float(per_cell.max(axis=1).sum() / program.table.chunks)


def lockstep_bubble(program: Program, cost=TASK_COSTS) -> float:
    """The idle share of the devices' time when every tick lasts as long as its costliest
    task — the interpreter's ticks end in a collective-permute all stages take part in, so a
    stage that ran a forward waits for its neighbour's backward. ``cost``: per action code
    (:data:`IDLE` ... :data:`LAST_WEIGHT_GRAD`), e.g. the compiled FLOPs of each branch
    (:func:`kdist.hlo.branch_flops`). With every task costing the same it is the share of
    idle cells; with a backward costing more than a forward, more where a tick mixes
    kinds (a forward idles beside a backward): zero-bubble's, not 1F1B's or
    interleaved's, whose ticks run one kind (:data:`kdist.parallel.pipeline.schedules.LOCKSTEP`).

    Example:
        >>> from kdist.parallel.pipeline import schedules
        >>> p = Program(schedules.build("1f1b", stages=4, microbatches=8))
        >>> round(lockstep_bubble(p, [0, 1, 1, 1, 1, 1, 1, 1]), 12) == round(
        ...     float((p.action == IDLE).mean()), 12)
        True
    """
    per_cell = np.asarray(cost, dtype=np.float64)[program.action]  # (ticks, stages)
    return float(1 - per_cell.sum() / (program.table.stages * per_cell.max(axis=1).sum()))


def _assign_slots(intervals, write, read) -> int:
    """Gives every ``(stage, arrives, last_read, reads)`` value a buffer slot free from its
    arrival (written at the end of that tick) to its last read (a slot read at a tick can
    take a new value at that tick's end); fills ``write``/``read``; returns the slots used."""
    free_at: dict[int, list[int]] = {}  # stage -> per slot, the tick it is free from
    for stage, arrives, last, reads in sorted(intervals, key=lambda i: i[1]):
        slots = free_at.setdefault(stage, [])
        slot = next((i for i, tick in enumerate(slots) if tick <= arrives), len(slots))
        if slot == len(slots):
            slots.append(0)
        slots[slot] = last
        write[arrives, stage] = slot
        for tick in reads:
            read[tick, stage] = slot
    return max((len(s) for s in free_at.values()), default=0) or 1


class Task(NamedTuple):
    """What one tick's task gives back (zeros where it computes nothing)."""

    output: Any  # F's activation, sent to the next stage
    d_input: Any  # B's or I's input cotangent, sent to the previous stage
    d_weights: list  # this chunk's weight gradient (B, W)
    d_loss_weights: Any  # the loss head's gradient (the last virtual stage)
    loss: Any  # this microbatch's loss (the last virtual stage's B or I; layers' at B, I)
    statistics: Any = ()  # the layers' statistics of this microbatch (B, I; see interpret)


class Carry(NamedTuple):
    """What the scan over ticks carries on each device."""

    inputs: Any  # (input_slots, b, ...): inputs kept from F until their B (or W)
    cotangents: Any  # (cotangent_slots, b, ...): cotangents arrived, until read
    d_weights: list  # gradients accumulated per chunk, like the weights
    d_loss_weights: Any
    d_xm: Any  # (M, b, ...): the inputs' cotangents (stage 0)
    loss: Any
    statistics: Any = ()  # summed over microbatches


def interpret(program: Program, stage_fn, loss_fn, weights, loss_weights, xm, data=None,
              shared=None, every_stage=False, statistics=None, loss_axes=None):
    """One device's part of ``program`` (inside a ``shard_map`` with ``stage`` manual).

    ``stage_fn(chunk_weights, x, data_m, chunk)`` applies this device's layers of model
    ``chunk`` to a microbatch's activation ``x`` (``(b, ...)``, the shape it returns);
    ``loss_fn(loss_weights, y, data_m)`` is that microbatch's share of the loss from the
    last virtual stage's output (the step's loss is their sum). ``data``: a pytree of
    ``(M, b, ...)`` arrays (masks, positions, targets, microbatch indices for seeds), of
    which both get microbatch ``m``'s slices ``data_m``. ``weights``: arrays with a leading
    chunk dimension (``(v, ...)``); ``xm``: the inputs ``(M, b, ...)`` (read on stage 0
    only); ``shared``: a dict of arrays every microbatch gets whole (a dropout seed), merged
    into ``data_m`` (then a dict). Returns ``(loss, d_weights, d_loss_weights, d_xm)``, each this
    device's part: the loss and ``d_loss_weights`` on the last stage, ``d_xm`` on stage 0,
    zeros elsewhere. ``every_stage``: every stage runs each tick's kind of task, idle ones
    on zeros (:mod:`kdist.parallel.pipeline.every_stage`: collectives among all devices inside the
    layers, as ring attention's).

    ``statistics``: None, or a pytree of shapes (``jax.ShapeDtypeStruct``): then
    ``stage_fn`` returns ``(y, (loss, stats))`` — the losses its layers add (a MoE layer's
    load balance: part of the step's loss, differentiated with it; the same on every
    device that splits the rows, so counted once) and statistics of those shapes (not
    differentiated), both counted once per microbatch (at its ``B``, or ``I``) — and the
    result gains the statistics' sum over microbatches as a fifth element, this device's.
    ``loss_axes``: the axes besides ``stage`` over which the caller sums the devices'
    losses (default: every axis the inputs vary over). A layers' loss the same on several
    of them is divided among them; over an axis an enclosing region reduces (kdist's
    per-device loss averages over its batch axes) each device keeps the whole value.
    """
    table = program.table
    S, v = table.stages, table.chunks
    s = jax.lax.axis_index(AXIS)
    # Round the ring only when a microbatch goes round again (interleaved chunks).
    ring = S if v > 1 else S - 1
    forward_perm = [(i, (i + 1) % S) for i in range(ring)]
    backward_perm = [((i + 1) % S, i) for i in range(ring)]
    columns = {name: jnp.asarray(getattr(program, name)) for name in (
        "action", "microbatch", "chunk", "read", "cotangent", "write", "write_cotangent")}
    zeros_x = jnp.zeros(xm.shape[1:], xm.dtype)
    varying = _varying_axes(weights, loss_weights, xm, data) | {AXIS}
    kinds = jnp.asarray(alike.forward_ticks(program)) if every_stage else None

    def vary(tree):
        return jax.tree.map(lambda a: to_varying(a, varying), tree)

    def zero(tree):
        return vary(jax.tree.map(jnp.zeros_like, tree))

    def layers(w, x, data_m, c):  # the stage's layers: (y, their loss, their statistics)
        if statistics is None:
            return stage_fn(w, x, data_m, c), vary(jnp.zeros((), jnp.float32)), ()
        y, (loss, stats) = stage_fn(w, x, data_m, c)
        # The same on every device splitting the rows (and tokens): the step's loss sums
        # over them (schedule_region), so each holds its share; the cotangent 1 each gets
        # is summed back (the typing's transpose) to 1 for the one value.
        summed = varying if loss_axes is None else set(loss_axes) & varying
        copies = math.prod(jax.lax.axis_size(a) for a in summed - {AXIS}
                           - set(varying_axes(loss)))
        return y, to_varying(loss.astype(jnp.float32), varying) / copies, stats

    def tick(carry: Carry, t):
        at = {name: col[t, s] for name, col in columns.items()}
        m, c = at["microbatch"], at["chunk"]
        data_m = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, keepdims=False),
                              data)
        if shared:
            data_m = {**data_m, **shared}
        w = [jax.lax.dynamic_index_in_dim(a, c, keepdims=False) for a in weights]
        x = jnp.where(at["read"] < 0, jax.lax.dynamic_index_in_dim(xm, m, keepdims=False),
                      jax.lax.dynamic_index_in_dim(carry.inputs, jnp.maximum(at["read"], 0),
                                                   keepdims=False))
        g = jax.lax.dynamic_index_in_dim(carry.cotangents, at["cotangent"], keepdims=False)

        def task(output=zeros_x, d_input=zeros_x, d_weights=None, d_loss_weights=None,
                 loss=None, stats=None):
            return vary(Task(output, d_input, zero(w) if d_weights is None else d_weights,
                             zero(loss_weights) if d_loss_weights is None else d_loss_weights,
                             jnp.zeros(()) if loss is None else loss,
                             vary(_zeros(statistics)) if stats is None else stats))

        def stage(w, x):  # ((y, the layers' loss), statistics): vjp's has_aux form
            y, loss, stats = layers(w, x, data_m, c)
            return (y, loss), stats

        one = vary(jnp.ones((), jnp.float32))

        def full(w, lw, x):  # the last virtual stage: its layers and the loss
            (y, loss), stats = stage(w, x)
            return loss_fn(lw, y, data_m).astype(jnp.float32) + loss, stats

        def idle(w, x, g):
            return task()

        def forward(w, x, g):
            return task(output=stage(w, x)[0][0])

        def backward(w, x, g):
            (_, loss), vjp, stats = jax.vjp(stage, w, x, has_aux=True)
            dw, dx = vjp((g, one))
            return task(d_input=dx, d_weights=dw, loss=loss, stats=stats)

        def last_backward(w, x, g):
            value, vjp, stats = jax.vjp(full, w, vary(loss_weights), x, has_aux=True)
            dw, dlw, dx = vjp(one)
            return task(d_input=dx, d_weights=dw, d_loss_weights=dlw, loss=value, stats=stats)

        def input_grad(w, x, g):  # the layers' loss and statistics are counted here
            (_, loss), vjp, stats = jax.vjp(lambda x: stage(w, x), x, has_aux=True)
            return task(d_input=vjp((g, one))[0], loss=loss, stats=stats)

        def last_input_grad(w, x, g):  # the loss is counted here, not again at W
            value, vjp, stats = jax.vjp(lambda x: full(w, vary(loss_weights), x), x,
                                        has_aux=True)
            return task(d_input=vjp(one)[0], loss=value, stats=stats)

        def weight_grad(w, x, g):
            _, vjp, _ = jax.vjp(lambda w: stage(w, x), w, has_aux=True)
            return task(d_weights=vjp((g, one))[0])

        def last_weight_grad(w, x, g):
            _, vjp, _ = jax.vjp(lambda w, lw: full(w, lw, x), w, vary(loss_weights),
                                has_aux=True)
            dw, dlw = vjp(one)
            return task(d_weights=dw, d_loss_weights=dlw)

        # Everything typed varying over every manual axis before any vjp: a replicated
        # weight's cotangent would otherwise be summed inside the branch, a collective
        # that only the devices taking that branch would reach (they would wait forever).
        # The sums run once, after the schedule.
        if every_stage:
            done = Task(*alike.run_task(
                kinds[t], at["action"], w, x, g, lambda w, x: layers(w, x, data_m, c),
                lambda lw, y: loss_fn(lw, y, data_m), loss_weights, vary, one,
                vary(_zeros(statistics))))
        else:
            done = jax.lax.switch(
                at["action"], (idle, forward, backward, last_backward, input_grad,
                               last_input_grad, weight_grad, last_weight_grad), vary(w), x, g)
        d_w = [jax.lax.dynamic_update_index_in_dim(
            acc, jax.lax.dynamic_index_in_dim(acc, c, keepdims=False) + grad, c, 0)
            for acc, grad in zip(carry.d_weights, done.d_weights)]
        sends_back = (at["action"] >= BACKWARD) & (at["action"] <= LAST_INPUT_GRAD)  # B, I
        first = (s == 0) & (c == 0) & sends_back  # virtual stage 0's B or I
        d_xm = jax.lax.dynamic_update_index_in_dim(
            carry.d_xm, jnp.where(first, done.d_input, jax.lax.dynamic_index_in_dim(
                carry.d_xm, m, keepdims=False)), m, 0)
        arrived = jax.lax.ppermute(done.output, AXIS, forward_perm)
        returned = jax.lax.ppermute(done.d_input, AXIS, backward_perm)
        return Carry(inputs=_store(carry.inputs, arrived, at["write"]),
                     cotangents=_store(carry.cotangents, returned, at["write_cotangent"]),
                     d_weights=d_w,
                     d_loss_weights=jax.tree.map(jnp.add, carry.d_loss_weights,
                                                 done.d_loss_weights),
                     d_xm=d_xm, loss=carry.loss + done.loss,
                     statistics=jax.tree.map(jnp.add, carry.statistics, done.statistics)), None

    init = vary(Carry(
        inputs=jnp.zeros((program.input_slots,) + xm.shape[1:], xm.dtype),
        cotangents=jnp.zeros((program.cotangent_slots,) + xm.shape[1:], xm.dtype),
        d_weights=[jnp.zeros_like(w) for w in weights],
        d_loss_weights=jax.tree.map(jnp.zeros_like, loss_weights),
        d_xm=jnp.zeros_like(xm), loss=jnp.zeros((), jnp.float32),
        statistics=_zeros(statistics)))
    final, _ = jax.lax.scan(tick, init, jnp.arange(table.ticks))
    result = (final.loss, final.d_weights, final.d_loss_weights, final.d_xm)
    return result if statistics is None else (*result, final.statistics)


def _zeros(template):
    """Zeros shaped like ``template``'s leaves (arrays or ``jax.ShapeDtypeStruct``)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), template or ())


def _store(buffer, value, slot):
    """``buffer[slot] = value`` where ``slot >= 0``."""
    index = jnp.maximum(slot, 0)
    old = jax.lax.dynamic_index_in_dim(buffer, index, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, value, old),
                                               index, 0)


def _varying_axes(*trees) -> set:
    axes = set()
    for leaf in jax.tree.leaves(trees):
        axes |= set(varying_axes(leaf))
    return axes
