"""Keras ``Dense`` and ``EinsumDense`` whose matmul is quantized, and the factories the
models construct their projections with.

The quantized layers keep Keras' weights (float32 ``kernel`` and ``bias``, same names and
shapes, so checkpoints and layouts are unchanged) and replace only the matmul of ``call``
with :func:`kdist.precision.matmul.matmul`; the bias add and any activation stay in the
compute dtype.
"""

from __future__ import annotations

import keras
from keras import layers, ops

from kdist.precision import matmul as quantized
from kdist.precision.policy import check


def _split_equation(equation: str) -> int:
    """The number of contracted axes of an ``EinsumDense`` equation of the form
    ``"<lead><C>,<C><O>-><lead><O>"`` (the projections' shapes: ``btd,dnh->btnh``,
    ``btnh,nhd->btd``); anything else is a ``ValueError``."""
    try:
        inputs, output = equation.split("->")
        x, w = inputs.split(",")
    except ValueError:
        x = w = output = None
    contracted = "".join(c for c in (x or "") if c in (w or "") and c not in (output or ""))
    n = len(contracted)
    if not (x and n and x.endswith(contracted) and w.startswith(contracted)
            and output == x[:len(x) - n] + w[n:]):
        raise ValueError(
            f"EinsumDense equation {equation!r} is not a projection a quantized matmul takes: "
            "expected '<lead><contracted>,<contracted><out>-><lead><out>' (e.g. "
            "'btd,dnh->btnh'). Use matmul_precision='bf16' for this layer.")
    return n


@keras.saving.register_keras_serializable(package="kdist")
class QuantizedDense(layers.Dense):
    """``keras.layers.Dense`` with its matmul quantized by ``matmul_precision``
    (``"int8"``, ``"int8-sr"`` or ``"fp8"``; :mod:`kdist.precision.matmul`).

    Example:
        >>> QuantizedDense(4, matmul_precision="int8")(keras.ops.ones((2, 3))).shape
        (2, 4)
    """

    def __init__(self, units, matmul_precision: str = "int8", **kwargs):
        super().__init__(units, **kwargs)
        if check(matmul_precision) == "bf16":
            raise ValueError("QuantizedDense needs matmul_precision='int8', 'int8-sr' or "
                             "'fp8'; for 'bf16' use keras.layers.Dense (kdist.precision.dense "
                             "does).")
        self.matmul_precision = matmul_precision

    def call(self, inputs, training=None):
        kernel = ops.convert_to_tensor(self.kernel)  # cast to the compute dtype
        x = quantized.matmul(inputs, kernel, 1, self.matmul_precision)
        if self.bias is not None:
            x = ops.add(x, self.bias)
        return x if self.activation is None else self.activation(x)

    def get_config(self):
        return {**super().get_config(), "matmul_precision": self.matmul_precision}


@keras.saving.register_keras_serializable(package="kdist")
class QuantizedEinsumDense(layers.EinsumDense):
    """``keras.layers.EinsumDense`` with its contraction quantized by ``matmul_precision``;
    the equation must be a projection (``"btd,dnh->btnh"``, ``"btnh,nhd->btd"``).

    Example:
        >>> layer = QuantizedEinsumDense("btd,dnh->btnh", (None, 2, 3), matmul_precision="fp8")
        >>> layer(keras.ops.ones((1, 5, 4))).shape
        (1, 5, 2, 3)
    """

    def __init__(self, equation, output_shape, matmul_precision: str = "int8", **kwargs):
        super().__init__(equation, output_shape, **kwargs)
        if check(matmul_precision) == "bf16":
            raise ValueError("QuantizedEinsumDense needs matmul_precision='int8', 'int8-sr' "
                             "or 'fp8'; for 'bf16' use keras.layers.EinsumDense "
                             "(kdist.precision.einsum_dense does).")
        self.contracted = _split_equation(equation)
        self.matmul_precision = matmul_precision

    def call(self, inputs, training=None):
        kernel = ops.convert_to_tensor(self.kernel)  # cast to the compute dtype
        x = quantized.matmul(inputs, kernel, self.contracted, self.matmul_precision)
        if self.bias is not None:
            x = ops.add(x, self.bias)
        return x if self.activation is None else self.activation(x)

    def get_config(self):
        return {**super().get_config(), "matmul_precision": self.matmul_precision}


def dense(units, matmul_precision: str = "bf16", **kwargs) -> layers.Dense:
    """``keras.layers.Dense`` under ``"bf16"``, else :class:`QuantizedDense`.

    Example:
        >>> type(dense(4, "int8", name="up")).__name__
        'QuantizedDense'
    """
    if check(matmul_precision) == "bf16":
        return layers.Dense(units, **kwargs)
    return QuantizedDense(units, matmul_precision=matmul_precision, **kwargs)


def einsum_dense(equation, output_shape, matmul_precision: str = "bf16",
                 **kwargs) -> layers.EinsumDense:
    """``keras.layers.EinsumDense`` under ``"bf16"``, else :class:`QuantizedEinsumDense`.

    Example:
        >>> type(einsum_dense("btd,dnh->btnh", (None, 2, 3), "bf16")).__name__
        'EinsumDense'
    """
    if check(matmul_precision) == "bf16":
        return layers.EinsumDense(equation, output_shape, **kwargs)
    return QuantizedEinsumDense(equation, output_shape, matmul_precision=matmul_precision,
                                **kwargs)
