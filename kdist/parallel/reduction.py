"""Gradients reduced by kdist instead of XLA's partitioner: one collective per weight.

Under XLA's automatic partitioning (GSPMD) every op that produces a partial sum of a
gradient gets its own all-reduce, in that op's output type, and XLA:CPU turns none of them
into reduce-scatters (``benchmarks/README.md``, ``communication.py``): the tied token
table's two gradients are reduced separately, fsdp gradients are all-reduced in full and
then sliced, and everything is reduced in float32. With ``gradient_reduction`` set on the
distribution, the loss and its gradient are computed per device in a ``jax.shard_map``
over the batch axes (``data``, ``fsdp``), and each weight's gradient leaves it through one
``custom_vjp``: every use of the weight summed on the device first, then

* ``"float32"`` / ``"bfloat16"``: one reduce-scatter over ``fsdp`` (into the device's
  shard) and one all-reduce over ``data`` of that shard — the minimum traffic of data and
  fully sharded data parallelism — in that type (bfloat16: each device's partial gradient
  rounded to 8 bits of mantissa before the sum);
* ``"float8"`` / ``"int8"``: 8-bit codes with a float32 scale per block, exchanged as bytes
  and summed in float32 (:mod:`kdist.parallel.compression`), optionally with error
  feedback: what quantisation lost is kept per device in the optimizer state (a
  ``<weight>_gradient_residual`` variable, checkpointed with it) and added back at the
  next step (:mod:`kdist.parallel.train_step` carries it).

The ``model`` axis (tensor parallelism) stays with XLA's partitioner inside the region
(``shard_map(axis_names=...)`` makes only the batch axes manual): its collectives are the
layers' activations', and a weight's gradient is already sharded over ``model`` like the
weight. Dropout draws each device's rows of the global batch's mask
(:mod:`kdist.parallel.dropout`), so masks equal the 1-device run's. The loss is each
device's loss on its rows, combined as the loss' own reduction combines rows: the mean for
Keras' ``sum_over_batch_size`` (every device holds as many rows), weighted by each
device's sum of sample weights for ``mean_with_sample_weight`` (BERT's masked tokens), the
sum for ``sum``. Under a ``seq`` axis (:mod:`kdist.parallel.context`) each device holds
a share of every sequence's tokens: ``seq`` is manual in the region too, and the loss and
every gradient are summed over it like over a batch axis (for causal LMs, whose loss sums
per-token terms; other tasks and dropout are refused there).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec as P

from kdist import _keras_compat
from kdist.parallel import compression, experts, region
from kdist.parallel.context import transform as context_step
from kdist.parallel.dropout import Dropout
from kdist.parallel.layout import BatchLayout, active
from kdist.parallel.mesh import REPLICA_AXES, summed_axes
from kdist.parallel.region import varying_axes
from kdist.parallel.transform import Transform, step_owner, training_only

REDUCTIONS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # summed in that type
COMPRESSED = tuple(compression.FORMATS)  # 8-bit codes on the wire, summed in float32
RESIDUAL_SUFFIX = "_gradient_residual"
_LOSS_REDUCTIONS = ("sum_over_batch_size", "mean_with_sample_weight", "sum")


def gradient_axes(dist) -> tuple[str, ...]:
    """The batch axes a step's gradients are summed over: the summed axes
    (:func:`kdist.parallel.mesh.summed_axes`) that split rows; ``seq`` joins them while a
    split sequence is traced (:func:`kdist.parallel.context.transform.summed_axes`)."""
    return summed_axes(dist.mesh_shape, among=REPLICA_AXES)


def gradient_plan(layout_axes, manual, summed, sizes, reduction: str = "float32",
                  automatic=("model",)) -> _Plan:
    """How a weight with these layout axes enters a region whose new manual axes are
    ``manual`` (gathered over ``fsdp`` there if it is among them) and how its gradient
    leaves it: summed over ``summed`` in ``reduction``'s type (or 8-bit codes).
    ``automatic``: the axes still left to XLA's partitioner inside the region; the
    reduction runs per device of those too (see :func:`_reduce`). A weight split over a
    summed axis other than ``fsdp`` (an expert weight over ``expert``: each device its own
    experts, their gradient whole from the tokens the dispatch brought) is not summed
    over it."""
    spec = [a if a in manual else None for a in layout_axes]
    summed = [a for a in summed if a == "fsdp" or a not in spec]
    auto = tuple(a for a in automatic if sizes.get(a, 1) > 1 and a not in manual)
    auto_spec = P(*(a if a in auto else None for a in layout_axes)) if auto else None
    return _Plan(tuple(summed), tuple(sorted(sizes.items())),
                 next((i for i, a in enumerate(spec) if a == "fsdp"), None), reduction,
                 auto, auto_spec)


def check(dist, model) -> None:
    """Refuses, before compiling, what explicit reduction cannot compute like the
    1-device run: dropout layers other than kdist's, a loss reduction it does not know."""
    asked = requested_by(dist)
    foreign = sorted(layer.name for layer in _keras_compat.all_layers(model)
                     if isinstance(getattr(layer, "rate", None), float) and layer.rate > 0
                     and not isinstance(layer, Dropout))
    if foreign:
        raise ValueError(
            f"{asked} computes each device's rows in a manual region, "
            f"where layers {', '.join(foreign[:3])} would draw the same random mask on every "
            f"device. Use kdist.parallel.dropout.Dropout (it draws each "
            f"device's rows of the global mask), a rate of 0, or {_without(dist)}.")
    if dist.mesh_shape.get("seq", 1) > 1:
        _check_split_sequence(dist, model)
    reduction = _loss_reduction(model)
    if reduction not in _LOSS_REDUCTIONS:
        raise ValueError(
            f"{asked} combines the devices' losses as "
            f"the loss' reduction does; {type(model).__name__}'s loss has reduction "
            f"{reduction!r}, expected one of {_LOSS_REDUCTIONS} (a single loss). Use such a "
            f"loss or {_without(dist)}.")


