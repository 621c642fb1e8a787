"""Backbone/Task base classes: config, presets, cost models, the fused-loss default, token ids."""

from unittest import mock

import keras
import numpy as np
import pytest

from kdist.models import (
    BERT_PRESETS,
    GPT_PRESETS,
    BertClassifier,
    BertMaskedLM,
    GPTBackbone,
    GPTCausalLM,
    task_for_preset,
)
from kdist.models.losses import auto_chunk_size, chunked_cross_entropy
from tests.bert_helpers import TINY_BERT, mlm_batches
from tests.helpers import TINY_GPT, TINY_LLAMA, token_batches


def trainable_size(model) -> int:
    return int(sum(np.prod(w.shape) for w in model.trainable_weights))


@pytest.mark.parametrize("build", [
    lambda: GPTCausalLM.from_preset("gpt-nano"),
    lambda: GPTCausalLM(GPTBackbone(**TINY_LLAMA)),  # GQA, SwiGLU, RMSNorm, untied, RoPE
    lambda: GPTCausalLM.from_preset("gpt-nano", vocabulary_size=1000, vocabulary_divisible_by=64),
    lambda: BertMaskedLM.from_preset("bert-tiny"),
    lambda: BertClassifier.from_preset("bert-tiny", num_classes=3),
], ids=["gpt-nano", "llama-gqa", "gpt-padded", "bert-tiny-mlm", "bert-tiny-classifier"])
def test_cost_model_counts_the_built_models_parameters(build):
    model = build()
    assert model.cost_model().parameters == trainable_size(model)
    config = {k: v for k, v in model.backbone.get_config().items()
              if k not in ("name", "trainable", "dtype")}
    task_args = {"num_classes": 3} if isinstance(model, BertClassifier) else {}
    assert type(model).cost_model_for(config, **task_args).parameters == trainable_size(model)


# Values of kdist.flops.model_flops_per_token / bert_flops_per_token and kdist.plan's
# parameter_count / activation_bytes_per_token at commit 7f3d1d7 (before the cost models).
def test_cost_models_give_the_previous_figures():
    for preset, half, full, params, act, act_remat in [
        ("gpt-nano", 33030144, 34603008, 5322240, 116736, 80384),
        ("llama-nano", 32243712, 33816576, 7211264, 135168, 84992),
        ("gpt2-small", 755347968, 769503744, 124475904, 862856, 458888),
    ]:
        cost = task_for_preset(preset).cost_model_for(GPT_PRESETS[preset])
        assert cost.flops_per_token(256).training == half
        assert cost.flops_per_token(256, causal_half=False).training == full
        assert cost.parameters == params
        assert cost.activation_bytes_per_token(256, 2) == act
        assert cost.activation_bytes_per_token(256, 2, remat=True) == act_remat
    base = BERT_PRESETS["bert-base"]
    assert BertMaskedLM.cost_model_for(base).flops_per_token(128).training == 667948032
    masked = BertMaskedLM.cost_model_for(base, masked_positions=20).flops_per_token(128)
    assert masked.training == 546292512 and not masked.causal
    classifier = BertClassifier.cost_model_for(BERT_PRESETS["bert-tiny"], num_classes=3)
    assert classifier.flops_per_token(128).training == 2753298
    assert BertMaskedLM.cost_model_for(base).activation_bytes_per_token(128) > 0


def test_task_for_preset():
    assert task_for_preset("gpt-nano") is GPTCausalLM
    assert task_for_preset("llama-1b") is GPTCausalLM
    assert task_for_preset("bert-base") is BertMaskedLM
    with pytest.raises(ValueError, match="Unknown preset 'gpt-5'.*gpt-nano"):
        task_for_preset("gpt-5")


