"""Every private Keras/JAX API kdist uses (kdist/_keras_compat.py) still works as relied on.

A failure here after an upgrade names the function to fix, instead of a training run
breaking deep inside fit."""

import jax
import keras
import numpy as np
import pytest

from kdist import _keras_compat as compat
from tests.helpers import tiny_gpt


def test_checked_versions_are_the_installed_ones_or_the_pins_moved():
    assert keras.__version__.startswith("3.15"), "re-check kdist/_keras_compat.py for keras"
    assert jax.__version__.startswith("0.10"), "re-check kdist/_keras_compat.py for jax"


def test_fit_state_helpers():
    model = tiny_gpt()
    model.compile(optimizer="adamw")
    compat.set_initial_epoch(model, 3)
    compat.set_initial_epoch(model, None)
    x = np.zeros((8, 16), "int32")
    compat.symbolic_build(model, (x, x))
    assert model.optimizer.built or model.compiled
    trainable, non_trainable, optimizer, metrics = compat.jax_state(model)
    assert len(trainable) == len(model.trainable_variables)
    assert compat.optimizer_iterations(model.optimizer).path.endswith("iteration")
    assert compat.learning_rate_schedule(model.optimizer) is not None
    assert model in compat.all_layers(model)


def test_schedule_at_update_count_under_accumulation():
    schedule = keras.optimizers.schedules.PolynomialDecay(1.0, 10, end_learning_rate=0.0)

    @compat.schedule_at_update_count
    class SGD(keras.optimizers.SGD):
        pass

    opt = SGD(learning_rate=schedule, gradient_accumulation_steps=4)
    opt.build([keras.Variable(np.zeros(2))])
    compat.optimizer_iterations(opt).assign(20)  # 20 micro-batches = 5 updates
    assert int(opt.iterations) == 5
    assert float(opt.learning_rate) == 0.5  # the schedule at 5, not at 20 (0.0)


def test_end_fit_epoch_finds_fits_epoch_iterator():
    seen = []

    class End(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            compat.end_fit_epoch()  # must find fit's epoch_iterator up the stack
            seen.append(epoch)

    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=1, verbose=0, callbacks=[End()])
    assert seen == [0]
    with pytest.raises(compat.CompatibilityError, match="epoch iterator"):
        compat.end_fit_epoch()  # outside fit


def test_abstract_variables_and_layouts():
    with keras.StatelessScope(initialize_variables=False):
        layer = keras.layers.Dense(4)
        layer.build((None, 3))
    compat.forget_pending_variables()
    assert not compat.variable_initialized(layer.kernel)  # kdist.groups.diloco' templates
    assert compat.deferred_initializer(layer.kernel)((3, 4)).shape == (3, 4)
    assert compat.variable_initialized(keras.Variable(np.zeros(2)))
    assert compat.variable_layout(layer.kernel) is None
    compat.set_variable_layout(layer.kernel, "a layout")
    assert compat.variable_layout(layer.kernel) == "a layout"


def test_forget_uninitialized_keeps_the_others_pending():
    with keras.StatelessScope(initialize_variables=False):
        template = keras.layers.Dense(4)
        template.build((None, 3))
        kept = keras.layers.Dense(2)
        kept.build((None, 3))
    assert isinstance(compat.variable_initializer(template.kernel),
                      keras.initializers.GlorotUniform)
    compat.forget_uninitialized(template.weights)
    with keras.StatelessScope():  # its exit initialises what is still pending
        pass
    # Initialising drops the initializer; the forgotten variable still has it (never
    # initialised, no memory).
    assert compat.variable_initializer(kept.kernel) is None
    assert compat.variable_initializer(template.kernel) is not None


def test_pending_variables_are_initialised_once():
    with keras.StatelessScope(initialize_variables=False):
        layer = keras.layers.Dense(4, kernel_initializer="ones")
        layer.build((None, 3))
    layer.bias.assign(np.full(4, 2.0, "float32"))  # assigned: not initialised again
    assert compat.pending_variable_count() == 2
    assert compat.initialize_pending_variables() == 1  # the kernel, from its initializer
    assert np.asarray(layer.kernel.value).sum() == 12 and np.asarray(layer.bias.value)[0] == 2
    assert compat.initialize_pending_variables() == 0


