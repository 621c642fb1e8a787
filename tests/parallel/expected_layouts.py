"""The layout every weight of kdist's GPT and BERT families must get: its logical axes
(as the models' regex tables gave them before each layer declared its own), mapped to mesh
axes by the rule table, with ZeRO-3's split of what those leave unsharded over fsdp."""

import re

from kdist.parallel.rules import LOGICAL_TO_MESH

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
    r"block_\d+/moe/router": ("embed", None),
    r"block_\d+/moe/(gate|up)": ("expert", "embed", "mlp"),
    r"block_\d+/moe/down": ("expert", "mlp", "embed"),
    r"block_\d+/moe/expert_load": ("expert",),
    r"block_\d+/moe/dropped_tokens": (),
    r"block_\d+/moe/shared_(up|gate)": ("embed", "mlp"),
    r"block_\d+/moe/shared_down": ("mlp", "embed"),
    r"(pooler|mlm_transform)/kernel": ("embed", None),
    r"(pooler|mlm_transform)/bias": ("norm",),
    r"mlm_output_bias/bias": ("vocab",),
    r"classifier_head/kernel": ("embed", None),
    r"classifier_head/bias": (None,),
}


# The toy family's (tests/toy_family.py) declarations.
TOY_AXES = {
    r".*/embeddings": ("vocab", "embed"),
    r".*/up/kernel": ("embed", "mlp"),
    r".*/up/bias": ("mlp",),
    r".*/down/kernel": ("mlp", "embed"),
    r".*/down/bias": ("embed",),
}


def expected_axes(path, table=EXPECTED_AXES):
    matches = [axes for pattern, axes in table.items() if re.fullmatch(pattern, path)]
    assert len(matches) == 1, (path, matches)
    return matches[0]


def padded_spec(variable):
    spec = tuple(variable.value.sharding.spec)
    return spec + (None,) * (len(variable.shape) - len(spec))


def expected_spec(path, shape, mesh_sizes, table=EXPECTED_AXES):
    """The PartitionSpec the strategy rules prescribe for a weight: its logical axes'
    mesh axes; under fsdp, a weight they leave unsharded over fsdp (a norm scale, a bias)
    is split along its largest dimension that divides (ZeRO-3: 1/fsdp of every weight)."""
    spec = [mesh_axis if mesh_axis and mesh_sizes[mesh_axis] > 1 else None
            for mesh_axis in (LOGICAL_TO_MESH.get(a) for a in expected_axes(path, table))]
    fsdp = mesh_sizes["fsdp"]
    free = [d for d, n in enumerate(shape) if spec[d] is None and n % fsdp == 0]
    if fsdp > 1 and "fsdp" not in spec and free:
        spec[max(free, key=lambda d: shape[d])] = "fsdp"
    return tuple(spec)


def assert_layouts(model, table=EXPECTED_AXES) -> None:
    """Every weight declares its expected logical axes and is laid out as the rules say
    under the active distribution, and its Adam moments (if any) are laid out like it."""
    import keras

    from kdist.parallel.rules import declared_axes

    sizes = keras.distribution.distribution().mesh_shape
    slots = {v.path: v for v in model.optimizer.variables} if model.optimizer else {}
    adam = any(path.startswith("adam_w/") for path in slots)  # a built AdamW: every
    # trainable weight has both moments (a missing one is an error, not a skip)
    for w in model.weights:
        assert declared_axes(w) == expected_axes(w.path, table), w.path
        assert padded_spec(w) == expected_spec(w.path, w.shape, sizes, table), w.path
        for slot in ("momentum", "velocity"):
            name = f"adam_w/{w.path.replace('/', '_')}_{slot}"
            if adam and w.trainable:
                assert name in slots, f"{name} not among AdamW's variables"
            if name in slots:
                assert padded_spec(slots[name]) == padded_spec(w), name
