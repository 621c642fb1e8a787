"""The fused, chunked cross-entropy: value and gradients against autodiff of the plain
loss, on one device and sharded, and inside GPTCausalLM's training."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import kdist
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.models.embeddings import TOKEN_AXES
from kdist.models.losses import chunked_cross_entropy
from tests.helpers import TINY_GPT, token_batches, train

B, T, D, V = 8, 16, 32, 64


def _inputs(dtype="float32"):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(B, T, D)).astype(dtype), rng.normal(size=(V, D)).astype("float32"),
            rng.integers(0, V, (B, T)).astype("int32"))


def _plain_loss(hidden, table, labels):
    """What GPTCausalLM computes without the option: full logits, then Keras' loss."""
    logits = jnp.einsum("btd,vd->btv", hidden, table.astype(hidden.dtype))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return loss(labels, logits.astype("float32"))


@pytest.mark.parametrize("chunk", [1, 5, 16])  # 5 -> largest divisor of 16 below: 4
def test_value_and_gradient_match_autodiff(chunk):
    hidden, table, labels = _inputs()
    expected, (gh, gw) = jax.value_and_grad(_plain_loss, (0, 1))(hidden, table, labels)
    fused = jax.jit(jax.value_and_grad(
        lambda h, w: chunked_cross_entropy(h, w, labels, chunk), (0, 1)))
    loss, (fh, fw) = fused(hidden, table)
    np.testing.assert_allclose(loss, expected, rtol=2e-6)
    np.testing.assert_allclose(fh, gh, rtol=2e-6, atol=2e-6 * np.abs(gh).max())
    np.testing.assert_allclose(fw, gw, rtol=2e-6, atol=2e-6 * np.abs(gw).max())


def test_bfloat16_hidden_states_match_autodiff():
    hidden, table, labels = _inputs("float32")
    hidden = jnp.asarray(hidden, jnp.bfloat16)
    expected, (gh, gw) = jax.value_and_grad(_plain_loss, (0, 1))(hidden, table, labels)
    loss, (fh, fw) = jax.value_and_grad(
        lambda h, w: chunked_cross_entropy(h, w, labels, 4), (0, 1))(hidden, table)
    assert fh.dtype == jnp.bfloat16 and fw.dtype == jnp.float32
    # The plain path rounds the logits to bf16 before the float32 loss; the fused one keeps
    # them in float32: agreement to bf16 resolution (2^-8).
    np.testing.assert_allclose(loss, expected, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(fw), np.asarray(gw), atol=2e-2 * np.abs(gw).max())


@pytest.mark.parametrize("mesh", ["fsdp=8", "data=2,fsdp=2,model=2", "model=8"])
def test_sharded_matches_one_device(mesh):
    hidden, table, labels = _inputs()
    expected, (gh, gw) = jax.value_and_grad(_plain_loss, (0, 1))(hidden, table, labels)
    keras.distribution.set_distribution(kdist.distribution(mesh))
    loss, (fh, fw) = jax.jit(jax.value_and_grad(
        lambda h, w: chunked_cross_entropy(h, w, labels, 4), (0, 1)))(hidden, table)
    np.testing.assert_allclose(loss, expected, rtol=2e-6)
    np.testing.assert_allclose(fh, gh, rtol=2e-6, atol=2e-6 * np.abs(gh).max())
    np.testing.assert_allclose(fw, gw, rtol=2e-6, atol=2e-6 * np.abs(gw).max())
    # The table's gradient comes out in the table's layout: vocab over model, embed over fsdp.
    spec = kdist.distribution(mesh).layout_for("token_embedding/embeddings", (V, D),
                                                  TOKEN_AXES).axes
    assert tuple(fw.sharding.spec) + (None,) * (2 - len(fw.sharding.spec)) == spec


@pytest.mark.parametrize("mesh", [None, "data=2,fsdp=2,model=2"])
def test_gpt_training_losses_match_plain_loss(mesh):
    batches = token_batches(3)

    def losses(chunk):
        keras.utils.clear_session()
        keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
        keras.utils.set_random_seed(0)
        return train(GPTCausalLM(GPTBackbone(**TINY_GPT), loss_chunk_size=chunk), batches)

    plain, fused = losses(None), losses(4)
    np.testing.assert_allclose(fused, plain, rtol=2e-6)
    assert fused[-1] < fused[0]


def test_untied_embeddings_and_round_trip():
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT, tie_embeddings=False), loss_chunk_size=8)
    plain = GPTCausalLM.from_config({**lm.get_config(), "loss_chunk_size": None})
    plain.set_weights(lm.get_weights())
    batches = token_batches(1)
    np.testing.assert_allclose(train(lm, batches), train(plain, batches), rtol=2e-6)
    assert GPTCausalLM.from_config(lm.get_config()).loss_chunk_size == 8


def test_saved_model_keeps_training_fused(tmp_path):
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT), loss_chunk_size=8)
    lm.compile(optimizer="adam")
    lm.save(tmp_path / "lm.keras")
    loaded = keras.saving.load_model(tmp_path / "lm.keras")
    assert loaded.loss_chunk_size == 8 and loaded._fused_loss


def test_metrics_fall_back_to_logits_and_bad_values_are_refused():
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT), loss_chunk_size=8)
    lm.compile(optimizer="adam", metrics=["accuracy"])
    x, y = token_batches(1)[0]
    logs = lm.train_on_batch(x, y, return_dict=True)
    assert 0 <= logs["accuracy"] <= 1  # accuracy needs the logits: the plain path ran
    with pytest.raises(ValueError, match="loss_chunk_size"):
        GPTCausalLM(GPTBackbone(**TINY_GPT), loss_chunk_size=-1)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(*_inputs(), chunk_size=0)


@pytest.mark.parametrize("mesh", [None, "data=2,fsdp=2,model=2"])
def test_padding_rows_of_the_table_take_no_part(mesh):
    # GPTBackbone(vocabulary_divisible_by=...) pads the table; the padding rows must not
    # enter the softmax (large values here would dominate it) and get no gradient.
    hidden, table, labels = _inputs()
    padding = 10 * np.random.default_rng(1).normal(size=(V, D)).astype("float32")
    expected, (gh, gw) = jax.value_and_grad(_plain_loss, (0, 1))(hidden, table, labels)
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    loss, (fh, fw) = jax.jit(jax.value_and_grad(
        lambda h, w: chunked_cross_entropy(h, w, labels, 4, vocabulary_size=V), (0, 1)))(
        hidden, np.concatenate([table, padding]))
    np.testing.assert_allclose(loss, expected, rtol=2e-6)
    np.testing.assert_allclose(fh, gh, rtol=2e-6, atol=2e-6 * np.abs(gh).max())
    np.testing.assert_allclose(fw[:V], gw, rtol=2e-6, atol=2e-6 * np.abs(gw).max())
    np.testing.assert_array_equal(fw[V:], 0)
    with pytest.raises(ValueError, match="vocabulary_size must be an int in \\[1, 64\\]"):
        chunked_cross_entropy(hidden, table, labels, 4, vocabulary_size=65)
