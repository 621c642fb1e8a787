"""The MoE layer against a dense reference that computes every expert for every token."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import kdist
from kdist.models import GPTBackbone, GPTCausalLM
from kdist.models.expert_compute import capacity_limited, dropless
from kdist.models.moe import MoEFeedForward, check_moe
from kdist.models.moe_load import expert_load
from kdist.models.router import load_balance_loss, z_loss
from kdist.models.scan import LayerStack
from tests.helpers import TINY_GPT

D, E, F = 16, 4, 8


def _layer(**options):
    layer = MoEFeedForward(num_experts=E, expert_dim=F, **options)
    layer.build((None, None, D))
    return layer


def _x(shape=(2, 6, D), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _silu(v):
    return v / (1 + jnp.exp(-v))


def dense_reference(params, x, k, router="softmax", shared=None, kept=None, chosen=None,
                    renormalize=True, scale=1.0):
    """Every expert on every token, weighted by the router (zero for unchosen experts) times
    ``scale`` (``routed_scale``; the shared experts unscaled);
    ``kept (N, k)``: which assignments the capacity let through; ``chosen (N, k)``: the
    experts (when differentiating: the choice is discrete, found on concrete values).
    ``params``: the router's kernel and the experts' (gate, up, down), or (up, down): GELU."""
    router_kernel, *kernels = params
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ router_kernel  # (N, E)
    scores = jax.nn.softmax(logits) if router == "softmax" else jax.nn.sigmoid(logits)
    if chosen is None:
        chosen = np.argsort(-np.asarray(scores), axis=-1, kind="stable")[:, :k]  # (N, k)
    mask = np.zeros(scores.shape, "float32")
    for n, experts in enumerate(chosen):
        mask[n, experts] = 1.0 if kept is None else kept[n]
    top = scores * np.asarray(jnp.zeros_like(scores).at[
        np.arange(len(chosen))[:, None], chosen].set(1.0))
    if renormalize:  # (N, E), renormalised over the k
        top = top / top.sum(-1, keepdims=True)
    weights = top * mask * scale
    y = 0
    for e in range(kernels[0].shape[0]):
        y = y + weights[:, e:e + 1] * _mlp(tokens, [w[e] for w in kernels])
    if shared is not None:
        y = y + _mlp(tokens, shared)
    return y.reshape(x.shape), chosen


def _mlp(x, kernels):  # SwiGLU's (gate, up, down) or GELU's (up, down), written out
    if len(kernels) == 3:
        gate, up, down = kernels
        return (_silu(x @ gate) * (x @ up)) @ down
    up, down = kernels
    h = x @ up
    return (0.5 * h * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))) @ down


def _params(layer):
    return [jnp.asarray(w) for w in (layer.router_kernel, *layer.kernels)]


@pytest.mark.parametrize("router,k,shared,scale,activation", [
    ("softmax", 2, 0, 1.0, "swiglu"), ("sigmoid", 3, 1, 2.5, "swiglu"),
    ("softmax", 2, 1, 2.0, "gelu")])
def test_dropless_equals_every_expert_weighted_by_the_router(router, k, shared, scale,
                                                             activation):
    layer = _layer(experts_per_token=k, router=router, shared_experts=shared,
                   routed_scale=scale, activation=activation)
    x = _x()
    shared_params = None if not shared else [jnp.asarray(w) for w in layer.shared]
    expected, _ = dense_reference(_params(layer), x, k, router, shared_params, scale=scale)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(x)), expected,
                               rtol=1e-5, atol=1e-6)
    again = MoEFeedForward.from_config(layer.get_config())
    assert (again.routed_scale, again.activation) == (scale, activation)
    assert len(layer.kernels) == (3 if activation == "swiglu" else 2)


def test_unrenormalised_weights_are_the_routers_probabilities():
    """``renormalize=False`` (Qwen3-MoE's ``norm_topk_prob: false``): the k softmax
    probabilities weigh the experts as they are."""
    layer = _layer(experts_per_token=2, renormalize=False)
    x = _x()
    expected, _ = dense_reference(_params(layer), x, 2, renormalize=False)
    got = keras.ops.convert_to_numpy(layer(x))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    renormalised, _ = dense_reference(_params(layer), x, 2)
    assert np.abs(got - renormalised).max() > 0.1 * np.abs(renormalised).max()  # it matters
    config = layer.get_config()
    assert config["renormalize"] is False
    assert MoEFeedForward.from_config(config).get_config() == config


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_gradients_equal_the_dense_reference(activation):
    layer = _layer(experts_per_token=2, activation=activation)
    x, cotangent = _x(seed=1), _x(seed=2)

    def moe_loss(params, x):
        values = dict(zip(["router"] + [w.path.rsplit("/", 1)[-1] for w in layer.kernels],
                          params))
        trainable = [values[v.path.rsplit("/", 1)[-1]] for v in layer.trainable_variables]
        y, _ = layer.stateless_call(trainable, [v.value for v in
                                                layer.non_trainable_variables], x)
        return jnp.sum(y * cotangent)

    _, chosen = dense_reference(_params(layer), x, 2)

    def reference_loss(params, x):
        return jnp.sum(dense_reference(params, x, 2, chosen=chosen)[0] * cotangent)

    got = jax.grad(moe_loss, argnums=(0, 1))(_params(layer), x)
    want = jax.grad(reference_loss, argnums=(0, 1))(_params(layer), x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.abs(w).max()))


def test_one_gelu_expert_is_a_gpt_mlp_without_biases():
    """GELU experts are a GPT block's MLP: one expert, top-1, equals ``MLP("gelu")`` with
    the expert's weights (no biases) on every token."""
    from kdist.models.layers import MLP

    layer = MoEFeedForward(num_experts=1, experts_per_token=1, expert_dim=F,
                           activation="gelu")
    layer.build((None, None, D))
    mlp = MLP(intermediate_dim=F, activation="gelu", use_bias=False)
    mlp.build((None, None, D))
    mlp.up.kernel.assign(layer.up[0])
    mlp.down.kernel.assign(layer.down[0])
    x = _x()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(x)),
                               keras.ops.convert_to_numpy(mlp(x)), rtol=1e-5, atol=1e-6)
    assert layer.gate is None and [w.path.rsplit("/", 1)[-1] for w in layer.weights] == [
        "router", "up", "down", "expert_load", "dropped_tokens"]


