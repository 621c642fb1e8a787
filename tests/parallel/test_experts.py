"""Expert parallelism's all-to-all dispatch equals the dropless layer (8 host devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from kdist.models.expert_compute import capacity_limited, dropless
from kdist.models.router import expert_counts
from kdist.parallel.experts import expert_parallel_outputs

N, K, E, D, F = 64, 2, 8, 16, 8


def _inputs(seed=0, gated=True):
    """Tokens, their experts and SwiGLU experts' ``(gate, up, down)`` (GELU's ``(up, down)``)."""
    rng = np.random.default_rng(seed)
    tokens = rng.normal(size=(N, D)).astype("float32")
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype("int32")
    weights = [rng.normal(size=s).astype("float32") * 0.3
               for s in ((E, D, F), (E, D, F), (E, F, D))]
    return tokens, experts, weights if gated else weights[1:]


def _mesh(devices):
    return jax.make_mesh((devices,), ("expert",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:devices])


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "gelu"])
def test_all_to_all_dispatch_equals_dropless_when_nothing_overflows(gated, devices=8):
    tokens, experts, weights = _inputs(gated=gated)
    slots = N // devices * K  # a device's every assignment could go to one expert
    out, dropped = expert_parallel_outputs(tokens, experts, weights, _mesh(devices),
                                           "expert", slots)
    want = dropless(tokens, experts, expert_counts(jnp.asarray(experts), E), weights)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert int(dropped) == 0  # (gradients: the harness's expert rows compare Adam's moments)


def test_overflow_drops_per_source_device_and_is_counted():
    tokens, experts, weights = _inputs(1)
    devices, slots = 2, 3
    out, dropped = expert_parallel_outputs(tokens, experts, weights, _mesh(devices),
                                           "expert", slots)
    # Each device's half of the tokens is a capacity-limited layer of its own.
    half, factor = N // devices, slots * E / (N // devices * K)
    parts = [capacity_limited(tokens[i:i + half], experts[i:i + half],
                              expert_counts(jnp.asarray(experts[i:i + half]), E), weights,
                              factor) for i in (0, half)]
    np.testing.assert_allclose(out, np.concatenate([p[0] for p in parts]), rtol=1e-5,
                               atol=1e-6)
    assert int(dropped) == sum(int(p[1]) for p in parts) > 0


def test_experts_not_divisible_by_the_axis_refused():
    tokens, experts, weights = _inputs()
    with pytest.raises(ValueError, match="divisible"):
        expert_parallel_outputs(tokens, experts, [w[:6] for w in weights], _mesh(4),
                                "expert", 16)


@pytest.mark.parametrize("mesh", ["expert=4,fsdp=2", "expert=2,model=2,data=2"])
def test_the_compiled_step_moves_tokens_not_expert_weights_over_the_expert_axis(
        mesh, full_locations):  # the exchanges are found by their HLO op names
    import keras

    import kdist
    from kdist import hlo
    from kdist.models import GPTBackbone, GPTCausalLM
    from kdist.planning.compile import compile_train_step
    from tests.helpers import TINY_GPT

    dist = kdist.distribution(mesh)
    keras.distribution.set_distribution(dist)
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT, moe={"num_experts": 8, "expert_dim": 32}))
    lm.compile(optimizer="adamw")
    for block in lm.backbone.blocks:  # each expert's weights on its own devices
        specs = [tuple(w.value.sharding.spec) for w in (block.mlp.gate, block.mlp.up,
                                                          block.mlp.down)]
        assert all(spec[0] == "expert" for spec in specs), specs
        if "model" in mesh:  # and each expert's hidden width split over 'model'
            assert [spec.index("model") for spec in specs] == [2, 2, 1], specs
    x = np.zeros((8, 16), "int32")
    compiled, _ = compile_train_step(lm, x, x, dist)
    found = hlo.parse_collectives(compiled.as_text(), 8)
    over = [(c.kind, c.axes(dist.mesh_shape), c.op_name) for c in found]
    exchanges = [name for kind, axes, name in over if kind == "all-to-all"
                 and axes == {"expert"}]
    for i in range(TINY_GPT["num_layers"]):  # there and back, forward and backward
        assert sum(f"block_{i}/shard_map" in name for name in exchanges) == 4, over
    assert not [name for kind, axes, name in over if kind == "all-gather"
                and "expert" in axes and "shard_map" in name], over


def test_wrong_expert_meshes_are_refused_before_compiling():
    import keras

    import kdist
    from kdist.models import GPTBackbone, GPTCausalLM
    from tests.helpers import TINY_GPT

    keras.distribution.set_distribution(kdist.distribution("expert=4,fsdp=2"))
    with pytest.raises(ValueError, match="num_experts'\\]=6 is not divisible by the 'expert'"):
        GPTBackbone(**TINY_GPT, moe={"num_experts": 6})
    dense = GPTCausalLM(GPTBackbone(**TINY_GPT))
    with pytest.raises(ValueError, match="has no Mixture-of-Experts layer.*moe="):
        dense.compile(optimizer="adam")
    keras.distribution.set_distribution(
        kdist.distribution("replica=2,expert=2,fsdp=2", sync_every=2))
    moe = GPTCausalLM(GPTBackbone(**TINY_GPT, moe={"num_experts": 8}))
    with pytest.raises(ValueError, match="'expert', 'fsdp' and 'replica' together.*'data'"):
        moe.compile(optimizer="adam")


def test_a_scanned_stacks_expert_weights_are_split_over_the_expert_axis():
    import keras

    import kdist
    from kdist.models import GPTBackbone, GPTCausalLM
    from tests.helpers import TINY_GPT

    keras.distribution.set_distribution(kdist.distribution("expert=4,fsdp=2"))
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT, scan_layers=True,
                                 moe={"num_experts": 8, "expert_dim": 32}))
    specs = {w.path: tuple(w.value.sharding.spec) for w in lm.weights if "/moe/" in w.path}
    for name in ("gate", "up", "down"):  # (L, E, ...): each expert on its own devices
        assert specs[f"blocks/moe/{name}"][:2] == (None, "expert"), specs


def test_decoding_one_sequence_under_an_expert_mesh_computes_the_rows_whole():
    """One prompt's rows do not split over expert=2,data=4: the layer computes them whole
    (the recipes' sample after training failed on every expert mesh), the same tokens as
    the model's weights decode on one device."""
    import keras

    import kdist
    from kdist.models import GPTBackbone, GPTCausalLM
    from tests.helpers import TINY_GPT

    def build():
        keras.utils.set_random_seed(0)
        return GPTCausalLM(GPTBackbone(**TINY_GPT, moe={"num_experts": 8, "expert_dim": 32}))

    keras.distribution.set_distribution(kdist.distribution("expert=2,data=4"))
    sharded = build()
    prompt = np.array([[5, 9, 2, 7]], "int32")
    tokens = sharded.generate(prompt, 10, sampler="greedy")
    values = [np.asarray(w.value) for w in sharded.weights]
    keras.distribution.set_distribution(None)
    local = build()
    for w, v in zip(local.weights, values):
        w.assign(v)
    np.testing.assert_array_equal(tokens, local.generate(prompt, 10, sampler="greedy"))
