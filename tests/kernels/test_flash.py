"""kdist's flash attention (Pallas, interpreted on the CPU) computes Keras' attention with
its gradients: causal or not, documents kept apart, grouped-query heads, tiles of several
sizes (chunks skipped, masked or plain by their place against the diagonal), per device
under a mesh; what it cannot take is refused by name."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import kdist
from kdist.kernels import flash
from tests.kernels.parity import assert_equals_keras_attention

B, T, N, K, H = 2, 384, 4, 2, 32  # three 128-token tiles; 2 query heads per key/value head


def _inputs(dtype="float32", kv_heads=K, length=T):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, length, n, H)), dtype)
               for n in (N, kv_heads, kv_heads))
    return q, k, v, jnp.asarray(rng.normal(size=(B, length, N, H)), "float32")


# Documents of every length, one crossing every tile boundary.
SEGMENTS = np.stack([np.repeat([0, 1, 2], [100, 200, 84]), np.repeat([0, 1], [300, 84])])
SQUARE, TALL, WIDE = (flash.FlashBlocks(128, 128, 128, 128), flash.FlashBlocks(384, 128, 128, 384),
                      flash.FlashBlocks(128, 384, 384, 128))
CASES = {  # (causal, documents, key/value heads, tiles)
    "causal-gqa": (True, False, K, SQUARE),
    "causal-gqa-tall-tiles": (True, False, K, TALL),
    "causal-multihead-wide-tiles": (True, False, N, WIDE),
    "causal-documents-gqa": (True, True, K, TALL),
    "bidirectional-mqa": (False, False, 1, SQUARE),
    "bidirectional-documents-gqa": (False, True, K, WIDE),
}


@pytest.mark.parametrize("causal, documents, kv_heads, blocks", list(CASES.values()),
                         ids=list(CASES))
def test_value_and_gradients_equal_keras_attention(causal, documents, kv_heads, blocks):
    q, k, v, weights = _inputs(kv_heads=kv_heads)
    segments = jnp.asarray(SEGMENTS) if documents else None
    assert_equals_keras_attention(
        lambda q, k, v: flash.flash_attention(q, k, v, causal=causal, segment_ids=segments,
                                 blocks=blocks),
        q, k, v, weights, causal=causal, segments=segments)


def test_bfloat16_matches_float32_attention_to_bfloat16_rounding():
    q, k, v, _ = _inputs("bfloat16")
    got = flash.flash_attention(q, k, v, causal=True, blocks=SQUARE)
    assert got.dtype == jnp.bfloat16
    want = keras.ops.dot_product_attention(*(x.astype("float32") for x in (q, k, v)),
                                           is_causal=True)
    # As splash's: outputs are convex combinations of values of magnitude ~1-3, each
    # rounded to bfloat16 (2^-8 relative), probabilities rounded once before the matmul.
    np.testing.assert_allclose(np.asarray(got, "float32"), want, atol=3e-2)


def test_per_device_under_a_mesh_equals_one_device():
    q, k, v, weights = _inputs(length=256)
    segments = jnp.asarray(np.concatenate([SEGMENTS[:, :256]] * 2))  # batch 4: data x fsdp
    q, k, v, weights = (jnp.concatenate([x] * 2) for x in (q, k, v, weights))

    def loss(q, k, v):
        return jnp.sum(flash.flash_attention(q, k, v, causal=True, segment_ids=segments,
                                             blocks=SQUARE) * weights)

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
    assert flash.supports(1024, 1024, 64) and not flash.supports(100, 100, 64)
    assert not flash.supports(384, 384, 64, blocks=flash.FlashBlocks(256, 256, 256, 256))
    assert not flash.supports(32768, 32768, 128)  # an example's keys beyond VMEM: splash
    with pytest.raises(ValueError, match="whole tiles"):
        flash.flash_attention(q[:, :100], k[:, :100], v[:, :100], causal=True)
    with pytest.raises(ValueError, match="self-attention"):
        flash.flash_attention(q, k[:, :128], v[:, :128], causal=True, blocks=SQUARE)


def _pallas_operands(jaxpr) -> list[list[tuple]]:
    """The operand shapes of every Pallas call in ``jaxpr`` and the jaxprs nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append([tuple(v.aval.shape) for v in eqn.invars])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _pallas_operands(inner)
    return found


def test_both_kernels_take_heads_with_the_sequence_in_lanes():
    # (B, heads, H, T): the layout in which a TPU's matmuls produce the projections. With
    # (B, heads, T, H) operands, XLA materialised a transpose of q, k, v and dO around the
    # kernels each layer (4.5 ms of a 173 ms gpt2-medium step on a TPU v5e).
    q, k, v, weights = _inputs()
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(flash.flash_attention(
        q, k, v, causal=True, blocks=SQUARE) * weights), argnums=(0, 1, 2)))(q, k, v).jaxpr
    calls = _pallas_operands(jaxpr)
    assert len(calls) == 2  # forward and backward
    heads = {(B, N, H, T), (B, K, H, T)}
    for operands in calls:
        four = [s for s in operands if len(s) == 4 and s[2] != 1]  # not the (.., 1, T) rows
        assert four and set(four) <= heads, operands
