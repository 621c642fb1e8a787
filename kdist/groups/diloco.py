"""Replica groups that synchronise every few steps: DiLoCo over the ``replica`` mesh axis.

DiLoCo (Douillard et al. 2023, "Distributed Low-Communication Training of Language
Models"): the mesh's ``replica`` groups (each its own ``data``/``fsdp``/``model`` sub-mesh)
each train on their share of every batch with the optimizer the model was compiled with
(the *inner* optimizer, AdamW in the paper) and nothing crosses groups; every
``sync_every`` (H) inner steps the groups average their parameter change since the last
sync, ``Δ = mean_r(θ - θ_r)`` (the *outer gradient*), an outer SGD with Nesterov momentum
(lr 0.7, momentum 0.9) moves the shared ``θ``, and every group starts the next round there.
Inner optimizer state stays with its group, never averaged. Traffic across groups: one
all-reduce of the parameters every H steps (data parallelism: one every step).

In one SPMD program (:func:`kdist.groups.group_step.train_step`): the model's weights are the
outer ``θ`` — what evaluation, generation, ``model.save`` and the checkpoint's ``params.*`` see,
as of the last sync. The last step of ``fit`` is a sync step too (:class:`FitEnd`), so
a run shorter than H, or its trailing partial round, is not lost: the same outer step on
the groups' mean change over the round's fewer steps (docs/communicating-less.md says what
ends a fit otherwise). :class:`DiLoCo` (the optimizer ``compile`` gets under a DiLoCo
distribution) holds, with a leading replica dimension sharded over ``replica``, each
group's parameters and its inner optimizer's state, plus the outer momentum: Keras state,
so checkpoints hold all of it and resume mid-round exactly. The step is a ``shard_map``
over ``replica`` only, so inside it each group's arrays are its own and the group's
``data``/``fsdp``/``model`` axes are left to XLA (or to kdist's explicit reduction, nested):
no collective crosses groups unless written here. The sync step is a second compiled
program (:func:`make_train_function` picks it every H-th step on the host), so the
collectives across groups appear in it alone; the other H-1 steps' program has none but
the loss's mean for Keras' logs (4 bytes).

With replica groups as separate jobs (:mod:`kdist.groups`: ``KDIST_REPLICA_GROUP`` set),
each job holds one group and runs the inner step alone; the outer step runs on the host
every ``sync_every`` steps, its gradients exchanged through storage
(:class:`kdist.groups.sync.OuterSync`), with the same :func:`outer_update`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import keras

from kdist import _keras_compat
from kdist.compiled_step import CompiledStep, attach
from kdist.groups.group_step import AXIS, train_step
from kdist.parallel import reduction
from kdist.parallel.layout import BatchLayout, active

STACKED_PREFIX = "replica_"
MOMENTUM_SUFFIX = "_outer_momentum"


class GroupState:
    """Where :class:`DiLoCo` keeps what is not a Keras variable: the inner optimizer
    (out of Keras' saving walk: its variables are templates without values, keys for
    ``StatelessScope``, which ``model.save`` must not try to write) and the positions of
    the stacked state in ``DiLoCo.variables``."""

    def __init__(self, inner):
        self.inner = inner
        self.templates = []  # the inner optimizer's variables, stacked in the same order
        self.params, self.stacked, self.momenta = [], [], []  # indices into .variables
        self.iterations = None  # index of DiLoCo's own step counter
        self.outer = None  # separate group jobs: their kdist.groups.sync.OuterSync
        self.schedule = None  # the train function's _Schedule (FitEnd marks fit's end there)


@keras.saving.register_keras_serializable(package="kdist")
class DiLoCo(keras.optimizers.Optimizer):
    """DiLoCo's optimizer: the inner optimizer per replica group, an outer Nesterov SGD
    on the groups' averaged parameter change every ``sync_every`` steps.

    ``compile`` wraps the optimizer it is given in this one when the distribution has
    ``sync_every`` (the user's script does not change); its variables are each group's
    parameters and inner state (leading dimension: the groups) and the outer momentum.
    ``iterations`` counts inner updates; ``learning_rate`` is the inner one.

    Args:
        inner_optimizer: the optimizer each group steps with (e.g. ``kdist.optim.adamw``).
        sync_every: inner updates between syncs (H).
        outer_learning_rate, outer_momentum, outer_nesterov: the outer SGD (paper: 0.7,
            0.9, Nesterov). Learning rate 1 and momentum 0 make the sync a plain average
            of the groups' parameters.

    Example:
        >>> import kdist
        >>> keras.distribution.set_distribution(kdist.distribution(
        ...     "replica=2,fsdp=4", sync_every=50))  # doctest: +SKIP
        >>> model.compile(optimizer=kdist.optim.adamw(3e-4))  # doctest: +SKIP
        >>> type(model.optimizer).__name__  # doctest: +SKIP
        'DiLoCo'
    """

    def __init__(self, inner_optimizer, sync_every: int, outer_learning_rate: float = 0.7,
                 outer_momentum: float = 0.9, outer_nesterov: bool = True, name=None,
                 **kwargs):
        inner = keras.optimizers.get(inner_optimizer)
        check_inner(inner)
        super().__init__(learning_rate=0.0, name=name or "diloco", **kwargs)
        self.groups = GroupState(inner)
        self.sync_every = sync_every
        self.outer_learning_rate = outer_learning_rate
        self.outer_momentum = outer_momentum
        self.outer_nesterov = outer_nesterov

    def inner(self):
        """The inner optimizer (the one compiled with). Its own variables are templates
        without values: the state is this optimizer's stacked copies."""
        return self.groups.inner

    @property
    def accumulation(self) -> int:
        """Micro-batches per inner update (the inner optimizer's gradient accumulation)."""
        return int(self.groups.inner.gradient_accumulation_steps or 1)

    @property
    def learning_rate(self):
        schedule = _keras_compat.learning_rate_schedule(self.groups.inner)
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self.iterations)
        return self.groups.inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        raise AttributeError(
            "DiLoCo's learning rate is its inner optimizer's, stepped per replica group "
            "from the optimizer state: give the inner optimizer its schedule before compile.")

    def build(self, var_list):
        if self.built:  # as Keras' optimizers: a second build (e.g. before a restore) is a no-op
            return
        dist = active()
        groups = dist.mesh_shape[AXIS]
        parts = self.groups
        pending = _keras_compat.pending_variable_count()  # a caller's (kdist plan) stay
        with keras.StatelessScope(initialize_variables=False):  # templates: no values
            parts.inner.build(var_list)
            if dist.config.gradients.error_feedback:
                reduction.add_residuals(dist, var_list, parts.inner)
        _keras_compat.forget_pending_variables(pending)
        parts.templates = list(parts.inner.variables)
        mesh = dist.device_mesh

        def stacked_layout(variable, layout):
            axes = tuple(layout.axes) if layout is not None else (None,) * len(variable.shape)
            return BatchLayout((AXIS, *axes), mesh)

        def add(name, shape, dtype, initializer, layout):
            self.add_variable(shape, initializer, dtype, layout=layout, name=name)
            return len(self.variables) - 1

        for w in var_list:
            parts.params.append(add(
                STACKED_PREFIX + _name(w.path), (groups, *w.shape), w.dtype,
                _Broadcast(w), stacked_layout(w, dist.get_variable_layout(w))))
        for v in parts.templates:
            initializer = _Broadcast(v) if _keras_compat.variable_initialized(v) \
                else _Broadcast(None, _keras_compat.deferred_initializer(v))
            parts.stacked.append(add(
                STACKED_PREFIX + _name(v.path.split("/", 1)[-1]), (groups, *v.shape),
                v.dtype, initializer,
                stacked_layout(v, _keras_compat.variable_layout(v))))
        for w in var_list:
            parts.momenta.append(add(_name(w.path) + MOMENTUM_SUFFIX, w.shape, w.dtype,
                                     "zeros", dist.get_variable_layout(w)))
        counter = _keras_compat.optimizer_iterations(self)
        parts.iterations = next(i for i, v in enumerate(self.variables) if v is counter)
        super().build(var_list)
        # After Keras' build (which would add accumulators): ``iterations`` then counts
        # inner updates, and kdist.callbacks.Throughput finds the micro-batches per update.
        self.gradient_accumulation_steps = parts.inner.gradient_accumulation_steps

    # kdist.parallel.transform.StepOwner: DiLoCo runs the training step itself.
    def kdist_prepare(self, model):
        if not self.built:  # the build adds the residuals to the inner optimizer
            self.build(model.trainable_variables)

    def kdist_wrap_compute(self, compute, step):
        def group(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_variables):
            # A group's slice of the inner optimizer's state: nothing for Keras' loss scaling
            # (which maps it to model.optimizer's variables; DiLoCo scales nothing).
            return compute(trainable, non_trainable, metrics, x, y, sample_weight, [])
        return group

    def kdist_train_step(self, model, state, data):
        return train_step(model, state, data, sync=True)

    def kdist_make_train_function(self, model, force: bool):
        return make_train_function(model, force)

    def kdist_state_optimizer(self):
        return self.groups.inner

    def kdist_fit_callbacks(self, callbacks):
        return [FitEnd(callbacks)]

    def finalize_variable_values(self, var_list):
        # Keras calls this when every fit ends (in its `finally`, also on an error): no later
        # step, of train_on_batch or another fit, is this fit's last.
        if self.groups.schedule is not None:
            self.groups.schedule.remaining = None
        super().finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise TypeError("DiLoCo steps only through kdist's train step "
                        "(kdist.groups.diloco.train_step), inside each replica group.")

    def apply(self, grads, trainable_variables=None):
        raise TypeError("DiLoCo steps only through kdist's train step "
                        "(kdist.groups.diloco.train_step), inside each replica group.")

    def get_config(self):
        return {"name": self.name, "sync_every": self.sync_every,
                "inner_optimizer": keras.saving.serialize_keras_object(self.groups.inner),
                "outer_learning_rate": self.outer_learning_rate,
                "outer_momentum": self.outer_momentum, "outer_nesterov": self.outer_nesterov}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["inner_optimizer"] = keras.saving.deserialize_keras_object(
            config["inner_optimizer"], custom_objects=custom_objects)
        return cls(**config)


