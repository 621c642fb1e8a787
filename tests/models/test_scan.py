"""Scanned layer stacks (``scan_layers=True``): the same function as unstacked blocks, and
the converter, saving, loading, dropout and remat that go with them."""

import keras
import numpy as np
import pytest

import kdist
from kdist.models import BertClassifier, BertMaskedLM, GPTBackbone, GPTCausalLM
from kdist.models.layers import PreNormBlock
from kdist.models.scan import LayerStack, StackedInitializer
from kdist.models.stacking import (
    conversion_plan,
    match_layer_layout,
    stack_layer_weights,
    unstack_layer_weights,
)
from tests.bert_helpers import TINY_BERT
from tests.helpers import TINY_GPT, token_batches, train, weights

BATCHES = token_batches(3)


def _gpt(scan_layers, seed=0, **overrides):
    keras.utils.set_random_seed(seed)
    return GPTCausalLM(GPTBackbone(**{**TINY_GPT, **overrides, "scan_layers": scan_layers}))


def _stacked_copy(unstacked, **overrides):
    """A stacked model holding the unstacked one's weights (by the converter)."""
    model = _gpt(True, **overrides)
    values = match_layer_layout(weights(unstacked), {w.path: w.shape for w in model.weights})
    for w in model.weights:
        w.assign(values[w.path])
    return model


@pytest.mark.parametrize("remat", [False, "save_dots"])
def test_stacked_blocks_train_like_unstacked_blocks(remat):
    unstacked = _gpt(False, remat=remat)
    stacked = _stacked_copy(unstacked, remat=remat)
    assert [w.path for w in stacked.weights][2:4] == ["blocks/attention_norm/gamma",
                                                      "blocks/attention_norm/beta"]
    assert stacked.backbone.blocks.weights[4].shape == (2, 64, 8, 8)  # (L, D, N, H)
    np.testing.assert_allclose(train(stacked, BATCHES), train(unstacked, BATCHES), rtol=2e-6)
    back = unstack_layer_weights(weights(stacked))
    for path, value in weights(unstacked).items():
        np.testing.assert_allclose(back[path], value, rtol=0, atol=2e-6, err_msg=path)
    if not remat:
        prompt = BATCHES[0][0][:2, :4]
        np.testing.assert_array_equal(stacked.generate(prompt, 10, sampler="greedy"),
                                      unstacked.generate(prompt, 10, sampler="greedy"))


def test_one_block_is_traced_not_num_layers():
    """The stacked step's program holds one copy of the block (in a loop)."""
    import jax

    def program_size(model):
        model.compile(optimizer="adamw")
        kdist._keras_compat.symbolic_build(model, BATCHES[0])
        model.optimizer.build(model.trainable_variables)
        state = kdist._keras_compat.jax_state(model)
        return len(jax.jit(model.train_step).lower(state, BATCHES[0]).as_text())

    deep = dict(num_layers=8)
    assert program_size(_gpt(True, **deep)) < 0.4 * program_size(_gpt(False, **deep))


def test_flops_count_every_layer_of_the_scan():
    """The stacked step's matmuls, counted per loop iteration (kdist.hlo; XLA's
    cost_analysis counts a loop body once), equal the unstacked step's; kdist's XLA figure
    (cost_analysis plus the loops' matmuls) is within the loops' element-wise ops of it."""
    import jax

    from kdist import hlo
    from kdist.planning import xla_flops

    def compiled_text(model):
        model.compile(optimizer="adamw")
        batch = BATCHES[0][0][:4], BATCHES[0][1][:4]
        kdist._keras_compat.symbolic_build(model, batch)
        model.optimizer.build(model.trainable_variables)
        state = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                             kdist._keras_compat.jax_state(model))
        compiled = jax.jit(model.train_step).lower(state, batch).compile()
        return compiled.as_text(), xla_flops(compiled)

    # A stack's blocks keep what "minimal" keeps (kdist.models.remat.in_scan), which with
    # XLA's attention leaves its two matmuls to run again in the backward pass; chunked
    # attention names its output and statistics, which "minimal" keeps.
    (stacked, stacked_xla), (unstacked, unstacked_xla) = (
        compiled_text(_gpt(True, num_layers=4, attention_chunk_size=8)),
        compiled_text(_gpt(False, num_layers=4, attention_chunk_size=8)))
    assert hlo.matmul_flops(stacked) == pytest.approx(hlo.matmul_flops(unstacked), rel=1e-3)
    assert hlo.matmul_flops(stacked, per_iteration=False) < 0.5 * hlo.matmul_flops(stacked)
    assert stacked_xla == pytest.approx(unstacked_xla, rel=0.1)


def test_dropout_draws_per_layer_and_per_step():
    stack = LayerStack(PreNormBlock(num_heads=2, head_dim=8, intermediate_dim=32,
                                    dropout=0.5, name="block"), num_layers=2)
    x = np.random.default_rng(0).normal(size=(2, 4, 16)).astype("float32")
    stack(x)
    for w in stack.weights:  # both layers the same weights
        w.assign(np.broadcast_to(np.asarray(w.value)[:1], w.shape))
    weights_ = [keras.ops.convert_to_tensor(v) for v in stack.weights]
    seed = np.array([1, 2], "uint32")
    by_layer = [stack._layer([w[i] for w in weights_], x, {}, i, seed, True) for i in (0, 1)]
    assert np.abs(np.asarray(by_layer[0]) - np.asarray(by_layer[1])).max() > 0
    assert np.abs(np.asarray(stack(x, training=True)) - np.asarray(stack(x, training=True))
                  ).max() > 0  # the stack's seed generator advances
    np.testing.assert_array_equal(stack(x), stack(x))  # no dropout at inference
    # ... and inference leaves the seed stream alone, as Keras' Dropout does: the next
    # training call draws what it would have drawn without the evaluation between.
    state = np.asarray(stack.seed_generator.state.value)
    stack(x, training=False)
    np.testing.assert_array_equal(stack.seed_generator.state.value, state)
    stack(x, training=True)
    assert not np.array_equal(stack.seed_generator.state.value, state)


