"""The training step: an ordered tuple of transforms, asked of the model's declaration.

A kdist task declares the step features it supports in ``step_features`` (names from
:data:`kdist.parallel.transform.FEATURES`); the distribution says which transforms it
wants. :data:`TRANSFORMS` lists them outermost first — replica groups, the split sequence,
the explicit gradient reduction, the pipeline's stages and its schedule, the experts'
axis — and the three
entry points are loops over it: :func:`check_compile` (refusals before anything compiles),
:func:`prepare` (state kept in the optimizer) and :func:`compute_loss_and_updates` (each
wanted transform wraps the compute inside it, the task's own Keras compute innermost).
Nothing here asks for a class by name; a new transform is its module and one entry here.
"""

from __future__ import annotations

import inspect

import jax
import keras

from kdist import _keras_compat, compiled_step
from kdist.parallel import experts, reduction
from kdist.parallel import train_step as stateful
from kdist.parallel.context import transform as context
from kdist.parallel.layout import active
from kdist.parallel.pipeline import transform as pipeline
from kdist.parallel.transform import STEP_OWNER, Step, declares, step_owner

# Outermost first: each wraps the compute of those after it.
TRANSFORMS = (STEP_OWNER, context.TRANSFORM, reduction.TRANSFORM, pipeline.STAGES,
              pipeline.SCHEDULE, experts.TRANSFORM)


def wanted(dist=None) -> tuple:
    """The transforms the distribution (default: the active one) asks for, outermost first."""
    dist = dist or active()
    return () if dist is None else tuple(t for t in TRANSFORMS if t.wanted(dist))


def state_optimizer(model):
    """The optimizer whose variables ``compute_loss_and_updates`` is given: a step owner's
    (DiLoCo's inner one), else the model's."""
    owner = step_owner(model)
    return owner.kdist_state_optimizer() if owner is not None else getattr(
        model, "optimizer", None)


def fit_arguments(model, x, args: tuple, kwargs: dict) -> dict:
    """``fit``'s arguments after ``x`` and ``y`` by name (those given by position too), its
    ``callbacks`` (a list, or None) with those the step owner adds
    (:class:`kdist.parallel.transform.StepOwner`). Arrays ``x`` are checked batch by batch
    against the mesh first (:func:`check_batches`).

    Example:
        >>> kwargs = fit_arguments(model, x, args, kwargs)  # in Task.fit  # doctest: +SKIP
    """
    kwargs = {**dict(zip(tuple(inspect.signature(keras.Model.fit).parameters)[3:], args)),
              **kwargs}
    check_batches(x, kwargs.get("batch_size"))
    owner = step_owner(model)
    if owner is not None:
        callbacks = list(kwargs.get("callbacks") or [])
        kwargs["callbacks"] = callbacks + owner.kdist_fit_callbacks(callbacks)
    return kwargs


def check_batches(x, batch_size: int | None) -> None:
    """For arrays ``x`` (or a dict of them), both batch sizes ``fit`` will send — ``batch_size``
    (Keras' default 32) and the remainder that ends each epoch — must split over the
    replica axes: refused here, before anything compiles (Keras checks only the first
    batch's layout, and JAX's error for the last names no fix)."""
    dist = active()
    leaves = [v for v in (x.values() if isinstance(x, dict) else [x]) if hasattr(v, "shape")]
    if dist is None or not leaves or not leaves[0].shape:
        return
    rows, batch = leaves[0].shape[0], batch_size or 32
    for size in {min(batch, rows), rows % batch} - {0}:
        dist.check_batch(size)


def check_compile(model) -> None:
    """Refuses, before any compilation, what the distribution asks for and the model does
    not support: an error rather than silently training another way.

    Example:
        >>> check_compile(model)  # in Task.compile, before super().compile()  # doctest: +SKIP
    """
    dist = active()
    if dist is None:
        return
    _check_built_under(model, dist)
    for transform in wanted(dist):
        if transform.feature is not None and not declares(model, transform.feature):
            raise ValueError(transform.refusal(dist, model))


