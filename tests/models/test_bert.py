"""BERT: padding, config and file round-trips, presets, weight loading. (Sharded training
equals one device's: the ``bert`` rows of tests/parallel/combinations.py.)"""

import jax
import keras
import numpy as np
import pytest

import kdist
from kdist.models import BERT_PRESETS, BertBackbone, BertClassifier, BertMaskedLM
from tests.bert_helpers import TINY_BERT, mlm_batches, tiny_bert_mlm, train_mlm
from tests.helpers import weights

BATCHES = mlm_batches(steps=3)


def encode(model, token_ids, padding_mask):
    x = {"token_ids": token_ids, "segment_ids": np.zeros_like(token_ids),
         "padding_mask": padding_mask}
    out = model.backbone(x)
    return np.asarray(out["sequence_output"]), np.asarray(out["pooled_output"])


def test_padding_is_honoured():
    model = tiny_bert_mlm()
    ids = np.random.default_rng(0).integers(5, 256, (2, 10)).astype("int32")
    seq, pooled = encode(model, ids, np.ones_like(ids))
    padded = np.pad(ids, ((0, 0), (0, 6)))  # six [PAD] (id 0) tokens appended
    mask = (np.arange(16) < 10).astype("int32")[None].repeat(2, 0)
    seq_padded, pooled_padded = encode(model, padded, mask)
    np.testing.assert_allclose(seq_padded[:, :10], seq, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled_padded, pooled, rtol=1e-5, atol=1e-6)
    # Attending to the padding would change them: the mask is what keeps them equal.
    seq_unmasked, _ = encode(model, padded, np.ones_like(padded))
    assert np.abs(seq_unmasked[:, :10] - seq).max() > 1e-3


def test_attention_is_bidirectional():
    model = tiny_bert_mlm()
    ids = np.random.default_rng(1).integers(5, 256, (1, 12)).astype("int32")
    changed = ids.copy()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    before, _ = encode(model, ids, np.ones_like(ids))
    after, _ = encode(model, changed, np.ones_like(ids))
    assert np.abs(before[0, 0] - after[0, 0]).max() > 1e-4  # the first token sees the last


def test_config_and_file_round_trips(tmp_path):
    backbone = BertBackbone(**TINY_BERT, dropout=0.1, remat=True)
    config = backbone.get_config()
    assert BertBackbone.from_config(config).get_config() == config
    mlm = BertMaskedLM(backbone)
    assert BertMaskedLM.from_config(mlm.get_config()).get_config() == mlm.get_config()
    clf = BertClassifier(BertBackbone(**TINY_BERT), num_classes=3, classifier_dropout=0.2)
    assert BertClassifier.from_config(clf.get_config()).get_config() == clf.get_config()

    model = tiny_bert_mlm()
    train_mlm(model, BATCHES[:1])
    model.save(tmp_path / "mlm.keras")
    restored = keras.saving.load_model(tmp_path / "mlm.keras")
    assert isinstance(restored, BertMaskedLM)
    x, y, w = BATCHES[1]
    np.testing.assert_array_equal(np.asarray(restored(x)), np.asarray(model(x)))
    assert float(restored.train_on_batch(x, y, sample_weight=w)[0]) == float(
        model.train_on_batch(x, y, sample_weight=w)[0])


def test_presets_have_the_published_shapes():
    expected = {"bert-tiny": (2, 128, 2), "bert-mini": (4, 256, 4), "bert-small": (4, 512, 8),
                "bert-base": (12, 768, 12), "bert-large": (24, 1024, 16)}
    for name, (layers, hidden, heads) in expected.items():
        config = BERT_PRESETS[name]
        assert (config["num_layers"], config["hidden_dim"], config["num_heads"]) == (
            layers, hidden, heads)
        assert config["intermediate_dim"] == 4 * hidden
        assert (config["max_sequence_length"], config["num_segments"]) == (512, 2)
    # BERT-base has 109,482,240 parameters (embeddings, 12 layers, pooler; no MLM head).
    # Counted from abstract shapes: nothing is allocated.
    shapes = jax.eval_shape(lambda: [w.value for w in BertBackbone.from_preset(
        "bert-base").weights])
    assert sum(int(np.prod(s.shape)) for s in shapes) == 109_482_240
    with pytest.raises(ValueError, match="Unknown preset 'bert-huge'.*bert-tiny"):
        BertMaskedLM.from_preset("bert-huge")


