"""The quantized matmuls against numpy references of the same quantizers
(tests/precision/reference.py): int8 forward and both backward products exactly (int32
accumulation), float8 within float32 rounding; sharded operands give one device's result."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kdist.precision import fp8_matmul, int8_matmul, quantize
from kdist.precision.matmul import matmul
from tests.precision import reference

M, K, N = 24, 40, 16  # tokens, contracted, output channels


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32) * 3  # activations, some rows large
    x[5] *= 40
    x[7] = 0.0  # an all-zero token: scale 1, codes 0
    w = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)  # the cotangent
    return x, w, dy


def _gradients(fn, x, w, dy):
    _, vjp = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))
    return [np.asarray(g) for g in vjp(jnp.asarray(dy))]


def test_int8_quantizer_matches_the_reference_exactly():
    x, _, _ = _operands()
    for axis in (0, 1):
        codes, scale = quantize.int8(jnp.asarray(x), axis)
        ref_codes, ref_scale = reference.int8(x, axis)
        np.testing.assert_array_equal(np.asarray(codes), ref_codes)
        np.testing.assert_array_equal(np.asarray(scale), ref_scale)
    assert np.asarray(codes).dtype == np.int8 and np.abs(np.asarray(codes)).max() == 127


def test_int8_forward_equals_the_reference_exactly():
    x, w, _ = _operands()
    y = jax.jit(int8_matmul)(x, w)
    np.testing.assert_array_equal(np.asarray(y), reference.int8_product(x, w))
    # and it is a matmul: within the bound of int8's rounding of x @ w
    assert (np.abs(np.asarray(y) - x @ w) <= reference.int8_rounding_bound(x, w)).all()


def test_int8_gradients_are_the_straight_through_reference():
    """dx = Q(dy) Q(w)^T (dy per token, w per input channel), dw = Q(x)^T Q(dy) (x per input
    channel, dy per output channel, both over the tokens): the same integers, so equal."""
    x, w, dy = _operands()
    dx, dw = _gradients(int8_matmul, x, w, dy)
    np.testing.assert_allclose(dx, reference.int8_product(dy, w.T), rtol=0, atol=0)
    np.testing.assert_allclose(dw, reference.int8_product(x.T, dy), rtol=0, atol=0)
    # straight through: the float gradients within int8's rounding bound (not the
    # rounding's zero derivative); dw's bound is wide where one token (row 5) dominates
    # its input channels' scales
    assert (np.abs(dx - dy @ w.T) <= reference.int8_rounding_bound(dy, w.T)).all()
    assert (np.abs(dw - x.T @ dy) <= reference.int8_rounding_bound(x.T, dy)).all()


def test_int8_in_bfloat16_returns_bfloat16_from_float32_scales():
    x, w, dy = _operands()
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y = int8_matmul(xb, wb)
    assert y.dtype == jnp.bfloat16
    expected = reference.int8_product(np.asarray(xb, np.float32), np.asarray(wb, np.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  expected.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_fp8_forward_and_gradients_match_the_reference():
    """e4m3 for x and w, e5m2 for dy; float32 sums of exact float8 products."""
    x, w, dy = _operands()
    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    y = np.asarray(fp8_matmul(x, w))
    dx, dw = _gradients(fp8_matmul, x, w, dy)
    for got, want in ((y, reference.fp8_product(x, w, e4m3, e4m3)),
                      (dx, reference.fp8_product(dy, w.T, e5m2, e4m3)),
                      (dw, reference.fp8_product(x.T, dy, e4m3, e5m2))):
        np.testing.assert_allclose(got, want, rtol=0, atol=4e-6 * np.abs(want).max())
    assert not np.array_equal(y, x @ w)  # it really rounded


def test_nd_projection_flattens_tokens_and_channels():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)  # (B, T, N, H)
    w = rng.standard_normal((4, 5, 6)).astype(np.float32)  # (N, H, D)
    y = np.asarray(matmul(x, w, 2, "int8"))
    np.testing.assert_array_equal(
        y, reference.int8_product(x.reshape(6, 20), w.reshape(20, 6)).reshape(2, 3, 6))


def test_sharded_operands_give_one_devices_result():
    """Rows over 4 devices and the contracted axis over 2 (as model splits the attention
    output's heads): the per-token maxima are all-reduced over the split axis and the int32
    partial sums add exactly, so forward and gradients equal one device's bit for bit."""
    for got, want in zip(*sharded_and_one_device(int8_matmul)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def sharded_and_one_device(fn, dy_spec=("data", None)):
    """``fn``'s forward and both gradients on :func:`_operands`, jitted with x's rows over
    4 devices and its contracted axis over 2, w's over those 2 and dy's axes as
    ``dy_spec``; then on one device."""
    x, w, dy = _operands()
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
    dys = jax.device_put(dy, NamedSharding(mesh, P(*dy_spec)))

    @jax.jit
    def step(x, w, dy):
        y, vjp = jax.vjp(fn, x, w)
        return (y, *vjp(dy))

    return step(xs, ws, dys), step(x, w, dy)


@pytest.mark.parametrize("precision, match", [("int4", "matmul precision"),
                                              ("bf16", "plain matmuls")])
def test_unknown_precision_is_refused(precision, match):
    with pytest.raises(ValueError, match=match):
        matmul(np.ones((2, 3)), np.ones((3, 4)), 1, precision)


def test_nd_operands_are_contracted_in_place_not_reshaped():
    # A reshape to (tokens, K) fixes a row-major layout on the TPU: XLA then copies every
    # projection's input and gradient into it (seen: 118 copies in a 2-layer gpt2-medium
    # int8 step compiled for a v5e, 73 without the reshapes).
    x = jnp.ones((2, 3, 4, 5))  # (B, T, N, H)
    w = jnp.ones((4, 5, 6))  # (N, H, D)

    def loss(x, w):
        return jnp.sum(matmul(x, w, 2, "int8"))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
    shapes = [tuple(v.aval.shape) for eqn in jaxpr.jaxpr.eqns
              if eqn.primitive.name in ("reshape", "transpose") for v in eqn.invars]
    assert not [s for s in shapes if s in ((2, 3, 4, 5), (4, 5, 6), (2, 3, 6))], shapes
