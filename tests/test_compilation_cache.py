"""The test session's persistent compilation cache (tests/conftest.py) loads only the
identical program: one that differs in a constant, a shape or a sharding compiles afresh."""

import os
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def _entries() -> set[str]:
    """The cache's entries of ``_program``'s programs. Named after its own function, not a
    lambda: the other xdist worker writes lambdas' programs into the same directory at any
    moment (a cold run once counted one here)."""
    return {p.name for p in Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).iterdir()
            if p.name.startswith("jit_compilation_cache_probe")}


def _program(scale: float, marker: float):
    # A new function object each call: JAX's in-memory caches cannot serve it, only the
    # persistent one (keyed by the program, not by the Python function).
    def compilation_cache_probe(x):
        return x * scale + marker
    return jax.jit(compilation_cache_probe)


def test_only_the_identical_program_is_loaded_from_the_cache():
    assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]
    marker = float(uuid.uuid4().int % 10**6)  # a program no earlier run compiled
    x, longer = jnp.ones((4,), jnp.float32), jnp.ones((8,), jnp.float32)
    before = _entries()
    np.testing.assert_array_equal(_program(2.0, marker)(x), 2.0 + marker)
    first = _entries() - before
    assert len(first) == 1  # compiled once and written, however fast it compiled
    _program(2.0, marker)(x)  # the same program, traced again
    assert _entries() - before == first
    np.testing.assert_array_equal(_program(3.0, marker)(x), 3.0 + marker)  # a constant
    _program(2.0, marker)(longer)  # a shape
    assert len(_entries() - before) == 3  # each change: a new key, a new compilation
