"""Sharded training computes the same function as 1-device training."""

import re

import keras
import numpy as np
import pytest

from kdist.parallel.rules import LOGICAL_TO_MESH, declared_axes
from tests.helpers import tiny_gpt, token_batches, train, weights

# The layouts as the models' regex tables gave them before each layer declared its weights'
# axes (kdist.parallel.rules.add_weight / build_with_axes): the declarations must agree.
EXPECTED_AXES = {
    r"token_embedding/embeddings": ("vocab", "embed"),
    r"token_embedding/reverse_embeddings": ("embed", "vocab"),
    r"position_embedding/embeddings": ("position", "embed"),
    r"segment_embedding/embeddings": (None, "embed"),
    r"(encoder_)?block_\d+/attention/query/kernel": ("embed", "heads", "head_dim"),
    r"(encoder_)?block_\d+/attention/query/bias": ("heads", "head_dim"),
    r"(encoder_)?block_\d+/attention/(key|value)/kernel": ("embed", "kv_heads", "head_dim"),
    r"(encoder_)?block_\d+/attention/(key|value)/bias": ("kv_heads", "head_dim"),
    r"block_\d+/attention/qkv/kernel": ("embed", "kv_heads", None, "head_dim"),
    r"block_\d+/attention/qkv/bias": ("kv_heads", None, "head_dim"),
    r"(encoder_)?block_\d+/attention/attention_output/kernel": ("heads", "head_dim", "embed"),
    r"(encoder_)?block_\d+/attention/attention_output/bias": ("norm",),
    r"(encoder_)?block_\d+/mlp/(up|gate)/kernel": ("embed", "mlp"),
    r"(encoder_)?block_\d+/mlp/(up|gate)/bias": ("mlp",),
    r"(encoder_)?block_\d+/mlp/down/kernel": ("mlp", "embed"),
    r"(encoder_)?block_\d+/mlp/down/bias": ("norm",),
    r"((encoder_)?block_\d+/(attention_norm|mlp_norm)|final_norm|embeddings_norm|mlm_norm)"
    r"/(gamma|beta|scale)": ("norm",),
    r"(pooler|mlm_transform)/kernel": ("embed", None),
    r"(pooler|mlm_transform)/bias": ("norm",),
    r"mlm_output_bias/bias": ("vocab",),
    r"classifier_head/kernel": ("embed", None),
    r"classifier_head/bias": (None,),
}


def expected_axes(path):
    matches = [axes for pattern, axes in EXPECTED_AXES.items() if re.fullmatch(pattern, path)]
    assert len(matches) == 1, (path, matches)
    return matches[0]

MESHES = ["data=8", "fsdp=8", "fsdp=4,model=2", "data=2,model=4", "data=2,fsdp=2,model=2"]
BATCHES = token_batches(steps=3)


def run(mesh, dtype_policy="float32"):
    keras.config.set_dtype_policy(dtype_policy)
    model = tiny_gpt(mesh)
    losses = train(model, BATCHES)
    return model, losses, weights(model)


@pytest.fixture(scope="module")
def reference():
    _, losses, final = run(None)
    keras.utils.clear_session()
    return losses, final


def padded_spec(variable):
    spec = tuple(variable.value.sharding.spec)
    return spec + (None,) * (len(variable.shape) - len(spec))


def expected_spec(path, shape, mesh_sizes):
    """The PartitionSpec the strategy rules prescribe for a weight: its logical axes'
    mesh axes; under fsdp, a weight they leave unsharded over fsdp (a norm scale, a bias)
    is split along its largest dimension that divides (ZeRO-3: 1/fsdp of every weight)."""
    spec = [mesh_axis if mesh_axis and mesh_sizes[mesh_axis] > 1 else None
            for mesh_axis in (LOGICAL_TO_MESH.get(a) for a in expected_axes(path))]
    fsdp = mesh_sizes["fsdp"]
    free = [d for d, n in enumerate(shape) if spec[d] is None and n % fsdp == 0]
    if fsdp > 1 and "fsdp" not in spec and free:
        spec[max(free, key=lambda d: shape[d])] = "fsdp"
    return tuple(spec)


@pytest.mark.parametrize("mesh", MESHES)
def test_float32_parity_and_layouts(mesh, reference):
    ref_losses, ref_weights = reference
    model, losses, final = run(mesh)
    # Float32: only the summation order differs between meshes.
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6, atol=0)
    for path, value in final.items():
        np.testing.assert_allclose(value, ref_weights[path], rtol=0, atol=2e-6, err_msg=path)
    # Every weight is laid out as the strategy says, and its Adam moments like it.
    sizes = keras.distribution.distribution().mesh_shape
    slots = {v.path: v for v in model.optimizer.variables}
    for w in model.weights:
        assert declared_axes(w) == expected_axes(w.path), w.path
        assert padded_spec(w) == expected_spec(w.path, w.shape, sizes), w.path
        for slot in ("momentum", "velocity"):
            assert padded_spec(slots[f"adam_w/{w.path.replace('/', '_')}_{slot}"]) == padded_spec(w)


def test_bfloat16_parity():
    """mixed_bfloat16 on a hybrid mesh against mixed_bfloat16 on 1 device.

    Tolerance: matmuls run in bf16 (8-bit mantissa: relative rounding 2**-9 = 2e-3), and the
    sharded program rounds partial sums at other points (e.g. before an all-reduce instead of
    inside one dot), so logits differ by a few bf16 ulps (~1e-3 absolute here). The loss
    averages 8 x 16 token losses whose errors have independent signs, which leaves ~1e-4
    absolute; measured: at most 2e-5 relative over 3 steps. We allow 2e-4 relative (1e-3
    absolute at loss 5.5): 10x the measured spread, and 100x below the 0.1 that the loss
    moves over these 3 steps, so a wrong gradient or a missed reduction would fail.
    """
    _, ref_losses, _ = run(None, "mixed_bfloat16")
    keras.utils.clear_session()
    model, losses, _ = run("data=2,fsdp=2,model=2", "mixed_bfloat16")
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-4)
    assert ref_losses[0] - ref_losses[2] > 0.05  # the steps did change the loss
    assert all(w.dtype == "float32" for w in model.weights)
    assert model.backbone.blocks[0].attention.query.compute_dtype == "bfloat16"


def test_same_seed_same_losses():
    first = run("data=2,fsdp=2,model=2")[1]
    keras.utils.clear_session()
    second = run("data=2,fsdp=2,model=2")[1]
    assert first == second
