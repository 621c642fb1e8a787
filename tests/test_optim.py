"""AdamW recipe: schedule, decay mask, clipping, gradient accumulation."""

import keras
import numpy as np
import pytest

import kdist
from kdist.optim import adamw, warmup_cosine
from tests.helpers import tiny_gpt, token_batches, train, weights


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
    """Two micro-batches of 4 with accumulation = one batch of 8 (mean loss per batch)."""
    (x, y), = token_batches(1, batch=8)
    large = tiny_gpt()
    train(large, [(x, y)], optimizer=adamw(1e-2, warmup_steps=0, decay_steps=10))
    keras.utils.clear_session()
    accumulated = tiny_gpt()
    train(accumulated, [(x[:4], y[:4]), (x[4:], y[4:])],
          optimizer=adamw(1e-2, warmup_steps=0, decay_steps=10, gradient_accumulation_steps=2))
    assert int(accumulated.optimizer.iterations) == 1
    reference = weights(large)
    for path, value in weights(accumulated).items():
        np.testing.assert_allclose(value, reference[path], atol=2e-6, err_msg=path)


def test_bad_accumulation_is_refused():
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive"):
        kdist.optim.adamw(gradient_accumulation_steps=0)
