"""The peak a quantized step's MFU divides by (kdist.precision.peak)."""

import pytest

from kdist.accelerators import accelerator
from kdist.flops import transformer_flops_per_token
from kdist.precision.peak import peak_tflops, quantized_share

GPT2_SMALL = transformer_flops_per_token(12, 768, 12, 3072, 50304, 1024)


def test_int8_peak_is_the_time_at_both_peaks():
    """Per token: q / 393 + (F - q) / 197 seconds per TFLOP at once; F over that."""
    v5e = accelerator("tpu-v5e")
    share = (GPT2_SMALL.qkv + GPT2_SMALL.output_projection + GPT2_SMALL.mlp) / GPT2_SMALL.forward
    assert quantized_share(GPT2_SMALL) == pytest.approx(share)
    assert peak_tflops(v5e, "int8", GPT2_SMALL) == pytest.approx(
        1 / (share / 393 + (1 - share) / 197))
    assert 197 < peak_tflops(v5e, "int8", GPT2_SMALL) < 393
    assert peak_tflops(v5e, "bf16", GPT2_SMALL) == 197.0


@pytest.mark.parametrize("device, precision", [("tpu-v5e", "fp8"), ("tpu-v5p", "int8")])
def test_no_published_peak_is_refused_naming_the_flag(device, precision):
    with pytest.raises(ValueError, match="--matmul-precision bf16"):
        peak_tflops(accelerator(device), precision, GPT2_SMALL)


def test_int8_sr_is_counted_at_the_int8_peak():
    """Its matmuls are int8's (only the gradients' rounding differs): the same blend, in
    ``kdist plan`` and the Throughput callback alike."""
    from kdist.callbacks.peak import Peak, matmul_peak

    v5e = accelerator("tpu-v5e")
    assert peak_tflops(v5e, "int8-sr", GPT2_SMALL) == peak_tflops(v5e, "int8", GPT2_SMALL)
    peak = Peak(197.0, "table", "TPU v5 lite", "bfloat16")
    sr = matmul_peak(peak, GPT2_SMALL, matmul_precision="int8-sr")
    assert sr.tflops == matmul_peak(peak, GPT2_SMALL, matmul_precision="int8").tflops
    assert sr.note.startswith("matmul precision int8-sr:")


def test_the_head_counts_at_the_int8_peak_only_when_quantized():
    """``head_matmul_precision`` (``kdist plan --head-matmul-precision``): the vocabulary
    head's FLOPs (``unembedding``) join the int8 share; left at bf16 the blend is the
    blocks' alone, as before the option."""
    from types import SimpleNamespace

    from kdist.callbacks.peak import Peak, matmul_peak

    v5e, f = accelerator("tpu-v5e"), GPT2_SMALL
    blocks = (f.qkv + f.output_projection + f.mlp) / f.forward
    head = f.unembedding / f.forward
    assert peak_tflops(v5e, "int8", f, head_matmul_precision="bf16") == peak_tflops(
        v5e, "int8", f) == pytest.approx(1 / (blocks / 393 + (1 - blocks) / 197))
    both = 1 / ((blocks + head) / 393 + (1 - blocks - head) / 197)
    assert peak_tflops(v5e, "int8", f, head_matmul_precision="int8") == pytest.approx(both)
    assert peak_tflops(v5e, "bf16", f, head_matmul_precision="int8") == pytest.approx(
        1 / (head / 393 + (1 - head) / 197))
    assert quantized_share(f, head=True) == pytest.approx(blocks + head)
    with pytest.raises(ValueError, match="--head-matmul-precision bf16"):
        peak_tflops(v5e, "int8", f, head_matmul_precision="fp8")
    # the Throughput callback reads both from the model
    lm = SimpleNamespace(backbone=SimpleNamespace(matmul_precision="int8"),
                         head_matmul_precision="int8")
    peak = matmul_peak(Peak(197.0, "table", "TPU v5 lite", "bfloat16"), f, lm)
    assert peak.tflops == pytest.approx(both)
    assert "QKV, attention output, MLP, vocabulary head" in peak.note


def test_kdist_plan_takes_the_head_flag(capsys):
    from kdist import cli

    argv = ["plan", "--preset", "gpt-nano", "--mesh", "fsdp=8", "--device", "tpu-v5e",
            "--compile", "none"]
    assert cli.main([*argv, "--matmul-precision", "int8", "--head-matmul-precision",
                     "int8"]) == 0
    out = capsys.readouterr().out
    assert "matmul precision int8, head int8: " in out
    assert "of the FLOPs (QKV, attention output, MLP, vocabulary head)" in out
    assert cli.main([*argv, "--preset", "bert-tiny", "--head-matmul-precision", "int8"]) != 0
    assert "--head-matmul-precision quantizes a causal LM's" in capsys.readouterr().err
