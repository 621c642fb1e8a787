"""Export to Hugging Face format from sharded models: bit-exact round trips, readable by
keras-hub's converters, refused where no HF model computes the same function."""

import json

import keras
import keras_hub
import numpy as np
import pytest
from safetensors.numpy import load_file

import kdist
from kdist.models import BertBackbone, BertClassifier, BertMaskedLM, GPTBackbone, GPTCausalLM
from tests.helpers import TINY_GPT
from tests.models.hf_fixtures import write_checkpoint


def stored(directory) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("family, cls, mesh", [
    ("gpt2", GPTCausalLM, "data=2,fsdp=2,model=2"),
    ("llama", GPTCausalLM, "fsdp=8"),
    ("bert", BertMaskedLM, "data=2,fsdp=2,model=2"),
])
def test_load_export_load_is_bit_exact(family, cls, mesh, tmp_path):
    source = write_checkpoint(tmp_path / "in", family, shards=2)
    keras.distribution.set_distribution(kdist.distribution(mesh))
    model = cls.from_pretrained(tmp_path / "in")
    # Small shards: the index and several files are written and read back.
    model.save_pretrained(tmp_path / "out", max_shard_bytes=64 * 1024)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 2
    out = stored(tmp_path / "out")
    # Every tensor a kdist weight came from is written back with the same bits; the tied
    # decoder copy BERT checkpoints carry is not re-written (HF ties it on load).
    expected = {k for k in source if k != "cls.predictions.decoder.weight"}
    assert set(out) == expected
    for key in expected:
        assert same_bits(out[key], source[key]), key
    again = cls.from_pretrained(tmp_path / "out")
    for a, b in zip(model.weights, again.weights):
        assert a.path == b.path and same_bits(np.asarray(a.value), np.asarray(b.value)), a.path
        assert a.value.sharding == b.value.sharding


def test_a_trained_kdist_model_exports_and_keras_hub_reads_it(tmp_path):
    # A kdist GPT trained a few steps under fsdp=8 (a pretraining run's model, small; MLP 4 x
    # width: keras-hub's GPT-2 converter ignores n_inner).
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    lm = GPTCausalLM(GPTBackbone(**{**TINY_GPT, "vocabulary_size": 300, "intermediate_dim": 256,
                                    "vocabulary_divisible_by": 128}))
    lm.compile(optimizer=kdist.optim.adamw(1e-2, warmup_steps=1, decay_steps=4))
    x = np.random.default_rng(0).integers(0, 300, (8, 17)).astype("int32")
    for _ in range(2):
        lm.train_on_batch(x[:, :-1], x[:, 1:])
    kdist.hf.export(lm, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 300
    assert stored(tmp_path)["transformer.wte.weight"].shape == (300, 64)  # padding rows cut
    ids = x[:2, :16]
    want = np.asarray(lm.backbone.predict_on_batch(ids))
    keras.distribution.set_distribution(None)
    theirs = keras_hub.models.GPT2Backbone.from_preset(str(tmp_path))
    got = theirs.predict_on_batch({"token_ids": ids, "padding_mask": np.ones_like(ids)})
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # ... and kdist reads it back into the exact weights. The table's 84 padding rows (never
    # an input, cut from the logits) are not part of the function: they come back as zeros.
    again = GPTCausalLM.from_pretrained(tmp_path)
    for a, b in zip(lm.weights, again.weights):
        a, b = np.asarray(a.value), np.asarray(b.value)
        if a.shape == (384, 64):
            a, b, padding = a[:300], b[:300], b[300:]
            assert not padding.any()
        assert same_bits(a, b)


def test_a_classifier_exports_its_head_and_labels(tmp_path):
    write_checkpoint(tmp_path / "in", "bert")
    backbone = BertBackbone.from_pretrained(tmp_path / "in")
    clf = BertClassifier(backbone, num_classes=4)  # a new head on a pretrained encoder
    clf.save_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["num_labels"] == 4 and len(config["id2label"]) == 4
    again = BertClassifier.from_pretrained(tmp_path / "out")
    assert again.num_classes == 4
    for a, b in zip(clf.weights, again.weights):
        assert same_bits(np.asarray(a.value), np.asarray(b.value)), a.path


def test_bfloat16_export_halves_the_file_and_loads(tmp_path):
    write_checkpoint(tmp_path / "in", "llama")
    lm = GPTCausalLM.from_pretrained(tmp_path / "in")
    lm.save_pretrained(tmp_path / "bf16", dtype="bfloat16")
    size = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert size < 0.51 * (tmp_path / "in" / "model.safetensors").stat().st_size
    again = GPTCausalLM.from_pretrained(tmp_path / "bf16")  # bfloat16 read, float32 weights
    table = np.asarray(again.backbone.token_embedding.embeddings.value)
    np.testing.assert_allclose(table, np.asarray(lm.backbone.token_embedding.embeddings.value),
                               rtol=1e-2, atol=1e-2)
    assert table.dtype == np.float32


def test_models_without_a_hugging_face_equivalent_are_refused(tmp_path):
    odd = GPTCausalLM(GPTBackbone(**{**TINY_GPT, "position_embedding": "rotary"}))
    with pytest.raises(ValueError, match="no Hugging Face equivalent: as gpt2: "
                                         "position_embedding='rotary'"):
        odd.save_pretrained(tmp_path)
    fused = GPTCausalLM(GPTBackbone(**{**TINY_GPT, "fused_qkv": True}))
    with pytest.raises(ValueError, match="fused_qkv=True"):
        fused.save_pretrained(tmp_path)
    mlm = BertMaskedLM.from_preset("bert-tiny", vocabulary_size=64, num_layers=1)
    with pytest.raises(ValueError, match="mlp_activation='gelu' .tanh GELU. has no Hugging Face"):
        mlm.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Sequential is not a kdist model with a Hugging "
                                         "Face format"):
        kdist.hf.export(keras.Sequential([keras.layers.Dense(2)]), tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        mlm.backbone.save_pretrained(tmp_path, dtype="int8")
    assert not (tmp_path / "config.json").exists()  # nothing half-written
