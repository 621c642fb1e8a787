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

import jax
import jax.numpy as jnp
import numpy as np

from kdist.parallel import reduction, region
from kdist.parallel.pipeline import every_stage as alike
from kdist.parallel.region import to_varying

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


def interpret(program: Program, stage_fn, loss_fn, weights, loss_weights, xm, data=None,
              shared=None, every_stage=False):
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

    def tick(carry, t):
        inputs, cotangents, d_w, d_lw, d_xm, loss = carry
        at = {name: col[t, s] for name, col in columns.items()}
        m, c = at["microbatch"], at["chunk"]
        data_m = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, keepdims=False),
                              data)
        if shared:
            data_m = {**data_m, **shared}
        w = [jax.lax.dynamic_index_in_dim(a, c, keepdims=False) for a in weights]
        x = jnp.where(at["read"] < 0, jax.lax.dynamic_index_in_dim(xm, m, keepdims=False),
                      jax.lax.dynamic_index_in_dim(inputs, jnp.maximum(at["read"], 0),
                                                   keepdims=False))
        g = jax.lax.dynamic_index_in_dim(cotangents, at["cotangent"], keepdims=False)

        def idle(w, x, g):
            return vary((zeros_x, zeros_x, zero(w), zero(loss_weights), jnp.zeros(())))

        def forward(w, x, g):
            y = stage_fn(w, x, data_m, c)
            return vary((y, zeros_x, zero(w), zero(loss_weights), jnp.zeros(())))

        def backward(w, x, g):
            _, vjp = jax.vjp(lambda w, x: stage_fn(w, x, data_m, c), w, x)
            dw, dx = vjp(g)
            return vary((zeros_x, dx, dw, zero(loss_weights), jnp.zeros(())))

        def full(w, lw, x):  # the last virtual stage: its layers and the loss
            return loss_fn(lw, stage_fn(w, x, data_m, c), data_m).astype(jnp.float32)

        one = vary(jnp.ones((), jnp.float32))

        def last_backward(w, x, g):
            value, vjp = jax.vjp(full, w, vary(loss_weights), x)
            dw, dlw, dx = vjp(one)
            return vary((zeros_x, dx, dw, dlw, value))

        def input_grad(w, x, g):
            _, vjp = jax.vjp(lambda x: stage_fn(w, x, data_m, c), x)
            return vary((zeros_x, vjp(g)[0], zero(w), zero(loss_weights), jnp.zeros(())))

        def last_input_grad(w, x, g):  # the loss is counted here, not again at W
            value, vjp = jax.vjp(lambda x: full(w, vary(loss_weights), x), x)
            return vary((zeros_x, vjp(one)[0], zero(w), zero(loss_weights), value))

        def weight_grad(w, x, g):
            _, vjp = jax.vjp(lambda w: stage_fn(w, x, data_m, c), w)
            return vary((zeros_x, zeros_x, vjp(g)[0], zero(loss_weights), jnp.zeros(())))

        def last_weight_grad(w, x, g):
            _, vjp = jax.vjp(lambda w, lw: full(w, lw, x), w, vary(loss_weights))
            dw, dlw = vjp(one)
            return vary((zeros_x, zeros_x, dw, dlw, jnp.zeros(())))

        # Everything typed varying over every manual axis before any vjp: a replicated
        # weight's cotangent would otherwise be summed inside the branch, a collective
        # that only the devices taking that branch would reach (they would wait forever).
        # The sums run once, after the schedule.
        if every_stage:
            y, dx, dw, dlw, value = alike.run_task(
                kinds[t], at["action"], w, x, g, lambda w, x: stage_fn(w, x, data_m, c),
                lambda lw, y: loss_fn(lw, y, data_m), loss_weights, vary)
        else:
            y, dx, dw, dlw, value = jax.lax.switch(
                at["action"], (idle, forward, backward, last_backward, input_grad,
                               last_input_grad, weight_grad, last_weight_grad), vary(w), x, g)
        d_w = [jax.lax.dynamic_update_index_in_dim(
            acc, jax.lax.dynamic_index_in_dim(acc, c, keepdims=False) + grad, c, 0)
            for acc, grad in zip(d_w, dw)]
        d_lw = jax.tree.map(jnp.add, d_lw, dlw)
        sends_back = (at["action"] >= BACKWARD) & (at["action"] <= LAST_INPUT_GRAD)  # B, I
        first = (s == 0) & (c == 0) & sends_back  # virtual stage 0's B or I
        d_xm = jax.lax.dynamic_update_index_in_dim(
            d_xm, jnp.where(first, dx, jax.lax.dynamic_index_in_dim(d_xm, m, keepdims=False)),
            m, 0)
        arrived = jax.lax.ppermute(y, AXIS, forward_perm)
        returned = jax.lax.ppermute(dx, AXIS, backward_perm)
        inputs = _store(inputs, arrived, at["write"])
        cotangents = _store(cotangents, returned, at["write_cotangent"])
        return (inputs, cotangents, d_w, d_lw, d_xm, loss + value), None

    buffer = (program.input_slots,) + xm.shape[1:]
    init = vary((jnp.zeros(buffer, xm.dtype),
                 jnp.zeros((program.cotangent_slots,) + xm.shape[1:], xm.dtype),
                 [jnp.zeros_like(w) for w in weights],
                 jax.tree.map(jnp.zeros_like, loss_weights),
                 jnp.zeros_like(xm), jnp.zeros((), jnp.float32)))
    (_, _, d_w, d_lw, d_xm, loss), _ = jax.lax.scan(tick, init, jnp.arange(table.ticks))
    return loss, d_w, d_lw, d_xm


