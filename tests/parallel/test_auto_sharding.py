"""Automatic sharding of models without a kdist table: keras-hub backbones, any Keras model."""

import keras
import keras_hub
import numpy as np
import pytest

import kdist
from kdist.parallel.auto import ShardingError, infer_axes
from kdist.parallel.coverage import coverage_report

MESH = {"data": 1, "fsdp": 4, "model": 2}
SMALL = dict(vocabulary_size=256, num_layers=2, num_heads=4, hidden_dim=128,
             intermediate_dim=256, max_sequence_length=32, dropout=0.0)


RULES = [
    # keras-hub GPT2 / Bert / Llama: (hidden, heads, head_dim) in, (heads, head_dim, hidden) out.
    ("transformer_layer_0/self_attention/query/kernel", (128, 4, 32), ("fsdp", "model", None)),
    ("transformer_layer_0/self_attention/query/bias", (4, 32), ("model", None)),
    ("transformer_layer_0/self_attention/attention_output/kernel", (4, 32, 128),
     ("model", None, "fsdp")),
    ("transformer_layer_0/feedforward_intermediate_dense/kernel", (128, 256), ("fsdp", "model")),
    ("transformer_layer_0/feedforward_gate_dense/kernel", (128, 256), ("fsdp", "model")),
    ("transformer_layer_0/feedforward_output_dense/kernel", (256, 128), ("model", "fsdp")),
    ("token_embedding/embeddings", (512, 128), ("model", "fsdp")),
    ("token_embedding/reverse_embeddings", (128, 512), ("fsdp", "model")),
    # Gemma: (heads, hidden, head_dim) in; ffw_gating up, ffw_linear down.
    ("decoder_block_0/attention/query/kernel", (4, 128, 32), ("model", "fsdp", None)),
    ("decoder_block_0/ffw_gating_2/kernel", (128, 256), ("fsdp", "model")),
    ("decoder_block_0/ffw_linear/kernel", (256, 128), ("model", "fsdp")),
    # Not tensor-parallel: FSDP by shape (largest divisible dimension), or small.
    ("position_embedding/embeddings", (32, 256), (None, "fsdp")),
    ("my_dense/kernel", (4100, 12), ("fsdp", None)),
    ("layer_norm/gamma", (64,), (None,)),
]


def test_rules_by_structure_and_shape():
    for path, shape, axes in RULES:
        assert infer_axes(path, shape, MESH)[0] == axes, path


def test_unshardable_shapes_name_the_weight_and_the_axis():
    with pytest.raises(ShardingError, match=r"'blk/attention/key/kernel'.*'model' mesh axis"):
        infer_axes("blk/attention/key/kernel", (64, 1, 64), MESH)  # 1 kv head over model=2
    with pytest.raises(ShardingError, match=r"'odd/kernel' \(shape \(4099, 3\).*'fsdp'"):
        infer_axes("odd/kernel", (4099, 3), MESH)
    # Explicitly allowed: replicated, and the rule says so.
    assert infer_axes("odd/kernel", (4099, 3), MESH, allow_replicated=["odd/.*"]) == (
        (None, None), "replicated (allowed)")


def test_coverage_report_lists_every_weight_and_per_device_bytes_shrink():
    keras.distribution.set_distribution(kdist.distribution("fsdp=8", auto_shard=True))
    model = keras_hub.models.LlamaBackbone(vocabulary_size=256, num_layers=2, num_query_heads=8,
                                           num_key_value_heads=2, hidden_dim=128,
                                           intermediate_dim=128)
    rows, text = coverage_report(model)
    assert [r["path"] for r in rows] == [w.path for w in model.weights]
    for w in model.weights:
        assert w.path in text
    full = sum(np.prod(w.shape) * 4 for w in model.weights)
    sharded = sum(r["bytes_per_device"] for r in rows)
    small = sum(np.prod(w.shape) * 4 for w in model.weights if np.prod(w.shape) <= 4096)
    assert sharded == pytest.approx((full - small) / 8 + small)
    rules = {r["rule"] for r in rows}
    assert rules == {"fsdp by shape", "replicated (small)"}  # all automatic
    assert next(r for r in rows if r["path"].endswith("query/kernel"))["axes"][0] == "fsdp"


def test_without_auto_shard_a_foreign_model_is_refused():
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    with pytest.raises(ValueError, match="auto_shard=True"):
        keras_hub.models.GPT2Backbone(**{**SMALL, "hidden_dim": 128})