def _name(path: str) -> str:
    return path.replace("/", "_")


class _Broadcast(keras.initializers.Initializer):
    """Initialises a stacked variable with one copy of ``variable``'s value (or of
    ``initializer``'s output) per replica group; read only then (an abstract build, as
    ``kdist plan``'s, never reads it)."""

    def __init__(self, variable, initializer=None):
        self.variable, self.initializer = variable, initializer

    def __call__(self, shape, dtype=None):
        value = (self.variable.value if self.initializer is None
                 else self.initializer(shape[1:], dtype))
        return jnp.broadcast_to(jnp.asarray(value, dtype), shape)


def check_inner(inner) -> None:
    """Refuses inner optimizers whose state DiLoCo cannot keep per group."""
    if isinstance(inner, (DiLoCo, keras.optimizers.LossScaleOptimizer)):
        raise ValueError(
            f"DiLoCo's inner optimizer cannot be a {type(inner).__name__} (its state is not "
            f"per group); use a plain optimizer such as kdist.optim.adamw, and "
            f"mixed_bfloat16 rather than mixed_float16.")
    if inner.use_ema:
        raise ValueError("DiLoCo's inner optimizer has use_ema=True; an average of the inner "
                         "weights per group is not built. Use use_ema=False.")


def wrap(optimizer):
    """The optimizer ``compile`` uses under the active distribution: wrapped in
    :class:`DiLoCo` when it has ``sync_every`` (DiLoCo then owns the step); a DiLoCo
    optimizer (e.g. reloaded) is unwrapped or rewrapped to the distribution's settings."""
    dist = active()
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, DiLoCo):
        optimizer = optimizer.inner()
    groups = None if dist is None else dist.config.replicas
    if groups is None:
        return optimizer
    return DiLoCo(optimizer, groups.sync_every, groups.outer_learning_rate,
                  groups.outer_momentum, groups.outer_nesterov)


