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
