"""kdist's own gradient reduction (``kdist.distribution(..., gradient_reduction=...)``): one
collective per weight, in the asked type or as 8-bit codes, error feedback in the optimizer
state, refusals. (That it trains like one device on every mesh, with dropout, BERT, the
fused loss, chunked attention and a split sequence: the ``gradient_reduction`` rows of
tests/parallel/combinations.py.)"""

import collections

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist import hlo
from kdist.models import BertBackbone, BertMaskedLM, GPTBackbone, GPTCausalLM
from tests.bert_helpers import TINY_BERT
from tests.helpers import TINY_GPT, parity_optimizer, token_batches
from tests.parallel.harness import assert_trains_like_one_device, reference_run

MESHES = ["data=8", "fsdp=8", "data=2,fsdp=4"]


def _bert(mesh, reduction, dropout=0.1):
    keras.distribution.set_distribution(
        kdist.distribution(mesh, gradient_reduction=reduction) if mesh else None)
    keras.utils.set_random_seed(0)
    return BertMaskedLM(BertBackbone(**TINY_BERT, dropout=dropout))


def _model(mesh, reduction, config=TINY_GPT, seed=1, **lm_options):
    keras.distribution.set_distribution(
        kdist.distribution(mesh, gradient_reduction=reduction) if mesh else None)
    keras.utils.set_random_seed(seed)
    return GPTCausalLM(GPTBackbone(**config), **lm_options)


def _emitted_collectives(model, batch):
    """Collectives of the train step as kdist emits it (HLO before XLA's passes: XLA:CPU
    later promotes bfloat16 reductions to float32, GPUs keep them)."""
    x, y = batch
    model.train_on_batch(x, y)  # builds optimizer and metrics state
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    text = jax.jit(model.train_step).lower(state, (x, y)).compiler_ir("hlo").as_hlo_text()
    return hlo.parse_collectives(text, num_devices=8)


@pytest.mark.parametrize("reduction", ["float32", "bfloat16"])
def test_one_reduce_scatter_per_weight_in_the_asked_type(reduction):
    model = _model("fsdp=8", reduction)
    model.compile(optimizer=parity_optimizer())
    found = _emitted_collectives(model, token_batches(1)[0])
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    weights = model.trainable_variables
    assert len(scatters) == len(weights)  # the tied token table's two uses: one reduction
    size = 2 if reduction == "bfloat16" else 4
    assert sum(c.bytes for c in scatters) == sum(w.value.size for w in weights) * size
    kinds = collections.Counter(c.kind for c in found)
    assert kinds["all-reduce"] <= 1  # the loss's mean; no gradient is all-reduced


def test_data_parallel_reduction_is_the_ring_minimum():
    sizes = {"data": 8, "fsdp": 1, "model": 1}
    config = {"vocabulary_size": 256, "num_layers": 2, "num_heads": 8, "hidden_dim": 64,
              "intermediate_dim": 128}
    result = kdist.plan.plan("gpt-nano", mesh="data=8", global_batch_size=8,
                             sequence_length=32, device_memory="1TiB", suggest=False,
                             model_overrides=config, gradient_reduction="float32")
    minimum = kdist.plan.theoretical_collective_bytes(
        {**kdist.models.GPT_PRESETS["gpt-nano"], **config}, sizes, 8, 32)
    gradients = result.collectives["all-reduce"]["wire_bytes"]
    # Every gradient once (XLA may combine them); the loss's mean adds a few bytes.
    assert minimum["all-reduce"] <= gradients <= minimum["all-reduce"] * 1.001


