"""The ``stage`` mesh axis: a layer stack split into pipeline stages, microbatches flowing
through them (GPipe), optionally in circular repeats.

A scanned layer stack (:class:`kdist.models.scan.LayerStack`) holds its L layers as weights
of shape ``(L, ...)`` whose first dimension is sharded over ``stage``: stage ``s`` of S
holds layers ``s K ... (s + 1) K - 1`` (``K = L / S``). With ``R`` circular repeats the
weights are ``(R, L / R, ...)``, sharded on the second dimension, so stage ``s`` holds
``K = L / (R S)`` layers of each repeat ``r``: layers ``(r S + s) K ...`` — non-adjacent
stages of the model on one device, and a microbatch goes round the ring of stages R times.

Only the stack runs in the pipeline; the embedding and the head (and the loss) run
outside, on every stage, over that stage group's rows (``stage`` does not split the
batch), with the vocabulary split over the stages when there is no ``model`` axis
(``kdist.parallel.rules.FALLBACK_MESH``: each stage computes a ``1 / S`` slice of the
logits): nothing but activations crosses between stages, and the head does not lengthen
every pipeline iteration as it would on the last stage.

The schedule (:func:`pipelined`) runs inside a ``jax.shard_map`` over ``stage`` only — the
``data``, ``fsdp`` and ``model`` axes stay with XLA's partitioner inside every stage. The
batch of each replica group is cut into M microbatches; one ``lax.scan`` runs
``R M + S - 1`` iterations, in each of which every stage applies its K layers to the
activation it holds and sends the result to the next stage with one ``ppermute``. Stage
``s`` at iteration ``t`` works on virtual microbatch ``v = t - s`` (microbatch ``v mod M`` of
repeat ``v div M``); outside ``0 <= v < R M`` it is in the bubble and computes on zeros — never
on a leftover value, whose NaN a discarding ``where`` would still pass to the gradient.
The backward pass is the scan's gradient: the same schedule in reverse. The idle share of
the iterations, the *bubble*, is ``(S - 1) / (R M + S - 1)`` (:func:`bubble_fraction`).

The user changes only the distribution: ``kdist.distribution("stage=4,fsdp=2",
pipeline_microbatches=8, pipeline_repeats=2)``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kdist.parallel import region, rules
from kdist.parallel.layout import active, divisors
from kdist.parallel.mesh import REPLICA_AXES, batch_axes, summed_axes
from kdist.parallel.pipeline.settings import Schedule
from kdist.parallel.region import to_varying

AXIS = "stage"


def _settings():
    """``(stages, repeats, microbatches)`` of the active distribution (1, 1, 1 without)."""
    dist = active()
    if dist is None:
        return 1, 1, 1
    pipe = dist.config.pipeline
    return (1, 1, 1) if pipe is None else (dist.config.stages, pipe.repeats, pipe.microbatches)


def stages() -> int:
    """The size of the active distribution's ``stage`` axis (1 without a pipeline)."""
    return _settings()[0]