def _check_split_sequence(dist, model) -> None:
    """Under a ``seq`` axis each device computes the loss on its own tokens: right for a
    task whose loss is a sum of per-token terms (it declares ``"token_reordering"``), not
    for one that reads positions across the sequence (BERT's masked positions, its first
    token). Dropout masks there would repeat across a row's token shares."""
    name, asked = type(model).__name__, requested_by(dist)
    if "token_reordering" not in getattr(model, "step_features", frozenset()):
        raise ValueError(
            f"{asked} on mesh {dist.spec} computes each "
            f"device's loss on its share of every sequence's tokens; {name}'s loss reads "
            f"tokens across the whole sequence (it does not declare the 'token_reordering' "
            f"step feature). Use {_without(dist)} (XLA's reductions) or a mesh without "
            f"'seq'.")
    dropout = sorted(layer.name for layer in _keras_compat.all_layers(model)
                     if isinstance(layer, Dropout) and layer.rate > 0)
    if dropout:
        raise ValueError(
            f"{asked} on mesh {dist.spec}: dropout "
            f"layers ({', '.join(dropout[:3])}) would draw the same mask for every 'seq' "
            f"share of a row in the per-device region (not built for a split sequence). "
            f"Use a dropout rate of 0, {_without(dist)}, or a mesh without 'seq'.")


def _without(dist) -> str:
    """How to leave the per-device loss out, for error messages."""
    if dist.config.gradients.reduction is not None:
        return "gradient_reduction=None"
    return "no 'seq' axis in the replica groups (put those devices on data or fsdp)"


def requested_by(dist) -> str:
    """What asked for the per-device loss, for error messages."""
    if dist.config.gradients.reduction is not None:
        return f"gradient_reduction={dist.config.gradients.reduction!r}"
    return ("DiLoCo's replica groups with a split sequence (which compute the loss per "
            "device: kdist.parallel.config.Parallelism.step_reduction)")


