"""DiLoCo's step in one program: every replica group's inner step in one ``shard_map``
over ``replica`` (each group's arrays its own, its other axes left to the layers below),
and, in the sync program, the outer step on the groups' mean parameter change — the only
collective across groups. :class:`kdist.groups.diloco.DiLoCo` holds the state it reads.

Example:
    >>> GroupResult._fields[-2:]
    ('loss', 'y_pred')
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec as P

from kdist import _keras_compat
from kdist.groups.outer import outer_settings, outer_update
from kdist.parallel import reduction, region
from kdist.parallel import train_step as stateful
from kdist.parallel.layout import active

AXIS = "replica"


class GroupStep(NamedTuple):
    """What a group's step reads (one ``shard_map`` over ``replica``): the outer weights,
    the groups' stacked parameters and inner state (leading dimension: the groups), the
    outer momenta, Keras' state and the batch."""

    theta: list
    params: list
    inner_state: list
    momenta: list
    non_trainable: list
    metrics: list
    x: Any
    y: Any
    sample_weight: Any


class GroupResult(NamedTuple):
    """What a group's step gives back: as :class:`GroupStep`, then the loss Keras logs and
    the predictions its metrics read (the group's rows)."""

    theta: list
    params: list
    inner_state: list
    momenta: list
    non_trainable: list
    metrics: list
    loss: Any
    y_pred: Any


# Each field's layout over ``replica``: a group's own rows of what is stacked or per row.
STEP_SPECS = GroupStep(P(), P(AXIS), P(AXIS), P(), P(), P(), P(AXIS), P(AXIS), P(AXIS))
RESULT_SPECS = GroupResult(P(), P(AXIS), P(AXIS), P(), P(), P(), P(), P(AXIS))


def train_step(model, state, data, sync: bool, guard: bool = True):
    """One DiLoCo step: every group's inner step; with ``sync``, the outer step after it.

    Keras' JAX ``train_step(state, data)`` contract: same state layout (the model's
    weights are ``θ``; the optimizer's variables those of :class:`DiLoCo`), same logs.
    ``guard``: an inner step run where a round ends (the host's schedule out of phase)
    logs NaN (off for separate group jobs, whose outer step runs on the host,
    :mod:`kdist.groups.sync`). A sync step may end a partial round (``fit``'s last step).
    """
    dist = active()
    optimizer = model.optimizer
    parts = optimizer.groups
    inner = parts.inner
    theta, non_trainable, opt, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    residuals = reduction.residual_indices(model.trainable_variables, inner)
    period = optimizer.sync_every * optimizer.accumulation
    count = opt[parts.iterations]

    groups = dist.mesh_shape[AXIS]

    def mean(x):  # over the groups
        return jax.lax.pmean(x, AXIS) if groups > 1 else x

    def group(s: GroupStep) -> GroupResult:
        params = [p[0] for p in s.params]
        inner_state = [v[0] for v in s.inner_state]
        unscaled, y_pred, params, non_trainable, inner_state, metrics = stateful.apply_step(
            model, inner, residuals, params, s.non_trainable, inner_state, s.metrics, s.x,
            s.y, s.sample_weight)
        # Keras' state a group computed from its own rows (a MoE layer's expert load, its
        # balance bias): the groups' mean, so that the job holds one value (a small
        # all-reduce per step; state every group computes alike does not vary: untouched).
        non_trainable = [mean(v) if groups > 1 and AXIS in region.varying_axes(v) else v
                         for v in non_trainable]
        theta, momenta = s.theta, s.momenta
        if sync:  # the only collective across groups: the outer gradient's mean
            with jax.named_scope("kdist/outer_sync"):  # (named in profiles and HLO)
                delta = [mean(t - p) for t, p in zip(theta, params)]  # one all-reduce each
                theta, momenta = zip(*(outer_update(outer_settings(optimizer), t, m, d)
                                       for t, m, d in zip(theta, momenta, delta)))
            params = [jax.lax.pcast(t, AXIS, to="varying") if groups > 1 else t for t in theta]
        return GroupResult(list(theta), [p[None] for p in params],
                           [v[None] for v in inner_state], list(momenta), non_trainable,
                           metrics, loss=mean(unscaled),  # logged: the mean over groups
                           y_pred=region.stackable(y_pred))

    pick = lambda indices: [opt[i] for i in indices]  # noqa: E731
    before = GroupStep(theta, pick(parts.params), pick(parts.stacked), pick(parts.momenta),
                       non_trainable, metrics, x, y, sample_weight)
    if groups > 1:  # each group's arrays its own; its other axes left to the layers below
        run = region.shard_map(group, mesh=dist.device_mesh.backend_mesh, axes={AXIS},
                               in_specs=(STEP_SPECS,), out_specs=RESULT_SPECS,
                               batch_axes=(AXIS,))
    else:  # one group: the whole mesh (XLA:CPU refuses a 1-device manual all-reduce)
        run = group
    after = run(before)
    non_trainable, metrics, unscaled = after.non_trainable, after.metrics, after.loss
    theta = after.theta if sync else theta
    # An inner step where a round ends (the host's schedule out of phase) shows as NaN.
    if guard and not sync:
        unscaled = jnp.where((count + 1) % period == 0, jnp.nan, unscaled)
    opt = list(opt)
    for indices, values in ((parts.params, after.params), (parts.stacked, after.inner_state),
                            (parts.momenta, after.momenta)):
        for i, v in zip(indices, values):
            opt[i] = v
    opt[parts.iterations] = count + 1
    logs, metrics = _keras_compat.update_metrics_variables(
        model, metrics, unscaled, x, y, after.y_pred, sample_weight)
    return logs, (theta, non_trainable, opt, metrics)