def test_byte_pair_backend_is_settable():
    import keras_hub
    import tokenizers

    tokenizer = keras_hub.tokenizers.BytePairTokenizer(
        vocabulary={"a": 0, "b": 1, "ab": 2}, merges=["a b"])
    backend = compat.byte_pair_backend(tokenizer)
    assert isinstance(backend, tokenizers.Tokenizer)
    compat.set_byte_pair_backend(tokenizer, backend)
    assert compat.byte_pair_backend(tokenizer) is backend
    assert tokenizer.tokenize("ab").tolist() == [2]


def test_byte_pair_split_pattern_is_keras_hubs():
    import tokenizers

    split = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(compat.byte_pair_split_pattern()), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("it's 1234 words")]
    assert pieces == ["it", "'s", " ", "123", "4", " words"]  # numbers in threes


def test_process_helpers_in_one_process():
    assert compat.distributed_client() is None
    assert compat.coordinator_address() is None
    assert compat.jax_backends_started()  # conftest's session already uses the devices
    assert all(hasattr(env, "is_env_present") for env in compat.cluster_environments())
    compat.sync_keras_seed()


def test_train_step_helpers():
    # kdist's own train steps (kdist.parallel.train_step, replicas) use these.
    model = tiny_gpt()
    model.compile(optimizer="adamw")
    x = np.zeros((8, 16), "int32")
    model.train_on_batch(x, x)
    state = compat.jax_state(model)
    shardings = compat.state_shardings(model)
    assert [len(s) for s in shardings] == [len(s) for s in state]
    y_pred = model.predict_on_batch(x)
    logs, metrics = compat.update_metrics_variables(model, state[3], 1.0, x, x, y_pred, None)
    assert "loss" in logs and len(metrics) == len(state[3])
    calls = []
    step = compat.step_function(model, lambda state, data: (calls.append(data), state))
    step("state", iter(["batch"]))
    assert calls == ["batch"]


def test_keras_train_step_is_the_trainers_own_jit():
    # kdist.compiled_step compiles it ahead; it must be the program Keras' fit would run:
    # the state donated and, under a distribution, the state outputs pinned.
    model = tiny_gpt(mesh="fsdp=8")
    model.compile(optimizer="adamw")
    x = np.zeros((8, 16), "int32")
    model.train_on_batch(x, x)
    state = compat.jax_state(model)
    jitted = compat.keras_train_step(model)
    lowered = jitted.lower(state, (x, x))
    state_info, data_info = lowered.args_info[0]
    is_info = lambda a: hasattr(a, "donated")  # noqa: E731
    assert all(a.donated for a in jax.tree.leaves(state_info, is_leaf=is_info))
    assert not any(a.donated for a in jax.tree.leaves(data_info, is_leaf=is_info))
    out_state = lowered.compile().output_shardings[1]
    assert jax.tree.leaves(out_state) == jax.tree.leaves(compat.state_shardings(model))


def test_a_progress_bar_figure_prints_without_four_decimals(capsys):
    """Keras' bar printed `tok/s: 1503.5000`; built as ProgbarLogger builds it."""
    for verbose in (1, 2):
        bar = keras.utils.Progbar(target=2, verbose=verbose, stateless_metrics=set())
        bar.update(1, [("tok/s", compat.progress_bar_figure(1503.5))])
        bar.update(2, [("tok/s", compat.progress_bar_figure(12.34))], finalize=True)
    out = capsys.readouterr().out
    assert "tok/s: 1,504" in out and out.count("tok/s: 12.3") == 2 and "0000" not in out
    assert "12.34" not in out


def test_keras_asks_for_tensorflow_only_once_it_is_loaded():
    """Keras' serialisation and seeding see TensorFlow exactly when it is imported (this
    process has it, from the data tests), and import kdist installed the view once."""
    import importlib
    import sys

    compat.tensorflow_only_when_loaded()  # again: idempotent
    for name in compat._RECOGNISE_ONLY:
        view = importlib.import_module(name).tf
        assert isinstance(view, compat._TensorFlowIfLoaded), name
        assert view.available == ("tensorflow" in sys.modules)
    config = keras.layers.Dense(2).get_config()
    assert keras.layers.Dense.from_config(config).units == 2
