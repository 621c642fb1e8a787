"""Performance options of the GPT blocks: remat policies and the fused QKV projection give
the same training as the defaults."""

import keras
import numpy as np
import pytest

from kdist.models import GPTBackbone, GPTCausalLM
from tests.helpers import TINY_GPT, TINY_LLAMA, tiny_gpt, token_batches, train
from tests.parallel.harness import assert_trains_like_one_device


@pytest.mark.parametrize("remat", ["block", "save_dots", "minimal", "auto"])
def test_remat_policies_train_like_no_remat(remat):
    batches = token_batches(3)
    plain = train(tiny_gpt(seed=1), batches)
    rematted = train(tiny_gpt(seed=1, remat=remat), batches)
    np.testing.assert_allclose(rematted, plain, rtol=2e-6)


def test_unknown_remat_is_refused():
    with pytest.raises(ValueError, match="save_dots"):
        GPTBackbone(**TINY_GPT, remat="everything")


def _fused_copy(unfused: GPTCausalLM) -> GPTCausalLM:
    """The same model with a fused QKV projection holding the unfused weights."""
    config = unfused.backbone.get_config()
    fused = GPTCausalLM(GPTBackbone.from_config({**config, "fused_qkv": True}))
    n, k = config["num_heads"], config.get("num_key_value_heads") or config["num_heads"]
    g = n // k
    source = {w.path: w.numpy() for w in unfused.weights}
    for w in fused.weights:
        if "/qkv/" not in w.path:
            w.assign(source[w.path])
            continue
        prefix, kind = w.path.rsplit("/qkv/", 1)
        q, kk, v = (source[f"{prefix}/{name}/{kind}"] for name in ("query", "key", "value"))
        # query (..., N, H) -> (..., K, G, H); then key and value as the last two of G + 2.
        q = q.reshape(q.shape[:-2] + (k, g, q.shape[-1]))
        w.assign(np.concatenate([q, kk[..., None, :], v[..., None, :]], axis=-2))
    return fused


@pytest.mark.parametrize("config", [TINY_GPT, TINY_LLAMA], ids=["gpt", "llama-gqa"])
def test_fused_qkv_matches_unfused(config):
    keras.utils.set_random_seed(0)
    unfused = GPTCausalLM(GPTBackbone(**config))
    fused = _fused_copy(unfused)
    assert any("attention/qkv/kernel" in w.path for w in fused.weights)
    x, _ = token_batches(1)[0]
    np.testing.assert_allclose(fused.predict_on_batch(x), unfused.predict_on_batch(x),
                               rtol=2e-6, atol=2e-6)
    batches = token_batches(2)
    np.testing.assert_allclose(train(fused, batches), train(unfused, batches), rtol=2e-6)
    if config is TINY_LLAMA:  # the key/value cache path uses the fused projection too
        prompt = x[:1, :4]
        np.testing.assert_array_equal(fused.generate(prompt, 8, sampler="greedy"),
                                      unfused.generate(prompt, 8, sampler="greedy"))


def test_fused_qkv_shards_under_tensor_parallelism():
    lm = tiny_gpt("data=2,fsdp=2,model=2", fused_qkv=True, num_key_value_heads=4)
    kernel = next(w for w in lm.weights if w.path.endswith("attention/qkv/kernel"))
    assert kernel.shape == (64, 4, 4, 8)  # (D, K, G + 2, H)
    assert tuple(kernel.value.sharding.spec)[:2] == ("fsdp", "model")
    losses = train(lm, token_batches(2))
    assert np.isfinite(losses).all()


def _padded_copy(plain: GPTCausalLM, multiple: int, **kwargs) -> GPTCausalLM:
    """The same model with its token table padded to ``multiple`` rows (random padding)."""
    config = plain.backbone.get_config()
    padded = GPTCausalLM(GPTBackbone.from_config({**config, "vocabulary_divisible_by": multiple}),
                         **kwargs)
    source = {w.path: w.numpy() for w in plain.weights}
    rng = np.random.default_rng(1)
    for w in padded.weights:
        value = source[w.path]
        if w.shape != value.shape:  # the token table: real rows, then padding
            value = np.concatenate([value, rng.normal(size=(w.shape[0] - value.shape[0],
                                                            value.shape[1]))]).astype("float32")
        w.assign(value)
    return padded


@pytest.mark.parametrize("loss_chunk_size", [None, 4])
def test_padded_vocabulary_computes_the_same_function(loss_chunk_size):
    keras.utils.set_random_seed(0)
    plain = GPTCausalLM(GPTBackbone(**{**TINY_GPT, "vocabulary_size": 250}),
                        loss_chunk_size=loss_chunk_size)
    padded = _padded_copy(plain, 128, loss_chunk_size=loss_chunk_size)
    assert padded.backbone.token_embedding.embeddings.shape == (256, 64)
    batches = token_batches(3, vocab=250)
    x, _ = batches[0]
    logits = padded.predict_on_batch(x)
    assert logits.shape == (8, 16, 250)  # the padding rows are cut from the logits
    assert padded.output.shape[-1] == 250  # and the functional model says so
    np.testing.assert_allclose(logits, plain.predict_on_batch(x), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(train(padded, batches), train(plain, batches), rtol=2e-6)
    config = padded.backbone.get_config()
    assert GPTBackbone.from_config(config).vocabulary_divisible_by == 128
    np.testing.assert_array_equal(padded.generate(x[:1, :4], 8, sampler="greedy"),
                                  plain.generate(x[:1, :4], 8, sampler="greedy"))


def test_padding_lets_an_odd_vocabulary_shard_over_model():
    import kdist

    odd = {**TINY_GPT, "vocabulary_size": 251}  # prime: no model axis divides it
    keras.distribution.set_distribution(kdist.distribution("fsdp=4,model=2"))
    with pytest.raises(ValueError, match="vocabulary_size=251 is not divisible by the 'model'"
                                         ".*vocabulary_divisible_by=128"):
        GPTBackbone(**odd)
    assert_trains_like_one_device("gpt", "fsdp=4,model=2",
                                  config={**odd, "vocabulary_divisible_by": 128})
