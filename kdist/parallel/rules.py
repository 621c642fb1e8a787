"""Logical axes of weights, and the rules that map them to mesh axes — as data.

Every weight dimension has a *logical axis* saying what it means (``vocab``, ``embed``,
``heads``, ...). :data:`LOGICAL_TO_MESH` maps logical axes to mesh axes, so one rule set
serves every strategy: ``embed -> fsdp`` gives ZeRO-3 style weight sharding,
``heads/mlp/vocab -> model`` gives Megatron-style tensor parallelism, and a mesh axis of
size 1 simply drops out. A new mesh axis adds its rules here.

A layer declares its weights' logical axes where it creates them:
:func:`add_weight` for its own weights, :func:`build_with_axes` for a Keras sublayer's
(``Dense``, ``EinsumDense``, ``LayerNormalization``). The axes travel on the variable
(``variable.logical_axes``), so a layout can be found at creation — Keras asks the
distribution then — and later, for abstract variables that were never initialised
(``kdist.planning``). Models without declarations (a user's, keras-hub's) can register a
table of path regexes (:func:`register_logical_axes`) or use auto-sharding.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Mapping, Sequence

# Which mesh axis each logical axis of a weight is sharded over. Axes not listed
# (head_dim, position, norm) are never sharded.
LOGICAL_TO_MESH: dict[str, str] = {
    "embed": "fsdp",
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "layers": "stage",  # a scanned stack's layers: contiguous pipeline stages
    "expert": "expert",  # a MoE layer's experts (kdist.models.moe, kdist.parallel.experts)
}
# "layers": the leading layer axis of a scanned stack's weights (kdist.models.scan).
# Where a logical axis goes when its mesh axis above has size 1 (and the dimension divides):
# without tensor parallelism the vocabulary (token table, output head) is split over the
# pipeline stages, which all run the embedding and the head (kdist.parallel.pipeline): each
# computes 1/S of the logits, and only activations cross between stages.
FALLBACK_MESH: dict[str, str] = {"vocab": "stage"}
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "position", "norm",
                "layers", "expert")
# Activations' logical axes -> mesh axes, beside the weights' rules: the batch is split over
# every replica axis at once, a sequence's tokens over seq (context parallelism), heads
# over model. The layouts of what crosses into a per-device region (a pipeline's stages,
# context attention, the per-device loss) come from here (activation_spec).
ACTIVATION_TO_MESH: dict[str, tuple[str, ...]] = {
    "batch": ("replica", "data", "fsdp", "expert"),
    "length": ("seq",),
    "heads": ("model",),
    "kv_heads": ("model",),
}

Axes = tuple[str | None, ...]

_TABLES: dict[str, Axes] = {}  # registered pattern -> logical axes
_pending = threading.local()   # weight name -> axes, while a layer builds


def _checked(axes: Sequence[str | None], what: str) -> Axes:
    axes = tuple(axes)
    unknown = [a for a in axes if a is not None and a not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"Logical axes {unknown} of {what} are unknown. Expected names from "
                         f"{LOGICAL_AXES} (or None).")
    return axes


def register_logical_axes(table: Mapping[str, Sequence[str | None]]) -> None:
    """Registers a table from weight-path regex to logical axes (for models whose layers
    do not declare them). Patterns are matched with ``re.fullmatch`` against
    ``variable.path``; the same pattern again with other axes is an error.

    Example:
        >>> register_logical_axes({r"(.*/)?my_dense/kernel": ("embed", "mlp")})
    """
    for pattern, axes in table.items():
        axes = _checked(axes, f"pattern {pattern!r}")
        if _TABLES.get(pattern, axes) != axes:
            raise ValueError(
                f"Pattern {pattern!r} is already registered with logical axes "
                f"{_TABLES[pattern]}; refusing to redefine it as {axes}."
            )
        _TABLES[pattern] = axes


def logical_axes_for(path: str) -> Axes | None:
    """The logical axes a registered table gives a weight path, or None.

    Raises ``ValueError`` if several patterns with different axes match the path.
    """
    matches = {p: a for p, a in _TABLES.items() if re.fullmatch(p, path)}
    if len(set(matches.values())) > 1:
        raise ValueError(
            f"Weight '{path}' matches several logical-axes patterns with different axes: "
            f"{matches}. Make the patterns in the model's table mutually exclusive."
        )
    return next(iter(matches.values()), None)


@contextlib.contextmanager
def _declaring(axes_by_name: Mapping[str, Sequence[str | None]]):
    previous = getattr(_pending, "axes", None)
    _pending.axes = {n: _checked(a, f"weight '{n}'") for n, a in axes_by_name.items()}
    try:
        yield
    finally:
        _pending.axes = previous


def _tag(variables, axes_by_name) -> None:
    for v in variables:
        name = v.path.rsplit("/", 1)[-1]
        if name in axes_by_name:
            v.logical_axes = tuple(axes_by_name[name])


def add_weight(layer, name: str, shape: Sequence[int], axes: Sequence[str | None],
               **kwargs):
    """``layer.add_weight(name=name, shape=shape, **kwargs)`` with the weight's logical axes
    declared: its layout follows from them under any kdist mesh.

    Example:
        >>> class Scale(keras.layers.Layer):
        ...     def build(self, shape):
        ...         self.scale = add_weight(self, "scale", (shape[-1],), ("embed",),
        ...                                 initializer="ones")
    """
    with _declaring({name: axes}):
        variable = layer.add_weight(name=name, shape=tuple(shape), **kwargs)
    _tag([variable], {name: axes})
    return variable


def build_with_axes(sublayer, input_shape, **axes_by_name: Sequence[str | None]) -> None:
    """Builds a Keras sublayer so that each weight named in ``axes_by_name`` gets those
    logical axes (e.g. ``kernel=("embed", "mlp"), bias=("mlp",)``).

    Example:
        >>> dense = keras.layers.Dense(64, name="up")
        >>> build_with_axes(dense, (None, 32), kernel=("embed", "mlp"), bias=("mlp",))
        >>> dense.kernel.logical_axes
        ('embed', 'mlp')
    """
    with _declaring(axes_by_name):
        sublayer.build(input_shape)
    _tag(sublayer.weights, axes_by_name)


def declared_axes(variable) -> Axes | None:
    """The logical axes declared for a variable (by its layer, or a registered table)."""
    axes = getattr(variable, "logical_axes", None)
    if axes is not None:
        return tuple(axes)
    pending = getattr(_pending, "axes", None)
    if pending:  # inside add_weight / build_with_axes: Keras asks before we can tag
        name = variable.path.rsplit("/", 1)[-1]
        if name in pending:
            return pending[name]
    return logical_axes_for(variable.path)


def activation_spec(logical: Sequence[str | None], sizes: Mapping[str, int],
                    axes=None) -> tuple:
    """The ``PartitionSpec`` entries of an activation with these logical axes (one per
    dimension; None: not split): each dimension over its mesh axes of size > 1 — only those
    in ``axes`` when given (a ``shard_map``'s specs may name only its own manual axes).

    Example:
        >>> activation_spec(("batch", "length", None), {"data": 2, "fsdp": 4, "seq": 2})
        (('data', 'fsdp'), 'seq', None)
        >>> activation_spec(("batch", "length", None), {"data": 2, "seq": 2}, axes={"seq"})
        (None, 'seq', None)
    """
    out = []
    for name in logical:
        mesh = tuple(a for a in ACTIVATION_TO_MESH.get(name, ()) if sizes.get(a, 1) > 1
                     and (axes is None or a in axes))
        out.append(None if not mesh else mesh[0] if len(mesh) == 1 else mesh)
    return tuple(out)
