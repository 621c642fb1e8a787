"""Chunked attention computes Keras' attention, with gradients, without keeping the
probabilities; GPT models built with it train exactly like the default ones, also sharded."""

from unittest import mock

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from kdist.models import GPTBackbone, GPTCausalLM
from kdist.models.chunked_attention import chunked_attention
from tests.bert_helpers import mlm_batches, tiny_bert_mlm, train_mlm
from tests.helpers import TINY_GPT, TINY_LLAMA, tiny_gpt, token_batches, train

B, T, N, K, H = 2, 10, 4, 2, 8  # grouped-query: 2 query heads per key/value head


def _inputs(dtype="float32"):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), dtype) for n in (N, K, K))
    return q, k, v, jnp.asarray(rng.normal(size=(B, T, N, H)), "float32")


def _masks():
    segments = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    documents = segments[:, None, :, None] == segments[:, None, None, :]  # (B, 1, T, T)
    padding = np.arange(T)[None, None, None] < np.array([7, 10])[:, None, None, None]
    fully_masked_row = np.ones((B, 1, T, T), bool)
    fully_masked_row[0, 0, 2] = False  # Keras: such a row attends uniformly
    return {"none": None, "documents": documents, "padding": padding,
            "fully_masked_row": fully_masked_row}


@pytest.mark.parametrize("mask", list(_masks()))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("chunk_size", [3, 4, 16])  # 3 and 16: the last chunk is padded
def test_value_and_gradients_equal_keras_attention(mask, causal, chunk_size):
    q, k, v, weights = _inputs()
    m = _masks()[mask]

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weights)

    def ours(q, k, v):
        return chunked_attention(q, k, v, mask=m, is_causal=causal, chunk_size=chunk_size)

    def keras_attention(q, k, v):
        return keras.ops.dot_product_attention(q, k, v, mask=m, is_causal=causal)

    np.testing.assert_allclose(ours(q, k, v), keras_attention(q, k, v), atol=2e-6)
    got = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(keras_attention), argnums=(0, 1, 2))(q, k, v)
    for g, w, name in zip(got, want, "qkv"):
        np.testing.assert_allclose(g, w, atol=5e-6, err_msg=f"gradient of {name}")


def test_bfloat16_matches_float32_attention_to_bfloat16_rounding():
    q, k, v, _ = _inputs("bfloat16")
    got = chunked_attention(q, k, v, is_causal=True, chunk_size=4)
    assert got.dtype == jnp.bfloat16
    want = keras.ops.dot_product_attention(*(x.astype("float32") for x in (q, k, v)),
                                           is_causal=True)
    # Outputs are convex combinations of values of magnitude ~1-3: bfloat16 keeps 8 bits of
    # mantissa (relative 2^-8 = 0.4%), and the probabilities are rounded to bfloat16 once.
    np.testing.assert_allclose(np.asarray(got, "float32"), want, atol=3e-2)


def test_probabilities_are_not_kept_for_the_backward_pass():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 1024, 4, 16)), "float32") for _ in range(3))

    def temp_bytes(attend):
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), (0, 1, 2)))
        return step.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    probabilities = 2 * 4 * 1024 * 1024 * 4  # (B, N, T, T) float32: 32 MiB
    keras_bytes = temp_bytes(lambda q, k, v: keras.ops.dot_product_attention(
        q, k, v, is_causal=True))
    chunked_bytes = temp_bytes(lambda q, k, v: chunked_attention(
        q, k, v, is_causal=True, chunk_size=32))
    assert keras_bytes >= probabilities
    # What is left (8.1 MiB measured, against Keras' 129 MiB): a few (B, N, T, 32) float32
    # arrays of one chunk (1 MiB each: logits, probabilities, their gradients) and the
    # float32 gradients of q, k and v.
    assert chunked_bytes < probabilities / 3, (chunked_bytes, keras_bytes)


def test_bad_arguments_are_refused_with_the_shapes():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"\(B, 1, T, S\)"):
        chunked_attention(q, k, v, mask=np.ones((B, N, T, T), bool))  # a mask per head
    with pytest.raises(ValueError, match="multiple of the key's 3"):
        chunked_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_attention(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        GPTBackbone(**TINY_GPT, attention_chunk_size=-8)


def _chunked_copy(model: GPTCausalLM, chunk: int) -> GPTCausalLM:
    config = {**model.backbone.get_config(), "attention_chunk_size": chunk}
    copy = GPTCausalLM(GPTBackbone.from_config(config))
    copy.set_weights(model.get_weights())
    return copy


@pytest.mark.parametrize("config", [TINY_GPT, TINY_LLAMA], ids=["gpt", "llama-gqa"])
def test_gpt_with_chunked_attention_trains_like_the_default(config):
    keras.utils.set_random_seed(0)
    plain = GPTCausalLM(GPTBackbone(**config))
    chunked = _chunked_copy(plain, 8)
    assert chunked.backbone.blocks[0].attention.get_config()["attention_chunk_size"] == 8
    x, _ = token_batches(1)[0]
    with mock.patch("kdist.models.attention.chunked_attention", wraps=chunked_attention) as spy:
        np.testing.assert_allclose(chunked.predict_on_batch(x), plain.predict_on_batch(x),
                                   rtol=2e-6, atol=2e-6)
    assert spy.call_count == config["num_layers"]  # traced once per block, not Keras'
    batches = token_batches(3)
    np.testing.assert_allclose(train(chunked, batches), train(plain, batches), rtol=2e-6)
    prompt = x[:1, :4]  # generation attends through the key/value cache, as before
    np.testing.assert_array_equal(chunked.generate(prompt, 8, sampler="greedy"),
                                  plain.generate(prompt, 8, sampler="greedy"))


def test_document_masks_train_like_the_default():
    keras.utils.set_random_seed(0)
    plain = GPTCausalLM(GPTBackbone(**TINY_GPT, document_mask=True))
    chunked = _chunked_copy(plain, 8)
    segments = np.repeat(np.arange(4), 4)[None].repeat(8, 0)  # 4 documents of 4 tokens
    batches = [({"token_ids": x, "segment_ids": segments}, y) for x, y in token_batches(3)]
    np.testing.assert_allclose(train(chunked, batches), train(plain, batches), rtol=2e-6)


def test_sharded_chunked_attention_trains_like_one_device():
    batches = token_batches(3)
    one = train(tiny_gpt(seed=2, attention_chunk_size=8), batches)
    sharded = train(tiny_gpt("data=2,fsdp=2,model=2", seed=2, attention_chunk_size=8), batches)
    np.testing.assert_allclose(sharded, one, rtol=2e-6)


def test_bert_with_chunked_attention_trains_like_the_default():
    batches = mlm_batches(3)  # rows of different real lengths: padding masks
    plain = train_mlm(tiny_bert_mlm(seed=3), batches)
    chunked = train_mlm(tiny_bert_mlm(seed=3, attention_chunk_size=8), batches)
    np.testing.assert_allclose(chunked, plain, rtol=2e-6)
