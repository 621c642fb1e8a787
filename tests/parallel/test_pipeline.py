"""The ``stage`` axis: pipelined training computes what one device computes, the schedule
sends what it should, and bad settings fail before anything compiles."""

import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import kdist
from kdist import hlo
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.parallel import pipeline
from kdist.planning.compile import build_abstract, compile_train_step, token_batch
from tests.helpers import TINY_GPT, parity_optimizer, token_batches, train, weights

DEEP_GPT = dict(TINY_GPT, num_layers=8)  # 8 layers: 1, 2 or 4 per stage
BATCHES = token_batches(steps=3, batch=16)


def _lm(mesh, config=DEEP_GPT, lm_options=None, **options):
    keras.distribution.set_distribution(kdist.distribution(mesh, **options) if mesh else None)
    keras.utils.set_random_seed(0)
    return GPTCausalLM(GPTBackbone(**{**config, "scan_layers": True}), **(lm_options or {}))


def _run(mesh, config=DEEP_GPT, lm_options=None, **options):
    model = _lm(mesh, config, lm_options, **options)
    return train(model, BATCHES), weights(model)


@pytest.mark.parametrize("repeats", [1, 2])
def test_collective_permutes_carry_one_microbatch_per_iteration(repeats):
    """The compiled step's collective-permutes move (b, T, D) activations, once per
    iteration forward and once backward: 2 (R M + S - 1) x b T D x 4 bytes per device."""
    stages, micro, batch, length = 4, 4, 16, 16
    dist = kdist.distribution("stage=4,data=2", pipeline_repeats=repeats)
    keras.distribution.set_distribution(dist)
    model = build_abstract(lambda: GPTCausalLM(GPTBackbone(**DEEP_GPT)), dist)
    model.compile(optimizer=parity_optimizer())
    compiled, _ = compile_train_step(model, *token_batch(batch, length), dist)
    permutes = [c for c in hlo.parse_collectives(compiled.as_text(), 8)
                if c.kind == "collective-permute" and c.op_name.endswith("ppermute")]
    rows = batch // (2 * micro)  # per device: the data axis splits each microbatch
    activation = rows * length * DEEP_GPT["hidden_dim"] * 4
    iterations = repeats * micro + stages - 1
    assert {c.bytes for c in permutes} == {activation}
    assert sum(c.executions for c in permutes) == 2 * iterations
    summary = hlo.summarize_collectives(permutes)["collective-permute"]
    assert summary["bytes"] == pipeline.Schedule(
        stages, repeats, micro, 2, 8).permute_bytes(activation)