def _loss_reduction(model):
    loss = getattr(model, "loss", None)
    if isinstance(loss, keras.losses.Loss):
        return loss.reduction
    if loss is None or isinstance(loss, str) or callable(loss):
        return "sum_over_batch_size"  # Keras wraps names and functions with this reduction
    return f"a {type(loss).__name__} of losses"


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one weight's gradient is reduced (static: hashable, part of the trace)."""

    axes: tuple[str, ...]  # the manual batch axes of the region
    sizes: tuple[tuple[str, int], ...]
    fsdp_dim: int | None  # the weight's dimension sharded over fsdp
    reduction: str
    automatic: tuple[str, ...]  # axes of size > 1 the partitioner still has in the region
    auto_spec: P | None  # the weight's spec over them (None: there are none)


def residual_axes(dist) -> tuple[str, ...]:
    """The axes along which devices hold different error-feedback residuals: those their
    partial gradients differ along — the batch axes, and ``seq`` (each device's tokens)."""
    return summed_axes(dist.mesh_shape)


def residual_layout(dist, variable):
    """The layout of a weight's error-feedback residual: one whole (unsharded over fsdp)
    copy of the weight per device of :func:`residual_axes`, ``(devices, *weight.shape)``."""
    axes = [a if a != "fsdp" else None for a in dist.get_variable_layout(variable).axes]
    return BatchLayout((residual_axes(dist), *axes), dist.device_mesh)


def add_residuals(dist, weights, optimizer) -> None:
    """Adds an error-feedback residual per trainable weight to ``optimizer`` (built),
    named ``<weight path>_gradient_residual``, zero, laid out by :func:`residual_layout`."""
    devices = math.prod(dist.mesh_shape[a] for a in residual_axes(dist))
    have = {v.name for v in optimizer.variables}
    for w in weights:
        name = w.path.replace("/", "_") + RESIDUAL_SUFFIX
        if name not in have:
            optimizer.add_variable((devices, *w.shape), "zeros", "float32",
                                   layout=residual_layout(dist, w), name=name)


def residual_indices(weights, optimizer) -> list[int] | None:
    """Positions in ``optimizer.variables`` of each weight's residual, or None when the
    optimizer has none (no error feedback)."""
    position = {v.name: i for i, v in enumerate(optimizer.variables)}
    names = [w.path.replace("/", "_") + RESIDUAL_SUFFIX for w in weights]
    if not any(n in position for n in names):
        return None
    return [position[n] for n in names]


