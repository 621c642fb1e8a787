"""Hugging Face checkpoints into sharded kdist models, against keras-hub's own converters.

Checkpoints are written with numpy (tests/models/hf_fixtures.py): GPT-2, Llama 3.2-style
(GQA, llama3 RoPE scaling, untied head; stored as a 3-shard index) and BERT. keras-hub's
``*Backbone.from_preset(DIR)`` reads them with its independent mapping; kdist's must give
the same hidden states in float32 on 1 device and under fsdp=8 and data=2,fsdp=2,model=2.
"""

import keras
import keras_hub
import numpy as np
import pytest
from safetensors.numpy import load_file

import kdist
from kdist import _keras_compat
from kdist.models import BertBackbone, BertClassifier, BertMaskedLM, GPTBackbone, GPTCausalLM
from tests.models.hf_fixtures import write_checkpoint

MESHES = [None, "fsdp=8", "data=2,fsdp=2,model=2"]
IDS = np.random.default_rng(1).integers(0, 300, (2, 16)).astype("int32")
PAD = np.ones_like(IDS)
PAD[1, 12:] = 0  # BERT: a padded row
BERT_X = {"token_ids": IDS, "segment_ids": (np.arange(16) >= 8).astype("int32")[None]
          .repeat(2, 0), "padding_mask": PAD}
# keras-hub's BERT uses the tanh GELU, HF's the exact one: compared like for like here, the
# exact form against transformers in test_hf_transformers.py.
KDIST_OVERRIDES = {"gpt2": {}, "llama": {}, "bert": {"mlp_activation": "gelu"}}
KERAS_HUB = {"gpt2": "GPT2Backbone", "llama": "Llama3Backbone", "bert": "BertBackbone"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for family, shards in (("gpt2", 1), ("llama", 3), ("bert", 1)):
        write_checkpoint(root / family, family, shards=shards)
    return root


def hidden(model, family):
    if family == "bert":
        return np.asarray(model.predict_on_batch(BERT_X)["sequence_output"])
    return np.asarray(model.predict_on_batch(IDS))


@pytest.fixture(scope="module")
def keras_hub_hidden(checkpoints):
    out = {}
    for family, name in KERAS_HUB.items():
        keras.distribution.set_distribution(None)
        backbone = getattr(keras_hub.models, name).from_preset(str(checkpoints / family))
        x = BERT_X if family == "bert" else {"token_ids": IDS, "padding_mask": np.ones_like(IDS)}
        y = backbone.predict_on_batch(x)
        out[family] = np.asarray(y["sequence_output"] if family == "bert" else y)
        keras.utils.clear_session()
    return out


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_hidden_states_match_keras_hub(family, mesh, checkpoints, keras_hub_hidden):
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    cls = BertBackbone if family == "bert" else GPTBackbone
    backbone = cls.from_pretrained(checkpoints / family, dropout=0.0, **KDIST_OVERRIDES[family])
    got, want = hidden(backbone, family), keras_hub_hidden[family]
    rows = (slice(None), slice(None)) if family != "bert" else (0, slice(None))
    np.testing.assert_allclose(got[rows], want[rows], rtol=0, atol=1e-5)
    if family == "bert":  # the padded row: real positions only
        np.testing.assert_allclose(got[1, :12], want[1, :12], rtol=0, atol=1e-5)
    assert np.abs(want).max() > 1  # not a vacuous comparison
    if mesh:  # loaded into the sharded variables, not replicated
        table = backbone.token_embedding.embeddings.value
        assert tuple(table.sharding.spec) == (("model" if "model" in mesh else None), "fsdp")


def test_the_fidelity_options_are_what_makes_them_agree(checkpoints, keras_hub_hidden):
    # Without llama3 RoPE scaling, or with the wrong GELU, the functions differ visibly.
    plain = GPTBackbone.from_pretrained(checkpoints / "llama", rope_scaling=None)
    assert np.abs(hidden(plain, "llama") - keras_hub_hidden["llama"]).max() > 0.1
    exact = BertBackbone.from_pretrained(checkpoints / "bert", dropout=0.0)  # HF's erf GELU
    assert exact.mlp_activation == "gelu_exact"
    assert np.abs(hidden(exact, "bert")[0] - keras_hub_hidden["bert"][0]).max() > 1e-4
    assert GPTBackbone.from_pretrained(checkpoints / "llama").layer_norm_epsilon == 1e-6


def test_causal_lm_heads_tied_and_untied(checkpoints):
    for family, head in (("gpt2", "transformer.wte.weight"), ("llama", "lm_head.weight")):
        keras.distribution.set_distribution(kdist.distribution("data=2,fsdp=2,model=2"))
        lm = GPTCausalLM.from_pretrained(checkpoints / family, dropout=0.0)
        assert lm.backbone.tie_embeddings == (family == "gpt2")
        tensors = {}
        for file in sorted((checkpoints / family).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        logits = np.asarray(lm.predict_on_batch(IDS))
        assert logits.shape == (2, 16, 300)  # the padding rows (300 -> 384) are cut
        want = hidden(lm.backbone, family) @ tensors[head].T
        np.testing.assert_allclose(logits, want, rtol=0, atol=2e-5)
        keras.utils.clear_session()


def gelu(x):
    from scipy.special import erf

    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def layer_norm(x, gamma, beta, eps=1e-12):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def test_bert_heads(checkpoints, tmp_path):
    t = load_file(str(checkpoints / "bert" / "model.safetensors"))
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    mlm = BertMaskedLM.from_pretrained(checkpoints / "bert", dropout=0.0)
    positions = np.array([[1, 5, 9], [0, 3, 11]], "int32")
    logits = np.asarray(mlm.predict_on_batch({**BERT_X, "mask_positions": positions}))
    sequence = hidden(mlm.backbone, "bert")
    x = np.take_along_axis(sequence, positions[..., None], 1)
    p = "cls.predictions."
    x = gelu(x @ t[p + "transform.dense.weight"].T + t[p + "transform.dense.bias"])
    x = layer_norm(x, t[p + "transform.LayerNorm.weight"], t[p + "transform.LayerNorm.bias"])
    want = x @ t["bert.embeddings.word_embeddings.weight"].T + t[p + "bias"]
    np.testing.assert_allclose(logits, want, rtol=0, atol=2e-5)

    # A classifier checkpoint: num_classes read from its head.
    write_checkpoint(tmp_path, "bert", tensors={
        **t, "classifier.weight": 0.2 * np.ones((3, 64), "float32"),
        "classifier.bias": np.arange(3, dtype="float32")})
    keras.utils.clear_session()
    keras.distribution.set_distribution(kdist.distribution("data=2,fsdp=2,model=2"))
    clf = BertClassifier.from_pretrained(tmp_path, dropout=0.0, classifier_dropout=0.0)
    assert clf.num_classes == 3
    pooled = np.tanh(sequence[:, 0] @ t["bert.pooler.dense.weight"].T + t["bert.pooler.dense.bias"])
    want = pooled @ (0.2 * np.ones((3, 64))).T + np.arange(3)
    np.testing.assert_allclose(np.asarray(clf.predict_on_batch(BERT_X)), want, rtol=0, atol=2e-5)


def test_keys_without_the_base_prefix_and_old_buffers_load_the_same(checkpoints, tmp_path):
    # The original gpt2 upload: no "transformer." prefix, and causal-mask buffers stored.
    tensors = load_file(str(checkpoints / "gpt2" / "model.safetensors"))
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), "float32"))
    write_checkpoint(tmp_path / "bare", "gpt2", tensors=bare)
    # BERT converted from TensorFlow: LayerNorm gamma/beta, and no "bert." prefix.
    bert = load_file(str(checkpoints / "bert" / "model.safetensors"))
    old = {k.removeprefix("bert.").replace("LayerNorm.weight", "LayerNorm.gamma")
           .replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in bert.items()}
    write_checkpoint(tmp_path / "old-bert", "bert", tensors=old)
    for family, cls, directory in (("gpt2", GPTBackbone, "bare"), ("bert", BertBackbone,
                                                                   "old-bert")):
        a = cls.from_pretrained(checkpoints / family)
        b = cls.from_pretrained(tmp_path / directory)
        for wa, wb in zip(a.weights, b.weights):
            assert wa.path == wb.path
            np.testing.assert_array_equal(np.asarray(wa.value), np.asarray(wb.value))


