"""Expert parallelism's all-to-all dispatch equals the dropless layer (8 host devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from kdist.models.moe import capacity_limited, dropless
from kdist.models.router import expert_counts
from kdist.parallel.experts import expert_parallel_outputs

N, K, E, D, F = 64, 2, 8, 16, 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.normal(size=(N, D)).astype("float32")
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype("int32")
    weights = [rng.normal(size=s).astype("float32") * 0.3
               for s in ((E, D, F), (E, D, F), (E, F, D))]
    return tokens, experts, weights


def _mesh(devices):
    return jax.make_mesh((devices,), ("expert",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:devices])


def test_all_to_all_dispatch_equals_dropless_when_nothing_overflows(devices=8):
    tokens, experts, weights = _inputs()
    slots = N // devices * K  # a device's every assignment could go to one expert
    out, dropped = expert_parallel_outputs(tokens, experts, *weights, _mesh(devices),
                                           "expert", slots)
    want = dropless(tokens, experts, expert_counts(jnp.asarray(experts), E), *weights)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert int(dropped) == 0

    def loss(ws, fn):
        return jnp.sum(fn(ws) ** 2)

    grads = jax.grad(loss)(weights, lambda ws: expert_parallel_outputs(
        tokens, experts, *ws, _mesh(devices), "expert", slots)[0])
    want_grads = jax.grad(loss)(weights, lambda ws: dropless(
        tokens, experts, expert_counts(jnp.asarray(experts), E), *ws))
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()))


def test_overflow_drops_per_source_device_and_is_counted():
    tokens, experts, weights = _inputs(1)
    devices, slots = 2, 3
    out, dropped = expert_parallel_outputs(tokens, experts, *weights, _mesh(devices),
                                           "expert", slots)
    # Each device's half of the tokens is a capacity-limited layer of its own.
    half, factor = N // devices, slots * E / (N // devices * K)
    parts = [capacity_limited(tokens[i:i + half], experts[i:i + half],
                              expert_counts(jnp.asarray(experts[i:i + half]), E), *weights,
                              factor) for i in (0, half)]
    np.testing.assert_allclose(out, np.concatenate([p[0] for p in parts]), rtol=1e-5,
                               atol=1e-6)
    assert int(dropped) == sum(int(p[1]) for p in parts) > 0


def test_experts_not_divisible_by_the_axis_refused():
    tokens, experts, weights = _inputs()
    with pytest.raises(ValueError, match="divisible"):
        expert_parallel_outputs(tokens, experts, *[w[:6] for w in weights], _mesh(4),
                                "expert", 16)