def stack_shape(num_layers: int) -> tuple[int, ...]:
    """The leading (layer) dimensions of a stacked weight under the active distribution:
    ``(L,)``, or ``(R, L / R)`` with R circular repeats. Raises ``ValueError`` if the layers
    do not divide into equal stages (x repeats), naming the valid values.

    Example:
        >>> stack_shape(12)  # no pipeline
        (12,)
    """
    stages, repeats, _ = _settings()
    if stages > 1 and num_layers % (stages * repeats):
        valid_stages = [d for d in divisors(num_layers) if d > 1
                        and num_layers % (d * repeats) == 0]
        valid_repeats = [r for r in divisors(num_layers) if num_layers % (r * stages) == 0]
        fixes = []
        if valid_stages:
            fixes.append(f"a 'stage' mesh axis among {valid_stages} with "
                         f"pipeline_repeats={repeats}")
        if valid_repeats:
            fixes.append(f"pipeline_repeats among {valid_repeats} with stage={stages}")
        fixes.append(f"a layer count that is a multiple of {stages * repeats}")
        raise ValueError(
            f"num_layers={num_layers} does not divide into {stages} pipeline stages x "
            f"{repeats} repeats (stages get equal block counts). Use "
            + ", or ".join(fixes) + ".")
    return (num_layers,) if repeats == 1 else (repeats, num_layers // repeats)


def schedule_for(batch, num_layers: int, training=None) -> Schedule | None:
    """The schedule a stack of ``num_layers`` runs with for a batch of ``batch`` rows, or
    None when it runs unpipelined (no ``stage`` axis; or, outside training, a batch that
    does not divide into microbatches — e.g. generating one sequence). In training such a
    batch is a ``ValueError`` listing the batch sizes and microbatch counts that fit.

    Example:
        >>> schedule_for(8, 4) is None  # no distribution: no pipeline
        True
    """
    stages, repeats, microbatches = _settings()
    if stages == 1:
        return None
    dist = active()
    # Rows are cut into microbatches per replica group; inside a region that splits rows
    # already (per-device loss, replica groups) ``batch`` is a block, and only the replica
    # axes still automatic divide it further.
    automatic = region.current().automatic(dist.mesh_shape)
    replicas = math.prod(dist.mesh_shape[a] for a in batch_axes(dist.mesh_shape, automatic))
    if not isinstance(batch, int) or batch % (replicas * microbatches):
        if not training:
            return None
        per_replica = batch // replicas if isinstance(batch, int) and batch % replicas == 0 \
            else None
        counts = [m for m in divisors(per_replica, 4096) if m >= stages] if per_replica else []
        raise ValueError(
            f"The batch of {batch} rows does not divide into pipeline_microbatches="
            f"{microbatches} for each of the {replicas} replicas of mesh '{dist.spec}' "
            f"(it must be a multiple of {replicas} x {microbatches} = "
            f"{replicas * microbatches}). Use a global batch that is a multiple of "
            f"{replicas * microbatches}"
            + (f", or pipeline_microbatches among {counts}" if counts else "") + ".")
    return Schedule(stages, repeats, microbatches, replicas, num_layers,
                    dist.device_mesh.backend_mesh)


def layout_axes(variable) -> tuple:
    """A weight's mesh axes per dimension under the active distribution (its layout)."""
    return tuple(active().get_variable_layout(variable).axes)


def _to_microbatches(a, schedule: Schedule):
    """``(B, ...)`` -> ``(M, B / M, ...)``: each replica group's rows cut into M, so every
    microbatch keeps the batch's sharding over the replica axes (no data moves)."""
    g, m = schedule.replicas, schedule.microbatches
    rows = a.shape[0] // (g * m)
    a = jnp.swapaxes(a.reshape((g, m, rows) + a.shape[1:]), 0, 1)
    return a.reshape((m, g * rows) + a.shape[3:])


def _from_microbatches(a, schedule: Schedule):
    """The inverse of :func:`_to_microbatches`."""
    g, m = schedule.replicas, schedule.microbatches
    rows = a.shape[1] // g
    a = jnp.swapaxes(a.reshape((m, g, rows) + a.shape[2:]), 0, 1)
    return a.reshape((g * m * rows,) + a.shape[3:])


# The logical axes of the stack's input and of the keyword arguments LayerStack passes on
# (kdist.models.scan): what the stages' shard_map splits over its manual axes.
INPUT_AXES = {
    "x": ("batch", "length", "embed"),
    "attention_mask": ("batch", None, None, "length"),  # key padding under a split sequence
    "positions": ("batch", "length"),
    "segment_ids": ("batch", "length"),
}


def pipelined(layer, weights, x, kwargs, seed, schedule: Schedule, layouts=None, state=None):
    """``x`` ``(B, T, D)`` through the stacked layers with the pipeline ``schedule``.

    ``layer(w, h, kwargs, index, seed)`` applies the layer of global index ``index`` with
    weight slices ``w`` to ``h``; ``weights`` are the stacked arrays (``(L, ...)`` or
    ``(R, L / R, ...)``, layers sharded over ``stage``); ``kwargs`` go to every layer —
    those with one row per batch row (masks, positions) are cut into microbatches like
    ``x`` (their axes: :data:`INPUT_AXES`); ``seed`` (a dropout seed, or None) is folded
    with each device's batch shard; ``layouts``: each weight's mesh axes per dimension (its
    variable's layout; default: only the layer dimension over ``stage``). Returns
    ``(B, T, D)`` on every stage.

    ``state``: None, or the layers' non-trainable state as ``(L, ...)`` arrays (small,
    whole on every device): then ``layer(w, h, kwargs, index, seed, rows)`` gets layer
    ``index``'s rows and returns ``(h, new rows, the losses it added)``, and the result is
    ``(y, loss, sums)``: the layers' losses, each microbatch's weighted ``1 / M``, and the
    new rows summed over microbatches ``(L, ...)`` (:class:`kdist.models.scan.LayerStack`).

    Every axis but ``model`` is manual in the stages (:mod:`kdist.parallel.region`): each
    device works on its own rows (the batch axes) and, under a ``seq`` axis, its own tokens
    (attention then runs per device, :mod:`kdist.parallel.context`); ``model`` stays with
    XLA (tensor parallelism inside each stage). Axes an enclosing region made manual (a
    replica group, the per-device loss of the explicit reduction) stay its: the stages'
    ``shard_map`` takes the others, and is differentiable nested. Each stage's weights are
    all-gathered over ``fsdp`` once per step (not once per iteration) where this region
    makes ``fsdp`` manual, and their gradient, accumulated on the device over the
    schedule's iterations, leaves through kdist's one gradient reduction
    (:func:`kdist.parallel.reduction.use`: a reduce-scatter over ``fsdp``, an all-reduce
    of the shard over the other summed axes) — where XLA's partitioner would reduce every
    iteration's partial gradient. The price: the stage's weights and their gradient
    unsharded over ``fsdp`` during the step.
    """
    from kdist.parallel import reduction

    sizes = active().mesh_shape
    batch = x.shape[0]
    per_row = {k for k, v in kwargs.items() if v.ndim and v.shape[0] == batch}
    xm = _to_microbatches(x, schedule)  # (M, b, T, D), b split over the replica axes
    kwm = {k: _to_microbatches(v, schedule) if k in per_row else v for k, v in kwargs.items()}
    lead = 1 if schedule.repeats == 1 else 2
    # Every axis but model manual (JAX's partial-auto lowering of debug callbacks handles
    # only one automatic axis); those already manual around us are not ours to split.
    wanted = frozenset(a for a in schedule.mesh.axis_names if a != "model")
    new = region.current().automatic(wanted)
    if layouts is None:
        layouts = [(None,) * (lead - 1) + (AXIS,) for _ in weights]
    w_specs = [P(*(a if a in new else None for a in axes)) for axes in layouts]
    summed = summed_axes(sizes, among=new)
    inside = tuple(sorted(region.current().automatic(sizes) - new))  # model
    plans = tuple(reduction.gradient_plan(axes, new, summed, sizes, automatic=inside)
                  for axes in layouts)

    def spec(name):  # a microbatched array: (M, ...) with the logical axes of `name`
        return P(None, *rules.activation_spec(INPUT_AXES.get(name, ("batch",)), sizes, new))

    program = functools.partial(_stage_program, layer, schedule, lead, frozenset(per_row),
                                plans)
    # The rows here are microbatch slices, not blocks of the global batch: no batch axes
    # for dropout's global row offsets (each device folds its own seed instead, below).
    stated = state is not None
    out = region.shard_map(
        program, mesh=schedule.mesh, axes=wanted,
        in_specs=(w_specs, spec("x"), {k: spec(k) if k in per_row else P() for k in kwm},
                  None if seed is None else P(), P() if stated else None),
        out_specs=(spec("x"), P(), P()) if stated else spec("x"))(
            list(weights), xm, kwm, seed, list(state) if stated else None)
    return (_from_microbatches(out[0], schedule), *out[1:]) if stated else \
        _from_microbatches(out, schedule)


def _stage_program(layer, schedule: Schedule, lead, per_row, plans, weights, xm, kwargs,
                   seed, state):
    """One device's program (inside ``shard_map``): its stage's part of the schedule, on its
    rows."""
    from kdist.parallel import reduction

    if seed is not None:  # each device's rows their own dropout masks
        # (over the axes of size > 1 only: the same index, and the seed then varies only
        # where the carry does, as the scan over ticks needs)
        split = batch_axes({a: jax.lax.axis_size(a) for a in REPLICA_AXES})
        seed = jax.random.fold_in(seed, jax.lax.axis_index(split) if split else 0)
    weights = [reduction.use(w, None, plan) for w, plan in zip(weights, plans)]
    return _schedule(layer, schedule, lead, per_row, weights, xm, kwargs, seed, state)


def _stage_layers(layer, weights, h, kw, first, seed, state, count, microbatches=1):
    """``h`` through this stage's ``count`` layers from global index ``first`` (weights
    ``(count, ...)``): ``h``, or with ``state`` (``(L, ...)`` arrays, whole) ``(h, (loss,
    sums))``: the losses the layers added, weighted ``1 / microbatches`` (the step's loss is
    the microbatches' mean), and their new state rows placed at their rows of ``(L, ...)``
    zeros."""
    if state is None:
        def body(h, xs):
            w, k = xs
            return layer(w, h, kw, first + k, seed), None

        return jax.lax.scan(body, h, (weights, jnp.arange(count)))[0]

    def stated(h, xs):
        w, k = xs
        rows = [jax.lax.dynamic_index_in_dim(a, first + k, keepdims=False) for a in state]
        h, rows, loss = layer(w, h, kw, first + k, seed, rows)
        return h, (rows, loss)

    h, (rows, losses) = jax.lax.scan(stated, h, (weights, jnp.arange(count)))
    sums = [jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(a), r.astype(a.dtype), first, 0)
            for a, r in zip(state, rows)]
    return h, (jnp.sum(losses) / microbatches, sums)


