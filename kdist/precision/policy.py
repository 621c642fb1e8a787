"""The matmul precision policy: which arithmetic the Transformer's large matmuls use.

``"bf16"`` (default) leaves them to Keras' dtype policy (bfloat16 under
``mixed_bfloat16``, float32 under ``float32``): nothing is quantized. ``"int8"`` runs the
forward matmul and both backward matmuls with int8 operands and int32 accumulation
(:func:`kdist.precision.matmul.int8_matmul`); ``"int8-sr"`` the same with the gradients'
codes stochastically rounded (:func:`kdist.precision.matmul.int8_sr_matmul`); ``"fp8"``
with float8 operands, e4m3 forward and e5m2 gradients
(:func:`kdist.precision.matmul.fp8_matmul`). Weights, optimizer state,
softmax, norms and the loss are the dtype policy's under every precision.
"""

from __future__ import annotations

import dataclasses

PRECISIONS = ("bf16", "int8", "int8-sr", "fp8")


@dataclasses.dataclass(frozen=True)
class Precision:
    """A checked matmul precision: its ``name`` and the peak (``kdist.accelerators``'
    table's column) its matmuls are counted against.

    Example:
        >>> precision("int8").quantized, precision("bf16").peak, precision("int8-sr").peak
        (True, 'bf16', 'int8')
    """

    name: str

    @property
    def quantized(self) -> bool:
        return self.name != "bf16"

    @property
    def peak(self) -> str:
        """The peak-table column of the quantized matmuls' rate: ``"int8-sr"``'s matmuls
        are int8's (only how the gradients' codes round differs)."""
        return "int8" if self.name == "int8-sr" else self.name


def check(name, argument: str = "matmul_precision") -> str:
    """``name`` if it is one of :data:`PRECISIONS`, else a ``ValueError`` naming
    ``argument``, what it got and what to pass.

    Example:
        >>> check("int8")
        'int8'
    """
    if name not in PRECISIONS:
        raise ValueError(f"{argument}={name!r} is not a matmul precision. Pass one of "
                         f"{', '.join(repr(p) for p in PRECISIONS)} ('bf16': the dtype "
                         f"policy's unquantized matmuls; 'int8'/'fp8': quantized matmuls; "
                         f"'int8-sr': int8 with stochastically rounded gradients).")
    return name


def precision(name: str = "bf16") -> Precision:
    """The matmul precision policy ``name`` (``"bf16"``, ``"int8"``, ``"int8-sr"`` or
    ``"fp8"``), checked.
    Pass its name as a backbone's ``matmul_precision`` to train under it.

    Example:
        >>> import kdist
        >>> kdist.precision("fp8").name
        'fp8'
    """
    return Precision(check(name, "precision"))