def test_capacity_equals_dropless_when_nothing_overflows():
    dropless = _layer(experts_per_token=2)
    limited = _layer(experts_per_token=2, capacity_factor=float(E))  # room for every token
    limited.set_weights(dropless.get_weights())
    x = _x()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(limited(x, training=True)),
                               keras.ops.convert_to_numpy(dropless(x)), rtol=1e-6, atol=1e-7)
    assert float(limited.dropped) == 0.0


def test_capacity_drops_late_tokens_and_counts_them():
    k, factor = 2, 0.5
    layer = _layer(experts_per_token=k, capacity_factor=factor)
    x = _x()
    _, chosen = dense_reference(_params(layer), x, k)
    slots = int(np.ceil(factor * chosen.size / E))
    taken, kept = np.zeros(E, int), np.zeros(chosen.shape, "float32")
    for n in range(chosen.shape[0]):  # earlier tokens first, a token's choices in order
        for j, e in enumerate(chosen[n]):
            kept[n, j] = taken[e] < slots
            taken[e] += 1
    expected, _ = dense_reference(_params(layer), x, k, kept=kept)
    y = keras.ops.convert_to_numpy(layer(x, training=True))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert (kept == 0).sum() > 0
    assert float(layer.dropped) == (kept == 0).sum()
    assert expert_load(layer)[layer.path]["dropped_tokens"] == (kept == 0).sum()


def test_losses_and_load_of_one_call():
    layer = _layer(experts_per_token=2, aux_loss_weight=0.1, z_loss_weight=0.01)
    x = _x()
    layer(x)
    assert layer.losses == [] and float(layer.load[0]) == 0  # inference records nothing
    layer(x, training=True)
    params = _params(layer)
    logits = x.reshape(-1, D) @ params[0]
    _, chosen = dense_reference(params, x, 2)
    counts = np.bincount(chosen.ravel(), minlength=E)
    aux = load_balance_loss(jax.nn.softmax(logits), counts)
    np.testing.assert_allclose([float(v) for v in layer.losses],
                               [0.1 * float(aux), 0.01 * float(z_loss(logits))], rtol=1e-6)
    load = expert_load(layer)[layer.path]
    np.testing.assert_allclose([load["min_share"], load["max_share"]],
                               [counts.min() / chosen.size, counts.max() / chosen.size],
                               rtol=1e-7)  # float32 shares