def loss_and_updates(model, compute, trainable, non_trainable, metrics, x, y, sample_weight,
                     optimizer_variables, residuals=None):
    """Keras' ``compute_loss_and_updates(..., training=True)`` with kdist's reduction.

    ``compute`` is the step's compute inside this transform
    (:mod:`kdist.parallel.transform`); it runs per device on the device's rows and the
    gathered weights. Returns what it returns, with the loss combined
    over devices; the gradient of that loss arrives reduced and sharded like the weights.
    ``residuals`` (8-bit with error feedback): one per weight, its ``residual_layout``;
    their "gradients" are the new residuals (see :mod:`kdist.parallel.train_step`).
    """
    dist = active()
    axes = gradient_axes(dist)
    # A split sequence (kdist.parallel.context): each device holds its own tokens, so the
    # loss and every gradient are partial over `seq` too, and summed over it like a replica.
    summed = axes + context_step.summed_axes()
    layouts = [dist.get_variable_layout(v).axes for v in model.trainable_variables]
    specs = [P(*(a if a in axes else None for a in layout)) for layout in layouts]
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    # Manual: the batch axes, and axes of size 1 (nothing to partition; leaving them to
    # XLA made XLA:CPU's bfloat16 all-reduce promotion crash, jaxlib 0.10.2); those an
    # enclosing region made manual already stay so (region.shard_map).
    manual = {a for a, n in dist.mesh_shape.items() if a in summed or n == 1}
    inside = tuple(sorted(region.current().automatic(dist.mesh_shape) - manual))
    plans = [gradient_plan(layout, axes, summed, dist.mesh_shape,
                           dist.config.step_reduction, automatic=inside)
             for layout in layouts]
    combine = _loss_reduction(model)

    def local(trainable, residuals, non_trainable, metrics, x, y, sample_weight,
              optimizer_variables):
        def device_loss(trainable, residuals):
            residuals = [None] * len(trainable) if residuals is None else [
                r[0] for r in residuals]
            # (an expert weight: this device's experts, in zeros of its shape, for Keras)
            full = [experts.as_whole(use(w, r, plan), shape)
                    for w, r, plan, shape in zip(trainable, residuals, plans, shapes)]
            loss, (unscaled, y_pred, new_non_trainable, new_metrics) = compute(
                full, non_trainable, metrics, x, y, sample_weight, optimizer_variables)
            if summed:  # this device's loss on its rows (and tokens) -> on all of them
                loss, unscaled = _combine((loss, unscaled), combine, sample_weight, summed)
            return loss, (unscaled, region.stackable(y_pred), new_non_trainable, new_metrics)

        (loss, aux), (grads, new_residuals) = jax.value_and_grad(
            device_loss, argnums=(0, 1), has_aux=True)(trainable, residuals)
        return loss, aux, grads, new_residuals

    # a residual per device of the axes its partial gradient differs along (residual_axes)
    residual_specs = None if residuals is None else [P(summed or None)] * len(residuals)
    # Per-row arrays: rows over the batch axes, a split sequence's tokens over seq.
    data_specs = [jax.tree.map(lambda a: context_step.row_spec(a, axes), t)
                  for t in (x, y, sample_weight)]
    in_specs = (specs, residual_specs, P(), P(), *data_specs, P())
    out_specs = (P(), (P(), context_step.output_spec(axes), P(), P()), specs, residual_specs)
    per_device = region.shard_map(local, mesh=dist.device_mesh.backend_mesh, axes=manual,
                                  in_specs=in_specs, out_specs=out_specs, batch_axes=axes)

    # The gradients are computed inside the region (above) and handed to the caller's
    # differentiation by a custom_vjp: JAX 0.10 cannot differentiate through a shard_map
    # nested in another (DiLoCo's per-group region) -- its residuals name the outer axes.
    @jax.custom_vjp
    def run(trainable, residuals, rest):
        loss, aux, _, _ = per_device(trainable, residuals, *rest)
        return loss, aux

    def run_fwd(trainable, residuals, rest):
        loss, aux, grads, new_residuals = per_device(trainable, residuals, *rest)
        return (loss, aux), (grads, new_residuals)

    def run_bwd(saved, cotangents):
        grads, new_residuals = saved
        scale = cotangents[0]  # d(caller's objective)/d(loss): 1 for Keras' train step
        return [g * scale.astype(g.dtype) for g in grads], new_residuals, None

    run.defvjp(run_fwd, run_bwd)
    return run(trainable, residuals,
               (non_trainable, metrics, x, y, sample_weight, optimizer_variables))


def _combine(losses, reduction, sample_weight, axes):
    if reduction == "sum":
        return jax.lax.psum(losses, axes)
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        weight = jnp.sum(jnp.asarray(sample_weight, jnp.float32))
        total = jax.lax.psum(weight, axes)
        return jax.tree.map(lambda v: jax.lax.psum(v * weight, axes) / total, losses)
    return jax.lax.pmean(losses, axes)  # equal rows per device: the mean of the means


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def use(weight, residual, plan):
    """The full weight from this device's shard; its gradient is reduced on the way back.

    The result is typed as varying over every batch axis (it meets per-device rows), so
    JAX adds no reduction of its own: the backward pass below is the only one. The
    ``residual``'s cotangent is the new error-feedback residual (8-bit), not a gradient.
    """
    weight = gather(weight, plan)
    invariant = tuple(a for a in plan.axes if a not in varying_axes(weight))
    return jax.lax.pcast(weight, invariant, to="varying") if invariant else weight


