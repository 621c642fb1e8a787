"""A stacked kdist weight (``scan_layers=True``) made from its layers' Hugging Face tensors.

A :class:`kdist.models.scan.LayerStack` holds every block weight once, stacked on leading
layer dimensions: ``blocks/attention/query/kernel`` of shape ``(L, ...)``, or ``(R, L / R,
...)`` under a pipeline with ``R`` circular repeats — the same layers in row-major order,
so element ``[r, j]`` is layer ``r * (L / R) + j`` (:mod:`kdist.models.stacking`). A
Hugging Face checkpoint stores each layer separately (``transformer.h.<i>.attn.c_attn.weight``).
:class:`StackedMap` is the stacked weight's mapping: one
:class:`~kdist.models.hf.tensors.TensorMap` per layer, with the stack's leading dimensions
in front of theirs.

* :meth:`StackedMap.read` reads a device's shard — only the layers in its leading
  slice(s), and of each only the box of the rest — so under a pipeline every stage reads
  its own layers, and inside them every device its own box, layer by layer;
* :meth:`StackedMap.to_hf` splits a whole stacked weight into its layers' HF regions
  (export; :func:`layer_index` names the leading index of one layer).

Example:
    >>> from kdist.models.hf.tensors import TensorMap
    >>> hf = {f"h.{i}.b": np.full(4, float(i)) for i in range(4)}
    >>> stack = StackedMap(tuple(TensorMap(f"h.{i}.b", (4,)) for i in range(4)), (2, 2))
    >>> stack.shape
    (2, 2, 4)
    >>> stack.read(lambda key, box: hf[key][box], (slice(1, 2), slice(0, 2), slice(0, 1))).ravel()
    array([2., 3.])
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kdist.models import stacking
from kdist.models.hf.tensors import Reader, TensorMap


@dataclass(frozen=True)
class StackedMap:
    """``kdist weight[lead index of layer i] = layers[i]``; ``lead``: the stack's leading
    dimensions, ``(L,)`` or ``(R, L / R)`` (default ``(len(layers),)``)."""

    layers: tuple[TensorMap, ...]
    lead: tuple[int, ...] | None = None

    def __post_init__(self):
        lead = tuple(int(n) for n in (self.lead or (len(self.layers),)))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "lead", lead)
        if math.prod(lead) != len(self.layers) or not self.layers:
            raise ValueError(f"a stack of leading shape {lead} needs {math.prod(lead)} layers; "
                             f"got {len(self.layers)}")
        shapes = {m.shape for m in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"the layers of a stack must have one shape; got {sorted(shapes)}")

    @property
    def per_layer_shape(self) -> tuple[int, ...]:
        return self.layers[0].shape

    @property
    def shape(self) -> tuple[int, ...]:
        return self.lead + self.per_layer_shape

    def viewed(self, shape: Sequence[int]) -> StackedMap:
        """This stack with the leading dimensions of ``shape`` when ``shape`` is a view of it
        (``(L, ...)`` <-> ``(R, L / R, ...)``: the layers in the same order), else itself."""
        shape = tuple(int(n) for n in shape)
        lead = shape[: len(shape) - len(self.per_layer_shape)]
        if (len(lead) in (1, 2) and shape[len(lead):] == self.per_layer_shape
                and math.prod(lead) == len(self.layers)):
            return StackedMap(self.layers, lead)
        return self

    def read(self, reader: Reader, index: Sequence[slice] | None = None) -> np.ndarray:
        """The stacked weight's values at ``index`` (one device's shard; None = all): for each
        layer in the leading slices, only its box of the rest, read through its own map."""
        k = len(self.lead)
        index = tuple(index) if index is not None else ()
        index = index + (slice(None),) * (len(self.shape) - len(index))
        ranges = [range(*s.indices(n)) for s, n in zip(index[:k], self.lead)]
        rest = index[k:]
        lengths = tuple(len(r) for r in ranges)
        if 0 in lengths:  # an empty box: an empty read of layer 0 gives the dtype
            box = tuple(len(range(*s.indices(n))) for s, n in zip(rest, self.per_layer_shape))
            empty = self.layers[0].read(reader, (slice(0, 0),) + rest[1:])
            return empty.reshape(lengths + box)
        # Row-major over the leading box: the stack's layer order.
        parts = [self.layers[int(np.ravel_multi_index(at, self.lead))].read(reader, rest)
                 for at in itertools.product(*ranges)]
        values = np.stack(parts)
        return values.reshape(lengths + values.shape[1:])

    def to_hf(self, values: np.ndarray) -> list[np.ndarray]:
        """The whole stacked weight ``values`` as each layer's region of its HF tensor."""
        if tuple(values.shape) != self.shape:
            raise ValueError(f"{self.layers[0].key} ...: expected a stacked weight of shape "
                             f"{self.shape}, got {tuple(values.shape)}")
        flat = np.reshape(values, (len(self.layers),) + self.per_layer_shape)
        return [m.to_hf(v) for m, v in zip(self.layers, flat)]

    def layer_index(self, layer: int) -> tuple[int, ...]:
        """The leading index of layer ``layer`` in the stack (``(i,)`` or ``(r, j)``)."""
        return tuple(int(i) for i in np.unravel_index(layer, self.lead))


def stacked_map(path: str, config: dict,
                tensor_map: Callable[[str, dict], object]) -> StackedMap | None:
    """The :class:`StackedMap` of a stacked block weight path (``blocks/...``,
    ``encoder_blocks/...``): layer ``i`` is what ``tensor_map`` gives for the unstacked path
    ``block_<i>/...`` (a stack itself for a MoE layer's experts: then one stack of leading
    shape ``(L, E)``). None if ``path`` is not stacked, or a layer has no HF tensor."""
    if stacking.unstacked_key(path, 0) is None:
        return None
    layers = [tensor_map(stacking.unstacked_key(path, i), config)
              for i in range(config["num_layers"])]
    if all(isinstance(m, StackedMap) for m in layers):  # a MoE layer's experts: (L, E, ...)
        return StackedMap(tuple(t for m in layers for t in m.layers),
                          (len(layers),) + layers[0].lead)
    if any(not isinstance(m, TensorMap) for m in layers):
        return None
    return StackedMap(tuple(layers))


def parts(tensor_map) -> tuple[TensorMap, ...]:
    """The per-tensor maps of a weight's map: its layers for a stack, else itself."""
    return tensor_map.layers if isinstance(tensor_map, StackedMap) else (tensor_map,)


def fitted(tensor_map, shape: Sequence[int]):
    """``tensor_map`` with a stack's leading dimensions taken from the variable's ``shape``
    (the repeats a pipeline asked for when the model was built)."""
    return tensor_map.viewed(shape) if isinstance(tensor_map, StackedMap) else tensor_map
