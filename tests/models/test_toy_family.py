"""A model family defined only here — a two-layer MLP language model — trains sharded, is
planned and gets an MFU, with no edit in kdist/: the parallel layer, the planner and the
Throughput callback use its declarations (logical axes, step features, cost model), never
its class."""

import json
import math

import keras
import numpy as np

import kdist
from kdist.models.base import Backbone, Task
from tests.helpers import parity_optimizer, token_batches
from tests.toy_family import HIDDEN, LENGTH, MLP, MLPLM, VOCAB, MLPBackbone, MLPCost


def build(mesh=None):
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    keras.utils.set_random_seed(0)
    model = MLPLM(MLPBackbone(VOCAB, HIDDEN, MLP))
    model(np.zeros((1, LENGTH), "int32"))
    return model


def train(mesh, callbacks=()):
    model = build(mesh)
    model.compile(optimizer=parity_optimizer())
    batches = token_batches(3, batch=8, length=LENGTH, vocab=VOCAB)
    x, y = (np.concatenate([b[i] for b in batches]) for i in (0, 1))
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history.history["loss"]


def test_is_planned_through_its_cost_model():
    plan = kdist.plan.plan(lambda: build_abstract_model(), mesh="fsdp=4,model=2",
                           global_batch_size=8, sequence_length=LENGTH, suggest=False)
    cost = MLPCost(VOCAB, HIDDEN, MLP)
    assert plan.fits
    assert plan.as_dict()["parameters"] == cost.parameters
    assert plan.flops["formula"] == cost.flops_per_token(LENGTH).training * 8 * LENGTH


def build_abstract_model():
    model = MLPLM(MLPBackbone(VOCAB, HIDDEN, MLP))
    model(keras.KerasTensor((8, LENGTH), "int32"))
    return model


def test_gets_mfu_from_throughput(tmp_path):
    throughput = kdist.callbacks.Throughput(global_batch_size=8, sequence_length=LENGTH,
                                            log_dir=tmp_path, log_every=1, peak_tflops=1.0)
    train("fsdp=4,model=2", callbacks=[throughput])
    rows = [json.loads(line) for line in (tmp_path / "throughput.jsonl").read_text().splitlines()]
    config = next(r for r in rows if r["kind"] == "config")
    flops = MLPCost(VOCAB, HIDDEN, MLP).flops_per_token(LENGTH)
    assert config["flops_convention"] == flops.convention  # the cost model's, not 6N
    steps = [r for r in rows if r["kind"] == "interval" and r.get("mfu") is not None]
    assert steps
    for r in steps:
        assert math.isclose(r["mfu"], r["tokens_per_s_per_device"] * flops.training / 1e12,
                            rel_tol=1e-6)


def test_a_functional_kdist_model_leaves_the_base_classes_alone():
    # Keras injects Functional into the bases of a functional model's classes; the base
    # classes are mixins so that a subclassed family still builds afterwards.
    kdist.models.GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1)
    assert Backbone.__bases__ == (object,) and Task.__bases__ == (object,)
    assert build()(np.zeros((1, LENGTH), "int32")).shape == (1, LENGTH, VOCAB)
