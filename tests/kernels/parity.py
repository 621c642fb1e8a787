"""The check both Pallas attention kernels' tests share: value and gradients against Keras'
attention in float32."""

import jax
import jax.numpy as jnp
import keras
import numpy as np


def assert_equals_keras_attention(attention, q, k, v, weights, *, causal, segments):
    """``attention(q, k, v)`` (a kernel with its mask settings bound) against
    ``keras.ops.dot_product_attention`` with the same causality and documents
    (``segments (B, T)`` or None): outputs and the gradients of ``sum(out * weights)``.

    float32 throughout (the interpreter's matmuls, the softmax statistics): differences are
    summation order alone."""
    mask = None if segments is None else \
        segments[:, None, :, None] == segments[:, None, None, :]  # (B, 1, T, T)

    def keras_attention(q, k, v):
        return keras.ops.dot_product_attention(q, k, v, mask=mask, is_causal=causal)

    np.testing.assert_allclose(attention(q, k, v), keras_attention(q, k, v), atol=2e-6)
    loss = [lambda q, k, v, f=f: jnp.sum(f(q, k, v) * weights)
            for f in (attention, keras_attention)]
    got, want = (jax.grad(f, argnums=(0, 1, 2))(q, k, v) for f in loss)
    for g, w, name in zip(got, want, "qkv"):
        np.testing.assert_allclose(g, w, atol=5e-6, err_msg=f"gradient of {name}")