def test_model_training_loss_adds_every_layers_weighted_losses():
    backbone = GPTBackbone(**TINY_GPT, moe={"num_experts": 4, "aux_loss_weight": 0.5,
                                            "every": 2})
    lm = GPTCausalLM(backbone)
    lm.compile(optimizer=keras.optimizers.SGD(0.0))
    x = np.random.default_rng(0).integers(0, 256, (4, 17)).astype("int32")
    lm(x[:, :-1], training=True)  # eagerly: the losses each MoE layer adds
    extra = sum(float(v) for v in lm.losses)
    assert len(lm.losses) == 2 and extra > 0.5  # one MoE block: aux >= k x 0.5, and z
    evaluated = float(lm.test_on_batch(x[:, :-1], x[:, 1:]))  # no auxiliary losses
    trained = float(lm.train_on_batch(x[:, :-1], x[:, 1:]))
    np.testing.assert_allclose(trained - evaluated, extra, rtol=1e-5)


def test_config_round_trips_and_places_moe_blocks():
    backbone = GPTBackbone(**TINY_GPT, moe={"num_experts": 4, "every": 2, "router": "sigmoid"})
    again = GPTBackbone.from_config(backbone.get_config())
    assert again.moe == backbone.moe and again.moe["experts_per_token"] == 2
    kinds = [type(block.mlp).__name__ for block in again.blocks]
    assert kinds == ["MLP", "MoEFeedForward"]
    assert again.blocks[1].mlp.gate.logical_axes == ("expert", "embed", "mlp")


@pytest.mark.parametrize("moe,message", [
    ({"num_experts": 4, "experts_per_token": 5}, "cannot choose more experts"),
    ({"num_experts": 4, "top_k": 2}, "unknown keys"),
    ({"num_experts": 4, "router": "hash"}, "router"),
    ({"num_experts": 4, "capacity_factor": 0}, "capacity_factor"),
    ({"num_experts": 4, "balance_bias_rate": -0.001}, "balance_bias_rate"),
    ({"num_experts": 4, "balance_bias_rate": "0.1"}, "balance_bias_rate"),
    ({"num_experts": 4, "renormalize": 0}, "renormalize"),
    ({"num_experts": 4, "routed_scale": 0}, "routed_scale"),
    ({"num_experts": 4, "routed_scale": True}, "routed_scale"),
    ({"num_experts": 4, "activation": "relu"}, "activation"),
])
def test_wrong_moe_configs_are_refused(moe, message):
    with pytest.raises(ValueError, match=message):
        check_moe(moe, 2, 8)


def test_a_scanned_moe_stack_trains_like_unstacked_blocks():
    """The stack's layers each read and update their row of the stacked load statistics and
    balance bias, and add their losses outside the scan: the same training, statistics and
    greedy decoding (which routes with the bias) as unstacked blocks."""
    from kdist.models.stacking import match_layer_layout, unstack_layer_weights
    from tests.helpers import token_batches, train, weights

    moe = {"num_experts": 4, "expert_dim": 32, "balance_bias_rate": 0.01}

    def gpt(scan):
        keras.utils.set_random_seed(0)
        return GPTCausalLM(GPTBackbone(**TINY_GPT, scan_layers=scan, moe=moe))

    unstacked, stacked = gpt(False), gpt(True)
    values = match_layer_layout(weights(unstacked), {w.path: w.shape for w in stacked.weights})
    for w in stacked.weights:
        w.assign(values[w.path])
    batches = token_batches(3)
    np.testing.assert_allclose(train(stacked, batches), train(unstacked, batches), rtol=2e-6)
    back = unstack_layer_weights(weights(stacked))
    for path, value in weights(unstacked).items():  # the statistics and the bias too
        np.testing.assert_allclose(back[path], value, rtol=0, atol=2e-6, err_msg=path)
    assert np.abs(back["block_1/moe/balance_bias"]).max() > 0  # the bias moved
    load = expert_load(stacked)  # shares of 256 assignments: exact
    assert load == expert_load(unstacked) and list(load) == ["block_0/moe", "block_1/moe"]
    prompt = batches[0][0][:2, :4]
    np.testing.assert_array_equal(stacked.generate(prompt, 10, sampler="greedy"),
                                  unstacked.generate(prompt, 10, sampler="greedy"))


