"""8-bit gradient exchange (kdist.parallel.compression): codes within the format's error,
sums in float32, and error feedback that keeps exactly what the codes lost."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from kdist.parallel import compression

SIZES = {"data": 2, "fsdp": 4}
MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"),
            axis_types=(AxisType.Auto, AxisType.Auto))


@pytest.mark.parametrize("fmt", ["float8", "int8"])
def test_quantisation_error_is_the_formats(fmt):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)) ** 3, jnp.float32)
    codes, scales = compression.quantize(x, fmt)
    assert codes.dtype == jnp.uint8
    error = np.abs(np.asarray(compression.dequantize(codes, scales, fmt) - x))
    peak = np.abs(np.asarray(x)).max(axis=1, keepdims=True)
    if fmt == "int8":  # half a step of max|x| / 127
        assert (error <= peak / 254 * (1 + 1e-6)).all()
    else:  # half an ulp of 3 mantissa bits; below e4m3's normal range, 2^-10 of the scale
        scale = peak / 448
        assert (error <= np.maximum(np.abs(np.asarray(x)) / 16, scale / 1024) * (1 + 1e-6)).all()


def _reduce(grads, residuals, fsdp_dim, fmt, axes=("data", "fsdp")):
    """compression.reduce over a data=2, fsdp=4 mesh; grads: one per device, stacked."""
    out_spec = P(("data", "fsdp"))

    def local(g, r):
        shard, error = compression.reduce(g[0], None if r is None else r[0],
                                          axes=axes, sizes=SIZES,
                                          fsdp_dim=fsdp_dim, fmt=fmt)
        return shard[None], (None if error is None else error[None])

    run = jax.shard_map(local, mesh=MESH, in_specs=(P(("data", "fsdp")),) * 2,
                        out_specs=(out_spec, out_spec), check_vma=False)
    return jax.jit(run)(grads, residuals)


@pytest.mark.parametrize("fsdp_dim,fmt,axes", [
    (None, "float8", ("data", "fsdp")), (1, "float8", ("data", "fsdp")),
    (None, "int8", ("data", "fsdp")), (1, "int8", ("fsdp", "data"))])  # any axis order
def test_reduced_shard_is_the_sum_within_the_codes_error(fsdp_dim, fmt, axes):
    rng = np.random.default_rng(1)
    grads = jnp.asarray(rng.standard_normal((8, 12, 40)), jnp.float32)  # 8 devices' partials
    exact = np.asarray(grads).sum(0)
    shards, _ = _reduce(grads, None, fsdp_dim, fmt, axes)
    shards = np.asarray(shards)
    for device in range(8):
        f = device % 4  # its index over fsdp
        want = exact if fsdp_dim is None else exact[:, f * 10:(f + 1) * 10]
        # Every device quantises its partial (error <= 2^-4 of each value, or 1/254 of its
        # block's peak), the owner its sum again: bounded by the sum of magnitudes.
        bound = (np.abs(np.asarray(grads)).sum(0).max() + np.abs(exact).max()) / 12
        assert np.abs(shards[device] - want).max() <= bound
        assert np.abs(shards[device] - want).max() > 0  # it did quantise
    replicas = shards.reshape(2, 4, *shards.shape[1:])
    np.testing.assert_array_equal(replicas[0], replicas[1])  # data replicas agree exactly


@pytest.mark.parametrize("fsdp_dim", [None, 1])
def test_error_feedback_keeps_exactly_what_the_codes_lost(fsdp_dim):
    rng = np.random.default_rng(2)
    grads = jnp.asarray(rng.standard_normal((8, 12, 40)), jnp.float32)
    old = jnp.asarray(rng.standard_normal((8, 12, 40)) * 0.01, jnp.float32)
    shards, new = _reduce(grads, old, fsdp_dim, "float8")
    exact = np.asarray(grads + old).sum(0)  # what should have been sent, residuals included
    kept = np.asarray(new).sum(0)
    for device in range(8):
        f = device % 4
        cut = slice(None) if fsdp_dim is None else slice(f * 10, (f + 1) * 10)
        # sent + kept == exact, up to float32 rounding of the sums
        np.testing.assert_allclose(np.asarray(shards[device]) + kept[:, cut], exact[:, cut],
                                   atol=2e-5)
