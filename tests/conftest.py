"""Test harness: 8 forced host devices, JAX backend, a fresh Keras state per test."""

import os
import tempfile

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Tokenizers and token stores of the test session live in one temporary cache.
os.environ.setdefault("KDIST_CACHE", tempfile.mkdtemp(prefix="kdist-test-cache-"))

import kdist  # noqa: E402

# 8 CPU devices, with the XLA:CPU settings that keep their collectives from stalling
# (kdist/parallel/devices.py); before anything starts JAX's backends.
kdist.force_host_devices(8)

import jax  # noqa: E402
import keras  # noqa: E402
import pytest  # noqa: E402


def pytest_sessionstart(session):
    if jax.device_count() != 8:
        raise RuntimeError(
            f"The tests need 8 host devices but JAX sees {jax.device_count()}: jax was imported "
            f"before tests/conftest.py set XLA_FLAGS."
        )


@pytest.fixture(autouse=True)
def fresh_keras_state():
    """Each test starts with no distribution, float32 and no remat scope, and a fixed seed."""
    keras.utils.clear_session()
    keras.distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")
    keras.utils.clear_session()