def test_saving_config_and_loading(tmp_path):
    model = _gpt(True, dropout=0.1, num_layers=4)
    train(model, BATCHES[:1])
    config = model.backbone.get_config()
    assert config["scan_layers"] is True
    assert GPTBackbone.from_config(config).get_config() == config
    layer_config = model.backbone.blocks.get_config()
    assert LayerStack.from_config(layer_config).get_config() == layer_config
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    x = BATCHES[0][0]
    np.testing.assert_array_equal(loaded.predict_on_batch(x), model.predict_on_batch(x))
    # Under circular pipeline repeats the stack is (R, L / R, ...): the file still loads.
    keras.distribution.set_distribution(kdist.distribution("stage=2,data=4",
                                                           pipeline_repeats=2))
    reviewed = keras.saving.load_model(tmp_path / "m.keras")
    assert reviewed.backbone.blocks.weights[0].shape == (2, 2, 64)
    for path, value in weights(model).items():
        np.testing.assert_array_equal(weights(reviewed)[path].reshape(value.shape), value)


def test_load_backbone_weights_into_a_stacked_backbone(tmp_path):
    keras.utils.set_random_seed(1)
    mlm = BertMaskedLM(kdist.models.BertBackbone(**TINY_BERT))  # unstacked
    mlm.save(tmp_path / "model.keras")
    clf = BertClassifier(kdist.models.BertBackbone(**TINY_BERT, scan_layers=True),
                         num_classes=3)
    kdist.models.load_backbone_weights(clf, tmp_path)
    want = stack_layer_weights({w.path: np.asarray(w.value) for w in mlm.backbone.weights})
    for w in clf.backbone.weights:
        np.testing.assert_array_equal(np.asarray(w.value), want[w.path], err_msg=w.path)


def test_converter_is_exact_and_refuses_what_it_cannot_convert():
    rng = np.random.default_rng(0)
    w = {f"block_{i}/mlp/up/kernel": rng.normal(size=(4, 8)) for i in range(6)}
    w["token_embedding/embeddings"] = rng.normal(size=(10, 4))
    stacked = stack_layer_weights(w, repeats=2)
    assert stacked["blocks/mlp/up/kernel"].shape == (2, 3, 4, 8)
    np.testing.assert_array_equal(stacked["blocks/mlp/up/kernel"][1, 2], w["block_5/mlp/up/kernel"])
    back = unstack_layer_weights(stacked, num_layers=6)
    assert all(np.array_equal(back[k], v) for k, v in w.items()) and sorted(back) == sorted(w)
    # Checkpoint keys (params., optimizer slots) convert alike.
    plan = conversion_plan({"optimizer.blocks_mlp_up_kernel_momentum": (2, 4)},
                           {"optimizer.block_0_mlp_up_kernel_momentum": (4,),
                            "optimizer.block_1_mlp_up_kernel_momentum": (4,)})
    assert plan["optimizer.blocks_mlp_up_kernel_momentum"].kind == "stack"
    with pytest.raises(ValueError, match=r"not numbered 0 \.\. 1"):
        stack_layer_weights({"block_0/x": np.ones(2), "block_2/x": np.ones(2)})
    with pytest.raises(ValueError, match="does not match the 2 layers"):
        match_layer_layout({"block_0/x": np.ones(2), "block_1/x": np.ones(3)},
                           {"blocks/x": (2, 2)})
    with pytest.raises(ValueError, match="'blocks/y' .* is missing"):
        match_layer_layout({"block_0/x": np.ones(2)}, {"blocks/y": (1, 2)})


def test_stacked_initializer_draws_each_layer_independently():
    glorot = StackedInitializer(keras.initializers.GlorotUniform(seed=3), (4,))
    values = np.asarray(glorot((4, 64, 32)))
    assert not np.array_equal(values[0], values[1])
    limit = np.sqrt(6 / (64 + 32))  # the per-layer fans, not the stacked shape's
    assert values.max() <= limit and values.max() > 0.9 * limit
    normal = np.asarray(StackedInitializer(keras.initializers.RandomNormal(stddev=0.02),
                                           (3,))((3, 200, 200)))
    assert abs(normal.std() - 0.02) < 1e-3 and not np.array_equal(normal[0], normal[1])


def test_the_stack_is_read_as_stored_and_each_layer_casts_its_own_slice():
    # Under mixed precision a backbone run by stateless_call (no autocast scope open) once
    # read its stacked weights cast to bfloat16 whole, before the scan: a second copy of
    # every block weight alive through the step. Only slices are cast, inside the loop.
    import jax

    keras.config.set_dtype_policy("mixed_bfloat16")
    backbone = GPTBackbone(**{**TINY_GPT, "scan_layers": True})
    trainable = [v.value for v in backbone.trainable_variables]
    rest = [v.value for v in backbone.non_trainable_variables]
    ids = np.zeros((3, 8), "int32")
    jaxpr = jax.make_jaxpr(lambda t: backbone.stateless_call(t, rest, ids)[0])(trainable)
    stacks = {tuple(v.shape) for v in backbone.trainable_variables
              if "blocks" in v.path and v.shape[0] == TINY_GPT["num_layers"]}
    cast_whole = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
                  and tuple(e.invars[0].aval.shape) in stacks]
    assert stacks and not cast_whole, cast_whole
    assert any(e.primitive.name == "scan" for e in jaxpr.eqns)
