"""AdamW recipe: schedule, decay mask, clipping, gradient accumulation."""

import keras
import numpy as np
import pytest

import kdist
from kdist.optim import adamw, warmup_cosine
from tests.helpers import parity_optimizer, tiny_gpt, token_batches, train, weights


def test_warmup_then_cosine():
    schedule = warmup_cosine(1e-3, warmup_steps=10, decay_steps=100, min_learning_rate_ratio=0.1)
    lr = [float(schedule(s)) for s in (0, 5, 10, 60, 110, 500)]
    np.testing.assert_allclose(lr, [0.0, 5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4], rtol=1e-5)


def test_weight_decay_only_on_matrices():
    model = tiny_gpt()
    optimizer = adamw()
    decayed = {v.path for v in model.trainable_variables if optimizer._use_weight_decay(v)}
    assert decayed == {v.path for v in model.trainable_variables
                       if v.path.endswith("kernel")}
    assert "token_embedding/embeddings" not in decayed


def test_global_norm_clipping_bounds_the_first_update():
    opt = adamw(learning_rate=1.0, warmup_steps=0, weight_decay=0.0, clipnorm=1e-3)
    assert opt.global_clipnorm == 1e-3
    var = keras.Variable(np.zeros(4, "float32"))
    opt.build([var])
    clipped = opt._clip_gradients([keras.ops.full((4,), 100.0)])[0]
    np.testing.assert_allclose(np.linalg.norm(np.asarray(clipped)), 1e-3, rtol=1e-5)


def test_gradient_accumulation_equals_the_large_batch():
    """2 updates from micro-batches of 4 with accumulation = 2 updates from batches of 8.

    The first update has learning rate 0 (warmup) and the second the peak, so a schedule
    that counted micro-batches instead of updates (Keras 3.15 does) would fail this.
    """
    batches = token_batches(2, batch=8)
    large = tiny_gpt()
    train(large, batches)
    keras.utils.clear_session()
    accumulated = tiny_gpt()
    micro = [(x[half], y[half]) for x, y in batches for half in (slice(0, 4), slice(4, 8))]
    train(accumulated, micro, optimizer=parity_optimizer(gradient_accumulation_steps=2))
    assert int(accumulated.optimizer.iterations) == 2
    reference = weights(large)
    for path, value in weights(accumulated).items():
        np.testing.assert_allclose(value, reference[path], atol=2e-6, err_msg=path)
    assert not np.allclose(reference["block_0/mlp/up/kernel"],
                           weights(tiny_gpt())["block_0/mlp/up/kernel"])  # it did train


def test_schedule_counts_updates_under_accumulation():
    optimizer = adamw(1e-3, warmup_steps=10, decay_steps=100, gradient_accumulation_steps=4)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    optimizer._iterations.assign(20)  # 20 micro-batches = 5 updates
    np.testing.assert_allclose(float(optimizer.learning_rate), 5e-4, rtol=1e-6)


def test_bad_accumulation_is_refused():
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive"):
        kdist.optim.adamw(gradient_accumulation_steps=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(learning_rate=-1e-3), r"learning_rate must be a finite number in \(0, inf\); got -0.001"),
    (dict(learning_rate=0.0), r"learning_rate must be a finite number in \(0, inf\); got 0.0"),
    (dict(learning_rate=float("nan")), "learning_rate must be a finite number.*got nan"),
    (dict(learning_rate=float("inf")), "learning_rate must be a finite number.*got inf"),
    (dict(learning_rate="3e-4"), "learning_rate must be a number; got '3e-4'"),
    (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0; got -1"),
    (dict(warmup_steps=2.5), "warmup_steps must be an integer >= 0; got 2.5"),
    (dict(decay_steps=0), "decay_steps must be an integer >= 1; got 0"),
    (dict(min_learning_rate_ratio=1.5), r"min_learning_rate_ratio must be .* \[0, 1\]"),
    (dict(weight_decay=-0.1), r"weight_decay must be a finite number in \[0, inf\)"),
    (dict(beta_1=1.0), r"beta_1 must be a finite number in \[0, 1\); got 1.0"),
    (dict(beta_2=float("nan")), "beta_2 must be a finite number"),
    (dict(epsilon=0.0), r"epsilon must be a finite number in \(0, inf\)"),
    (dict(clipnorm=-1.0), r"clipnorm must be a finite number in \(0, inf\)"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be a positive"),
])
def test_invalid_arguments_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adamw(**kwargs)


def test_schedule_arguments_are_checked_too():
    with pytest.raises(ValueError, match="learning_rate must be a finite number"):
        warmup_cosine(float("nan"), 10, 100)
    with pytest.raises(ValueError, match="decay_steps must be an integer >= 1; got -5"):
        warmup_cosine(1e-3, 10, -5)
    assert adamw(np.float32(1e-3), warmup_steps=np.int64(0), clipnorm=None) is not None