def test_scanned_stacks_refuse_mixed_blocks_also_where_a_pipeline_stacks_them():
    with pytest.raises(ValueError, match="every'\\]=2 mixes dense and MoE blocks"):
        GPTBackbone(**TINY_GPT, scan_layers=True, moe={"num_experts": 4, "every": 2})
    keras.distribution.set_distribution(kdist.distribution("stage=2,data=4"))
    with pytest.raises(ValueError, match="every'\\]=2 mixes dense and MoE blocks"):
        GPTBackbone(**TINY_GPT, moe={"num_experts": 4, "every": 2})  # stacked by default
    backbone = GPTBackbone(**TINY_GPT, moe={"num_experts": 4})  # MoE in every block: stacked
    assert isinstance(backbone.blocks, LayerStack)


def test_int8_experts_are_quantized_like_projections_each_expert_its_own():
    """Each expert's (or block's) product is the projections' int8 matmul of its rows and
    its weights, forward and both gradients bit for bit; the blocked dropless layer and the
    capacity path group rows differently but scale per token and per expert channel, so
    their forwards agree to float32 rounding."""
    from kdist.parallel.experts import batched_matmul
    from kdist.precision import int8_matmul

    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 5, 16)).astype("float32"), rng.normal(size=(3, 16, 8))
    w = w.astype("float32")

    def loss(f):
        return lambda a, b: jnp.sum(jnp.sin(f(a, b)))

    looped = jax.jit(jax.value_and_grad(loss(lambda a, b: jnp.stack(
        [int8_matmul(a[i], b[i]) for i in range(3)])), argnums=(0, 1)))(x, w)
    batched = jax.jit(jax.value_and_grad(loss(lambda a, b: batched_matmul(a, b, "int8")),
                                         argnums=(0, 1)))(x, w)
    for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(looped)):
        np.testing.assert_array_equal(got, want)
    exact = jax.jit(jax.value_and_grad(loss(lambda a, b: jnp.einsum("ncd,ndf->ncf", a, b)),
                                       argnums=(0, 1)))(x, w)
    assert 0 < np.abs(batched[1][1] - exact[1][1]).max() < 0.05 * np.abs(exact[1][1]).max()

    tokens = rng.normal(size=(64, D)).astype("float32")
    experts = np.stack([rng.choice(E, 2, replace=False) for _ in range(64)]).astype("int32")
    kernels = [rng.normal(size=s).astype("float32") * 0.3
               for s in ((E, D, F), (E, D, F), (E, F, D))]
    counts = jnp.zeros((E,), jnp.int32).at[experts.reshape(-1)].add(1)
    blocked = dropless(tokens, experts, counts, kernels, precision="int8")
    padded, dropped = capacity_limited(tokens, experts, counts, kernels, factor=float(E),
                                       precision="int8")
    assert int(dropped) == 0
    np.testing.assert_allclose(blocked, padded, rtol=1e-5, atol=1e-6)
    unquantized = dropless(tokens, experts, counts, kernels)
    assert 0 < np.abs(blocked - unquantized).max() < 0.05 * np.abs(unquantized).max()


def test_an_int8_moe_model_trains_like_bf16_within_quantization():
    from tests.helpers import token_batches, train

    def losses(precision):
        keras.utils.set_random_seed(0)
        lm = GPTCausalLM(GPTBackbone(**TINY_GPT, matmul_precision=precision,
                                     moe={"num_experts": 4, "expert_dim": 32}))
        assert lm.backbone.blocks[0].mlp.matmul_precision == precision
        return np.asarray(train(lm, token_batches(4)))

    bf16, int8 = losses("bf16"), losses("int8")
    # int8 codes are within 1/254 of their slice's peak: the losses of 4 steps agree to
    # 4.2e-5 relative (measured; 1e-3 is 24x that), and the loss falls as bf16's (0.07).
    np.testing.assert_allclose(int8, bf16, rtol=1e-3)
    assert not np.array_equal(int8, bf16) and int8[-1] < int8[0] - 0.05


