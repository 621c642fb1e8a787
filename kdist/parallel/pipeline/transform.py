"""The step's pipeline transforms: the ``stage`` axis (:data:`STAGES`) and a schedule that
runs the loss inside it (:data:`SCHEDULE`: 1F1B, interleaved, zero-bubble).

Under GPipe the task's own forward pass pipelines its layer stack (the stack calls
:func:`kdist.parallel.pipeline.stack.pipelined`), so :data:`STAGES` only checks. The other
schedules start a microbatch's backward as soon as its forward leaves the last stage, so
the loss must run inside the schedule: :data:`SCHEDULE` replaces the task's Keras compute
in training by one built from the parts the task exposes (:meth:`Task.schedule_parts
<kdist.models.base.Task.schedule_parts>` — the embedded batch, the block stack, the head's
layers, its targets and their normaliser — and ``Task.head_loss``), run by
:func:`kdist.parallel.pipeline.stack.scheduled`. ``call()`` keeps returning predictions;
nothing is set on the model. Metrics compiled with the task read logits from one more
forward pass (GPipe's, no gradient), as the logits never leave the schedule: a compile
without metrics pays nothing for them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import keras
from keras import ops

from kdist import _keras_compat
from kdist.parallel import rules
from kdist.parallel.pipeline.stack import scheduled_name
from kdist.parallel.transform import Transform, training_only


@dataclasses.dataclass(frozen=True)
class ScheduleParts:
    """What a task gives a schedule for one batch: ``hidden`` ``(B, T, D)`` (the embedded
    batch, computed before the schedule on every stage), ``block_kwargs`` (the stack's
    keyword arguments: masks, positions), ``blocks`` (its
    :class:`kdist.models.scan.LayerStack`), ``head_layers`` (whose trainable weights
    ``head_loss`` is given, in order), ``targets`` (a pytree of ``(B, ...)`` arrays, cut into
    microbatches like ``hidden``) and ``total`` (what the summed loss is divided by: the
    global batch's label count or weight sum)."""

    hidden: Any
    block_kwargs: dict
    blocks: Any
    head_layers: tuple
    targets: Any
    total: Any


def scheduled_loss(model, x, y, sample_weight):
    """The task's loss of one batch with the distribution's schedule (inside Keras'
    stateless scope): its parts through :meth:`LayerStack.scheduled_loss
    <kdist.models.scan.LayerStack.scheduled_loss>`, each microbatch's
    ``head_loss(weights, hidden, targets) / total`` on the last virtual stage."""
    parts = model.schedule_parts(x, y, sample_weight)
    head = [[ops.convert_to_tensor(v) for v in layer.trainable_variables]
            for layer in parts.head_layers]

    def loss_fn(weights, hidden, targets):  # (b, T, D) -> this microbatch's share
        return model.head_loss(weights, hidden, targets) / parts.total

    kwargs = {k: v for k, v in parts.block_kwargs.items() if v is not None}
    loss = parts.blocks.scheduled_loss(parts.hidden, loss_fn, head, parts.targets, **kwargs)
    return model.input_alarm(x, loss)


def _compute(model, trainable, non_trainable, metrics, x, y, sample_weight,
             optimizer_variables):
    """Keras' ``compute_loss_and_updates(..., training=True)`` contract, the loss from
    :func:`scheduled_loss` (what Keras does around ``call`` and ``compute_loss``: the
    stateless scope, the layers' losses, the label check, the loss scale)."""
    mapping = [*zip(model.trainable_variables, trainable),
               *zip(model.non_trainable_variables, non_trainable)]
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        loss = scheduled_loss(model, x, y, sample_weight)
        extra = model.losses
    new_non_trainable = [scope.get_current_value(v) for v in model.non_trainable_variables]
    loss = model.finish_loss(y, loss, extra)
    unscaled = loss
    if model.optimizer is not None:
        with keras.StatelessScope(state_mapping=list(zip(model.optimizer.variables,
                                                         optimizer_variables))):
            loss = model.optimizer.scale_loss(loss)
    if _keras_compat.has_compiled_metrics(model):
        # The logits never leave the schedule: the metrics' from GPipe's forward pass
        # (no gradient, no dropout) of the same weights.
        frozen = [jax.lax.stop_gradient(w) for w in trainable]
        y_pred, _ = model.stateless_call(frozen, non_trainable, x, training=False)
    else:
        y_pred = unscaled  # no metric reads predictions; Keras' logs take the loss
    return loss, (unscaled, y_pred, new_non_trainable, metrics)


@training_only
def _wrap(compute, step):
    def run(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_variables):
        return _compute(step.model, trainable, non_trainable, metrics, x, y, sample_weight,
                        optimizer_variables)
    return run


def _stages_refusal(dist, model) -> str:
    return (f"The mesh '{dist.spec}' has a 'stage' axis (a pipeline), which "
            f"{type(model).__name__} does not support (it does not declare the 'pipeline' "
            f"step feature): its layers would not be split into stages. Use a mesh without "
            f"'stage', or a kdist GPT or BERT task.")


def _check_stacked(dist, model) -> None:
    if not any("layers" in (rules.declared_axes(w) or ()) for w in model.weights):
        raise ValueError(
            f"The mesh '{dist.spec}' has a 'stage' axis, but no weight of "
            f"{type(model).__name__} is stacked over layers, so nothing would be split into "
            f"stages. Build the model after setting this distribution with scan_layers=True "
            f"(or the default None, which stacks under a 'stage' axis).")


def _schedule_refusal(dist, model) -> str:
    return (f"pipeline_schedule={scheduled_name()!r} computes the loss inside the pipeline "
            f"from the task's parts, which {type(model).__name__} does not expose (it does "
            f"not declare the 'scheduled_pipeline' step feature). Use "
            f"pipeline_schedule='gpipe', or a kdist GPT or BERT masked-LM task.")


STAGES = Transform("pipeline stages", wanted=lambda dist: dist.config.stages > 1,
                   feature="pipeline", refusal=_stages_refusal, prepare=_check_stacked)
SCHEDULE = Transform("pipeline schedule", wanted=lambda dist: dist.config.schedule != "gpipe",
                     feature="scheduled_pipeline", refusal=_schedule_refusal, wrap=_wrap)
