"""kdist's own gradient reduction (``kdist.distribution(..., gradient_reduction=...)``): the
same training as one device, one collective per weight, bfloat16 on request."""

import collections

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist import hlo
from kdist.models import GPTBackbone, GPTCausalLM
from tests.bert_helpers import tiny_bert_mlm
from tests.helpers import TINY_GPT, TINY_LLAMA, parity_optimizer, token_batches, train

MESHES = ["data=8", "fsdp=8", "data=2,fsdp=4"]


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
    with pytest.raises(ValueError, match="model axis of 2"):
        kdist.distribution("fsdp=4,model=2", gradient_reduction="float32")
    with pytest.raises(ValueError, match="'float32' or 'bfloat16'"):
        kdist.distribution("fsdp=8", gradient_reduction="fp8")
    model = _model("fsdp=8", "float32", {**TINY_GPT, "dropout": 0.1})
    with pytest.raises(ValueError, match="dropout"):
        model.compile(optimizer=parity_optimizer())
    bert = tiny_bert_mlm()  # built on one device, compiled under the reducing distribution
    keras.distribution.set_distribution(kdist.distribution("fsdp=8", gradient_reduction="float32"))
    with pytest.raises(ValueError, match="BertMaskedLM does not support.*gradient_reduction"):
        bert.compile(optimizer=parity_optimizer())


def test_chunked_attention_trains_like_one_device_under_kdist_reduction():
    # Its scans run per device inside the manual region (carries typed as varying).
    batches = token_batches(3)
    config = {**TINY_GPT, "attention_chunk_size": 8}
    reference = train(_model(None, None, config), batches)
    np.testing.assert_allclose(train(_model("fsdp=8", "float32", config), batches), reference,
                               rtol=2e-6)
