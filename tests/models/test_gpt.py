"""GPT: shapes, config and file round-trips, remat, precision, generation."""

import keras
import numpy as np
import pytest

import kdist
from kdist.models import GPT_PRESETS, GPTBackbone, GPTCausalLM
from tests.helpers import TINY_GPT, tiny_gpt, token_batches, train, uncached_greedy


def test_forward_shapes_and_dtypes():
    model = tiny_gpt()
    logits = model(np.zeros((2, 16), "int32"))
    assert logits.shape == (2, 16, TINY_GPT["vocabulary_size"])
    assert logits.dtype == "float32"
    assert model.backbone(np.zeros((2, 16), "int32")).shape == (2, 16, 64)


def test_causality():
    model = tiny_gpt()
    x = np.random.default_rng(0).integers(0, 256, (1, 16)).astype("int32")
    y = x.copy()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    a, b = np.asarray(model(x)), np.asarray(model(y))
    np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_config_round_trip():
    backbone = GPTBackbone(**TINY_GPT, dropout=0.1, remat=True)
    config = backbone.get_config()
    assert GPTBackbone.from_config(config).get_config() == config
    lm = GPTCausalLM(backbone)
    assert GPTCausalLM.from_config(lm.get_config()).get_config() == lm.get_config()


def test_keras_file_round_trip(tmp_path):
    model = tiny_gpt()
    train(model, token_batches(1))
    path = tmp_path / "gpt.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, GPTCausalLM)
    x = np.arange(16, dtype="int32")[None]
    np.testing.assert_array_equal(np.asarray(restored(x)), np.asarray(model(x)))
    # Compiled on load with the same optimizer state: training continues identically.
    assert type(restored.optimizer) is type(model.optimizer) is kdist.optim.AdamW
    (x, y), = token_batches(1, seed=5)
    assert float(restored.train_on_batch(x, y)) == float(model.train_on_batch(x, y))


def test_presets():
    assert set(GPT_PRESETS) >= {"gpt-nano", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"}
    with pytest.raises(ValueError, match="Unknown preset 'gpt5'.*gpt-nano"):
        GPTCausalLM.from_preset("gpt5")
    # gpt2-small has the published 124M parameters (tied embeddings).
    config = GPT_PRESETS["gpt2-small"]
    d, f, n_layers = config["hidden_dim"], config["intermediate_dim"], config["num_layers"]
    block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    embeddings = (config["vocabulary_size"] + config["max_sequence_length"]) * d
    total = embeddings + n_layers * block + 2 * d
    assert 124_000_000 < total < 124_500_000


def test_sequence_longer_than_maximum_is_refused():
    model = tiny_gpt()
    model.compile(optimizer="adamw")
    x = np.zeros((8, 33), "int32")
    with pytest.raises(ValueError, match="Sequence length 33 exceeds .* max_sequence_length 32"):
        model.train_on_batch(x, x)


def test_remat_computes_the_same_training():
    batches = token_batches(2)
    plain = train(tiny_gpt(), batches)
    keras.utils.clear_session()
    rematerialised = tiny_gpt(remat=True)
    assert all(block.remat for block in rematerialised.backbone.blocks)
    np.testing.assert_allclose(train(rematerialised, batches), plain, rtol=1e-6)


def test_mixed_bfloat16_keeps_float32_where_it_matters():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tiny_gpt()
    assert {w.dtype for w in model.weights} == {"float32"}
    assert model(np.zeros((1, 8), "int32")).dtype == "float32"
    block = model.backbone.blocks[0]
    assert block.attention.query.compute_dtype == "bfloat16"
    assert block.attention_norm(np.ones((1, 2, 64), "float32")).dtype == "bfloat16"


@pytest.mark.parametrize("mesh, batch", [(None, 8), ("data=2,fsdp=2,model=2", 8), ("fsdp=8", 1)])
def test_cached_generation_equals_uncached_greedy(mesh, batch):
    model = tiny_gpt(mesh)
    train(model, token_batches(3))  # trained a little so the argmax is not degenerate
    prompt = np.random.default_rng(1).integers(0, 256, (batch, 5)).astype("int32")
    cached = model.generate(prompt, max_length=20, sampler="greedy")
    np.testing.assert_array_equal(cached, uncached_greedy(model, prompt, 20))
    assert len(np.unique(cached[:, 5:])) > 1


def test_sampling_is_seeded_and_bad_arguments_are_refused():
    model = tiny_gpt()
    prompt = np.zeros((2, 3), "int32")
    a = model.generate(prompt, max_length=12, sampler="random", seed=3)
    b = model.generate(prompt, max_length=12, sampler="random", seed=3)
    np.testing.assert_array_equal(a, b)
    unseeded = [model.generate(prompt, max_length=12, sampler="random") for _ in range(2)]
    assert not np.array_equal(*unseeded)  # the RNG advances between unseeded calls
    _, run = model._generators[("random", 3)]
    assert run._cache_size() == 1  # one compilation served both seeded calls
    assert model.generate(prompt, max_length=12, sampler="top_p", seed=1).shape == (2, 12)
    with pytest.raises(ValueError, match="max_length=40 must exceed .* at most .* 32"):
        model.generate(prompt, max_length=40)
    with pytest.raises(ValueError, match="Unknown sampler 'beam2'"):
        model.generate(prompt, max_length=8, sampler="beam2")


def test_kdist_imports_as_documented():
    assert kdist.models.GPTCausalLM is GPTCausalLM