def _schedule(layer, schedule, lead, per_row, weights, xm, kwargs, seed, state=None):
    stages, repeats, micro = schedule.stages, schedule.repeats, schedule.microbatches
    per_stage = schedule.layers_per_stage
    s = jax.lax.axis_index(AXIS)
    # This stage's layers as (R, K, ...): repeat r, local layer k is global layer
    # (r S + s) K + k.
    weights = [w[None] for w in weights] if lead == 1 else weights
    zeros = jnp.zeros(xm.shape[1:], xm.dtype)
    # The inputs reach only stage 0: typed varying over stages once here, so the backward
    # pass sums their cotangent over stages once, not in every iteration.
    wire = _wire_dtype(xm.dtype, schedule.mesh)
    xm = to_varying(xm.astype(wire), {AXIS}).astype(xm.dtype)

    def apply_layers(r, h, kw):
        ws = [jax.lax.dynamic_index_in_dim(w, r, keepdims=False) for w in weights]
        return _stage_layers(layer, ws, h, kw, (r * stages + s) * per_stage, seed, state,
                             per_stage, micro)

    # Send to the next stage; round the ring only when a microbatch goes round again.
    perm = [(i, (i + 1) % stages) for i in range(stages if repeats > 1 else stages - 1)]

    def step(carry, t):
        shift, circ, out, extra = carry
        v = t - s  # this stage's virtual microbatch
        valid = (v >= 0) & (v < repeats * micro)
        v = jnp.clip(v, 0, repeats * micro - 1)
        m, r = v % micro, v // micro
        fresh = jax.lax.dynamic_index_in_dim(xm, jnp.minimum(t, micro - 1), keepdims=False)
        if repeats > 1:
            # Stage 0 keeps what comes back round the ring until its next repeat is due:
            # microbatch (t - S) mod M, back from the last stage after its repeat.
            back = t - stages
            keep = (s == 0) & (back >= 0) & (back < (repeats - 1) * micro)
            slot = jnp.maximum(back, 0) % micro
            kept = jax.lax.dynamic_index_in_dim(circ, slot, keepdims=False)
            circ = jax.lax.dynamic_update_index_in_dim(circ, jnp.where(keep, shift, kept),
                                                       slot, 0)
            again = jax.lax.dynamic_index_in_dim(circ, t % micro, keepdims=False)
            fresh = jnp.where(t < micro, fresh, again)
        h = jnp.where(s == 0, fresh, shift)
        h = jnp.where(valid, h, zeros)  # a bubble computes on zeros
        kw = {k: jax.lax.dynamic_index_in_dim(a, m, keepdims=False) if k in per_row else a
              for k, a in kwargs.items()}
        y = apply_layers(r, h, kw)
        if state is not None:  # a bubble's layers (on zeros) count nothing
            y, (loss, sums) = y
            extra = jax.tree.map(lambda a, b: a + jnp.where(valid, b, jnp.zeros_like(b)),
                                 extra, (loss, sums))
        done = (s == stages - 1) & valid & (r == repeats - 1)
        written = jax.lax.dynamic_index_in_dim(out, m, keepdims=False)
        out = jax.lax.dynamic_update_index_in_dim(
            out, jnp.where(done, y.astype(wire), written), m, 0)
        shift = jax.lax.ppermute(y, AXIS, perm)
        return (shift, circ, out, extra), None

    init = (zeros, jnp.zeros_like(xm) if repeats > 1 else jnp.zeros((), xm.dtype),
            jnp.zeros(xm.shape, wire))
    sizes = schedule.mesh.shape
    init = tuple(to_varying(c, {a for a in region.current().manual if sizes[a] > 1})
                 for c in init)
    # The layers' losses and state sums are the same on every device of a stage (the
    # layers sum their statistics over the rows' devices): typed as varying over stages.
    extra = () if state is None else jax.tree.map(
        lambda a: to_varying(jnp.zeros_like(a), {AXIS}), (jnp.zeros(()), state))
    (_, _, out, extra), _ = jax.lax.scan(step, (*init, extra),
                                         jnp.arange(schedule.iterations))
    # Only the last stage wrote: the sum over stages is its outputs, now on every stage.
    out = jax.lax.psum(out, AXIS).astype(xm.dtype)
    return out if state is None else (out, *jax.lax.psum(extra, AXIS))


