"""A model family defined only here — a two-layer MLP language model — trains sharded, is
planned and gets an MFU, with no edit in kdist/: the parallel layer, the planner and the
Throughput callback use its declarations (logical axes, step features, cost model), never
its class."""

import json
import math

import keras
import numpy as np
from keras import ops

import kdist
from kdist.flops import FlopsPerToken
from kdist.models.base import Backbone, CostModel, Task
from kdist.parallel.rules import add_weight, build_with_axes
from tests.helpers import parity_optimizer, token_batches

VOCAB, HIDDEN, MLP, LENGTH = 256, 64, 128, 16


class MLPBackbone(Backbone, keras.Model):
    """Token embedding, then one residual MLP (up, GELU, down); no attention."""

    def __init__(self, vocabulary_size: int, hidden_dim: int, mlp_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size, self.hidden_dim, self.mlp_dim = vocabulary_size, hidden_dim, mlp_dim
        self.up = keras.layers.Dense(mlp_dim, activation="gelu", name="up")
        self.down = keras.layers.Dense(hidden_dim, name="down")

    def build(self, input_shape):
        self.embeddings = add_weight(self, "embeddings", (self.vocabulary_size, self.hidden_dim),
                                     ("vocab", "embed"),
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))
        hidden = (*input_shape, self.hidden_dim)
        build_with_axes(self.up, hidden, kernel=("embed", "mlp"), bias=("mlp",))
        build_with_axes(self.down, (*input_shape, self.mlp_dim), kernel=("mlp", "embed"),
                        bias=("embed",))

    def call(self, token_ids):
        x = ops.take(self.embeddings, token_ids, axis=0)  # (B, T, D)
        return x + self.down(self.up(x))                  # (B, T, D)


class MLPCost(CostModel):
    def __init__(self, vocabulary_size, hidden_dim, mlp_dim, **_):
        self.v, self.d, self.f = vocabulary_size, hidden_dim, mlp_dim

    @property
    def parameters(self):
        return self.v * self.d + 2 * self.d * self.f + self.f + self.d

    def flops_per_token(self, sequence_length, causal_half=True):
        # up, down and the tied output projection: 2 FLOPs per multiply-add.
        return FlopsPerToken(qkv=0.0, attention=0.0, output_projection=0.0,
                             mlp=2 * (2 * self.d * self.f), unembedding=2 * self.d * self.v,
                             causal=False, causal_half=causal_half,
                             sequence_length=sequence_length)

    def activation_bytes_per_token(self, sequence_length, bytes_per_value=4, remat=False):
        return bytes_per_value * (2 * self.d + 2 * self.f + self.v)


class MLPLM(Task, keras.Model):
    backbone_class = MLPBackbone
    token_id_labels = True

    def __init__(self, backbone: MLPBackbone, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone

    def call(self, token_ids):
        hidden = self.backbone(token_ids)                              # (B, T, D)
        return ops.einsum("btd,vd->btv", hidden, self.backbone.embeddings)  # (B, T, V)

    def compile(self, optimizer="adamw", loss=None, **kwargs):
        loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    @classmethod
    def cost_model_for(cls, backbone_config, **task_args):
        return MLPCost(**backbone_config)


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


def test_trains_sharded_like_one_device():
    _, reference = train(None)
    model, losses = train("fsdp=4,model=2")
    np.testing.assert_allclose(losses, reference, rtol=2e-6)
    layouts = {w.path.split("mlp_backbone")[-1].split("/", 1)[-1]: tuple(w.value.sharding.spec)
               for w in model.weights}
    assert layouts == {"embeddings": ("model", "fsdp"), "up/kernel": ("fsdp", "model"),
                       "up/bias": ("model",), "down/kernel": ("model", "fsdp"),
                       "down/bias": ("fsdp",)}


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
