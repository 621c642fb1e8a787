"""Quantized matmuls with quantized backward passes (straight-through estimator).

``int8_matmul(x, w)`` computes ``x @ w`` for ``x (M, K)`` (M rows: tokens) and ``w (K, N)``
as three quantized products, each ``codes_a @ codes_b`` accumulated exactly (int32), then
rescaled in float32 by the outer product of the operands' scales
(:mod:`kdist.precision.quantize`). Scales are always taken along the axis a product
*keeps*, reducing over the axis it *contracts*, so the rescale factors out of the sum:

=========================  ===========================  ==================================
product                    first operand's scales       second operand's scales
=========================  ===========================  ==================================
forward ``y = x·w``        x per token (max over K)     w per output channel (max over K)
input grad ``dx = dy·wᵀ``  dy per token (max over N)    w per input channel (max over N)
weight grad ``dw = xᵀ·dy`` x per input channel (over M)  dy per output channel (over M)
=========================  ===========================  ==================================

The backward pass is straight-through: it differentiates ``x @ w`` as if the forward
rounding were the identity, and quantizes its own two products (so all three matmuls of
a layer's training step run on 8-bit operands). Under sharding each ``max`` is over the
full axis: inside ``jit`` XLA's partitioner reduces a split axis' maximum across devices
(an all-reduce of ``max``), and a split contracted axis' int32 partial sums add exactly,
so a sharded forward equals one device's. The weight gradient's scales reduce over the
tokens M: a step that splits its batch into microbatches or per-device regions (pipeline
schedules, ``gradient_reduction``) scales each part's tokens separately (tests state the
tolerance). No stochastic rounding: gradients round to nearest (unmeasured here, left out).

``fp8_matmul`` is the same with float8 codes: e4m3 for ``x`` and ``w``, e5m2 for ``dy``,
accumulated in float32 (current scaling: the scales of this call's values).

Example:
    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((2, 4)), jnp.full((4, 3), 0.5)
    >>> int8_matmul(x, w).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kdist.precision import quantize

_MATMUL = (((1,), (0,)), ((), ()))  # (M, K) x (K, N): contract a's 1 with b's 0


def product(a, b, quantize_a, quantize_b, accumulate):
    """``a (M, K) @ b (K, N)`` on codes: ``a`` scaled per row, ``b`` per column (both over
    K), the codes' product accumulated in ``accumulate`` and rescaled in float32.

    Example:
        >>> a = jnp.array([[1.0, 2.0]]); b = jnp.array([[3.0], [4.0]])
        >>> y = product(a, b, quantize.int8, quantize.int8, jnp.int32)  # exactly: 11
        >>> round(float(y[0, 0]), 3)
        11.016
    """
    codes_a, scale_a = quantize_a(a, axis=1)  # (M, K), (M, 1)
    codes_b, scale_b = quantize_b(b, axis=0)  # (K, N), (1, N)
    acc = lax.dot_general(codes_a, codes_b, _MATMUL, preferred_element_type=accumulate)
    return acc.astype(jnp.float32) * scale_a * scale_b  # (M, N)


def _quantized(quantize_x, quantize_w, quantize_dy, accumulate):
    """A ``(x, w) -> x @ w`` with the forward and both backward products quantized."""

    @jax.custom_vjp
    def matmul(x, w):
        out = jnp.result_type(x, w)
        return product(x, w, quantize_x, quantize_w, accumulate).astype(out)

    def forward(x, w):
        return matmul(x, w), (x, w)

    def backward(saved, dy):
        x, w = saved
        dx = product(dy, w.T, quantize_dy, quantize_w, accumulate)  # (M, N) @ (N, K)
        dw = product(x.T, dy, quantize_x, quantize_dy, accumulate)  # (K, M) @ (M, N)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    matmul.defvjp(forward, backward)
    return matmul


int8_matmul = _quantized(quantize.int8, quantize.int8, quantize.int8, jnp.int32)


def _fp8(dtype):
    return lambda x, axis: quantize.fp8(x, axis, dtype)


fp8_matmul = _quantized(_fp8(quantize.FP8_FORWARD), _fp8(quantize.FP8_FORWARD),
                        _fp8(quantize.FP8_GRADIENT), jnp.float32)

MATMULS = {"int8": int8_matmul, "fp8": fp8_matmul}


def matmul(x, w, contracted: int, precision: str):
    """``x (*lead, *C) @ w (*C, *O) -> (*lead, *O)`` by ``precision``'s quantized matmul,
    the ``contracted`` trailing axes of ``x`` (leading of ``w``) flattened into K, the rest
    of ``x`` into rows (tokens) and of ``w`` into output channels.

    Example:
        >>> matmul(jnp.ones((2, 3, 4, 2)), jnp.ones((4, 2, 5)), 2, "int8").shape
        (2, 3, 5)
    """
    if precision not in MATMULS:
        raise ValueError(f"matmul precision {precision!r} has no quantized matmul; use one "
                         f"of {sorted(MATMULS)} (or plain matmuls for 'bf16').")
    lead, outer = x.shape[:x.ndim - contracted], w.shape[contracted:]
    k = 1
    for d in w.shape[:contracted]:
        k *= d
    y = MATMULS[precision](x.reshape(-1, k), w.reshape(k, -1))  # (M, K) @ (K, N)
    return y.reshape(*lead, *outer)