def _wire_dtype(dtype, mesh):
    """The type of the two cross-stage sums (outputs, and the inputs' cotangent): float32
    on XLA:CPU, whose all-reduce promotion pass aborts on these bfloat16 all-reduces (jax
    0.10.2; it would promote them to float32 anyway), else the activations' own. The
    mesh's devices are the ones XLA compiles for (a TPU topology's ahead of time)."""
    return jnp.float32 if mesh.devices.flat[0].platform == "cpu" else dtype


def scheduled_name() -> str:
    """The active distribution's ``pipeline_schedule`` (``"gpipe"`` without a pipeline)."""
    dist = active()
    return "gpipe" if dist is None else dist.config.schedule


def scheduled(layer, weights, x, kwargs, seed, schedule: Schedule, loss_fn, loss_weights,
              targets, layouts=None, state=None):
    """The loss of ``x`` ``(B, T, D)`` through the stacked layers and ``loss_fn``, with the
    distribution's ``pipeline_schedule`` run by :mod:`kdist.parallel.pipeline.interpreter` (the loss
    joins the schedule, so a microbatch's backward starts as soon as its forward is done).

    ``layer``, ``weights``, ``kwargs`` and ``seed`` as in :func:`pipelined`;
    ``loss_fn(loss_weights, y, targets_m)`` is a microbatch's share of the loss on one
    device's rows (the step's loss is the sum over microbatches and devices); ``targets``
    a pytree of ``(B, ...)`` arrays cut into microbatches like ``x``; ``layouts`` each
    weight's mesh axes per dimension, as in :func:`pipelined` (a dimension over ``fsdp`` is
    gathered once per step, its gradient reduce-scattered once). Differentiable in
    ``weights``, ``loss_weights`` and ``x``. Each device folds the dropout seed with its
    row shard, as :func:`pipelined` does. ``state``: as in :func:`pipelined`; then the
    result is ``(loss, sums)``, the layers' losses (each microbatch's weighted ``1 / M``)
    included in the loss.
    """
    from kdist.parallel.pipeline import schedule_region, schedules

    dist = active()
    sizes = dist.mesh_shape
    stages, repeats = schedule.stages, schedule.repeats
    table = schedules.build(dist.config.pipeline.schedule, stages, schedule.microbatches,
                            repeats)
    batch = x.shape[0]
    per_row = {k: _to_microbatches(v, schedule) for k, v in kwargs.items()
               if v.ndim and v.shape[0] == batch}
    shared = {"kwargs": {k: v for k, v in kwargs.items() if k not in per_row}}
    if seed is not None:
        shared["seed"] = seed
    if state is not None:  # whole on every device (small): each stage reads its rows
        shared["state"] = list(state)
    data = {"per_row": per_row,
            "targets": jax.tree.map(lambda a: _to_microbatches(a, schedule), targets)}
    chunks = [w[None] for w in weights] if repeats == 1 else list(weights)  # (v, L / v, ...)
    lead = 1 if repeats == 1 else 2
    if layouts is None:
        layouts = [(None,) * (lead - 1) + (AXIS,) for _ in weights]
    # Only stage, fsdp and expert split a weight in the schedule's region (anything else,
    # e.g. a dimension over several axes, enters whole: correct, if gathered by XLA; each
    # device's experts: kdist.parallel.experts.as_whole) — where they
    # are still automatic: inside kdist's gradient reduction the weights arrive gathered
    # over fsdp, and their gradients leave unreduced, for the reduction's own collective.
    split = region.current().automatic((AXIS, "fsdp", "expert"))
    axes = [(None,) * (2 - lead) + tuple(a if a in split else None for a in layout)
            for layout in layouts]
    per_stage = schedule.layers_per_stage
    rows = batch_axes(sizes)  # a device's rows: its seed
    # The schedule's region splits the rows over the batch axes still automatic here; those
    # an enclosing region made manual (DiLoCo's replica groups) are not its to split or sum.
    row_axes = batch_axes(sizes, region.current().automatic(rows))
    # Under a seq axis (not made manual around us) every stage holds its share of each
    # sequence's tokens, and so does the loss on the last: targets must be per token.
    tokens = tuple(a for a in region.current().automatic({"seq"}) if sizes.get(a, 1) > 1)
    length = x.shape[1]
    if tokens:
        not_per_token = [a.shape for a in jax.tree.leaves(targets)
                         if a.ndim < 2 or a.shape[1] != length]
        if not_per_token:
            raise ValueError(
                f"pipeline_schedule={dist.config.pipeline.schedule!r} under the 'seq' axis "
                f"of mesh '{dist.spec}' computes the loss on each device's share of the "
                f"tokens, so every target must hold one value per token (axis 1 of length "
                f"{length}); this task's targets have shapes {not_per_token} (e.g. masked "
                f"positions). Use pipeline_schedule='gpipe' on this mesh, or no 'seq' axis.")
    manual = set(row_axes) | set(tokens)

    def spec(logical):  # a microbatched array (M, ...) with these logical axes
        return P(None, *rules.activation_spec(logical, sizes, manual))

    specs = (spec(INPUT_AXES["x"]),
             {"per_row": {k: spec(INPUT_AXES.get(k, ("batch",))) for k in per_row},
              "targets": jax.tree.map(lambda a: spec(("batch", "length")[:a.ndim]), targets)})

    def stage_fn(w, h, d, c):  # this device's layers of chunk c: (b, T, D) -> (b, T, D)
        first = (c * stages + jax.lax.axis_index(AXIS)) * per_stage
        kw = {**d["per_row"], **d["kwargs"]}
        key = d.get("seed")
        if key is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(rows) if rows else 0)

        return _stage_layers(layer, w, h, kw, first, key, d.get("state"), per_stage,
                             schedule.microbatches)

    def microbatch_loss(lw, y, d):
        return loss_fn(lw, y, d["targets"])

    return schedule_region.scheduled_loss(
        table, stage_fn, microbatch_loss, chunks, loss_weights,
        _to_microbatches(x, schedule), data, shared, mesh=schedule.mesh, batch_axes=row_axes,
        weight_axes=axes, token_axes=tokens, specs=specs,
        # ring attention's permutes over seq (manual here or in an enclosing region, as
        # kdist's gradient reduction's): every stage runs every tick's kind of task
        every_stage=sizes.get("seq", 1) > 1 and dist.config.context.variant == "ring",
        statistics=None if state is None else [jax.ShapeDtypeStruct(a.shape, a.dtype)
                                               for a in state])

