"""Qwen3's attention as GPT options: an explicit ``head_dim`` (N x H need not be D) and
per-head query/key RMSNorms before RoPE (``qk_norm``), against a NumPy reference, with
their weights, sharding, config round trip, cached generation and cost model."""

import keras
import numpy as np
import pytest

from kdist.models import GPT_PRESETS, GPTBackbone, GPTCausalLM
from kdist.models.attention import CausalSelfAttention
from kdist.planning import traffic
from tests.helpers import TINY_GPT, TINY_LLAMA, tiny_gpt, uncached_greedy
from tests.parallel.harness import assert_trains_like_one_device

QWEN = dict(TINY_LLAMA, head_dim=12, qk_norm=True)  # 8 heads x 12 = 96 wide, D = 64


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def test_attention_normalises_each_query_and_key_head_before_rope():
    rng = np.random.default_rng(0)
    layer = CausalSelfAttention(4, 6, num_key_value_heads=2, rotary_max_wavelength=10000.0,
                                use_bias=False, qk_norm=True, qk_norm_epsilon=1e-5)
    x = rng.normal(size=(2, 5, 16)).astype("float32")
    layer.build(x.shape)
    for norm in (layer.query_norm, layer.key_norm):
        norm.scale.assign(rng.normal(1.0, 0.5, size=6).astype("float32"))
    weights = {w.path.split("/", 1)[1]: w.numpy() for w in layer.weights}
    q = _rms(np.einsum("btd,dnh->btnh", x, weights["query/kernel"]),
             weights["query_norm/scale"], 1e-5)
    k = _rms(np.einsum("btd,dnh->btnh", x, weights["key/kernel"]),
             weights["key_norm/scale"], 1e-5)
    v = np.einsum("btd,dnh->btnh", x, weights["value/kernel"])
    q, k = (np.asarray(layer.rotate(a)) for a in (q, k))  # RoPE: tests/models/test_rope.py
    k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)  # query head n: KV head n // 2
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(6)
    scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bnqk,bknh->bqnh", probs, v)
    want = np.einsum("btnh,nhd->btd", out, weights["attention_output/kernel"])
    np.testing.assert_allclose(np.asarray(layer(x)), want, rtol=0, atol=2e-5)

    config = layer.get_config()
    assert (config["qk_norm"], config["qk_norm_epsilon"]) == (True, 1e-5)
    assert CausalSelfAttention.from_config(config).get_config() == config


def test_without_the_options_nothing_changes():
    backbone = GPTBackbone(**TINY_LLAMA)
    config = backbone.get_config()
    assert (config["head_dim"], config["qk_norm"], backbone.head_dim) == (None, False, 8)
    assert not any("_norm/scale" in w.path and "/attention/" in w.path
                   for w in backbone.weights)
    layer = CausalSelfAttention(2, 4)
    layer.build((1, 3, 8))
    assert layer.query_norm is None and not layer.get_config()["qk_norm"]


def test_weights_sharding_and_config_round_trip(tmp_path):
    lm = tiny_gpt("data=2,fsdp=2,model=2", **QWEN)
    weights = {w.path: w for w in lm.weights}
    at = "block_0/attention/"
    assert weights[at + "query/kernel"].shape == (64, 8, 12)
    assert weights[at + "key/kernel"].shape == (64, 4, 12)
    assert weights[at + "attention_output/kernel"].shape == (8, 12, 64)
    for name in ("query_norm", "key_norm"):  # (H,): never over model (ZeRO-3 splits it)
        norm = weights[f"{at}{name}/scale"]
        assert norm.shape == (12,) and norm.logical_axes == ("head_dim",)
        assert tuple(norm.value.sharding.spec) == ("fsdp",)
    assert tuple(weights[at + "query/kernel"].value.sharding.spec)[:2] == ("fsdp", "model")
    config = lm.backbone.get_config()
    assert (config["head_dim"], config["qk_norm"], lm.backbone.head_dim) == (12, True, 12)
    assert GPTBackbone.from_config(config).get_config() == config
    lm.save(tmp_path / "qwen.keras")
    x = np.arange(8, dtype="int32")[None]
    restored = keras.saving.load_model(tmp_path / "qwen.keras")
    np.testing.assert_array_equal(np.asarray(restored(x)), np.asarray(lm(x)))