def _store(buffer, value, slot):
    """``buffer[slot] = value`` where ``slot >= 0``."""
    index = jnp.maximum(slot, 0)
    old = jax.lax.dynamic_index_in_dim(buffer, index, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, value, old),
                                               index, 0)


def _varying_axes(*trees) -> set:
    from kdist.parallel.region import varying_axes

    axes = set()
    for leaf in jax.tree.leaves(trees):
        axes |= set(varying_axes(leaf))
    return axes


def value_and_grad(table, stage_fn, loss_fn, weights, loss_weights, xm, data=None,
                   shared=None, *, mesh, batch_axes=(), weight_axes=None, token_axes=(),
                   specs=None, every_stage=False):
    """The loss of ``table``'s schedule and its gradients, over ``mesh``.

    ``weights``: stacked arrays ``(v, L / v, ...)`` whose second dimension is split over
    ``stage`` (kdist's layer stacks under circular repeats: device ``s`` holds layers
    ``(c S + s) K ... (c S + s + 1) K - 1`` of chunk ``c``); ``stage_fn`` gets one chunk's
    ``(K, ...)`` slices. ``xm``: ``(M, B, ...)`` microbatches, rows split over
    ``batch_axes``, and so are ``data``'s; ``loss_weights`` and ``shared`` replicated.
    ``stage_fn`` and ``loss_fn`` as in :func:`interpret` (on each device's rows; the loss
    is the sum over devices). ``weight_axes``: per weight, its mesh axes per dimension
    (default: ``(None, "stage")``); a dimension over ``fsdp`` (a batch axis too: ZeRO-3)
    is all-gathered once before the schedule and its gradient reduce-scattered once after
    it, as GPipe's stages do (:func:`kdist.parallel.pipeline.stack.pipelined`).
    ``token_axes``: axes that split every sequence's tokens (``seq``): the loss and every
    gradient are partial over them too, and summed over them like over the batch axes.
    ``specs``: ``(xm_spec, data_specs)`` where arrays are split over more than their rows
    (tokens over ``seq``); default: rows over ``batch_axes``. ``every_stage``: as in
    :func:`interpret`. Returns ``(loss, (d_weights, d_loss_weights, d_xm))``.
    """
    from jax.sharding import PartitionSpec as P

    program = Program(table)
    rows = tuple(batch_axes) or None
    axes = [tuple(a) for a in weight_axes] if weight_axes else [(None, AXIS)] * len(weights)
    w_specs = [P(*a) for a in axes]
    x_spec, data_specs = specs or (P(None, rows), jax.tree.map(lambda _: P(None, rows), data))
    partial = tuple(batch_axes) + tuple(token_axes)  # what a device's gradient is partial over
    everything = (AXIS,) + partial
    # Every axis manual but a ``model`` of size > 1 (axes not named have size 1 here): that
    # one stays with XLA's partitioner inside every stage (tensor parallelism), as in
    # GPipe's stages. Only then, since a partly manual region changes what XLA emits: its
    # all-reduces carry a reducer whose root is a sharding annotation, and XLA:CPU's
    # promotion of 16-bit all-reduces to float32 (AllReducePromotion, jaxlib 0.10) aborts
    # the process on such a reducer ("Invalid binary instruction opcode copy") — so the
    # input's bfloat16 cotangent is summed over stage in float32 there (exact: one stage
    # holds it, the others add zeros).
    auto = {"model"} if dict(mesh.shape).get("model", 1) > 1 else set()

    def sum_over_stage(g):
        if auto and jnp.issubdtype(g.dtype, jnp.floating) and jnp.finfo(g.dtype).bits < 32:
            return jax.lax.psum(g.astype(jnp.float32), AXIS).astype(g.dtype)
        return jax.lax.psum(g, AXIS)

    # kdist's one gradient reduction (float32 here: under gradient_reduction's own region
    # the weights arrive gathered and their gradients leave for its collective instead).
    sizes = dict(mesh.shape)
    plans = [reduction.gradient_plan(a, set(partial), partial, sizes, automatic=())
             for a in axes]

    def device(weights, loss_weights, xm, data, shared):
        weights = [reduction.gather(w, plan) for w, plan in zip(weights, plans)]
        loss, d_w, d_lw, d_xm = interpret(program, stage_fn, loss_fn, weights,
                                          loss_weights, xm, data, shared, every_stage)
        loss = jax.lax.psum(loss, everything)
        d_w = [reduction.reduce(g, plan) for g, plan in zip(d_w, plans)]
        d_lw = jax.tree.map(lambda g: jax.lax.psum(g, everything), d_lw)
        return loss, d_w, d_lw, sum_over_stage(d_xm)

    lw_specs = jax.tree.map(lambda _: P(), loss_weights)
    # In a kdist region, so that the layers inside know their arrays are blocks.
    loss, d_w, d_lw, d_xm = region.shard_map(
        device, mesh=mesh, axes=set(mesh.axis_names) - auto,
        in_specs=(w_specs, lw_specs, x_spec, data_specs,
                  jax.tree.map(lambda _: P(), shared)),
        out_specs=(P(), w_specs, lw_specs, x_spec))(list(weights), loss_weights, xm, data,
                                                     shared)
    return loss, (d_w, d_lw, d_xm)