def gather(weight, plan):
    """This device's shard of a weight whole over ``fsdp`` (ZeRO-3's gather), where ``plan``
    splits it so: :func:`use`'s forward half, for code that differentiates by itself (the
    pipeline interpreter)."""
    if plan.fsdp_dim is not None:
        weight = jax.lax.all_gather(weight, "fsdp", axis=plan.fsdp_dim, tiled=True)
    return weight


def reduce(grad, plan):
    """A device's gradient summed as ``plan`` says — :func:`use`'s backward half, for code
    that differentiates by itself (the pipeline interpreter); not 8-bit (no residual)."""
    if plan.reduction in COMPRESSED:
        raise ValueError(f"reduce() sums without error feedback; {plan.reduction!r} needs it.")
    return _reduce(grad, None, plan)[0]


def _use_fwd(weight, residual, plan):
    return use(weight, residual, plan), residual


def _use_bwd(plan, residual, grad):
    # grad: the sum of every use of the weight on this device.
    if plan.auto_spec is None or not plan.axes:
        shard, residual = _reduce(grad, residual, plan)
    else:  # per device over the automatic axes too (a nested shard_map): see _reduce
        spec = plan.auto_spec
        in_specs = (spec, None if residual is None else spec)
        shard, residual = jax.shard_map(functools.partial(_reduce, plan=plan),
                                        in_specs=in_specs, out_specs=(spec, in_specs[1]),
                                        axis_names=set(plan.automatic))(grad, residual)
    return shard.astype(grad.dtype), residual


use.defvjp(_use_fwd, _use_bwd)


def _reduce(grad, residual, plan):
    """One device's gradient -> its reduced shard (and the 8-bit codes' new residual).

    Under the axes still automatic in the region (``model``; a pipeline's ``stage`` around
    which this reduction runs) this runs per device of them too: cutting a gradient into
    8-bit blocks then never moves data between the devices of a tensor-parallel group, and
    XLA:CPU's promotion of bfloat16 all-reduces (to float32) aborts on all-reduces left
    partly to the partitioner (jaxlib 0.10.2).
    """
    if not plan.axes:  # one replica (e.g. model=8): nothing to sum
        return grad, residual
    if plan.reduction in COMPRESSED:
        return compression.reduce(grad.astype(jnp.float32), residual, axes=plan.axes,
                                  sizes=dict(plan.sizes), fsdp_dim=plan.fsdp_dim,
                                  fmt=plan.reduction)
    grad = grad.astype(REDUCTIONS[plan.reduction])
    if plan.fsdp_dim is not None:  # into this device's shard: a reduce-scatter
        grad = jax.lax.psum_scatter(grad, "fsdp", scatter_dimension=plan.fsdp_dim, tiled=True)
    rest = tuple(a for a in plan.axes if a != "fsdp" or plan.fsdp_dim is None)
    if rest:  # over the replicas that hold the same shard: an all-reduce
        grad = jax.lax.psum(grad, rest)
    return grad, None


def _refusal(dist, model) -> str:
    return (f"The distribution asks for {requested_by(dist)}, which {type(model).__name__} "
            f"does not support (it does not declare the 'gradient_reduction' step feature), "
            f"so it would silently train with XLA's reductions. Build the distribution with "
            f"gradient_reduction=None (and without replica groups on a split sequence).")


def _prepare(dist, model) -> None:
    check(dist, model)
    # A step owner (DiLoCo) adds the residuals to its inner optimizer when it builds.
    if dist.config.gradients.error_feedback and step_owner(model) is None:
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        add_residuals(dist, model.trainable_variables, model.optimizer)


@training_only
def _wrap(compute, step):
    def reduced(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_variables):
        return loss_and_updates(step.model, compute, trainable, non_trainable, metrics, x, y,
                                sample_weight, optimizer_variables, step.residuals)
    return reduced


# The step's explicit gradient reduction: the loss per device, one collective per weight.
TRANSFORM = Transform("gradient reduction", wanted=lambda dist: bool(dist.config.step_reduction),
                      feature="gradient_reduction", refusal=_refusal, prepare=_prepare,
                      wrap=_wrap)