def test_a_rematerialised_moe_block_trains_like_one_that_keeps_everything():
    x = np.random.default_rng(0).integers(0, 256, (4, 17)).astype("int32")
    losses = []
    for remat in (False, "block"):
        keras.utils.set_random_seed(0)
        lm = GPTCausalLM(GPTBackbone(**TINY_GPT, remat=remat, moe={"num_experts": 4}))
        lm.compile(optimizer=keras.optimizers.SGD(0.1))
        losses.append([float(lm.train_on_batch(x[:, :-1], x[:, 1:])) for _ in range(2)])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "gelu"])
def test_blocked_grouped_matmul_equals_ragged_dot_with_an_empty_expert(gated):
    from kdist.models.expert_compute import blocked, grouped

    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, D)).astype("float32")
    weights = [rng.normal(size=s).astype("float32") for s in ((E, D, F), (E, D, F), (E, F, D))]
    weights = weights if gated else weights[1:]  # (gate, up, down) or GELU's (up, down)
    sizes = jnp.asarray([13, 0, 20, 7], "int32")  # groups of sorted rows; expert 1 empty
    want = grouped(x, sizes, weights)
    for block in (4, 128):
        np.testing.assert_allclose(blocked(x, sizes, weights, block=block), want,
                                   rtol=1e-5, atol=1e-5)


def test_cost_model_counts_every_weight_and_the_active_ones():
    config = dict(TINY_GPT, num_layers=4, moe={"num_experts": 4, "every": 2,
                                               "shared_experts": 1, "expert_dim": 24})
    backbone = GPTBackbone(**config)
    cost = GPTCausalLM.cost_model_for(config)
    assert cost.parameters == sum(int(np.prod(w.shape)) for w in backbone.trainable_weights)
    d, experts, unchosen = TINY_GPT["hidden_dim"], 4, 2  # 2 of the 4 experts per token
    assert cost.parameters - cost.active_parameters == 2 * unchosen * 3 * d * 24
    dense = GPTCausalLM.cost_model_for(dict(TINY_GPT, num_layers=4)).flops_per_token(32)
    moe = cost.flops_per_token(32)
    # 2 MoE blocks: GELU MLP (2 x 2 D F) out; 3 active SwiGLU experts (2 x 3 D F') and
    # the router (2 D E) in.
    change = 2 * (2 * 3 * d * 24 * 3 + 2 * d * experts - 2 * 2 * d * TINY_GPT["intermediate_dim"])
    assert moe.forward - dense.forward == change


def test_the_cost_model_counts_gelu_experts_two_matrices_each():
    config = dict(TINY_GPT, moe={"num_experts": 4, "expert_dim": 24, "activation": "gelu",
                                 "shared_experts": 1})
    cost = GPTCausalLM.cost_model_for(config)
    assert cost.parameters == sum(int(np.prod(w.shape))
                                  for w in GPTBackbone(**config).trainable_weights)
    d, layers = TINY_GPT["hidden_dim"], TINY_GPT["num_layers"]
    assert cost.experts.parameters == layers * 2 * d * 24 * 4 and cost.experts.matrices == 2
    assert cost.parameters - cost.active_parameters == layers * 2 * 2 * d * 24  # 2 unchosen


def test_the_cost_model_names_the_moe_preset_not_its_dense_twin():
    from kdist.models import GPT_PRESETS

    for name in ("gpt-nano", "gpt-nano-moe"):
        config = GPTBackbone.full_config(GPT_PRESETS[name])
        if config["moe"]:  # as a built backbone's config has it
            config["moe"] = check_moe(config["moe"], 4, config["intermediate_dim"])
        assert GPTCausalLM.cost_model_for(config).preset() == name


