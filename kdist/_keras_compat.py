"""Every use of private Keras or JAX API in kdist, in one place.

Each function names the private attribute it touches and the versions it was checked
against (keras 3.15.1, jax 0.10.2). ``tests/test_keras_compat.py`` calls every function
against the installed versions, so an upgrade that moves one of them fails there with the
function's name, not deep inside a training run. Nothing outside this module may import
``keras.src``, ``jax._src`` or touch a private attribute of a Keras object (a test greps
for it).
"""

from __future__ import annotations

import sys
from typing import Any

CHECKED_AGAINST = {"keras": "3.15.1", "jax": "0.10.2"}


class CompatibilityError(RuntimeError):
    """A private Keras/JAX API kdist relies on is missing in the installed version."""


def _missing(what: str, error: Exception) -> CompatibilityError:
    import jax
    import keras

    return CompatibilityError(
        f"{what} is not available in keras {keras.__version__} / jax {jax.__version__} "
        f"(kdist was checked against keras {CHECKED_AGAINST['keras']}, jax "
        f"{CHECKED_AGAINST['jax']}): {error}. Install the versions pinned in pyproject.toml."
    )


# --- Keras: fit and the optimizer ---------------------------------------------------------


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes ``fit`` start at ``epoch`` (``Model._initial_epoch``, read by Keras' fit since
    3.0; ``None`` clears it). How ``BackupAndRestore`` resumes."""
    model._initial_epoch = epoch


def end_fit_epoch() -> None:
    """Tells ``fit``'s data adapter that an epoch stopped by ``stop_training`` is over.

    An epoch that ends by ``stop_training`` leaves Keras' epoch iterator suspended before
    its ``data_adapter.on_epoch_end()``, and a ``PyDataset`` adapter then refuses the next
    epoch ("on_epoch_begin was called twice"). Keras offers callbacks no handle on the
    iterator, so it is found in ``fit``'s frame (the local ``epoch_iterator``), which is on
    the stack of the callback hook calling this.
    """
    frame = sys._getframe(1)
    while frame is not None:
        iterator = frame.f_locals.get("epoch_iterator")
        if iterator is not None and hasattr(iterator, "data_adapter"):
            iterator.data_adapter.on_epoch_end()
            return
        frame = frame.f_back
    raise CompatibilityError(
        "Could not find Keras' epoch iterator in fit's frame (a Keras version whose fit "
        "differs from 3.15's?). Resume from a step at an epoch boundary (save_every_steps a "
        "multiple of steps_per_epoch) to avoid ending an epoch early."
    )


def learning_rate_schedule(optimizer) -> Any:
    """The optimizer's learning rate as given: a schedule, a float or a variable
    (``Optimizer._learning_rate``; ``optimizer.learning_rate`` evaluates it instead)."""
    return getattr(optimizer, "_learning_rate", None)


def symbolic_build(model, batch) -> None:
    """Builds a model's loss and metric state from a batch of specs without computing
    (``Trainer._symbolic_build``, what ``fit`` does before its first step)."""
    model._symbolic_build(data_batch=batch)


def _pending_variables() -> list:
    try:
        from keras.src.backend.common import global_state
    except ImportError as e:
        raise _missing("keras.src.backend.common.global_state", e) from e
    return list(global_state.get_global_attribute("uninitialized_variables") or [])


def _set_pending_variables(variables: list) -> None:
    from keras.src.backend.common import global_state

    global_state.set_global_attribute("uninitialized_variables", variables)


def pending_variable_count() -> int:
    """How many variables a ``StatelessScope(initialize_variables=False)`` has left to
    initialise (``global_state`` attribute ``uninitialized_variables``)."""
    return len(_pending_variables())


def forget_pending_variables(start: int = 0) -> None:
    """Drops the variables a ``StatelessScope(initialize_variables=False)`` left to
    initialise later (``global_state`` attribute ``uninitialized_variables``), from the
    ``start``-th on: an abstract model must never be materialised."""
    _set_pending_variables(_pending_variables()[:start])


def initialize_pending_variables(start: int = 0) -> int:
    """Initialises, each with its own initializer and layout, the variables a
    ``StatelessScope(initialize_variables=False)`` left pending (from the ``start``-th on)
    that no one has assigned since (``global_state`` attribute ``uninitialized_variables``;
    ``Variable._value`` is None until then; ``Variable._deferred_initialize``), and drops
    them from the list. Returns how many were initialised. How ``kdist.models.hf`` builds a
    model whose weights it then assigns from a checkpoint: nothing is initialised twice."""
    pending = _pending_variables()
    count = 0
    for variable in pending[start:]:
        if variable._value is None:
            variable._deferred_initialize()
            count += 1
    _set_pending_variables(pending[:start])
    return count


# --- keras-hub: tokenizers ----------------------------------------------------------------


def set_byte_pair_backend(tokenizer, hf_tokenizer) -> None:
    """Makes a keras-hub ``BytePairTokenizer`` encode and decode (outside ``tf.data``) with
    ``hf_tokenizer``, a ``tokenizers.Tokenizer`` read from a model's ``tokenizer.json``
    (``BytePairTokenizer._tokenizer``, keras-hub 0.32: its pure-Python backend, which it
    otherwise builds from the vocabulary and merges with Llama 3's split pattern, whatever
    the model's own pre-tokenizer)."""
    if not hasattr(tokenizer, "_tokenizer"):
        raise CompatibilityError(f"{type(tokenizer).__name__} has no _tokenizer backend "
                                 f"(keras-hub changed; kdist was checked against 0.32).")
    tokenizer._tokenizer = hf_tokenizer


def byte_pair_split_pattern() -> str:
    """The regex keras-hub's ``BytePairTokenizer`` splits text with before merging
    (``keras_hub.src.tokenizers.byte_pair_tokenizer.SPLIT_PATTERN_TOKENIZERS``, keras-hub
    0.32; not exported): a vocabulary trained with it gives the ids keras-hub computes."""
    from kdist._optional import optional_import

    optional_import("keras_hub", "A byte-pair vocabulary split like keras-hub's")
    try:
        from keras_hub.src.tokenizers.byte_pair_tokenizer import SPLIT_PATTERN_TOKENIZERS
    except ImportError as e:
        raise _missing("keras_hub.src.tokenizers.byte_pair_tokenizer."
                       "SPLIT_PATTERN_TOKENIZERS", e) from e
    return SPLIT_PATTERN_TOKENIZERS


def byte_pair_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` a keras-hub ``BytePairTokenizer`` encodes with outside
    ``tf.data`` (``BytePairTokenizer._tokenizer``, keras-hub 0.32), or None."""
    return getattr(tokenizer, "_tokenizer", None)


# --- JAX / Keras: several processes -------------------------------------------------------


def distributed_client():
    """JAX's coordination-service client, or None before ``jax.distributed.initialize``
    (``jax._src.distributed.global_state.client``)."""
    try:
        from jax._src import distributed
    except ImportError as e:
        raise _missing("jax._src.distributed", e) from e
    return distributed.global_state.client


def coordinator_address() -> str | None:
    """The coordinator's ``host:port`` of the running job, or None
    (``jax._src.distributed.global_state.coordinator_address``)."""
    try:
        from jax._src import distributed
    except ImportError as e:
        raise _missing("jax._src.distributed", e) from e
    return distributed.global_state.coordinator_address


def sync_keras_seed() -> None:
    """The same Keras seed in every process, as ``keras.distribution.initialize`` does
    (``keras.src.backend.jax.distribution_lib.initialize_rng``)."""
    try:
        from keras.src.backend.jax.distribution_lib import initialize_rng
    except ImportError as e:
        raise _missing("keras.src.backend.jax.distribution_lib.initialize_rng", e) from e
    initialize_rng()


def jax_backends_started() -> bool:
    """Whether JAX has created its device backends (after which ``XLA_FLAGS``,
    ``jax.distributed.initialize`` and CPU collectives can no longer change anything;
    ``jax._src.xla_bridge.backends_are_initialized``)."""
    try:
        from jax._src import xla_bridge
    except ImportError as e:
        raise _missing("jax._src.xla_bridge", e) from e
    return xla_bridge.backends_are_initialized()


def cluster_environments() -> list:
    """The cluster detectors JAX tries in ``jax.distributed.initialize`` (SLURM, Open MPI,
    TPU pods, ...; ``jax._src.clusters.ClusterEnv._cluster_types``); empty if absent."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:
        return []
    return list(getattr(ClusterEnv, "_cluster_types", []))


# --- Keras: variables, layers and model state ---------------------------------------------


def variable_layout(variable):
    """The layout a variable was given at creation, or None (``Variable._layout``, set by
    Keras from the distribution when it initialises the variable)."""
    return getattr(variable, "_layout", None)


def set_variable_layout(variable, layout) -> None:
    """Gives an uninitialised (abstract) variable its layout, as Keras does when it
    initialises it under a distribution."""
    variable._layout = layout


def all_layers(model) -> list:
    """Every layer inside ``model``, itself included (``Layer._flatten_layers``)."""
    return list(model._flatten_layers())


def jax_state(model) -> tuple:
    """``(trainable, non_trainable, optimizer, metrics)`` variable values as the JAX
    trainer's ``train_step`` takes them (``JAXTrainer._get_jax_state``)."""
    return model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                optimizer_variables=True, metrics_variables=True)


def optimizer_iterations(optimizer):
    """The raw step counter (``Optimizer._iterations``): micro-batches under gradient
    accumulation, where ``optimizer.iterations`` counts updates."""
    return optimizer._iterations



def schedule_at_update_count(optimizer_class):
    """Class decorator for a Keras optimizer: its learning-rate schedule is evaluated at the
    update count (``optimizer.iterations``), not at the raw micro-step counter Keras 3.15
    uses under gradient accumulation (``Optimizer._get_current_learning_rate`` reading
    ``_learning_rate`` at ``_iterations``), which runs warmup and decay N times too fast."""
    import keras

    base = optimizer_class._get_current_learning_rate

    def _get_current_learning_rate(self):
        schedule = self._learning_rate
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self.iterations)
        return base(self)

    optimizer_class._get_current_learning_rate = _get_current_learning_rate
    return optimizer_class


def callback_model(callback):
    """The model a callback is attached to, without the state sync of the public
    ``Callback.model`` property (on JAX it pulls the whole training state back into the
    variables; ``Callback._model``). For hooks that only flag ``stop_training``."""
    return callback._model


class _BarFigure(float):
    """A float that Keras' progress bar prints as :func:`progress_bar_figure` says."""

    def __truediv__(self, other):
        return _BarFigure(float(self) / other)

    def __format__(self, spec):
        value = float(self)
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def progress_bar_figure(value: float) -> float:
    """``value`` for a ``fit`` log that Keras' progress bar prints to 3 significant figures,
    thousands separated (``1,504``, ``12.3``) instead of ``1503.5000``: ``Progbar.update``
    (keras 3.15.1) keeps each logged value with a count of 1 and prints ``value / count``
    with ``:.4f``, whatever it measures. This float divides into its own kind and formats
    itself; to anything else it is the number.

    Example:
        >>> f"{progress_bar_figure(1503.5) / 1:.4f}", progress_bar_figure(1503.5) + 1
        ('1,504', 1504.5)
    """
    return _BarFigure(value)


def aggregate_additional_loss(model, loss):
    """One of ``model.losses`` (regularisers, ``add_loss``) reduced as Keras' own
    ``compute_loss`` does (``Trainer._aggregate_additional_loss``)."""
    return model._aggregate_additional_loss(loss)


def has_compiled_metrics(model) -> bool:
    """Whether ``compile`` was given metrics or weighted metrics (``Trainer._compile_metrics``)."""
    return getattr(model, "_compile_metrics", None) is not None


def update_metrics_variables(model, metrics_variables, unscaled_loss, x, y, y_pred,
                             sample_weight):
    """``(logs, new metrics_variables)`` as the JAX trainer's ``train_step`` computes them
    after the update (``JAXTrainer._update_metrics_variables``)."""
    return model._update_metrics_variables(metrics_variables, unscaled_loss, x, y, y_pred,
                                           sample_weight)


def variable_initialized(variable) -> bool:
    """Whether a variable holds a value: one created in a
    ``StatelessScope(initialize_variables=False)`` has none (``Variable._value``)."""
    return getattr(variable, "_value", None) is not None


def deferred_initializer(variable):
    """The initializer an uninitialised variable will be initialised with
    (``Variable._initializer``)."""
    return variable._initializer


def state_shardings(model):
    """The shardings of ``(trainable, non_trainable, optimizer, metrics)`` state that the
    JAX trainer gives its jitted train step as ``out_shardings``
    (``JAXTrainer._get_state_sharding_spec``)."""
    return model._get_state_sharding_spec()


def keras_train_step(model):
    """``jax.jit`` of the model's train step exactly as Keras 3.15's
    ``JAXTrainer.make_train_function`` builds it: the state donated, the state outputs
    pinned to the state's shardings under a distribution (``_get_state_sharding_spec``),
    and under Flax NNX the class's ``train_step`` (``keras.src.backend.config.
    is_nnx_enabled``). ``kdist.compiled_step`` compiles it ahead and calls it."""
    import jax
    import keras

    try:
        from keras.src.backend.config import is_nnx_enabled
    except ImportError as e:
        raise _missing("keras.src.backend.config.is_nnx_enabled", e) from e
    out_shardings = None
    if keras.distribution.distribution() is not None:
        out_shardings = (None, model._get_state_sharding_spec())
    if is_nnx_enabled():
        def step(state, data):
            return type(model).train_step(model, state, data)
    else:
        step = model.train_step
    return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)


def step_function(model, step):
    """``step(state, data)`` wrapped as the JAX trainer wraps its jitted train step for
    ``fit``: ``(state, iterator)``, ``steps_per_execution`` steps per call
    (``JAXTrainer._make_function``)."""
    return model._make_function(step)


def forget_uninitialized(variables) -> None:
    """Drops ``variables`` from the list of variables a ``StatelessScope(
    initialize_variables=False)`` left to initialise later (``global_state`` attribute
    ``uninitialized_variables``), so they are never allocated; any other pending variable
    stays. For a layer built only as a template (``kdist.models.scan.LayerStack``)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError as e:
        raise _missing("keras.src.backend.common.global_state", e) from e
    ids = {id(v) for v in variables}
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    global_state.set_global_attribute("uninitialized_variables",
                                      [v for v in pending if id(v) not in ids])


def variable_initializer(variable):
    """The initializer a variable was (or will be) initialised with (``Variable.
    _initializer``; None once a Keras variable holds its value and drops it)."""
    return getattr(variable, "_initializer", None)


def in_shape_inference() -> bool:
    """Whether Keras is inferring output shapes (``compute_output_spec``: stand-in lengths
    for unknown dimensions, nothing computed), where a layer may take any path that gives
    the same shapes."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


# --- Keras: TensorFlow where nobody asked for it ------------------------------------------

# Keras modules whose only use of TensorFlow is to recognise TensorFlow's objects
# (``isinstance(obj, tf.TensorShape)`` in serialisation) or to seed it: an object of
# TensorFlow's cannot exist, nor needs seeding, before TensorFlow is imported.
_RECOGNISE_ONLY = ("keras.src.saving.serialization_lib", "keras.src.utils.rng_utils")


class _TensorFlowIfLoaded:
    """Keras' lazy ``tensorflow`` module, available only once something imported TensorFlow.

    Keras asks ``tf.available`` (which imports TensorFlow, ~5-8 s and ~1 GiB of address
    space) in every ``get_config`` and in ``keras.utils.set_random_seed``; where TensorFlow is
    installed, every training process loaded it. Asked again each time, so a later
    ``import tensorflow`` is seen."""

    def __init__(self, lazy):
        self._lazy = lazy

    @property
    def available(self) -> bool:
        return "tensorflow" in sys.modules and self._lazy.available

    def __getattr__(self, name):
        return getattr(self._lazy, name)


def tensorflow_only_when_loaded() -> None:
    """Makes Keras' serialisation and seeding use TensorFlow only where it
    is already imported (the module attribute ``tf`` of each of ``_RECOGNISE_ONLY``, Keras
    3.15's ``keras.src.utils.module_utils.tensorflow``). Keras' preprocessing layers, which
    need TensorFlow, keep importing it. What changes: ``keras.utils.set_random_seed`` seeds
    TensorFlow only if it was imported first (kdist's data never draws from TensorFlow's
    generator)."""
    import importlib

    for name in _RECOGNISE_ONLY:
        try:
            module = importlib.import_module(name)
            lazy = module.tf
        except (ImportError, AttributeError) as e:
            raise _missing(f"{name}.tf (Keras' lazy TensorFlow module)", e) from e
        if not isinstance(lazy, _TensorFlowIfLoaded):
            module.tf = _TensorFlowIfLoaded(lazy)


def live_non_trainable_values(model, indices: list[int]) -> list:
    """The current values of ``model.non_trainable_variables[i]`` for ``i`` in ``indices``,
    without the state sync of the public ``Callback.model``: inside ``fit`` the JAX trainer
    keeps the state in ``model._jax_state`` and purges the variables (``JAXTrainer.fit``,
    keras 3.15.1); before and after, or once a callback synced it (``_jax_state_synced``),
    the variables hold the values."""
    state = getattr(model, "_jax_state", None) or {}
    values = state.get("non_trainable_variables")
    if values and not getattr(model, "_jax_state_synced", True):
        return [values[i] for i in indices]
    variables = model.non_trainable_variables
    return [variables[i].value for i in indices]


def no_autocast():
    """A scope in which variables read as stored: Keras' ``AutocastScope(None)``."""
    from keras.src.backend import AutocastScope

    return AutocastScope(None)
