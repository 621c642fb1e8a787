"""The interpreter over the mesh: one ``shard_map`` region in which every device runs its
part of a schedule table (:func:`kdist.parallel.pipeline.interpreter.interpret`), a stage's
weights gathered once before it and their gradients reduced once after it (kdist's one
gradient reduction, :mod:`kdist.parallel.reduction`), and the loss as a function JAX
differentiates like any other (:func:`scheduled_loss`, a ``custom_vjp``).

Example:
    >>> table = schedules.build("1f1b", stages=4, microbatches=8)  # doctest: +SKIP
    >>> grads = jax.grad(lambda w: scheduled_loss(table, f, loss, w, lw, xm,  # doctest: +SKIP
    ...                                           mesh=mesh))(weights)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kdist.parallel import reduction, region
from kdist.parallel.pipeline.interpreter import AXIS, Program, interpret
from kdist.parallel.region import to_varying


def value_and_grad(table, stage_fn, loss_fn, weights, loss_weights, xm, data=None,
                   shared=None, *, mesh, batch_axes=(), weight_axes=None, token_axes=(),
                   specs=None, every_stage=False, statistics=None):
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
    :func:`interpret`. ``statistics``: as in :func:`interpret` (the shapes of the layers'
    statistics, ``(L, ...)`` arrays of which each stage fills its layers'
    rows): then the loss holds the layers' losses, and the result gains the statistics
    summed over microbatches, whole, as a third element. Returns ``(loss, (d_weights,
    d_loss_weights, d_xm))``.
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
        loss, d_w, d_lw, d_xm, *stats = interpret(
            program, stage_fn, loss_fn, weights, loss_weights, xm, data, shared, every_stage,
            statistics, loss_axes=partial)
        loss = jax.lax.psum(loss, everything)
        d_w = [reduction.reduce(g, plan) for g, plan in zip(d_w, plans)]
        d_lw = jax.tree.map(lambda g: jax.lax.psum(g, everything), d_lw)
        # Each stage its layers' rows; the same on every device of a stage (the layers sum
        # their statistics over the rows' devices, also those an enclosing region made
        # manual: kdist's per-device loss), hence the max over them: exact.
        stats = jax.tree.map(lambda a: _same_over(jax.lax.psum(a, AXIS)), stats)
        return loss, d_w, d_lw, sum_over_stage(d_xm), *stats

    lw_specs = jax.tree.map(lambda _: P(), loss_weights)
    # In a kdist region, so that the layers inside know their arrays are blocks.
    loss, d_w, d_lw, d_xm, *stats = region.shard_map(
        device, mesh=mesh, axes=set(mesh.axis_names) - auto,
        in_specs=(w_specs, lw_specs, x_spec, data_specs,
                  jax.tree.map(lambda _: P(), shared)),
        out_specs=(P(), w_specs, lw_specs, x_spec,
                   *((jax.tree.map(lambda _: P(), statistics),) if statistics is not None
                     else ())))(list(weights), loss_weights, xm, data, shared)
    return (loss, (d_w, d_lw, d_xm), *stats)


def _same_over(a):
    """``a``, equal on every device but typed as varying over some manual axes, as typed
    invariant (their max: exact)."""
    over = tuple(sorted(region.varying_axes(a)))
    return jax.lax.pmax(a, over) if over else a


def scheduled_loss(table, stage_fn, loss_fn, weights, loss_weights, xm, data=None,
                   shared=None, *, mesh, batch_axes=(), weight_axes=None, token_axes=(),
                   specs=None, every_stage=False, statistics=None):
    """:func:`value_and_grad`'s loss as a function JAX differentiates like any other: its
    forward pass runs the whole schedule (forwards and backwards) and keeps the gradients,
    its backward pass scales them by the loss's cotangent — so what computes ``xm`` (an
    embedding) and what uses the weights elsewhere (a tied head) get their gradients from
    the enclosing ``jax.grad``. ``data`` gets none (masks, targets, indices). With
    ``statistics`` the result is ``(loss, statistics)``, the second not differentiated.

    Example:
        >>> grads = jax.grad(lambda w: scheduled_loss(table, f, loss, w, lw, xm,  # doctest: +SKIP
        ...                                           mesh=mesh))(weights)
    """
    def run(weights, loss_weights, xm, data, shared):
        loss, grads, *stats = value_and_grad(
            table, stage_fn, loss_fn, weights, loss_weights, xm, data, shared, mesh=mesh,
            batch_axes=batch_axes, weight_axes=weight_axes, token_axes=token_axes,
            specs=specs, every_stage=every_stage, statistics=statistics)
        return (loss, *stats), grads

    inputs = {}  # the types of data and shared (static), for their zero cotangents

    @jax.custom_vjp
    def loss(weights, loss_weights, xm, data, shared):
        return run(weights, loss_weights, xm, data, shared)[0]

    def forward(weights, loss_weights, xm, data, shared):
        leaves, inputs["tree"] = jax.tree.flatten((data, shared))
        inputs["types"] = [(a.shape, a.dtype, region.varying_axes(a)) for a in leaves]
        return run(weights, loss_weights, xm, data, shared)

    def backward(grads, cotangents):
        cotangent = cotangents[0]  # the statistics' is not used: not differentiated
        scaled = jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), grads)
        return scaled + jax.tree.unflatten(inputs["tree"],
                                           [_no_cotangent(*t) for t in inputs["types"]])

    loss.defvjp(forward, backward)
    out = loss(list(weights), loss_weights, xm, data, shared)
    return out[0] if statistics is None else out


def _no_cotangent(shape, dtype, varying):
    """The zero cotangent of an input that is not differentiated (float0 for integers);
    from its shape, type and the manual axes it varies over (inside an enclosing region:
    kdist's per-device loss) only — the backward pass keeps no copy of it."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return to_varying(jnp.zeros(shape, dtype), varying)
    return np.zeros(shape, jax.dtypes.float0)
