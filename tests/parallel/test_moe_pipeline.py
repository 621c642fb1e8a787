"""Mixture-of-Experts layers in a pipeline: each microbatch routes its own tokens, so the
load-balance loss is each microbatch's, the step's their mean (Megatron-LM's rule: a
schedule starts a microbatch's backward before the later microbatches' routing exists),
while the load statistics and DeepSeek's balance bias are the batch's (summed counts).

The rows of tests/parallel/combinations.py show a pipeline with experts trains like one
device where the batch's and the microbatches' losses agree (load-balance weight 0); this
file shows the rule itself: one step of ``expert=2,stage=2,data=2`` under 1F1B (the
interpreter's own gradients) and GPipe (JAX's, through the scan) equals one device's step
on the same microbatches, each one's loss (LM + load balance + z-loss)
differentiated on its own and averaged.
"""

import jax
import keras
import numpy as np
import pytest

from tests.helpers import TINY_GPT
from tests.parallel import harness

MESH, MICROBATCHES, ROWS = "expert=2,stage=2,data=2", 2, 16
CONFIG = {**TINY_GPT, "num_layers": 4, "scan_layers": True,
          "moe": {"num_experts": 8, "experts_per_token": 2, "expert_dim": 32,
                  "balance_bias_rate": 0.01, "aux_loss_weight": 0.1}}


def microbatch_rows(replicas: int) -> list[np.ndarray]:
    """The batch rows of each microbatch (kdist.parallel.pipeline.stack._to_microbatches):
    every replica group's block of rows cut into M, microbatch m their m-th parts."""
    block = ROWS // replicas
    part = block // MICROBATCHES
    return [np.concatenate([np.arange(g * block + m * part, g * block + (m + 1) * part)
                            for g in range(replicas)]) for m in range(MICROBATCHES)]


def one_device_step(batch, learning_rate: float):
    """On one device: the mean of the microbatches' losses, the weights after one SGD step
    on the mean of their gradients, and the state one call on the whole batch records."""
    keras.utils.clear_session()
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(0)
    model = harness.FAMILIES["gpt"].build({**harness.FAMILIES["gpt"].config, **CONFIG}, {})
    model.compile(optimizer="sgd")
    x, y = batch
    model(x[:1])
    model.optimizer.build(model.trainable_variables)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    slots = [v.value for v in model.optimizer.variables]

    def loss(trainable, x, y):
        value, (_, _, state, _) = model.compute_loss_and_updates(
            trainable, non_trainable, [], x, y, None, training=True, optimizer_variables=slots)
        return value, state

    grad = jax.value_and_grad(loss, has_aux=True)
    parts = [grad(trainable, x[rows], y[rows]) for rows in microbatch_rows(4)]
    value = np.mean([float(v) for (v, _), _ in parts])
    mean = [np.mean([np.asarray(g[i]) for _, g in parts], axis=0) for i in range(len(trainable))]
    (whole, state), _ = grad(trainable, x, y)  # the batch's state, and loss, at once
    new = {v.path: np.asarray(w) - learning_rate * g
           for v, w, g in zip(model.trainable_variables, trainable, mean)}
    new.update({v.path: np.asarray(s) for v, s in zip(model.non_trainable_variables, state)})
    return value, float(whole), new


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_pipeline_step_averages_its_microbatches_losses(schedule):
    run = harness.train_run("gpt", MESH, config=CONFIG, rows=ROWS, steps=1, optimizer="sgd",
                            pipeline_schedule=schedule, pipeline_microbatches=MICROBATCHES)
    learning_rate = float(run.model.optimizer.learning_rate)
    loss, whole, expected = one_device_step(run.batches[0], learning_rate)
    # the rule shows: the batch's load-balance loss is another number
    assert abs(whole - loss) > 1e-4, (whole, loss)
    np.testing.assert_allclose(run.losses[0], loss, rtol=2e-6)
    assert sorted(expected) == sorted(run.final)
    for path, value in expected.items():
        np.testing.assert_allclose(harness._same_shape(run.final[path], value, path), value,
                                   rtol=0, atol=2e-6, err_msg=path)
