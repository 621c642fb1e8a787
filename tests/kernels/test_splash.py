"""Splash attention (Pallas, interpreted on the CPU) computes Keras' attention with its
gradients: causal or not, documents kept apart, grouped-query heads, per device under a
mesh; what it cannot take is refused by name."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import kdist
from kdist.kernels import splash
from tests.kernels.parity import assert_equals_keras_attention

B, T, N, K, H = 2, 256, 4, 2, 32  # two 128-token tiles; 2 query heads per key/value head


def _inputs(dtype="float32", kv_heads=K):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), dtype) for n in (N, kv_heads,
                                                                       kv_heads))
    return q, k, v, jnp.asarray(rng.normal(size=(B, T, N, H)), "float32")


SEGMENTS = np.stack([np.repeat([0, 1, 2], [100, 100, 56]), np.repeat([0, 1], [200, 56])])


FUSED, UNFUSED = splash.Blocks(256, 128, fused=True), splash.Blocks(128, 128, fused=False)
CASES = {  # (causal, documents, key/value heads, tiles)
    "causal-gqa": (True, False, K, FUSED),
    "causal-documents-gqa": (True, True, K, FUSED),
    "bidirectional-gqa": (False, False, K, FUSED),
    "bidirectional-documents-gqa": (False, True, K, FUSED),
    "causal-multihead-unfused": (True, False, N, UNFUSED),
    "causal-documents-multihead-unfused": (True, True, N, UNFUSED),
}


@pytest.mark.parametrize("causal, documents, kv_heads, blocks", list(CASES.values()),
                         ids=list(CASES))
def test_value_and_gradients_equal_keras_attention(causal, documents, kv_heads, blocks):
    q, k, v, weights = _inputs(kv_heads=kv_heads)
    segments = jnp.asarray(SEGMENTS) if documents else None
    assert_equals_keras_attention(
        lambda q, k, v: splash.splash_attention(q, k, v, causal=causal, segment_ids=segments,
                                                blocks=blocks),
        q, k, v, weights, causal=causal, segments=segments)


def test_bfloat16_matches_float32_attention_to_bfloat16_rounding():
    q, k, v, _ = _inputs("bfloat16")
    got = splash.splash_attention(q, k, v, causal=True)
    assert got.dtype == jnp.bfloat16
    want = keras.ops.dot_product_attention(*(x.astype("float32") for x in (q, k, v)),
                                           is_causal=True)
    # As chunked attention's test: outputs are convex combinations of values of magnitude
    # ~1-3, each rounded to bfloat16 (2^-8 relative), probabilities rounded once.
    np.testing.assert_allclose(np.asarray(got, "float32"), want, atol=3e-2)


def test_per_device_under_a_mesh_equals_one_device():
    q, k, v, weights = _inputs()
    segments = jnp.asarray(np.concatenate([SEGMENTS] * 2))  # batch 4: over data x fsdp
    q, k, v, weights = (jnp.concatenate([x] * 2) for x in (q, k, v, weights))

    def loss(q, k, v):
        return jnp.sum(splash.splash_attention(q, k, v, causal=True,
                                               segment_ids=segments) * weights)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    keras.distribution.set_distribution(kdist.distribution("data=2,fsdp=2,model=2"))
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    text = jax.jit(loss).lower(q, k, v).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text  # run per device
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=5e-6)


def test_what_it_cannot_take_is_refused():
    q, k, v, _ = _inputs()
    assert splash.supports(1024, 1024, 64) and not splash.supports(100, 100, 64)
    with pytest.raises(ValueError, match="multiples of 128"):
        splash.splash_attention(q[:, :100], k[:, :100], v[:, :100], causal=True)
    with pytest.raises(ValueError, match="segment_ids are those of self-attention"):
        splash.splash_attention(q, k[:, :128], v[:, :128], causal=False,
                                segment_ids=jnp.zeros((B, T), "int32"))