def test_trains_like_one_device_under_tensor_parallelism():
    assert_trains_like_one_device("llama", "data=2,fsdp=2,model=2",
                                  config=dict(head_dim=12, qk_norm=True))


def test_cached_generation_equals_uncached_greedy():
    model = tiny_gpt(**QWEN)
    prompt = np.random.default_rng(1).integers(0, 256, (2, 5)).astype("int32")
    cached = model.generate(prompt, max_length=12, sampler="greedy")
    np.testing.assert_array_equal(cached, uncached_greedy(model, prompt, 12))


@pytest.mark.parametrize("overrides, message", [
    (dict(head_dim=True), "head_dim must be"),
    (dict(head_dim=0), "head_dim must be"),
    (dict(TINY_LLAMA, head_dim=7), "even with rotary"),
    (dict(hidden_dim=60), "or pass head_dim explicitly"),
    (dict(qk_norm="yes"), "qk_norm must be True"),
])
def test_wrong_head_dims_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTBackbone(**{**TINY_GPT, **overrides})


def test_a_width_heads_do_not_divide_works_with_head_dim():
    backbone = GPTBackbone(**{**TINY_LLAMA, "hidden_dim": 60, "head_dim": 8})
    assert backbone(np.zeros((1, 4), "int32")).shape == (1, 4, 60)


def test_cost_model_counts_the_heads_as_configured():
    config = dict(QWEN, moe={"num_experts": 4, "every": 2, "expert_dim": 24})
    backbone = GPTBackbone(**config)
    cost = GPTCausalLM.cost_model_for(config)
    assert cost.parameters == sum(int(np.prod(w.shape)) for w in backbone.trainable_weights)
    d, n, k, h, layers = 64, 8, 4, 12, 2
    flops = cost.flops_per_token(32)
    assert flops.qkv == layers * 2 * d * (n + 2 * k) * h
    assert flops.output_projection == layers * 2 * n * h * d


def test_activation_estimate_counts_queries_n_heads_wide():
    """Queries and the attention output are N x H wide (96 here, D = 64): what the backward
    pass keeps grows by exactly those widths, and a head_dim equal to D / N changes
    nothing."""
    wide, plain = (GPTCausalLM.cost_model_for(c) for c in (QWEN, TINY_LLAMA))
    same = GPTCausalLM.cost_model_for(dict(TINY_LLAMA, head_dim=8))
    layers, d, q, kv, kv_wide = 2, 64, 96, 4 * 8, 4 * 12
    # In float32 values per layer: q, k, v counted 3Q and the output Q without remat; q,
    # k, v (Q + 2 K H) and the output Q kept by "minimal"; q, k, v by "save_dots".
    for remat, extra in ((False, 4 * (q - d)), ("minimal", 2 * (q - d) + 2 * (kv_wide - kv)),
                         ("save_dots", (q - d) + 2 * (kv_wide - kv))):
        grown = (wide.activation_bytes_per_token(32, remat=remat)
                 - plain.activation_bytes_per_token(32, remat=remat))
        assert grown == layers * 4 * extra, remat
        assert (same.activation_bytes_per_token(32, remat=remat)
                == plain.activation_bytes_per_token(32, remat=remat))


def test_the_qwen3_preset_has_the_published_size_and_plans_its_heads():
    # Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active (its model card).
    preset = GPT_PRESETS["qwen3-30b-a3b"]
    cost = GPTCausalLM.cost_model_for(preset)
    assert abs(cost.parameters / 30.53e9 - 1) < 0.01
    assert abs(cost.active_parameters / 3.35e9 - 1) < 0.01
    # The keys and values crossing the seq axis are K x 128 wide, not K x 2048 / 32.
    keys = 1024 * 4 * 128 * 2  # one layer's keys of one 1024-token row, K x H, bf16
    assert traffic.gathered_kv_bytes(preset, 1, 1024, 1, 2, 48) == 48 * 2 * keys
    gathered = traffic.context_terms(preset, 2, 1, 1, 1024, 2, "all_gather")[0]
    assert gathered.bytes == 48 * 2 * 0.5 * keys  # keys and values, (s - 1) / s of them
