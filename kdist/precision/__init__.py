"""Low-precision matmul training: the ``matmul_precision`` policy (``"bf16"``, ``"int8"``,
``"int8-sr"``, ``"fp8"``), its quantizers, quantized matmuls with quantized backward
passes, and the Keras layers the models build their projections with. See
``docs/precision.md``.

==============  ==============================================================================
``policy``      the names (``bf16``, ``int8``, ``int8-sr``, ``fp8``), ``check``, ``precision()``
``quantize``    dynamic symmetric scales and int8 / float8 codes; stochastic int8 rounding
``matmul``      quantized matmuls whose backward products are quantized too (custom VJP)
``layers``      ``QuantizedDense``, ``QuantizedEinsumDense``; the models' factories
``peak``        the peak MFU divides by under a quantized policy (``kdist plan``)
==============  ==============================================================================

Example:
    >>> import kdist
    >>> kdist.precision("int8").quantized
    True
"""

import sys
import types

from kdist.precision.layers import QuantizedDense, QuantizedEinsumDense, dense, einsum_dense
from kdist.precision.matmul import fp8_matmul, int8_matmul, int8_sr_matmul
from kdist.precision.policy import PRECISIONS, Precision, check, precision

__all__ = ["PRECISIONS", "Precision", "QuantizedDense", "QuantizedEinsumDense", "check",
           "dense", "einsum_dense", "fp8_matmul", "int8_matmul", "int8_sr_matmul",
           "precision"]


class _CallablePackage(types.ModuleType):
    """``kdist.precision("int8")`` calls :func:`precision` while ``kdist.precision`` stays
    this package (its modules reachable as attributes): a function of the same name would
    be replaced by the package whenever a submodule is first imported."""

    def __call__(self, name: str = "bf16") -> Precision:
        return precision(name)


sys.modules[__name__].__class__ = _CallablePackage