class _Schedule:
    """Which program the next step runs, counted on the host: the sync step every
    ``sync_every`` inner updates, and at the last step of ``fit`` (``remaining``, set by
    :class:`FitEnd`). The count is read from the state (one transfer) whenever the state is
    not the one the last step returned (a new ``fit``, ``train_on_batch``, a restore), so it
    never drifts from the optimizer's."""

    def __init__(self, model):
        self.model, self.last, self.count = model, None, 0
        self.remaining = None  # fit's steps left, the next one included; None: not known
        model.optimizer.groups.schedule = self

    def is_sync(self, state) -> bool:
        optimizer = self.model.optimizer
        if state is not self.last:
            self.count = int(jax.device_get(state[2][optimizer.groups.iterations]))
        period = optimizer.sync_every * optimizer.accumulation
        return (self.count + 1) % period == 0 or self.remaining == 1

    def returned(self, state) -> None:
        self.last, self.count = state, self.count + 1
        if self.remaining is not None:
            self.remaining -= 1


class FitEnd(keras.callbacks.Callback):
    """Tells DiLoCo's schedule, before each step of ``fit``'s last epoch, how many steps
    ``fit`` has left, so that its last step also runs the outer sync: a partial round's,
    before any callback, validation or save sees the step. ``Task.fit`` adds it under
    DiLoCo (:func:`kdist.parallel.step.fit_arguments`); a callback in ``callbacks`` that
    runs an epoch short (``Checkpoint`` resuming mid-epoch) gives its length in
    ``epoch_batches``. Without a known epoch length there is no last step to mark.

    Example:
        >>> model.fit(data, epochs=2, steps_per_epoch=30)  # H=50: syncs at 50, 60  # doctest: +SKIP
    """

    def __init__(self, callbacks=()):
        super().__init__()
        self.shorteners = [c for c in callbacks if hasattr(c, "epoch_batches")]
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        schedule = _keras_compat.callback_model(self).optimizer.groups.schedule
        epochs, steps = self.params.get("epochs"), self.params.get("steps")
        if steps is None or self.epoch != epochs - 1:
            schedule.remaining = None
            return
        short = [c.epoch_batches for c in self.shorteners if c.epoch_batches is not None]
        schedule.remaining = min([steps, *short]) - batch


