"""FLOPs accounting against nanoGPT's formula and XLA's own count; the peak table."""

import jax
import keras
import numpy as np
import pytest

from kdist import flops
from kdist.callbacks import peak as peaks
from kdist.models import (
    BERT_PRESETS,
    GPT_PRESETS,
    BertBackbone,
    BertClassifier,
    BertCostModel,
    BertMaskedLM,
    GPTBackbone,
    GPTCausalLM,
)
from kdist.planning import xla_train_step_flops

SHAPES = [  # (layers, hidden, heads, mlp, vocab, seq)
    (4, 256, 4, 1024, 8192, 256),  # gpt-nano
    (12, 768, 12, 3072, 50257, 1024),  # gpt2-small
    (48, 1600, 25, 6400, 50257, 1024),  # gpt2-xl
]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_nanogpt_formula_without_causal_half(shape):
    layers, hidden, heads, mlp, vocab, seq = shape
    ours = flops.transformer_flops_per_token(*shape, causal_half=False)
    n = flops.matmul_parameters(layers, hidden, heads, mlp, vocab)
    assert ours.training == flops.nanogpt_flops_per_token(n, layers, heads, hidden // heads, seq)
    half = flops.transformer_flops_per_token(*shape, causal_half=True)
    assert half.attention == ours.attention / 2
    assert half.training == ours.training - 3 * ours.attention / 2
    assert "half" in half.convention and "full" in ours.convention


def test_nanogpt_parameter_count_is_close_to_the_model():
    # nanoGPT's N is every parameter but the position table; ours leaves out biases and
    # norms too, which GPT-2-shaped models have very few of.
    backbone = GPTBackbone.from_preset("gpt-nano")
    position = backbone.position_embedding.embeddings.shape
    n_model = backbone.count_params() - position[0] * position[1]
    n_ours = flops.matmul_parameters(4, 256, 4, 1024, 8192)
    assert 0 < n_model - n_ours < 0.01 * n_ours


def test_reads_kdist_config_and_counts_remat_separately():
    lm = GPTCausalLM.from_preset("gpt-nano", num_layers=2, remat=True)
    f = flops.model_flops_per_token(lm, 256)
    assert f == flops.transformer_flops_per_token(2, 256, 4, 1024, 8192, 256, remat=True)
    assert f.hardware == f.training + f.forward - f.unembedding  # blocks recomputed once
    assert "remat" in f.convention
    encoder = flops.model_flops_per_token({**GPT_PRESETS["gpt-nano"], "causal": False}, 256)
    assert encoder.attention == 4 * f.attention  # twice the layers, no causal halving
    with pytest.raises(ValueError, match="has no num_layers"):
        flops.model_flops_per_token({"hidden_dim": 8}, 16)
    with pytest.raises(ValueError, match="sequence_length must be a positive int"):
        flops.transformer_flops_per_token(1, 8, 2, 16, 10, 0)


# XLA counts every op of the compiled train step; ours only the matmuls. The residual (XLA
# minus ours) is the softmax of attention and of the loss over the vocabulary, layer norms,
# GELU, residual adds, the cross-entropy and AdamW's per-parameter update (~15 FLOPs per
# parameter per step, large here per token because the test batches are small). XLA on CPU
# computes the full T x T attention matrix, so it is compared with causal_half=False.
XLA_CASES = {  # name: (preset overrides, batch, sequence length, max relative residual)
    "gpt-nano": (dict(GPT_PRESETS["gpt-nano"]), 4, 256, 0.10),
    "gpt2-small-2-layers": (dict(GPT_PRESETS["gpt2-small"], num_layers=2,
                                 vocabulary_size=16384), 2, 512, 0.10),
    # GQA (8 query / 2 key-value heads), SwiGLU, untied output, RoPE: the config reader
    # must see the smaller K/V projections and the third MLP matmul.
    "llama-nano": (dict(GPT_PRESETS["llama-nano"]), 4, 256, 0.10),
}


@pytest.mark.parametrize("name", list(XLA_CASES))
def test_agrees_with_xla_cost_analysis(name):
    config, batch, seq, tolerance = XLA_CASES[name]
    keras.distribution.set_distribution(None)
    # The logits path: XLA counts a loop body once, so the fused loss's chunk loop
    # (GPTCausalLM's default for large logits) would hide most of the unembedding.
    lm = GPTCausalLM(GPTBackbone(**config), loss_chunk_size=None)
    lm.compile(optimizer="adamw")
    xla = xla_train_step_flops(lm, batch, seq) / (batch * seq)
    ours = flops.model_flops_per_token(lm, seq, causal_half=False).training
    print(f"{name}: XLA {xla:.4g} / ours {ours:.4g} FLOPs per token = {xla / ours:.4f}")
    assert ours <= xla <= (1 + tolerance) * ours


def test_peak_table_override_and_measured():
    assert peaks.table_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peaks.table_peak_tflops("NVIDIA H200") == 989.0
    assert peaks.table_peak_tflops("NVIDIA A100-SXM4-40GB", "float32") == 156.0
    assert peaks.table_peak_tflops("TPU v5 lite") == 197.0
    assert peaks.table_peak_tflops("TPU v5") == 459.0
    assert peaks.table_peak_tflops("TPU v4") == 275.0
    assert peaks.table_peak_tflops("cpu") is None
    assert peaks.device_peak(override_tflops=123.0).source == "override"
    with pytest.raises(ValueError, match="must be positive"):
        peaks.device_peak(override_tflops=0.0)
    peak = peaks.device_peak(jax.devices()[:1], "float32")
    assert peak.source == "measured" and 0 < peak.tflops < 100
    assert "measured" in peak.describe()


# BERT: the encoder's attention is bidirectional (full T x T, nothing halved) and the MLM
# head runs at the P gathered positions only. XLA's extra (the residual) is as for GPT,
# plus the embedding LayerNorm and the gather of the masked positions.
BERT_XLA_CASES = {  # name: (preset, overrides, batch, sequence length, masked positions)
    "bert-tiny": ("bert-tiny", dict(vocabulary_size=8192), 8, 128, 32),
    "bert-base-2-layers": ("bert-base", dict(num_layers=2), 2, 512, 80),
}


def bert_flops(config, seq, **head):
    """BERT's count with a head (``masked_positions=P`` or ``num_classes=C``): its cost model's."""
    return BertCostModel(BertBackbone.full_config(config), **head).flops_per_token(seq)


def bert_sample_batch(batch, seq, masked):
    ids = np.ones((batch, seq), "int32")
    x = {"token_ids": ids, "segment_ids": ids, "padding_mask": ids,
         "mask_positions": np.zeros((batch, masked), "int32")}
    return x, np.zeros((batch, masked), "int32"), np.ones((batch, masked), "float32")


@pytest.mark.parametrize("name", list(BERT_XLA_CASES))
def test_bert_agrees_with_xla_cost_analysis(name):
    preset, overrides, batch, seq, masked = BERT_XLA_CASES[name]
    keras.distribution.set_distribution(None)
    lm = BertMaskedLM.from_preset(preset, **overrides)
    lm.compile(optimizer="adamw")
    sample = bert_sample_batch(batch, seq, masked)
    xla = xla_train_step_flops(lm, batch, seq, batch=sample) / (batch * seq)
    ours = bert_flops(lm.backbone.get_config(), seq, masked_positions=masked).training
    print(f"{name}: XLA {xla:.4g} / ours {ours:.4g} FLOPs per token = {xla / ours:.4f}")
    assert ours <= xla <= 1.10 * ours


def test_bert_count_is_the_encoder_without_causal_halving_plus_its_head():
    config = BERT_PRESETS["bert-base"]
    mlm = bert_flops(config, 128, masked_positions=20)
    encoder = flops.transformer_flops_per_token(12, 768, 12, 3072, 30522, 128, causal=False)
    assert mlm.attention == encoder.attention == 12 * 4 * 128 * 768  # full T x T
    assert "bidirectional" in mlm.convention
    assert mlm.unembedding == encoder.unembedding * 20 / 128
    assert mlm.extra == 2 * 768 * 768 * 20 / 128  # the MLM transform, at 20 of 128 positions
    clf = bert_flops(config, 128, num_classes=3)
    assert clf.unembedding == 0 and clf.extra == (2 * 768 * 768 + 2 * 768 * 3) / 128
    # A config dict states its attention (no family is guessed from its keys).
    bidirectional = {**config, "causal": False}
    assert flops.model_flops_per_token(bidirectional, 128).attention == encoder.attention
    classifier = BertClassifier.from_preset("bert-tiny", num_classes=3)
    assert flops.model_flops_per_token(classifier, 64) == bert_flops(
        BERT_PRESETS["bert-tiny"], 64, num_classes=3)
    with pytest.raises(ValueError, match="masked_positions must be in 1..sequence_length"):
        bert_flops(config, 128, masked_positions=200)
