"""One transform of the training step, as data: what it needs of the task, when the
distribution wants it, what it checks and prepares, and how it wraps the loss.

The step (:mod:`kdist.parallel.step`) is an ordered tuple of these, outermost first; its
``check_compile``, ``prepare`` and ``compute_loss_and_updates`` are loops over it. Each
transform's module owns its ``TRANSFORM`` (replica groups in
:mod:`kdist.groups.diloco`, the split sequence in :mod:`kdist.parallel.context`, the
explicit reduction in :mod:`kdist.parallel.reduction`, the pipeline's stages and schedule
in :mod:`kdist.parallel.pipeline`): a new one is its module and one entry in the tuple.

A *compute* is Keras' ``compute_loss_and_updates`` with ``training`` fixed by the
:class:`Step`: ``compute(trainable, non_trainable, metrics, x, y, sample_weight,
optimizer_variables) -> (loss, (unscaled_loss, y_pred, non_trainable, metrics))``.
``wrap(compute, step)`` returns a compute of the same contract.

Example:
    >>> noop = Transform("nothing", wanted=lambda dist: False)
    >>> noop.wrap(print, Step(model=None, training=True)) is print
    True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

# The step features a task may declare (its ``step_features``), and what each promises.
FEATURES = {
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
    "expert_parallel": "its Mixture-of-Experts layers (layers with a ``num_experts``) send "
                       "their tokens to the experts' devices over the 'expert' axis "
                       "(kdist.parallel.experts)",
    "scheduled_pipeline": "it exposes its parts (Task.schedule_parts: the embedding, the "
                          "block stack, the loss head and its targets), which a 1F1B-like "
                          "schedule runs microbatch by microbatch with the loss on the "
                          "last stage (kdist.parallel.pipeline.transform)",
}


def declares(model, feature: str) -> bool:
    """Whether ``model`` declares the step ``feature`` (its ``step_features``)."""
    if feature not in FEATURES:
        raise ValueError(f"Unknown step feature {feature!r}; known: {sorted(FEATURES)}.")
    return feature in getattr(model, "step_features", frozenset())


@runtime_checkable
class StepOwner(Protocol):
    """An optimizer that runs the training step itself, around Keras' (the outermost
    transform): DiLoCo's replica groups (:class:`kdist.groups.diloco.DiLoCo`). The
    step asks for these methods, never for a class."""

    def kdist_prepare(self, model):
        """After ``compile``: builds the state it keeps (before ``fit`` or a restore)."""

    def kdist_wrap_compute(self, compute, step):
        """The step's compute inside its own (the outermost transform, in training)."""

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


@dataclasses.dataclass(frozen=True)
class Step:
    """What a transform's ``wrap`` is given besides the compute it wraps."""

    model: Any
    training: bool
    residuals: list | None = None  # error feedback's, one per weight (reduction.py)


def _unchanged(compute, step):
    return compute


def training_only(wrap):
    """``wrap`` applied in training only: evaluation keeps the compute it is given."""
    @functools.wraps(wrap)
    def wrapped(compute, step):
        return wrap(compute, step) if step.training else compute
    return wrapped


@dataclasses.dataclass(frozen=True)
class Transform:
    """A transform of the training step (see the module docstring).

    ``wanted(dist)``: whether the distribution asks for it. ``feature``: the step feature a
    task must declare for it (None: any task), and ``refusal(dist, model)`` the error's
    text when it does not (raised in ``compile``, before Keras'). ``prepare(dist, model)``
    runs after Keras' ``compile``: checks of the compiled model and the state the transform
    keeps, built before ``fit`` or a restore looks for it. ``wrap(compute, step)``: the
    step's compute under it.
    """

    name: str
    wanted: Callable[[Any], bool]
    feature: str | None = None
    refusal: Callable[[Any, Any], str] | None = None
    prepare: Callable[[Any, Any], None] | None = None
    wrap: Callable[[Callable, Step], Callable] = _unchanged

    def __post_init__(self):
        if self.feature is not None and self.feature not in FEATURES:
            raise ValueError(f"Transform {self.name!r}: unknown step feature "
                             f"{self.feature!r}; known: {sorted(FEATURES)}.")


def _owner_prepare(dist, model) -> None:
    owner = step_owner(model)
    if owner is not None:
        owner.kdist_prepare(model)


@training_only
def _owner_wrap(compute, step):
    owner = step_owner(step.model)
    return compute if owner is None else owner.kdist_wrap_compute(compute, step)


# The outermost transform: an optimizer that owns the step (DiLoCo's replica groups,
# kdist.groups.diloco), reached through the StepOwner interface only.
STEP_OWNER = Transform("replica groups", wanted=lambda dist: dist.config.has_replicas,
                       prepare=_owner_prepare, wrap=_owner_wrap)
