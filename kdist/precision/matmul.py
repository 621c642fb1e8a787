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
tolerance).

``int8_sr_matmul`` (``matmul_precision="int8-sr"``) is ``int8_matmul`` with the gradient
``dy``'s codes stochastically rounded in both backward products
(:func:`kdist.precision.quantize.int8_stochastic`: unbiased, ``E[codes] = dy / scale``);
``x`` and ``w`` still round to nearest, so its forward is ``int8_matmul``'s bit for bit.
Its randomness is a function of ``dy`` (a key folded from the sum of its bit patterns and
the product's axes): no seed variable, nothing for a scanned layer stack or a pipeline
schedule to carry, and it changes with every step's ``dy``. A sharded step draws one device's
bits for the same ``dy``; where ``dy`` differs from one device's in the last bit (float32
sums in another order), the draw is another one: sharded and one-device runs then agree as
two stochastic roundings do, not bit for bit. Measured against ``int8`` (gpt-nano, 200
steps, one seed): validation losses within 0.3 %, as far apart as int8 and bf16 are — no
measured gain at that scale, so round-to-nearest stays the default (docs/precision.md).

``fp8_matmul`` is the same with float8 codes: e4m3 for ``x`` and ``w``, e5m2 for ``dy``,
accumulated in float32 (current scaling: the scales of this call's values).

Example:
    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((2, 4)), jnp.full((4, 3), 0.5)
    >>> int8_matmul(x, w).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    >>> bool((int8_sr_matmul(x, w) == int8_matmul(x, w)).all())  # the forward is int8's
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kdist.precision import quantize


def product(a, b, contract_a, contract_b, quantize_a, quantize_b, accumulate):
    """``a`` times ``b`` on codes, contracting ``a``'s axes ``contract_a`` with ``b``'s
    ``contract_b``: each operand scaled per slice of the axes it keeps (its maximum over the
    contracted ones), the codes' product accumulated in ``accumulate`` and rescaled in
    float32. The result's axes are ``a``'s kept ones, then ``b``'s (``dot_general``'s
    order). No operand is reshaped or transposed first: XLA keeps each in the layout its
    producer wrote (on a TPU, where it can fuse the quantizer into that producer).

    Example:
        >>> a = jnp.array([[1.0, 2.0]]); b = jnp.array([[3.0], [4.0]])
        >>> y = product(a, b, (1,), (0,), quantize.int8, quantize.int8, jnp.int32)
        >>> round(float(y[0, 0]), 3)  # exactly: 11
        11.016
    """
    codes_a, scale_a = quantize_a(a, axis=contract_a)  # scales: size 1 on contracted axes
    codes_b, scale_b = quantize_b(b, axis=contract_b)
    acc = lax.dot_general(codes_a, codes_b, ((contract_a, contract_b), ((), ())),
                          preferred_element_type=accumulate)
    kept_a = jnp.squeeze(scale_a, contract_a)  # (*a's kept axes)
    kept_b = jnp.squeeze(scale_b, contract_b)
    scale_a = kept_a.reshape(kept_a.shape + (1,) * kept_b.ndim)
    return acc.astype(jnp.float32) * scale_a * kept_b


def _quantized(quantize_x, quantize_w, quantize_dy, accumulate):
    """A ``(x, w, contracted) -> x @ w`` over ``x``'s trailing and ``w``'s leading
    ``contracted`` axes, with the forward and both backward products quantized."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def matmul(x, w, contracted=1):
        out = jnp.result_type(x, w)
        lead = x.ndim - contracted
        return product(x, w, tuple(range(lead, x.ndim)), tuple(range(contracted)),
                       quantize_x, quantize_w, accumulate).astype(out)

    def forward(x, w, contracted):
        return matmul(x, w, contracted), (x, w)

    def backward(contracted, saved, dy):
        x, w = saved
        lead = x.ndim - contracted
        tokens = tuple(range(lead))  # x's and dy's leading axes
        outputs_dy = tuple(range(lead, dy.ndim))  # dy's output channels
        outputs_w = tuple(range(contracted, w.ndim))  # w's output channels
        # dx = dy . w^T: dy per token, w per input channel, both over the outputs.
        dx = product(dy, w, outputs_dy, outputs_w, quantize_dy, quantize_w, accumulate)
        # dw = x^T . dy: x per input channel, dy per output channel, both over the tokens.
        dw = product(x, dy, tokens, tokens, quantize_x, quantize_dy, accumulate)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    matmul.defvjp(forward, backward)
    return matmul


def _fp8(dtype):
    return lambda x, axis, axis_names=(): quantize.fp8(x, axis, dtype, axis_names)


class Quantizers(NamedTuple):
    """A precision's quantizers of a matmul's inputs ``x``, weights ``w`` and output
    gradient ``dy`` (each ``(array, axis, axis_names=()) -> (codes, scales)``), and the
    dtype its code products accumulate in: what :func:`product` takes, for a caller that
    runs a layer's three products itself (the fused loss's head, inside its own VJP)."""

    x: Callable
    w: Callable
    dy: Callable
    accumulate: Any


QUANTIZERS = {
    "int8": Quantizers(quantize.int8, quantize.int8, quantize.int8, jnp.int32),
    "int8-sr": Quantizers(quantize.int8, quantize.int8, quantize.int8_stochastic, jnp.int32),
    "fp8": Quantizers(_fp8(quantize.FP8_FORWARD), _fp8(quantize.FP8_FORWARD),
                      _fp8(quantize.FP8_GRADIENT), jnp.float32),
}
int8_matmul = _quantized(*QUANTIZERS["int8"])
int8_sr_matmul = _quantized(*QUANTIZERS["int8-sr"])
fp8_matmul = _quantized(*QUANTIZERS["fp8"])

MATMULS = {"int8": int8_matmul, "int8-sr": int8_sr_matmul, "fp8": fp8_matmul}


def quantizers(precision: str) -> Quantizers:
    """``precision``'s :class:`Quantizers` (``"int8"``, ``"int8-sr"`` or ``"fp8"``).

    Example:
        >>> quantizers("int8").accumulate.__name__
        'int32'
    """
    if precision not in QUANTIZERS:
        raise ValueError(f"matmul precision {precision!r} has no quantized matmul; use one "
                         f"of {sorted(QUANTIZERS)} (or plain matmuls for 'bf16').")
    return QUANTIZERS[precision]


def matmul(x, w, contracted: int, precision: str):
    """``x (*lead, *C) @ w (*C, *O) -> (*lead, *O)`` by ``precision``'s quantized matmul,
    over the ``contracted`` trailing axes of ``x`` (leading of ``w``): scales per token
    (all of ``lead``) and per output channel (all of ``O``), as if the axes were flattened
    into ``(tokens, K) @ (K, outputs)`` — without reshaping either operand.

    Example:
        >>> matmul(jnp.ones((2, 3, 4, 2)), jnp.ones((4, 2, 5)), 2, "int8").shape
        (2, 3, 5)
    """
    quantizers(precision)  # a clear error for a precision with no quantized matmul
    return MATMULS[precision](x, w, contracted)
