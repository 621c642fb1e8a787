"""The training step's routing: which step features run, asked of the model's declaration.

A kdist task declares the step features it supports in ``step_features`` (a frozenset of
names from :data:`STEP_FEATURES`); the distribution says which it wants. The task calls
:func:`check_compile` from ``compile`` and delegates Keras' ``compute_loss_and_updates``
to :func:`compute_loss_and_updates`. Nothing here asks for a class by name: a new task
(or a user's) gets a feature by declaring it, a new feature (a pipeline schedule, ring
attention) is one more branch here and one more module of :mod:`kdist.parallel`. A ``seq``
axis (context parallelism) wraps the others: the sequence's layout is set, and its tokens
reordered, before the loss runs either way.
"""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import keras

from kdist import _keras_compat, compiled_step
from kdist.parallel import reduction, replicas, rules
from kdist.parallel import train_step as stateful
from kdist.parallel.context import step as context_step
from kdist.parallel.layout import active

# Name -> what a task declaring it promises.
STEP_FEATURES = {
    "gradient_reduction": "its loss can run per device (kdist.parallel.reduction): no "
                          "cross-device state in the forward pass other than the weights",
    "fused_loss": "it can train from hidden states through the fused cross-entropy "
                  "(kdist.models.losses) without materialising logits",
    "context_parallel": "its attention layers attend across a sequence split over the 'seq' "
                        "axis and its positions come from the sequence layout "
                        "(kdist.parallel.context); its token ids are axis 1 of x (or of "
                        "x[token_id_inputs[0]])",
    "token_reordering": "every array of x, y and sample_weight whose axis 1 has the sequence "
                        "length holds one value per token, and the loss does not depend on "
                        "their order (load balancing reorders them; a causal model's)",
    "pipeline": "its backbone holds its blocks as a scanned layer stack "
                "(kdist.models.scan.LayerStack), which a 'stage' mesh axis splits into "
                "pipeline stages (kdist.parallel.pipeline); nothing else is per layer",
    "scheduled_pipeline": "its training forward pass computes its loss inside the pipeline "
                          "schedule while `pipeline_loss_for(y, sample_weight)` is entered "
                          "(returning the loss, which compute_loss passes on), so 1F1B-like "
                          "schedules can start a microbatch's backward early "
                          "(kdist.parallel.interpreter)",
}


@runtime_checkable
class StepOwner(Protocol):
    """An optimizer that runs the training step itself, around Keras' (the outermost step
    wrapper): DiLoCo's replica groups (:class:`kdist.parallel.replicas.DiLoCo`). The
    routing here asks for these methods, never for a class."""

    def kdist_train_step(self, model, state, data):
        """Keras' JAX ``train_step(state, data)`` contract."""

    def kdist_make_train_function(self, model, force: bool):
        """Sets ``model.train_function`` (Keras' ``make_train_function`` contract)."""

    def kdist_state_optimizer(self):
        """The optimizer whose variables the loss sees (a group's slice of its state)."""

    def kdist_fit_callbacks(self, callbacks: list) -> list:
        """Callbacks ``fit`` runs besides ``callbacks`` (DiLoCo: the one that marks fit's
        last step, which ends a partial round with a sync)."""


def step_owner(model) -> StepOwner | None:
    """The model's optimizer if it owns the training step (:class:`StepOwner`), else None."""
    optimizer = getattr(model, "optimizer", None)
    return optimizer if isinstance(optimizer, StepOwner) else None


def state_optimizer(model):
    """The optimizer whose variables ``compute_loss_and_updates`` is given: a step owner's
    (DiLoCo's inner one), else the model's."""
    owner = step_owner(model)
    return owner.kdist_state_optimizer() if owner is not None else getattr(
        model, "optimizer", None)


