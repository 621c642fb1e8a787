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
          "moe": {"num_experts": 8, "experts_per_token": 2, "expert_dim": 24,
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


@pytest.mark.parametrize("mesh, options", [
    ("expert=2,stage=2,data=2", {"pipeline_schedule": "1f1b"}),
    ("expert=2,data=4", {"gradient_reduction": "float32"}),
])
def test_expert_weights_stay_split_in_stages_and_the_per_device_loss(mesh, options):
    """Where every batch axis is manual (a pipeline's stage, kdist's per-device loss), each
    device's experts enter padded into zeros of the weight's shape (Keras checks shapes)
    and come back out in the dispatch: no expert weight is gathered over 'expert', the
    tokens move by all-to-all."""
    import kdist
    from kdist import hlo
    from kdist.models import GPTBackbone, GPTCausalLM
    from kdist.planning.compile import compile_train_step

    dist = kdist.distribution(mesh, **options)
    keras.distribution.set_distribution(dist)
    lm = GPTCausalLM(GPTBackbone(**CONFIG))
    lm.compile(optimizer="adamw")
    x = np.zeros((ROWS, 16), "int32")
    compiled, _ = compile_train_step(lm, x, x, dist)
    over = [(c.kind, c.axes(dist.mesh_shape), c.bytes) for c in
            hlo.parse_collectives(compiled.as_text(), 8)]
    assert ("all-to-all", frozenset({"expert"})) in {(k, a) for k, a, _ in over}, over
    # an expert weight's bytes, of one layer or the stack, whole or a device's half (the
    # other all-gathers: the embedding table, 64 KiB, and the stack's state)
    moe = CONFIG["moe"]
    layer = moe["num_experts"] * CONFIG["hidden_dim"] * moe["expert_dim"] * 4
    sizes = {layer * f for f in (0.5, 1, CONFIG["num_layers"] / 2, CONFIG["num_layers"])}
    assert not [(kind, b) for kind, axes, b in over
                if kind == "all-gather" and "expert" in axes and b in sizes], over
