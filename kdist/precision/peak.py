"""The peak a quantized step's MFU divides by: its quantized matmuls at the chip's int8 rate,
everything else at its bfloat16 rate.

Under ``matmul_precision="int8"`` (and ``"int8-sr"``: the same int8 matmuls) the blocks'
projections (QKV, attention output, MLP: the ``qkv``, ``output_projection`` and ``mlp``
groups of :class:`kdist.flops.FlopsPerToken`, forward and both backward matmuls) run on
int8 operands; attention's score and value
matmuls stay bfloat16, and so does the vocabulary head (the ``unembedding`` group) unless
the task's ``head_matmul_precision`` quantizes it too (``kdist plan
--head-matmul-precision``). At both peaks at once a training token takes
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


def quantized_share(flops, blocks: bool = True, head: bool = False) -> float:
    """The share of a training token's FLOPs (``kdist.flops.FlopsPerToken``) that a
    quantized policy runs quantized: ``blocks``, the QKV, attention output and MLP matmuls
    (``matmul_precision``); ``head``, the vocabulary head (``head_matmul_precision``).

    Example:
        >>> from kdist.flops import transformer_flops_per_token
        >>> f = transformer_flops_per_token(4, 256, 4, 1024, 8192, 256)
        >>> round(quantized_share(f), 3), round(quantized_share(f, head=True), 3)
        (0.571, 0.952)
    """
    quantized = (flops.qkv + flops.output_projection + flops.mlp) if blocks else 0.0
    return (quantized + (flops.unembedding if head else 0.0)) / flops.forward


def _quantized_parts(matmul_precision, head_matmul_precision, flops):
    """``[(precision, share of the FLOPs, its flag)]`` of the quantized groups."""
    parts = ((check(matmul_precision), quantized_share(flops), "--matmul-precision"),
             (check(head_matmul_precision, "head_matmul_precision"),
              quantized_share(flops, blocks=False, head=True), "--head-matmul-precision"))
    return [part for part in parts if part[0] != "bf16"]


def peak_tflops(device, matmul_precision: str, flops, dtype: str = "bfloat16",
                head_matmul_precision: str = "bf16") -> float:
    """The peak (TFLOP/s, int8 operations counted as FLOPs) of ``device`` (an entry of
    :mod:`kdist.accelerators`' table) for a step of ``flops`` (``FlopsPerToken``) under
    ``matmul_precision`` (the blocks' projections) and ``head_matmul_precision`` (the
    vocabulary head); both ``"bf16"``: the ``dtype`` peak MFU always used. A device with no
    published peak for a quantized precision is a ``ValueError``.

    Example:
        >>> from kdist.accelerators import accelerator
        >>> from kdist.flops import transformer_flops_per_token
        >>> f = transformer_flops_per_token(4, 256, 4, 1024, 8192, 256)
        >>> peak_tflops(accelerator("tpu-v5e"), "bf16", f)
        197.0
    """
    base = device.tflops(dtype)
    parts = _quantized_parts(matmul_precision, head_matmul_precision, flops)
    if not parts:
        return base
    fast = sum(share / fast_peak(device, name, flag) for name, share, flag in parts)
    return 1.0 / (fast + (1.0 - sum(share for _, share, _ in parts)) / base)


def fast_peak(device, matmul_precision: str, flag: str = "--matmul-precision") -> float:
    """``device``'s published peak for ``matmul_precision``'s operands (int8 TOP/s), or a
    ``ValueError`` saying there is none and what to plan with instead (``flag``: the
    option that asked for it).

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
            f"{flag[2:].replace('-', '_')}={matmul_precision!r} has no peak to divide by. "
            f"Plan with {flag} bf16, or int8 on a chip with an int8 figure (tpu-v5e, "
            f"tpu-v6e, the NVIDIA GPUs).")
    return fast


def peak_line(device, matmul_precision: str, flops,
              head_matmul_precision: str = "bf16") -> str:
    """The plan's line saying which peak its MFU divides by, and why.

    Example:
        >>> from kdist.accelerators import accelerator
        >>> from kdist.flops import transformer_flops_per_token
        >>> f = transformer_flops_per_token(4, 256, 4, 1024, 8192, 256)
        >>> peak_line(accelerator("tpu-v5e"), "int8", f)[:44]
        'matmul precision int8: 57% of the FLOPs (QKV'
    """
    peak = peak_tflops(device, matmul_precision, flops,
                       head_matmul_precision=head_matmul_precision)
    blocks, head = matmul_precision != "bf16", head_matmul_precision != "bf16"
    groups = ", ".join(["QKV, attention output, MLP"] * blocks + ["vocabulary head"] * head)
    named = matmul_precision + (f", head {head_matmul_precision}" if head else "")
    return (f"matmul precision {named}: {quantized_share(flops, blocks, head):.0%} of the "
            f"FLOPs ({groups}) at {device.name}'s {device.int8_tops:g} TOP/s "
            f"int8, the rest at {device.tflops():g} TFLOP/s bf16: MFU's peak "
            f"{peak:.4g} TFLOP/s per chip")