def scheduled_loss(table, stage_fn, loss_fn, weights, loss_weights, xm, data=None,
                   shared=None, *, mesh, batch_axes=(), weight_axes=None, token_axes=(),
                   specs=None, every_stage=False):
    """:func:`value_and_grad`'s loss as a function JAX differentiates like any other: its
    forward pass runs the whole schedule (forwards and backwards) and keeps the gradients,
    its backward pass scales them by the loss's cotangent — so what computes ``xm`` (an
    embedding) and what uses the weights elsewhere (a tied head) get their gradients from
    the enclosing ``jax.grad``. ``data`` gets none (masks, targets, indices).

    Example:
        >>> grads = jax.grad(lambda w: scheduled_loss(table, f, loss, w, lw, xm,  # doctest: +SKIP
        ...                                           mesh=mesh))(weights)
    """
    def run(weights, loss_weights, xm, data, shared):
        return value_and_grad(table, stage_fn, loss_fn, weights, loss_weights, xm, data,
                              shared, mesh=mesh, batch_axes=batch_axes,
                              weight_axes=weight_axes, token_axes=token_axes, specs=specs,
                              every_stage=every_stage)

    inputs = {}  # the types of data and shared (static), for their zero cotangents

    @jax.custom_vjp
    def loss(weights, loss_weights, xm, data, shared):
        return run(weights, loss_weights, xm, data, shared)[0]

    def forward(weights, loss_weights, xm, data, shared):
        leaves, inputs["tree"] = jax.tree.flatten((data, shared))
        inputs["types"] = [(a.shape, a.dtype, region.varying_axes(a)) for a in leaves]
        return run(weights, loss_weights, xm, data, shared)

    def backward(grads, cotangent):
        scaled = jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), grads)
        return scaled + jax.tree.unflatten(inputs["tree"],
                                           [_no_cotangent(*t) for t in inputs["types"]])

    loss.defvjp(forward, backward)
    return loss(list(weights), loss_weights, xm, data, shared)


def _no_cotangent(shape, dtype, varying):
    """The zero cotangent of an input that is not differentiated (float0 for integers);
    from its shape, type and the manual axes it varies over (inside an enclosing region:
    kdist's per-device loss) only — the backward pass keeps no copy of it."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return to_varying(jnp.zeros(shape, dtype), varying)
    return np.zeros(shape, jax.dtypes.float0)