def test_config_round_trip_and_from_preset_arguments():
    lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=64, num_layers=1,
                                 loss_chunk_size=None, check_token_ids=True)
    assert lm.loss_chunk_size is None and lm.check_token_ids and lm.backbone.num_layers == 1
    config = lm.get_config()
    assert GPTCausalLM.from_config(config).get_config() == config
    assert config["backbone"]["config"]["position_embedding"] == "learned"
    clf = BertClassifier.from_preset("bert-tiny", num_classes=4, classifier_dropout=0.2,
                                     vocabulary_size=64)
    assert (clf.num_classes, clf.classifier_dropout, clf.backbone.vocabulary_size) == (4, 0.2, 64)


def test_auto_fused_loss_follows_the_measured_rule():
    # Measured (benchmarks/defaults.py): faster with GPT-2's vocabulary, slower with 8192.
    assert auto_chunk_size(2, 1024, 50257, platform="cpu") == 128
    assert auto_chunk_size(32, 256, 8192, platform="cpu") is None  # 256 MiB, V 8192: slower
    assert auto_chunk_size(8, 128, 50257, platform="cpu") == 32  # gpt2-small's measured shape
    assert auto_chunk_size(16, 1024, 50257, platform="cpu") == 16  # <= 64 MiB per chunk
    assert auto_chunk_size(1, 256, 50257, platform="cpu") is None  # 49 MiB: logits
    assert auto_chunk_size(8, 128, 50257, platform="gpu") is None  # no gain on the H200
    assert auto_chunk_size(None, 256, 50257, platform="cpu") is None  # symbolic batch
    lm = GPTCausalLM.from_preset("gpt-nano", num_layers=1, vocabulary_size=50257)
    lm.compile(optimizer="adam")
    assert lm.fused_loss_chunk_size(8, 128) == 32 and lm.fused_loss_chunk_size(2, 16) is None
    lm.compile(optimizer="adam", metrics=["accuracy"])  # metrics need logits
    assert lm.fused_loss_chunk_size(8, 128) is None
    for off in (None, 0):
        lm = GPTCausalLM.from_preset("gpt-nano", num_layers=1, vocabulary_size=50257,
                                     loss_chunk_size=off)
        lm.compile(optimizer="adam")
        assert lm.fused_loss_chunk_size(8, 128) is None
    nano = GPTCausalLM.from_preset("gpt-nano", num_layers=1)  # the main job's vocabulary
    nano.compile(optimizer="adam")
    assert nano.fused_loss_chunk_size(16, 256) is None


def test_fused_loss_with_sample_weight_computes_keras_weighted_loss():
    x, y = token_batches(1)[0]
    w = np.random.default_rng(0).uniform(size=y.shape).astype("float32")
    losses = []
    for chunk in (8, None):
        keras.utils.set_random_seed(0)
        lm = GPTCausalLM(GPTBackbone(**TINY_GPT), loss_chunk_size=chunk)
        lm.compile(optimizer="adam")
        losses.append(float(lm.train_on_batch(x, y, sample_weight=w)))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_token_ids_out_of_range_are_refused_before_the_device():
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT))
    lm.compile(optimizer="adam")
    x, y = token_batches(1)[0]
    for bad, found in ((256, r"\[\d+, 256\]"), (-1, r"\[-1, \d+\]")):
        wrong = x.copy()
        wrong[1, 2] = bad
        match = found + ".*valid range \\[0, 256\\)"
        with pytest.raises(ValueError, match=match):
            lm.fit(wrong, y, verbose=0)
        with pytest.raises(ValueError, match=match):
            lm.predict(wrong, verbose=0)
        with pytest.raises(ValueError, match=match):
            lm.evaluate(x, np.where(y == y[0, 0], bad, y), verbose=0)
    with pytest.raises(ValueError, match="validation_data's x"):
        lm.fit(x, y, validation_data=(wrong, y), verbose=0)
    mlm = BertMaskedLM.from_preset("bert-tiny", **TINY_BERT)
    mlm.compile(optimizer="adam")
    bx, by, bw = mlm_batches(1)[0]
    with pytest.raises(ValueError, match="x\\['token_ids'\\]"):
        mlm.fit({**bx, "token_ids": bx["token_ids"] + 256}, by, sample_weight=bw, verbose=0)
    with pytest.raises(ValueError, match="fit's y"):
        mlm.fit(bx, by - 300, sample_weight=bw, verbose=0)


