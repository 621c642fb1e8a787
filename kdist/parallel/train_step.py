"""kdist's training step where the step carries state of its own in the optimizer.

Keras' JAX ``train_step`` differentiates the loss with respect to the trainable weights and
lets the optimizer update its variables. Two of kdist's step features keep more state:

* error feedback of 8-bit gradients (:mod:`kdist.parallel.reduction`): each weight's
  residual is an optimizer variable; the step differentiates with respect to it as well,
  and its "gradient" (``custom_vjp``) is the next residual, written back after the update;
* DiLoCo (:mod:`kdist.groups.diloco`) runs this step per replica group.

:func:`train_step` is Keras' ``train_step`` otherwise unchanged (same loss, metrics, logs),
so its state is Keras' state and checkpoints hold the residuals like the Adam moments.
"""

from __future__ import annotations

import jax
import keras

from kdist import _keras_compat


def apply_step(model, optimizer, residual_indices, trainable, non_trainable,
               optimizer_variables, metrics, x, y, sample_weight, keras_optimizer_values=None):
    """One optimizer step: loss, gradients (and new residuals), ``optimizer``'s update.

    ``optimizer_variables`` are ``optimizer``'s; ``residual_indices`` the positions of the
    error-feedback residuals among them (None: none). ``keras_optimizer_values``: what
    Keras' own loss code is given as the model's optimizer variables (default: the same).
    Returns ``(unscaled_loss, y_pred, trainable, non_trainable, optimizer_variables,
    metrics)``.
    """
    def loss_fn(trainable, residuals):
        values = list(optimizer_variables)
        for i, r in zip(residual_indices or (), residuals):
            values[i] = r
        return model.compute_loss_and_updates(
            trainable, non_trainable, metrics, x, y, sample_weight, training=True,
            optimizer_variables=values)

    residuals = [optimizer_variables[i] for i in residual_indices or ()]
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (_, aux), (grads, new_residuals) = grad_fn(trainable, residuals)
    unscaled, y_pred, non_trainable, metrics = aux
    trainable, new_optimizer = optimizer.stateless_apply(optimizer_variables, grads, trainable)
    new_optimizer = list(new_optimizer)
    for i, r in zip(residual_indices or (), new_residuals):
        new_optimizer[i] = r
    return unscaled, y_pred, trainable, non_trainable, new_optimizer, metrics


def train_step(model, state, data, residual_indices):
    """Keras' JAX ``train_step(state, data)`` with the residuals carried (see the module
    docstring)."""
    trainable, non_trainable, optimizer_variables, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    unscaled, y_pred, trainable, non_trainable, optimizer_variables, metrics = apply_step(
        model, model.optimizer, residual_indices, trainable, non_trainable,
        optimizer_variables, metrics, x, y, sample_weight)
    logs, metrics = _keras_compat.update_metrics_variables(
        model, metrics, unscaled, x, y, y_pred, sample_weight)
    return logs, (trainable, non_trainable, optimizer_variables, metrics)