def make_train_function(model, force: bool = False) -> None:
    """Keras' ``make_train_function`` for DiLoCo: two compiled programs (inner step; inner
    step + sync), the same shardings and donation as Keras', chosen per step on the host."""
    if model.train_function is not None and not force:
        return
    out_shardings = (None, _keras_compat.state_shardings(model))
    job = active().config.replicas.jobs
    if job is not None:
        step, program = _group_job_step(model, job, out_shardings)
        model.train_function = attach(_keras_compat.step_function(model, step), [program])
        return
    programs = {sync: CompiledStep(jax.jit(functools.partial(train_step, model, sync=sync),
                                           donate_argnums=0, out_shardings=out_shardings))
                for sync in (False, True)}
    schedule = _Schedule(model)

    def step(state, data):
        sync = schedule.is_sync(state)
        # Both programs compile in the first step (counted as compilation by
        # kdist.callbacks.Throughput), not the sync one mid-run at step H.
        programs[True].prepare(state, data)
        logs, state = programs[sync](state, data)
        schedule.returned(state)
        return logs, state

    model.train_function = attach(_keras_compat.step_function(model, step),
                                  list(programs.values()))



def _group_job_step(model, job, out_shardings):
    """The step of one group among separate group jobs: the inner step alone in the
    program; every ``sync_every``-th, the outer step through the store, on the host
    (:class:`kdist.groups.sync.OuterSync`). Returns ``(step, its compiled program)``."""
    from kdist.groups.sync import OuterSync

    program = CompiledStep(jax.jit(functools.partial(train_step, model, sync=False,
                                                     guard=False),
                                   donate_argnums=0, out_shardings=out_shardings))
    schedule = _Schedule(model)
    outer = model.optimizer.groups.outer = OuterSync(model, job)

    def step(state, data):
        if outer.applied is None:
            state = outer.join(state, jax.tree.leaves(data)[0].shape)
        sync = schedule.is_sync(state)
        logs, state = program(state, data)
        schedule.returned(state)
        outer.beat(state="training", step=schedule.count)
        if sync:
            state = outer.round(state, step=schedule.count)
            schedule.last = state  # the same count, in a new state
        return logs, state

    return step, program