def test_bad_shapes_are_refused_before_building():
    with pytest.raises(ValueError, match="hidden_dim=60 must be divisible by num_heads=8"):
        BertBackbone(**{**TINY_BERT, "hidden_dim": 60})
    keras.distribution.set_distribution(kdist.distribution("data=2,model=4"))
    with pytest.raises(ValueError, match="num_heads=2 is not divisible by the 'model' mesh"):
        BertBackbone.from_preset("bert-tiny")
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2"):
        BertClassifier(BertBackbone(**TINY_BERT), num_classes=1)


def test_load_backbone_weights_exactly_and_refuse_a_mismatch(tmp_path):
    pretrained = tiny_bert_mlm()
    train_mlm(pretrained, BATCHES[:2])  # weights moved away from their initial values
    pretrained.save(tmp_path / "model.keras")
    saved = {w.path: np.asarray(w.value) for w in pretrained.backbone.weights}
    keras.utils.clear_session()

    # Into a sharded classifier built with another seed: every backbone weight bit-equal.
    keras.distribution.set_distribution(kdist.distribution("data=2,fsdp=2,model=2"))
    keras.utils.set_random_seed(7)
    clf = BertClassifier(BertBackbone(**TINY_BERT), num_classes=3)
    head = weights(clf)["classifier_head/kernel"]
    loaded = kdist.models.load_backbone_weights(clf, tmp_path)  # the run's directory
    assert sorted(loaded) == sorted(saved)
    for w in clf.backbone.weights:
        np.testing.assert_array_equal(np.asarray(w.value), saved[w.path], err_msg=w.path)
    np.testing.assert_array_equal(weights(clf)["classifier_head/kernel"], head)
    assert "fsdp" in str(clf.backbone.token_embedding.embeddings.value.sharding.spec)

    other = BertClassifier(BertBackbone(**{**TINY_BERT, "hidden_dim": 32}), num_classes=3)
    before = weights(other)
    with pytest.raises(ValueError, match=r"'token_embedding/embeddings' has shape \(256, 64\) "
                                         r"in the pretrained weights but \(256, 32\)"):
        kdist.models.load_backbone_weights(other, tmp_path / "model.keras")
    for path, value in weights(other).items():  # nothing was half-loaded
        np.testing.assert_array_equal(value, before[path])
    deeper = BertClassifier(BertBackbone(**{**TINY_BERT, "num_layers": 3}), num_classes=3)
    with pytest.raises(ValueError, match="'encoder_block_2/.*' .* is missing"):
        kdist.models.load_backbone_weights(deeper, tmp_path)
    with pytest.raises(ValueError, match="expected an existing .keras file"):
        kdist.models.load_backbone_weights(clf, tmp_path / "nothing.h5")


def test_classifier_trains_with_sample_weights():
    keras.utils.set_random_seed(0)
    clf = BertClassifier(BertBackbone(**TINY_BERT), num_classes=2, classifier_dropout=0.0)
    clf.compile(optimizer=kdist.optim.adamw(1e-2, warmup_steps=1, decay_steps=20))
    x = {k: v for k, v in BATCHES[0][0].items() if k != "mask_positions"}
    y = (x["token_ids"][:, 0] > 128).astype("int32")
    w = np.ones(8, "float32")
    w[4:] = 0.0  # rows with weight 0 count for neither the loss nor the accuracy
    first = clf.evaluate(x, y, sample_weight=w, verbose=0, return_dict=True)
    flipped = clf.evaluate(x, np.where(w > 0, y, 1 - y), sample_weight=w, verbose=0,
                           return_dict=True)
    assert first == flipped
    for _ in range(15):
        clf.train_on_batch(x, y)
    assert clf.evaluate(x, y, verbose=0, return_dict=True)["accuracy"] == 1.0
