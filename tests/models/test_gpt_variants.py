"""The Llama-style configuration of the GPT model, and document-aware attention."""

import keras
import numpy as np
import pytest

import kdist
from kdist.models import GPT_PRESETS, GPTBackbone
from kdist.models.layers import CausalSelfAttention, document_mask_and_positions
from tests.helpers import TINY_LLAMA, tiny_gpt, token_batches, train, uncached_greedy


def test_llama_weights_are_the_configured_ones():
    model = tiny_gpt("data=2,fsdp=2,model=2", **TINY_LLAMA)
    paths = {w.path: w for w in model.weights}
    assert paths["block_0/attention/key/kernel"].shape == (64, 4, 8)  # 4 KV heads of 8 dims
    assert paths["block_0/attention/query/kernel"].shape == (64, 8, 8)
    assert "block_0/mlp/gate/kernel" in paths and "block_0/attention_norm/scale" in paths
    assert not any(p.endswith("bias") or p.endswith("beta") for p in paths)
    assert "position_embedding/embeddings" not in paths  # rotary
    head = paths["token_embedding/reverse_embeddings"]  # untied output
    assert head.shape == (64, 256) and tuple(head.value.sharding.spec) == ("fsdp", "model")
    assert tuple(paths["block_0/attention/key/kernel"].value.sharding.spec) == (
        "fsdp", "model", None)


def test_fewer_kv_heads_than_the_model_axis_is_refused():
    keras.distribution.set_distribution(kdist.distribution("model=8"))
    with pytest.raises(ValueError, match="num_key_value_heads=4 is not divisible by the 'model'"):
        GPTBackbone(**TINY_LLAMA)


def test_rope_scores_depend_only_on_relative_position():
    attention = CausalSelfAttention(num_heads=2, head_dim=16, rotary_max_wavelength=10000.0)
    attention.build((None, None, 32))
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 6, 2, 16)).astype("float32")
    k = rng.normal(size=(1, 6, 2, 16)).astype("float32")

    def scores(offset):
        positions = np.arange(6)[None] + offset
        rq = attention.rotate(q, positions=positions)
        rk = attention.rotate(k, positions=positions)
        return np.einsum("btnh,bsnh->bnts", np.asarray(rq), np.asarray(rk))

    np.testing.assert_allclose(scores(37), scores(0), rtol=1e-4, atol=1e-4)
    assert not np.allclose(scores(0)[..., 0, 1], scores(0)[..., 0, 2])  # but not constant


def test_document_positions_and_mask():
    mask, positions = document_mask_and_positions(np.array([[0, 0, 0, 1, 1, 2]]))
    assert np.asarray(positions).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = np.asarray(mask)[0, 0]
    assert mask[4, 3] and not mask[3, 2] and not mask[5, 4]


@pytest.mark.parametrize("variant", [{}, TINY_LLAMA])
def test_document_logits_equal_each_document_alone(variant):
    model = tiny_gpt(**{**variant, "document_mask": True})
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 256, (1, 10)), rng.integers(0, 256, (1, 6))
    packed = np.concatenate([a, b], axis=1).astype("int32")
    segments = np.array([[0] * 10 + [1] * 6], "int32")
    logits = np.asarray(model({"token_ids": packed, "segment_ids": segments}))

    def alone(doc):
        return np.asarray(model({"token_ids": doc.astype("int32"),
                                 "segment_ids": np.zeros_like(doc, "int32")}))

    np.testing.assert_allclose(logits[:, :10], alone(a), atol=1e-5)
    np.testing.assert_allclose(logits[:, 10:], alone(b), atol=1e-5)


@pytest.mark.parametrize("mesh", [None, "data=2,fsdp=2,model=2"])
def test_gqa_rope_cached_generation_equals_uncached_greedy(mesh):
    model = tiny_gpt(mesh, **TINY_LLAMA)
    train(model, token_batches(3))
    prompt = np.random.default_rng(1).integers(0, 256, (8, 5)).astype("int32")
    cached = model.generate(prompt, max_length=20, sampler="greedy")
    np.testing.assert_array_equal(cached, uncached_greedy(model, prompt, 20))


def test_variant_config_and_file_round_trip(tmp_path):
    model = tiny_gpt(**{**TINY_LLAMA, "document_mask": True})
    config = model.backbone.get_config()
    assert GPTBackbone.from_config(config).get_config() == config
    model.save(tmp_path / "llama.keras")
    restored = keras.saving.load_model(tmp_path / "llama.keras")
    x = {"token_ids": np.arange(8, dtype="int32")[None], "segment_ids": np.zeros((1, 8), "int32")}
    np.testing.assert_array_equal(np.asarray(restored(x)), np.asarray(model(x)))


def test_llama_presets_have_the_published_sizes():
    # Parameters from the shapes alone (no weights): Llama 3.2 1B ~1.24 B, 3B ~3.2 B,
    # Llama 3.1 8B ~8.03 B.
    def count(p):
        d, f, layers = p["hidden_dim"], p["intermediate_dim"], p["num_layers"]
        kv = p["num_key_value_heads"] * d // p["num_heads"]
        block = d * d * 2 + 2 * d * kv + 3 * d * f + 2 * d
        embeddings = p["vocabulary_size"] * d * (1 if p["tie_embeddings"] else 2)
        return embeddings + layers * block + d

    assert abs(count(GPT_PRESETS["llama-1b"]) / 1.236e9 - 1) < 0.01
    assert abs(count(GPT_PRESETS["llama-3b"]) / 3.213e9 - 1) < 0.01
    assert abs(count(GPT_PRESETS["llama-8b"]) / 8.030e9 - 1) < 0.01