def test_loading_builds_nothing_twice_and_leaves_keras_clean(checkpoints):
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    lm = GPTCausalLM.from_pretrained(checkpoints / "gpt2", dropout=0.0)
    assert _keras_compat.initialize_pending_variables() == 0  # none left pending
    lm.compile(optimizer=kdist.optim.adamw(1e-3, warmup_steps=1, decay_steps=4))
    x = np.random.default_rng(0).integers(0, 300, (8, 17)).astype("int32")
    losses = [float(lm.train_on_batch(x[:, :-1], x[:, 1:])) for _ in range(3)]
    assert np.isfinite(losses).all() and losses[2] < losses[0]


def test_fidelity_options_round_trip_in_config_and_keras_files(checkpoints, tmp_path):
    lm = GPTCausalLM.from_pretrained(checkpoints / "llama")
    assert lm.backbone.rope_scaling["rope_type"] == "llama3"
    bert = BertMaskedLM.from_pretrained(checkpoints / "bert")
    for model in (lm, bert):
        config = model.backbone.get_config()
        again = type(model.backbone).from_config(config)
        assert again.get_config() == config
        model.save(tmp_path / "m.keras")
        loaded = keras.saving.load_model(tmp_path / "m.keras", compile=False)
        x = IDS if model is lm else {**BERT_X, "mask_positions": np.zeros((2, 2), "int32")}
        np.testing.assert_array_equal(loaded.predict_on_batch(x), model.predict_on_batch(x))
    # Defaults are today's: tanh GELU, no RoPE scaling.
    assert GPTBackbone.full_config({})["rope_scaling"] is None
    assert BertBackbone.full_config({})["mlp_activation"] == "gelu"