def test_expert_load_reaches_the_epoch_logs():
    from kdist.callbacks import ExpertLoad

    lm = GPTCausalLM(GPTBackbone(**TINY_GPT, moe={"num_experts": 4, "capacity_factor": 0.5}))
    lm.compile(optimizer="adam")
    x = np.random.default_rng(0).integers(0, 256, (4, 17)).astype("int32")
    history = lm.fit(x[:, :-1], x[:, 1:], batch_size=4, epochs=1, verbose=0,
                     callbacks=[ExpertLoad()])
    logs = {k: v[0] for k, v in history.history.items()}
    assert 0 <= logs["moe_min_share"] <= 0.25 <= logs["moe_max_share"] <= 1
    assert logs["moe_dropped"] > 0  # half the capacity dropless would need: some dropped


def _biased(rate=0.1, k=2, router="sigmoid"):
    return _layer(experts_per_token=k, router=router, balance_bias_rate=rate)


def test_balance_bias_moves_against_the_load_and_only_in_training():
    layer, x = _biased(), _x()
    layer(x)  # inference: the bias stays
    assert not np.any(keras.ops.convert_to_numpy(layer.balance_bias))
    _, chosen = dense_reference(_params(layer), x, 2, "sigmoid")  # bias 0: unbiased choice
    counts = np.bincount(chosen.ravel(), minlength=E)
    layer(x, training=True)
    want = 0.1 * np.sign(chosen.size / E - counts)  # overloaded: down; underloaded: up
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer.balance_bias),
                                  want.astype("float32"))
    assert want.max() > 0 > want.min()  # an imbalanced batch: both directions exercised


def test_balance_bias_chooses_the_experts_but_does_not_weigh_them():
    layer, x = _biased(k=2), _x()
    bias = np.array([0.0, 0.0, 0.0, 5.0], "float32")  # expert 3 always chosen
    layer.balance_bias.assign(bias)
    tokens = x.reshape(-1, D)
    scores = np.asarray(jax.nn.sigmoid(tokens @ _params(layer)[0]))
    chosen = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :2]
    assert (chosen == 3).any(-1).all()
    expected, _ = dense_reference(_params(layer), x, 2, "sigmoid", chosen=chosen)  # unbiased
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(x)), expected,
                               rtol=1e-5, atol=1e-6)


def test_rate_zero_keeps_the_layer_as_it_was():
    off, on = _layer(), _biased(rate=1e-3, k=2, router="softmax")
    assert off.balance_bias is None and [v.path.rsplit("/", 1)[-1] for v in off.weights] == [
        "router", "gate", "up", "down", "expert_load", "dropped_tokens"]
    on.set_weights(off.get_weights() + [np.zeros(E, "float32")])
    x = _x()  # a zero bias chooses and weighs exactly as no bias: the same bits
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(on(x, training=True)),
                                  keras.ops.convert_to_numpy(off(x, training=True)))


def test_balance_bias_lowers_the_largest_share_over_steps():
    # The router is not trained here, the batch the same every step: only the bias moves
    # the load. Rates near the scores' spread (~0.01 here) overshoot; 0.002 settles.
    def max_shares(rate):
        keras.utils.set_random_seed(0)
        layer = _layer(experts_per_token=1, router="sigmoid", balance_bias_rate=rate)
        x = _x((4, 16, D), seed=4)
        shares = []
        for _ in range(8):
            layer(x, training=True)
            shares.append(expert_load(layer)[layer.path]["max_share"])
        return shares

    off, on = max_shares(0.0), max_shares(0.002)
    assert len(set(off)) == 1 and on[0] == off[0]  # same weights; no bias: same choice
    assert max(on[1:]) < off[0]  # measured: 0.328 off; 0.281-0.312 on


def test_balance_bias_config_round_trips():
    layer = _biased(rate=0.002)
    again = MoEFeedForward.from_config(layer.get_config())
    assert again.balance_bias_rate == 0.002
    backbone = GPTBackbone(**TINY_GPT, moe={"num_experts": 4, "balance_bias_rate": 0.001})
    assert GPTBackbone.from_config(backbone.get_config()).moe["balance_bias_rate"] == 0.001
    assert backbone.blocks[0].mlp.balance_bias.dtype == "float32"