@pytest.mark.parametrize("repeats", [1, 2])
def test_bubble_slots_compute_on_zeros_and_every_microbatch_passes_every_layer(repeats):
    """A toy stack (layer i adds w_i, then doubles) against its sequential result; the
    first layer of a stage sees an all-zero input exactly in the S - 1 bubble iterations of
    each stage (never a leftover activation), and the gradient is the sequential one."""
    stages, num_layers = 4, 8
    keras.distribution.set_distribution(
        kdist.distribution("stage=4,data=2", pipeline_repeats=repeats))
    schedule = pipeline.schedule_for(16, num_layers, training=True)
    per_stage = schedule.layers_per_stage
    zero_inputs = []

    def layer(w, h, kwargs, index, seed):
        first = (index % per_stage) == 0
        jax.debug.callback(lambda f, z: zero_inputs.append(bool(f and z)), first,
                           jnp.all(h == 0))
        return 2 * (h + w[0])

    lead = (num_layers,) if repeats == 1 else (repeats, num_layers // repeats)
    w = jnp.arange(1, num_layers + 1, dtype=jnp.float32).reshape(lead + (1, 1))
    x = jnp.arange(16 * 3 * 2, dtype=jnp.float32).reshape(16, 3, 2) + 1

    def loss(w, x):
        out = pipeline.pipelined(layer, [w], x, {}, None, schedule)
        return jnp.sum(out ** 2), out

    (value, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(w, x)
    jax.effects_barrier()
    expected = x
    for i in range(num_layers):
        expected = 2 * (expected + w.reshape(-1)[i])
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    seq_grad = jax.grad(lambda w: jnp.sum(functools.reduce(
        lambda h, i: 2 * (h + w.reshape(-1)[i]), range(num_layers), x) ** 2))(w)
    np.testing.assert_allclose(grad, seq_grad, rtol=1e-6)
    assert np.isfinite(value)
    # 2 data shards x S stages x (S - 1) bubble iterations, each once forward.
    assert sum(zero_inputs) == 2 * stages * (stages - 1)


def test_settings_are_checked_before_compiling():
    with pytest.raises(ValueError, match="fewer than the 4 pipeline stages"):
        kdist.distribution("stage=4,data=2", pipeline_microbatches=2)
    with pytest.raises(ValueError, match="pipeline_repeats must be a positive int"):
        kdist.distribution("stage=4,data=2", pipeline_repeats=0)
    with pytest.raises(ValueError, match="needs a 'stage' mesh axis"):
        kdist.distribution("data=8", pipeline_microbatches=4)
    with pytest.raises(ValueError, match=r"num_layers=6 does not divide.*among \[2, 3, 6\]"):
        _lm("stage=4,data=2", dict(TINY_GPT, num_layers=6))
    with pytest.raises(ValueError, match=r"pipeline_repeats among \[1, 2\] with stage=4"):
        _lm("stage=4,data=2", dict(TINY_GPT, num_layers=8), pipeline_repeats=4)
    keras.distribution.set_distribution(kdist.distribution("stage=2,data=4"))
    unstacked = GPTCausalLM(GPTBackbone(**TINY_GPT, scan_layers=False))
    with pytest.raises(ValueError, match="no weight of GPTCausalLM is stacked"):
        unstacked.compile(optimizer="adamw")
    model = _lm("stage=4,data=2", pipeline_microbatches=4)
    model.compile(optimizer="adamw")
    x, y = BATCHES[0]
    with pytest.raises(ValueError, match=r"multiple of 2 x 4 = 8.*among \[6\]"):
        model.train_on_batch(x[:12], y[:12])
    assert model.predict_on_batch(x[:3]).shape == (3, 16, 256)  # inference: unpipelined


@pytest.mark.parametrize("repeats", [1, 2])
def test_layouts_split_layers_and_vocabulary_over_stages(repeats):
    model = _lm("stage=4,fsdp=2", pipeline_repeats=repeats)
    spec = tuple(model.backbone.blocks.weights[4].value.sharding.spec)  # query kernel
    assert spec[:repeats] == ((None,) * (repeats - 1) + ("stage",))
    assert "fsdp" in spec  # and ZeRO-3 inside each stage
    table = tuple(model.backbone.token_embedding.embeddings.value.sharding.spec)
    assert table == ("stage", "fsdp")  # no model axis: the vocabulary over the stages
    odd = _lm("stage=4,fsdp=2", dict(DEEP_GPT, vocabulary_size=250))
    assert tuple(odd.backbone.token_embedding.embeddings.value.sharding.spec)[0] is None


def test_dropout_under_a_pipeline_draws_fresh_masks():
    """Each layer, microbatch, device and step its own mask: the same batch twice, with
    (almost) no update between, gives two different finite losses."""
    model = _lm("stage=2,data=4", dict(TINY_GPT, dropout=0.3))
    model.compile(optimizer=parity_optimizer(learning_rate=1e-9))
    x, y = BATCHES[0][0][:8], BATCHES[0][1][:8]
    first, second = (float(model.train_on_batch(x, y)) for _ in range(2))
    assert np.isfinite(first) and np.isfinite(second) and abs(first - second) > 1e-3