def test_one_batch_calls_refuse_token_ids_out_of_range_too():
    """train_on_batch trained on a 0.0 loss with ids past the table (fit refused them)."""
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT))
    lm.compile(optimizer="adam")
    x, y = token_batches(1)[0]
    with pytest.raises(ValueError, match=r"train_on_batch's x has token ids in \[\d+, 256\]"):
        lm.train_on_batch(np.where(x == x[0, 0], 256, x), y)
    with pytest.raises(ValueError, match="train_on_batch's y"):
        lm.train_on_batch(x, y + 256)
    with pytest.raises(ValueError, match="test_on_batch's x"):
        lm.test_on_batch(x - 300, y)
    with pytest.raises(ValueError, match="predict_on_batch's x"):
        lm.predict_on_batch(x + 256)
    assert np.isfinite(float(lm.train_on_batch(x, y)))


def test_in_graph_check_is_never_a_silent_zero_loss():
    lm = GPTCausalLM(GPTBackbone(**TINY_GPT), check_token_ids=True)
    lm.compile(optimizer="adam")
    x, y = token_batches(1)[0]
    assert np.isfinite(float(lm.train_on_batch(x, y)))
    # Labels past the vocabulary gave a NaN loss here once (not 0.0); the compiled step now
    # refuses them, as it refuses inputs past it and negative labels.
    for wrong_x, wrong_y in ((x + 256, y), (x, y - 1000), (x, y + 256)):
        batches = (b for b in [(wrong_x, wrong_y)] * 2)  # a generator: not checked on the host
        with pytest.raises(ValueError, match="compiled step has token ids in"):
            lm.fit(batches, steps_per_epoch=2, verbose=0)
    with pytest.raises(ValueError, match="compiled step has token ids in \\[26"):
        lm.predict((b for b in [(x + 256,)]), steps=1, verbose=0)
    mlm = BertMaskedLM.from_preset("bert-tiny", **TINY_BERT, check_token_ids=True)
    mlm.compile(optimizer="adam")
    bx, by, bw = mlm_batches(1)[0]
    assert np.isfinite(float(mlm.train_on_batch(bx, by, sample_weight=bw)[0]))
    with pytest.raises(ValueError, match="compiled step has token ids in \\[-"):
        mlm.fit((b for b in [(bx, by - 300, bw)]), steps_per_epoch=1, verbose=0)


def test_auto_default_trains_fused_where_logits_are_large_with_the_same_loss():
    # 2 x 256 x 32768 float32 logits = 64 MiB: "auto" takes the fused loss, chunks of 64.
    shape = dict(vocabulary_size=32768, num_layers=1, num_heads=2, hidden_dim=32,
                 intermediate_dim=64, max_sequence_length=256)
    tokens = np.random.default_rng(0).integers(0, 32768, (2, 257)).astype("int32")
    losses = []
    for chunk in ("auto", None):
        keras.utils.set_random_seed(0)
        lm = GPTCausalLM(GPTBackbone(**shape), loss_chunk_size=chunk)
        lm.compile(optimizer="adam")
        assert lm.fused_loss_chunk_size(2, 256) == (64 if chunk else None)
        with mock.patch("kdist.models.losses.chunked_cross_entropy",
                        wraps=chunked_cross_entropy) as fused:
            losses.append(lm.fit(tokens[:, :-1], tokens[:, 1:], batch_size=2, epochs=2,
                                 verbose=0).history["loss"])
        assert fused.called == (chunk == "auto")
    np.testing.assert_allclose(losses[0], losses[1], rtol=2e-6)
