"""kdist's RotaryEmbedding computes what keras-hub's does (kdist no longer imports keras-hub
for it), and round-trips its config."""

import jax
import keras
import keras_hub  # the reference; a test dependency (`make setup` installs kdist[all])
import numpy as np
import pytest

from kdist.models.rope import RotaryEmbedding, ScaledRotaryEmbedding

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("options,shape,call", [
    ({}, (2, 16, 3, 8), {}),
    ({"max_wavelength": 500000.0}, (2, 16, 3, 64), {"start_index": 5}),
    ({"scaling_factor": 4.0}, (1, 7, 2, 16), {}),
    ({}, (2, 9, 4), {"positions": np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5]] * 2)}),  # (B, T)
    ({}, (2, 9, 2, 4), {"positions": np.arange(9) * 3}),  # (T,)
    ({"sequence_axis": 2, "feature_axis": 1}, (2, 6, 10, 3), {}),  # (B, H, T, heads)
])
def test_equals_keras_hub_bit_for_bit(options, shape, call):
    """Same ops in the same order (float32 angles, einsum, stack + reshape), so equal to
    the last bit on the same backend; keras-hub 0.32's layer is the reference."""
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    ours = RotaryEmbedding(**options)(x, **call)
    theirs = keras_hub.layers.RotaryEmbedding(**options)(x, **call)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours),
                                  keras.ops.convert_to_numpy(theirs))
    assert not np.array_equal(keras.ops.convert_to_numpy(ours), x)  # it did rotate


def test_equals_keras_hub_in_bfloat16_and_jitted():
    policy = keras.dtype_policies.DTypePolicy("mixed_bfloat16")
    x = keras.ops.cast(np.random.default_rng(1).normal(size=(2, 32, 4, 16)), "bfloat16")
    ours, theirs = (layer(max_wavelength=10000, dtype=policy)
                    for layer in (RotaryEmbedding, keras_hub.layers.RotaryEmbedding))
    run = jax.jit(lambda layer, v, start: layer(v, start_index=start), static_argnums=0)
    a, b = run(ours, x, 7), run(theirs, x, 7)
    assert a.dtype == b.dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(a, "float32"), np.asarray(b, "float32"))


def test_config_round_trips_and_serializes_as_kdist():
    layer = RotaryEmbedding(max_wavelength=500000.0, scaling_factor=2.0, name="rope")
    again = RotaryEmbedding.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()
    assert keras.saving.serialize_keras_object(layer)["registered_name"] == "kdist>RotaryEmbedding"
    x = np.ones((1, 3, 2, 4), "float32")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer(x)),
                                  keras.ops.convert_to_numpy(again(x)))


def test_odd_feature_axis_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="must be even; got 5. Use an even head_dim"):
        RotaryEmbedding()(np.ones((1, 2, 5), "float32"))
    with pytest.raises(ValueError, match="two different axes"):
        RotaryEmbedding(sequence_axis=-1)(np.ones((1, 2, 4), "float32"))


def test_scaled_rope_is_plain_rope_with_its_frequencies():
    """The shared rotation: ScaledRotaryEmbedding with a scaling that leaves every frequency
    unchanged (all wavelengths below L / high_freq_factor) equals plain RoPE."""
    x = np.random.default_rng(2).normal(size=(2, 8, 2, 8)).astype("float32")
    unchanged = {**LLAMA3, "original_max_position_embeddings": 10**9}
    scaled = ScaledRotaryEmbedding(10000.0, unchanged)(x)
    plain = RotaryEmbedding(max_wavelength=10000.0)(x)
    # Equal here (0.0); the frequencies come from numpy (1 / w**e) in one and XLA (w**-e) in
    # the other, which may differ in the last bit: 1e-6 bounds that at positions < 8.
    np.testing.assert_allclose(keras.ops.convert_to_numpy(scaled),
                               keras.ops.convert_to_numpy(plain), rtol=0, atol=1e-6)