def fit_arguments(model, x, args: tuple, kwargs: dict) -> dict:
    """``fit``'s arguments after ``x`` and ``y`` by name (those given by position too), its
    ``callbacks`` (a list, or None) with those the step owner adds (:class:`StepOwner`).
    Arrays ``x`` are checked batch by batch against the mesh first (:func:`check_batches`).

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


def supports(model, feature: str) -> bool:
    """Whether ``model`` declares the step ``feature``."""
    if feature not in STEP_FEATURES:
        raise ValueError(f"Unknown step feature {feature!r}; known: {sorted(STEP_FEATURES)}.")
    return feature in getattr(model, "step_features", frozenset())


def requested_features() -> frozenset:
    """The step features the active distribution asks for."""
    dist = active()
    features = set()
    if dist is not None and dist.config.step_reduction:
        features.add("gradient_reduction")
    if dist is not None and dist.mesh_shape.get("seq", 1) > 1:
        features.add("context_parallel")
    if dist is not None and dist.mesh_shape.get("stage", 1) > 1:
        features.add("pipeline")
        if dist.config.pipeline.schedule != "gpipe":
            features.add("scheduled_pipeline")
    return frozenset(features)


def check_compile(model) -> None:
    """Refuses, before any compilation, what the distribution asks for and the model does
    not support: an error rather than silently training another way.

    Example:
        >>> check_compile(model)  # in Task.compile, before super().compile()  # doctest: +SKIP
    """
    dist = active()
    if dist is not None:
        _check_built_under(model, dist)
    for feature in sorted(requested_features()):
        if feature == "context_parallel" and not supports(model, feature):
            raise ValueError(
                f"Mesh {dist.spec} splits every sequence over 'seq' (context parallelism), "
                f"which {type(model).__name__} does not support (it does not declare the "
                f"'context_parallel' step feature): each device would compute what its "
                f"'seq' neighbours compute. Put those devices on data, fsdp or model.")
        if feature == "scheduled_pipeline" and not supports(model, feature):
            raise ValueError(
                f"pipeline_schedule={dist.config.pipeline.schedule!r} computes the loss "
                f"inside the pipeline, which {type(model).__name__} does not support (it does "
                f"not declare the 'scheduled_pipeline' step feature). Use "
                f"pipeline_schedule='gpipe', or a kdist GPT task.")
        if feature == "scheduled_pipeline":
            continue
        if feature == "pipeline" and not supports(model, feature):
            raise ValueError(
                f"The mesh '{dist.spec}' has a 'stage' axis (a pipeline), which "
                f"{type(model).__name__} does not support (it does not declare the "
                f"'pipeline' step feature): its layers would not be split into stages. Use a "
                f"mesh without 'stage', or a kdist GPT or BERT task.")
        if not supports(model, feature):
            raise ValueError(
                f"The distribution asks for {reduction.requested_by(dist)}, which "
                f"{type(model).__name__} does not support (it does not declare the "
                f"'{feature}' step feature), so it would silently train with XLA's "
                f"reductions. Build the distribution with gradient_reduction=None (and "
                f"without replica groups on a split sequence).")


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


def optimizer_for(model, optimizer):
    """The optimizer ``compile`` gives Keras: under ``sync_every`` (DiLoCo) the given one
    wrapped in :class:`kdist.parallel.replicas.DiLoCo`."""
    return replicas.wrap(active(), optimizer)


def prepare(model) -> None:
    """After Keras' ``compile`` (before anything is compiled by XLA): refuses what the
    requested features cannot compute for this model and loss, then adds the state they
    keep (error-feedback residuals, DiLoCo's per-group state) to the optimizer, which is
    built now so that it exists before ``fit`` or a checkpoint restore looks for it."""
    dist = active()
    if dist is None:
        return
    if "gradient_reduction" in requested_features():
        reduction.check(dist, model)
    if "pipeline" in requested_features() and not any(
            "layers" in (rules.declared_axes(w) or ()) for w in model.weights):
        raise ValueError(
            f"The mesh '{dist.spec}' has a 'stage' axis, but no weight of "
            f"{type(model).__name__} is stacked over layers, so nothing would be split into "
            f"stages. Build the model after setting this distribution with scan_layers=True "
            f"(or the default None, which stacks under a 'stage' axis).")
    if step_owner(model) is not None:
        if not model.optimizer.built:  # DiLoCo's build adds the residuals to its inner one
            model.optimizer.build(model.trainable_variables)
    elif dist.config.gradients.error_feedback and "gradient_reduction" in requested_features():
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        reduction.add_residuals(dist, model.trainable_variables, model.optimizer)


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


def compute_loss_and_updates(model, compute, trainable_variables, non_trainable_variables,
                             metrics_variables, x, y, sample_weight, training=False,
                             optimizer_variables=None):
    """Keras' ``compute_loss_and_updates`` with the requested step features applied.

    ``compute`` is Keras' own (``super().compute_loss_and_updates`` of the task).
    """
    indices = _residual_indices(model) if training else None
    residuals = None if indices is None else [optimizer_variables[i] for i in indices]
    if training and step_owner(model) is not None:
        # A group's slice of the inner optimizer's state: nothing for Keras' loss scaling
        # (which maps it to model.optimizer's variables; DiLoCo scales nothing).
        optimizer_variables = []
    features = requested_features()
    if training and "scheduled_pipeline" in features:
        keras_compute = compute

        def compute(trainable, non_trainable, metrics, x, y, sample_weight, **kwargs):
            # The targets where the loss runs: inside kdist's reduction, a device's rows.
            with model.pipeline_loss_for(y, sample_weight):
                return keras_compute(trainable, non_trainable, metrics, x, y, sample_weight,
                                     **kwargs)

    def loss_and_updates(x, y, sample_weight):
        if training and "gradient_reduction" in features \
                and supports(model, "gradient_reduction"):
            return reduction.loss_and_updates(
                model, compute, trainable_variables, non_trainable_variables,
                metrics_variables, x, y, sample_weight, optimizer_variables, residuals)
        return compute(trainable_variables, non_trainable_variables, metrics_variables, x, y,
                       sample_weight, training=training,
                       optimizer_variables=optimizer_variables)

    if "context_parallel" in features and supports(model, "context_parallel"):
        return context_step.loss_and_updates(
            model, loss_and_updates, x, y, sample_weight,
            reorder=supports(model, "token_reordering"))
    return loss_and_updates(x, y, sample_weight)