def _check_built_under(model, dist) -> None:
    """Refuses a model whose weights were all created before ``dist`` was set (under no
    distribution, or another mesh's devices): Keras lays a weight out when it creates it,
    so they would stay where they are, and the optimizer's slots, made from them later,
    would meet the mesh with no layout at all (an error that points at the wrong fix)."""
    devices = set(dist.device_mesh.backend_mesh.devices.flat)
    placed = [_keras_compat.variable_layout(v) for v in model.trainable_variables]
    placed = [getattr(layout, "backend_layout", layout) for layout in placed]
    if not placed or any(p is not None and set(p.device_set) == devices for p in placed):
        return
    where = ("under no distribution" if placed[0] is None else
             f"on {len(placed[0].device_set)} devices of another mesh")
    raise ValueError(
        f"{type(model).__name__}'s weights were created before the distribution "
        f"'{dist.spec}' was set ({where}; the mesh spans {len(devices)} devices), and "
        f"Keras lays a weight out only when it creates it. Set the distribution first — "
        f"keras.distribution.set_distribution(kdist.distribution('{dist.spec}')) — then "
        f"build or load the model (from_preset, from_pretrained and "
        f"keras.saving.load_model included), then compile.")


def prepare(model) -> None:
    """After Keras' ``compile`` (before anything is compiled by XLA): each wanted
    transform refuses what it cannot compute for this model and loss, and adds the state it
    keeps (DiLoCo's per-group state, error-feedback residuals) to the optimizer, built now
    so that it exists before ``fit`` or a checkpoint restore looks for it."""
    dist = active()
    for transform in wanted(dist):
        if transform.prepare is not None:
            transform.prepare(dist, model)


def _residual_indices(model):
    dist = active()
    optimizer = state_optimizer(model)
    if dist is None or not dist.config.gradients.error_feedback or optimizer is None:
        return None
    return reduction.residual_indices(model.trainable_variables, optimizer)


def train_step(model, keras_train_step, state, data):
    """Keras' ``train_step``, or kdist's where a step feature keeps state of its own
    (:mod:`kdist.parallel.train_step`); the step owner's (:class:`StepOwner`: under
    DiLoCo its sync step, which ``fit`` alternates with the inner step)."""
    owner = step_owner(model)
    if owner is not None:
        return owner.kdist_train_step(model, state, data)
    indices = _residual_indices(model)
    if indices is None:
        return keras_train_step(state, data)
    return stateful.train_step(model, state, data, indices)


def make_train_function(model, keras_make, force: bool = False):
    """Keras' ``make_train_function`` with its jitted step compiled ahead of the first
    call (:mod:`kdist.compiled_step`: the same program, whose memory the callbacks then
    read), or the step owner's (DiLoCo: two programs, the sync step every ``sync_every``
    steps)."""
    owner = step_owner(model)
    if owner is not None:
        return owner.kdist_make_train_function(model, force)
    if model.train_function is not None and not force:
        return None
    keras_make(force)  # Keras' own checks (run_eagerly, jit_compile) and its step
    compiled_step.install(model)
    return None


def compute_loss_and_updates(model, keras_compute, trainable_variables,
                             non_trainable_variables, metrics_variables, x, y, sample_weight,
                             training=False, optimizer_variables=None):
    """Keras' ``compute_loss_and_updates`` under the wanted transforms: ``keras_compute``
    (the task's own, ``super().compute_loss_and_updates``) innermost, each transform
    wrapping those after it (:mod:`kdist.parallel.transform`)."""
    indices = _residual_indices(model) if training else None
    residuals = None if indices is None else [optimizer_variables[i] for i in indices]
    step = Step(model, bool(training), residuals)

    def compute(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_variables):
        return keras_compute(trainable, non_trainable, metrics, x, y, sample_weight,
                             training=training, optimizer_variables=optimizer_variables)

    for transform in reversed(wanted()):
        compute = _scoped(transform, transform.wrap(compute, step), compute)
    return compute(trainable_variables, non_trainable_variables, metrics_variables, x, y,
                   sample_weight, optimizer_variables)


def _scoped(transform, wrapped, inner):
    """``wrapped`` under ``jax.named_scope("kdist/<transform>")``, so that profiles and the
    HLO's op names show each transform's region (nested as the transforms are)."""
    if wrapped is inner:
        return inner
    scope = "kdist/" + transform.name.replace(" ", "_")

    def run(*args):
        with jax.named_scope(scope):
            return wrapped(*args)
    return run
