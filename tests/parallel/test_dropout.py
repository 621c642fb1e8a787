"""kdist's Dropout draws, inside a per-device region, the device's rows of the mask the
whole batch gets (kdist.parallel.dropout): bit for bit JAX's ``bernoulli``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdist.parallel.dropout import block_keep_mask, global_counters


@pytest.mark.parametrize("shape", [(8, 16, 64), (6,), (4, 3, 5, 7)])
def test_a_block_of_rows_is_that_block_of_the_global_mask(shape):
    seed = jnp.array([123456789, 987654321], jnp.uint32)
    full = np.asarray(jax.random.bernoulli(seed, 0.8, shape))
    assert 0.7 < full.mean() < 0.9  # a real mask, not all ones
    for rows in (1, 2):
        for start in sorted({0, rows, shape[0] - rows}):  # first, second, last block
            block = block_keep_mask(seed, 0.8, (rows, *shape[1:]), start)
            np.testing.assert_array_equal(block, full[start:start + rows])


def test_counters_past_two_to_the_32():
    # A global batch of activations beyond 2^32 elements (e.g. 1024 x 2048 x 4096): the
    # flat index carries into the high word as JAX's 64-bit counter does.
    rows = jnp.array([0, 1, 2**31 - 1, 70000, 123456789], jnp.uint32)
    row_size = 2**32 - 5
    hi, lo = global_counters(rows, row_size, (5, 3))
    expected = (np.asarray(rows, np.uint64)[:, None] * np.uint64(row_size)
                + np.arange(3, dtype=np.uint64))
    got = (np.asarray(hi, np.uint64) << np.uint64(32)) | np.asarray(lo, np.uint64)
    np.testing.assert_array_equal(got, expected)
