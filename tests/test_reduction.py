"""kdist's own gradient reduction (``kdist.distribution(..., gradient_reduction=...)``): the
same training as one device, one collective per weight, bfloat16 on request."""

import collections
from unittest import mock

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist import hlo
from kdist.models import BertBackbone, BertMaskedLM, GPTBackbone, GPTCausalLM
from kdist.parallel import reduction as reduction_module
from tests.bert_helpers import TINY_BERT, mlm_batches, train_mlm
from tests.helpers import TINY_GPT, TINY_LLAMA, parity_optimizer, token_batches, train

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


@pytest.fixture(scope="module")
def one_device():
    batches = token_batches(3)
    return batches, train(_model(None, None), batches)


@pytest.mark.parametrize("mesh", MESHES)
def test_float32_reduction_trains_like_one_device(mesh, one_device):
    batches, reference = one_device
    np.testing.assert_allclose(train(_model(mesh, "float32"), batches), reference, rtol=2e-6)


def test_fused_loss_and_untied_grouped_query_model_train_like_one_device():
    # The fused loss runs per device inside the manual region; Llama: untied output matrix,
    # RMSNorm, grouped-query attention.
    batches = token_batches(3)
    reference = train(_model(None, None, TINY_LLAMA, loss_chunk_size=8), batches)
    sharded = train(_model("data=2,fsdp=4", "float32", TINY_LLAMA, loss_chunk_size=8), batches)
    np.testing.assert_allclose(sharded, reference, rtol=2e-6)


def test_bfloat16_reduction_rounds_gradients_and_stays_close(one_device):
    batches, reference = one_device
    bf16 = train(_model("fsdp=8", "bfloat16"), batches)
    f32 = train(_model("fsdp=8", "float32"), batches)
    assert bf16 != f32  # each device's partial gradient is rounded to bfloat16 first
    # Tolerance: rounding a partial gradient to bfloat16 changes it by at most 2^-9
    # relatively; Adam's normalised steps of lr 1e-2 carry that into the weights, and three
    # steps move the loss by ~1e-5 of itself (measured 2.1e-6, here 50x that).
    np.testing.assert_allclose(bf16, reference, rtol=1e-4)


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


@pytest.mark.parametrize("mesh, reduction, variant", [
    ("seq=2,fsdp=2,model=2", "float32", "ring"), ("seq=4,data=2", "bfloat16", "all_gather")])
def test_a_split_sequence_sums_the_gradients_over_seq_too(mesh, reduction, variant,
                                                          one_device):
    # seq is manual in the region beside the batch axes (model stays with XLA): each
    # device's loss and gradients cover its tokens and are summed over seq as well.
    batches, reference = one_device
    keras.distribution.set_distribution(kdist.distribution(
        mesh, gradient_reduction=reduction, context_parallel=variant))
    keras.utils.set_random_seed(1)
    model = GPTCausalLM(GPTBackbone(**TINY_GPT))
    with mock.patch.object(reduction_module, "loss_and_updates",
                           wraps=reduction_module.loss_and_updates) as spy:
        losses = train(model, batches)
    assert spy.call_count >= 1  # kdist's reduction ran, not XLA's
    # bfloat16: rounding each partial gradient, as in the bfloat16 test above.
    np.testing.assert_allclose(losses, reference, rtol=2e-6 if reduction == "float32" else 1e-4)


def test_a_split_sequence_refuses_what_reads_across_it():
    # Under seq each device's loss covers its share of every sequence's tokens: BERT's loss
    # (masked positions, the first token) and dropout (one mask per share) are refused at
    # compile, before XLA compiles anything. A causal LM trains (tests/test_context_training.py).
    with pytest.raises(ValueError, match="does not declare the 'token_reordering'"):
        _bert("seq=4,data=2", "float32", dropout=0.0).compile(optimizer=parity_optimizer())
    model = _model("seq=8", "bfloat16", {**TINY_GPT, "dropout": 0.1})
    with pytest.raises(ValueError, match="same mask for every 'seq' share"):
        model.compile(optimizer=parity_optimizer())


def test_chunked_attention_trains_like_one_device_under_kdist_reduction():
    # Its scans run per device inside the manual region (carries typed as varying).
    batches = token_batches(3)
    config = {**TINY_GPT, "attention_chunk_size": 8}
    reference = train(_model(None, None, config), batches)
    np.testing.assert_allclose(train(_model("fsdp=8", "float32", config), batches), reference,
                               rtol=2e-6)


# --- every mesh, dropout, BERT, 8-bit --------------------------------------------------


@pytest.mark.parametrize("mesh", ["fsdp=4,model=2", "data=2,fsdp=2,model=2"])
def test_float32_reduction_with_a_model_axis_trains_like_one_device(mesh, one_device):
    # Only the batch axes are manual; tensor parallelism stays with XLA's partitioner.
    batches, reference = one_device
    np.testing.assert_allclose(train(_model(mesh, "float32"), batches), reference, rtol=2e-6)


def test_dropout_masks_are_the_one_device_runs(one_device):
    # Each device draws its rows of the global mask (kdist.parallel.dropout), so the run
    # with dropout equals the 1-device run with dropout, not merely "a" dropout run.
    batches, no_dropout = one_device
    config = {**TINY_GPT, "dropout": 0.1}
    reference = train(_model(None, None, config), batches)
    assert not np.allclose(reference[1:], no_dropout[1:], rtol=1e-4)  # masks were drawn
    sharded = train(_model("data=2,fsdp=2,model=2", "float32", config), batches)
    np.testing.assert_allclose(sharded, reference, rtol=2e-6)


def test_bert_with_dropout_trains_like_one_device():
    # Its loss averages over the masked tokens (mean_with_sample_weight): the devices'
    # losses are weighted by their sums of sample weights, which differ.
    batches = mlm_batches(3)
    reference = train_mlm(_bert(None, None), batches)
    np.testing.assert_allclose(train_mlm(_bert("fsdp=4,model=2", "float32"), batches),
                               reference, rtol=2e-6)


def test_int8_reduction_stays_close_to_one_device(one_device):
    # (float8: test_error_feedback_residuals_live_in_the_optimizer_state)
    batches, reference = one_device
    got = train(_model("data=2,fsdp=2,model=2", "int8"), batches)
    assert got != reference  # the gradients were quantised
    # Tolerance: an 8-bit code is within 2^-4 (float8) or 1/254 of its block's peak (int8)
    # of the value; Adam normalises the step, so the loss after three steps of lr 1e-2 moves
    # by ~1e-5 of itself (measured 3e-5 and 1e-5 here; 1e-3 is 30x that).
    np.testing.assert_allclose(got, reference, rtol=1e-3)


def test_error_feedback_residuals_live_in_the_optimizer_state(one_device):
    from kdist.checkpointing.state import state_variables

    batches, reference = one_device
    keras.distribution.set_distribution(
        kdist.distribution("data=2,fsdp=4", gradient_reduction="float8", error_feedback=True))
    keras.utils.set_random_seed(1)
    model = GPTCausalLM(GPTBackbone(**TINY_GPT))
    losses = train(model, batches)
    np.testing.assert_allclose(losses, reference, rtol=1e-3)
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
