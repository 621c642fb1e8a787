"""``matmul_precision="int8-sr"``: stochastically rounded gradient codes. The quantizer is
unbiased where round-to-nearest is not, a code is always its value's floor or ceiling, the
matmul's forward is int8's and its gradients are within one step of the straight-through
reference, and its randomness depends on the data only (never on sharding)."""

import jax
import jax.numpy as jnp
import numpy as np

from kdist.precision import int8_matmul, int8_sr_matmul, quantize
from tests.helpers import tiny_gpt, token_batches, train
from tests.precision import reference
from tests.precision.test_matmul import _gradients, _operands, sharded_and_one_device

DRAWS = 2048


def _rms(error):
    return np.sqrt(np.mean(error ** 2))


def _draws(x, axis, n=DRAWS):
    """``n`` stochastic roundings of ``x`` (codes, as int32) under keys 0..n-1."""
    keys = jax.random.split(jax.random.key(0), n)
    codes = jax.jit(jax.vmap(lambda k: quantize.int8_stochastic(x, axis, k)[0]))(keys)
    return np.asarray(codes, np.int32)


def test_stochastic_codes_are_unbiased_where_round_to_nearest_is_not():
    """Every value 0.3 of a step above a code: round-to-nearest takes 0.3 steps off each,
    the mean of stochastic codes converges on the values. A code is floor(v) + Bernoulli(f)
    (f = v's fraction): variance f(1 - f) steps², so the mean of n draws is within
    5 sqrt(f(1 - f) / n) of v but for a chance of 6e-7 per value (1.5e-4 for 256 values; the
    keys are fixed, so the test is deterministic)."""
    step = np.float32(1 / 127)  # the scale of rows whose peak is 1
    whole = np.arange(256).reshape(4, 64) % 120 - 60
    x = ((whole + 0.3) * step).astype(np.float32)
    x[:, 0] = 1.0  # the peak: codes 127, exact
    _, s = reference.int8(x, 1)
    np.testing.assert_array_equal(s, step)
    v = x.astype(np.float32) * (np.float32(1) / s)  # the values, in steps
    f = v - np.floor(v)
    mean = _draws(jnp.asarray(x), 1).mean(0)
    sigma = np.sqrt(f * (1 - f) / DRAWS)
    assert (np.abs(mean - v) <= 5 * sigma + 1e-6).all(), np.abs(mean - v).max()
    nearest = np.asarray(quantize.int8(jnp.asarray(x), 1)[0], np.float64)
    bias = (nearest - v)[:, 1:]  # round-to-nearest: -0.3 steps at every value
    np.testing.assert_allclose(bias, -0.3, atol=1e-4)
    assert np.abs((mean - v)[:, 1:].mean()) < 0.01  # the stochastic mean's error: ~0


def test_stochastic_codes_are_the_floor_or_the_ceiling_of_the_value():
    x, _, dy = _operands()
    for a, axis in ((x, 1), (dy, 0), (dy, 1)):
        _, s = reference.int8(a, axis)
        v = a * (np.float32(1) / s)
        codes = _draws(jnp.asarray(a), axis, n=64)
        assert ((codes == np.floor(v)) | (codes == np.ceil(v))).all()
        assert (np.abs(codes) <= 127).all()
        # and it is not round-to-nearest: some codes are the farther neighbour
        assert (np.abs(codes - v) > 0.5).any()


def test_the_key_is_the_datas_and_the_products():
    """No seed: the same dy draws the same codes, another dy (one value one ulp off) other
    codes, and dy's two products (reduced over different axes) different bits."""
    _, _, dy = _operands()

    def codes(a, axis):
        return np.asarray(quantize.int8_stochastic(jnp.asarray(a), axis)[0])

    np.testing.assert_array_equal(codes(dy, 1), codes(dy.copy(), 1))
    nudged = dy.copy()
    nudged[3, 4] = np.nextafter(nudged[3, 4], np.float32(np.inf))
    assert (codes(nudged, 1) != codes(dy, 1)).mean() > 0.1
    bits = [jax.random.key_data(quantize.data_key(jnp.asarray(dy), axis)) for axis in (0, 1)]
    assert not np.array_equal(*bits)


def test_int8_sr_matmul_rounds_only_the_gradients_and_stays_within_a_step():
    """Forward bit for bit int8's; dx and dw differ from int8's but are within the bound of
    straight-through products whose dy codes are off by up to one step (not half: the
    farther neighbour) and x's and w's by half a step."""
    x, w, dy = _operands()
    np.testing.assert_array_equal(np.asarray(int8_sr_matmul(x, w)),
                                  np.asarray(int8_matmul(x, w)))
    dx, dw = _gradients(int8_sr_matmul, x, w, dy)
    nearest_dx, nearest_dw = _gradients(int8_matmul, x, w, dy)
    assert not np.array_equal(dx, nearest_dx) and not np.array_equal(dw, nearest_dw)
    assert (np.abs(dx - dy @ w.T) <= reference.int8_rounding_bound(dy, w.T, steps_a=1)).all()
    assert (np.abs(dw - x.T @ dy) <= reference.int8_rounding_bound(x.T, dy, steps_b=1)).all()
    # the price of no bias: a code's squared error is f(1 - f) steps² on average, not
    # round-to-nearest's min(f, 1 - f)² (1/6 against 1/12 for uniform fractions f)
    assert _rms(dx - dy @ w.T) > _rms(nearest_dx - dy @ w.T)
    assert _rms(dw - x.T @ dy) > _rms(nearest_dw - x.T @ dy)


def test_sharded_int8_sr_matmul_draws_one_devices_bits():
    """The key hashes dy with an integer sum (exact in any order) and threefry's bits do
    not depend on sharding: the 4 x 2 sharded forward and gradients equal one device's bit
    for bit, as int8's do (tests/precision/test_matmul.py); dy split over both axes, so
    its hash sums over both."""
    for got, want in zip(*sharded_and_one_device(int8_sr_matmul, ("data", "model"))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_tiny_gpt_trains_differently_under_int8_sr_than_int8():
    """Through the backbone's layers: the same first loss (forward and weights are int8's;
    the first update is warmup's zero), then other gradients, so other losses from step 3
    (measured: 2.2e-4 apart, 4e-5 relative; test_training bounds both against bf16)."""
    batches = token_batches(3)
    nearest = train(tiny_gpt(seed=1, matmul_precision="int8"), batches)
    stochastic = train(tiny_gpt(seed=1, matmul_precision="int8-sr"), batches)
    assert stochastic[:2] == nearest[:2] and stochastic[2] != nearest[2]
    np.testing.assert_allclose(stochastic, nearest, rtol=5e-4)