def test_unsupported_settings_are_refused_before_compiling():
    with pytest.raises(ValueError, match="'float32', 'bfloat16', 'float8' or 'int8'"):
        kdist.distribution("fsdp=8", gradient_reduction="fp8")
    with pytest.raises(ValueError, match="error_feedback=True .* needs gradient_reduction"):
        kdist.distribution("fsdp=8", gradient_reduction="bfloat16", error_feedback=True)
    keras.distribution.set_distribution(kdist.distribution("fsdp=8", gradient_reduction="float32"))

    class KerasDropoutTask(kdist.models.base.Task, keras.Model):  # Keras' own Dropout
        step_features = frozenset({"gradient_reduction"})

    tokens = keras.Input((16,), dtype="int32")
    hidden = keras.layers.Dropout(0.1)(keras.layers.Embedding(256, 8)(tokens))
    task = KerasDropoutTask(inputs=tokens, outputs=keras.layers.Dense(256)(hidden))
    with pytest.raises(ValueError, match="same random mask on every device"):
        task.compile(optimizer=parity_optimizer())
    model = _model("fsdp=8", "float32")
    with pytest.raises(ValueError, match="loss has reduction 'none', expected one of"):
        model.compile(optimizer=parity_optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                      reduction="none"))


def test_a_split_sequence_refuses_what_reads_across_it():
    # Under seq each device's loss covers its share of every sequence's tokens: BERT's loss
    # (masked positions, the first token) and dropout (one mask per share) are refused at
    # compile, before XLA compiles anything. A causal LM trains (tests/test_context_training.py).
    with pytest.raises(ValueError, match="does not declare the 'token_reordering'"):
        _bert("seq=4,data=2", "float32", dropout=0.0).compile(optimizer=parity_optimizer())
    model = _model("seq=8", "bfloat16", {**TINY_GPT, "dropout": 0.1})
    with pytest.raises(ValueError, match="same mask for every 'seq' share"):
        model.compile(optimizer=parity_optimizer())


def test_bfloat16_reduction_rounds_each_partial_gradient():
    run = assert_trains_like_one_device("gpt", "fsdp=8", gradient_reduction="bfloat16",
                                        tolerance="bfloat16_gradients")
    # Not merely another summation order: the float32 reduction's losses differ.
    assert run.losses != reference_run("gpt", "fsdp=8", gradient_reduction="float32").losses


def test_dropout_references_draw_masks():
    # The dropout rows of tests/parallel/combinations.py compare with a 1-device run that
    # really drew masks.
    plain, dropout = reference_run("gpt"), reference_run("gpt", config={"dropout": 0.1})
    assert not np.allclose(plain.losses[1:], dropout.losses[1:], rtol=1e-4)


def test_error_feedback_residuals_live_in_the_optimizer_state():
    from kdist.checkpointing.state import state_variables

    run = assert_trains_like_one_device("gpt", "data=2,fsdp=4", gradient_reduction="float8",
                                        error_feedback=True, tolerance="8bit")
    model = run.model
    residuals = {v.path: v for v in model.optimizer.variables
                 if v.path.endswith("_gradient_residual")}
    assert len(residuals) == len(model.trainable_variables)
    table = residuals[next(p for p in residuals if "token_embedding_embeddings" in p)]
    assert table.shape == (8, *model.backbone.token_embedding.embeddings.shape)  # per device
    assert np.abs(np.asarray(table.value)).max() > 0  # what the codes lost, kept
    keys = state_variables(model)
    assert sum(k.endswith("_gradient_residual") for k in keys) == len(residuals)  # checkpointed


def test_8bit_gradients_cross_the_wire_as_one_byte_each():
    from kdist.parallel.compression import chunking

    model = _model("fsdp=8", "float8")  # int8 codes travel in the same buffers
    model.compile(optimizer=parity_optimizer())
    found = _emitted_collectives(model, token_batches(1)[0])
    exchanges = [c for c in found if c.kind == "all-to-all"]
    weights = model.trainable_variables
    assert len(exchanges) == len(weights) and not any(c.kind == "reduce-scatter" for c in found)
    # Per weight: 8 chunks of one byte per value, padded to whole blocks, plus a float32
    # scale per block: the parameters x 1 byte (+2.4% here, mostly the tiny weights' scales).
    expected = 0
    for w in weights:  # a shard over fsdp has one owner; a whole weight is cut among 8
        sharded = "fsdp" in kdist.parallel.layout.active().get_variable_layout(w).axes
        block, chunk = chunking(w.value.size // 8, 1) if sharded else chunking(w.value.size, 8)
        expected += 8 * chunk * (1 + 4 / block)
    assert sum(c.bytes for c in exchanges) == expected
    params = sum(w.value.size for w in weights)
    assert params <= expected <= params * 1.03
