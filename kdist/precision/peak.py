"""The peak a quantized step's MFU divides by: its quantized matmuls at the chip's int8 rate,
everything else at its bfloat16 rate.

Under ``matmul_precision="int8"`` (and ``"int8-sr"``: the same int8 matmuls) the blocks'
projections (QKV, attention output, MLP: the ``qkv``, ``output_projection`` and ``mlp``
groups of :class:`kdist.flops.FlopsPerToken`, forward and both backward matmuls) run on
int8 operands; attention's score and value
matmuls and the vocabulary head stay bfloat16. At both peaks at once a training token takes
``q / int8_peak + (F - q) / bf16_peak`` seconds (``F`` its training FLOPs, ``q`` the
quantized share), so the peak MFU compares with is ``F`` over that time: between the
bfloat16 and int8 peaks, closer to int8 the larger the projections' share.

Example:
    >>> from kdist.accelerators import accelerator
    >>> from kdist.flops import transformer_flops_per_token
    >>> f = transformer_flops_per_token(12, 768, 12, 3072, 50304, 1024)
    >>> round(quantized_share(f), 3), round(peak_tflops(accelerator("tpu-v5e"), "int8", f))
    (0.639, 289)
"""

from __future__ import annotations

from kdist.precision.policy import check, precision


def quantized_share(flops) -> float:
    """The share of a training token's FLOPs (``kdist.flops.FlopsPerToken``) that a
    quantized policy runs quantized: the QKV, attention output and MLP matmuls."""
    quantized = flops.qkv + flops.output_projection + flops.mlp
    return quantized / flops.forward


def peak_tflops(device, matmul_precision: str, flops, dtype: str = "bfloat16") -> float:
    """The peak (TFLOP/s, int8 operations counted as FLOPs) of ``device`` (an entry of
    :mod:`kdist.accelerators`' table) for a step of ``flops`` (``FlopsPerToken``) under
    ``matmul_precision``; ``"bf16"``: the ``dtype`` peak MFU always used. A device with no
    published peak for the precision is a ``ValueError``.

    Example:
        >>> from kdist.accelerators import accelerator
        >>> from kdist.flops import transformer_flops_per_token
        >>> f = transformer_flops_per_token(4, 256, 4, 1024, 8192, 256)
        >>> peak_tflops(accelerator("tpu-v5e"), "bf16", f)
        197.0
    """
    base = device.tflops(dtype)
    if check(matmul_precision) == "bf16":
        return base
    share = quantized_share(flops)
    return 1.0 / (share / fast_peak(device, matmul_precision) + (1.0 - share) / base)


def fast_peak(device, matmul_precision: str) -> float:
    """``device``'s published peak for ``matmul_precision``'s operands (int8 TOP/s), or a
    ``ValueError`` saying there is none and what to plan with instead.

    Example:
        >>> from kdist.accelerators import accelerator
        >>> fast_peak(accelerator("tpu-v5e"), "int8")
        393.0
    """
    fast = device.int8_tops if precision(matmul_precision).peak == "int8" else None
    if not fast:
        raise ValueError(
            f"{device.name} has no {matmul_precision} peak in kdist's accelerator table "
            f"(int8: {device.int8_tops}; fp8 peaks are not tabulated), so MFU under "
            f"matmul_precision={matmul_precision!r} has no peak to divide by. Plan with "
            f"--matmul-precision bf16, or int8 on a chip with an int8 figure (tpu-v5e, "
            f"tpu-v6e, the NVIDIA GPUs).")
    return fast


def peak_line(device, matmul_precision: str, flops) -> str:
    """The plan's line saying which peak its MFU divides by, and why.

    Example:
        >>> from kdist.accelerators import accelerator
        >>> from kdist.flops import transformer_flops_per_token
        >>> f = transformer_flops_per_token(4, 256, 4, 1024, 8192, 256)
        >>> peak_line(accelerator("tpu-v5e"), "int8", f)[:44]
        'matmul precision int8: 57% of the FLOPs (QKV'
    """
    peak = peak_tflops(device, matmul_precision, flops)
    return (f"matmul precision {matmul_precision}: {quantized_share(flops):.0%} of the FLOPs "
            f"(QKV, attention output, MLP) at {device.name}'s {device.int8_tops:g} TOP/s "
            f"int8, the rest at {device.tflops():g} TFLOP/s bf16: MFU's peak "
            f"{peak:.4g} TFLOP/s per chip")
