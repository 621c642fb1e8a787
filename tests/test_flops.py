"""FLOPs accounting against nanoGPT's formula and XLA's own count; the peak table."""

import jax
import keras
import pytest

from kdist import flops
from kdist.models import GPT_PRESETS, GPTBackbone, GPTCausalLM

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
    lm = GPTCausalLM(GPTBackbone(**config))
    lm.compile(optimizer="adamw")
    xla = flops.xla_train_step_flops(lm, batch, seq) / (batch * seq)
    ours = flops.model_flops_per_token(lm, seq, causal_half=False).training
    print(f"{name}: XLA {xla:.4g} / ours {ours:.4g} FLOPs per token = {xla / ours:.4f}")
    assert ours <= xla <= (1 + tolerance) * ours


def test_peak_table_override_and_measured():
    assert flops.table_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert flops.table_peak_tflops("NVIDIA H200") == 989.0
    assert flops.table_peak_tflops("NVIDIA A100-SXM4-40GB", "float32") == 156.0
    assert flops.table_peak_tflops("TPU v5 lite") == 197.0
    assert flops.table_peak_tflops("TPU v5") == 459.0
    assert flops.table_peak_tflops("TPU v4") == 275.0
    assert flops.table_peak_tflops("cpu") is None
    assert flops.device_peak(override_tflops=123.0).source == "override"
    with pytest.raises(ValueError, match="must be positive"):
        flops.device_peak(override_tflops=0.0)
    peak = flops.device_peak(jax.devices()[:1], "float32")
    assert peak.source == "measured" and 0 < peak.tflops < 100
    assert "measured" in peak.describe()
