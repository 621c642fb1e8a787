"""How one kdist weight is made from one Hugging Face tensor: a short chain of exact steps.

A :class:`TensorMap` says ``kdist weight = steps(HF tensor key[region])``, where the region
picks a part of a fused tensor (GPT-2's ``c_attn`` holds query, key and value side by side)
and each step is a pure re-indexing: :class:`Transpose` (``nn.Linear``'s ``(out, in)`` to
Keras' ``(in, out)``), :class:`Split` (one axis of ``N * H`` into head axes ``(N, H)``) or
:class:`Pad` (zero rows appended: GPT-2's 50257-row table padded to 50304). Because every
step only moves elements, both directions follow from the one description:

* :meth:`TensorMap.read` maps a *shard* of the kdist weight (the index one device holds)
  back to the smallest box of the HF tensor that contains it and reads only that box — so
  a device's shard is read without the rest of the tensor;
* :meth:`TensorMap.to_hf` turns a whole kdist weight back into its region of the HF tensor
  (export), exactly: no arithmetic touches a value.

Example:
    >>> hf = np.arange(12.0).reshape(2, 6)            # (D=2, 3 * N*H) fused, N=2, H=1
    >>> key = TensorMap("c_attn", (2, 6), region=((0, 2), (2, 4)), steps=(Split(1, (2, 1)),))
    >>> key.shape
    (2, 2, 1)
    >>> key.read(lambda name, box: hf[box], (slice(0, 2), slice(1, 2), slice(0, 1))).ravel()
    array([3., 9.])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis
Reader = Callable[[str, tuple[slice, ...]], np.ndarray]  # (HF key, box) -> values


@dataclass(frozen=True)
class Transpose:
    """Output axis ``i`` is input axis ``perm[i]`` (``np.transpose``)."""

    perm: tuple[int, ...]

    def shape(self, shape):
        return tuple(shape[p] for p in self.perm)


@dataclass(frozen=True)
class Split:
    """Input axis ``axis`` (of size ``prod(sizes)``) becomes axes ``axis ... axis+len-1``
    of ``sizes``, row-major (``np.reshape``)."""

    axis: int
    sizes: tuple[int, ...]

    def shape(self, shape):
        if shape[self.axis] != math.prod(self.sizes):
            raise ValueError(f"cannot split an axis of {shape[self.axis]} into {self.sizes}")
        return shape[:self.axis] + tuple(self.sizes) + shape[self.axis + 1:]


@dataclass(frozen=True)
class Pad:
    """Input axis ``axis`` is extended with zeros to ``size`` (padding rows never used)."""

    axis: int
    size: int

    def shape(self, shape):
        if self.size < shape[self.axis]:
            raise ValueError(f"cannot pad an axis of {shape[self.axis]} to {self.size}")
        return shape[:self.axis] + (self.size,) + shape[self.axis + 1:]


Step = Transpose | Split | Pad


@dataclass(frozen=True)
class TensorMap:
    """``kdist weight = steps(hf[key][region])``; ``hf_shape`` is the HF tensor's shape.

    ``region`` (``(start, stop)`` per axis, None = the whole tensor) is the part of the HF
    tensor this weight comes from; the other parts belong to other weights (a fused
    tensor). ``shape`` is the kdist weight's shape the chain produces.
    """

    key: str
    hf_shape: tuple[int, ...]
    region: Box | None = None
    steps: tuple[Step, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "hf_shape", tuple(int(n) for n in self.hf_shape))
        if self.region is not None:
            object.__setattr__(self, "region", tuple((int(a), int(b)) for a, b in self.region))
        self.shapes()  # a chain that does not fit its shapes fails where it is written

    def shapes(self) -> list[tuple[int, ...]]:
        """The shape before each step, then the final one."""
        shape = (tuple(b - a for a, b in self.region) if self.region is not None
                 else self.hf_shape)
        shapes = [shape]
        for step in self.steps:
            shape = step.shape(shape)
            shapes.append(shape)
        return shapes

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shapes()[-1]

    @property
    def full_region(self) -> Box:
        return self.region if self.region is not None else tuple((0, n) for n in self.hf_shape)

    # === Loading: a shard of the kdist weight from the HF tensor ===

    def read(self, reader: Reader, index: Sequence[slice] | None = None) -> np.ndarray:
        """The kdist weight's values at ``index`` (one device's shard; None = all), reading
        only the box of the HF tensor that holds them through ``reader(key, box)``."""
        shape = self.shape
        index = tuple(index) if index is not None else ()
        index = index + (slice(None),) * (len(shape) - len(index))
        box = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        return self._read(len(self.steps), box, reader)

    def _read(self, depth: int, box: Box, reader: Reader) -> np.ndarray:
        """Values of the box ``box`` of the array after the first ``depth`` steps."""
        if depth == 0:
            offset = self.full_region
            source = tuple(slice(o + a, o + b) for (o, _), (a, b) in zip(offset, box))
            return reader(self.key, source)
        step, before = self.steps[depth - 1], self.shapes()[depth - 1]
        if isinstance(step, Transpose):
            inner = [None] * len(box)
            for out_axis, in_axis in enumerate(step.perm):
                inner[in_axis] = box[out_axis]
            return np.transpose(self._read(depth - 1, tuple(inner), reader), step.perm)
        if isinstance(step, Pad):
            real = before[step.axis]
            a, b = box[step.axis]
            inner = list(box)
            inner[step.axis] = (min(a, real), min(b, real))
            values = self._read(depth - 1, tuple(inner), reader)
            missing = (b - a) - (inner[step.axis][1] - inner[step.axis][0])
            if missing:  # padding rows: zeros
                widths = [(0, 0)] * values.ndim
                widths[step.axis] = (0, missing)
                values = np.pad(values, widths)
            return values
        return self._read_split(depth, step, box, reader)

    def _read_split(self, depth: int, step: Split, box: Box, reader: Reader) -> np.ndarray:
        """The box, read as runs that are contiguous in the flat (unsplit) axis: one run
        when the box is row-contiguous (kdist's shards over heads), one per outer index
        otherwise (a bias ``(N, H)`` split over ``fsdp`` along ``H``) — never more than it
        holds."""
        k, axis = len(step.sizes), step.axis
        group = box[axis:axis + k]
        lengths = tuple(b - a for a, b in group)
        if 0 in lengths:  # an empty box
            values = self._read(depth - 1, box[:axis] + ((0, 0),) + box[axis + k:], reader)
            return values.reshape(values.shape[:axis] + lengths + values.shape[axis + 1:])
        # The first axis from which every later one is whole: runs are [a_j, b_j) x the rest.
        j = max([i for i in range(k) if lengths[i] != step.sizes[i]], default=0)
        inner_size = math.prod(step.sizes[j + 1:])
        runs = []
        for prefix in np.ndindex(*lengths[:j]):
            outer = [group[i][0] + prefix[i] for i in range(j)]
            start = int(np.ravel_multi_index(outer + [group[j][0]] + [0] * (k - j - 1),
                                             step.sizes)) if k else 0
            runs.append((start, start + lengths[j] * inner_size))
        parts = [self._read(depth - 1, box[:axis] + (run,) + box[axis + k:], reader)
                 for run in runs]
        values = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
        return values.reshape(values.shape[:axis] + lengths + values.shape[axis + 1:])

    # === Export: the HF region from the whole kdist weight ===

    def to_hf(self, values: np.ndarray) -> np.ndarray:
        """The whole kdist weight ``values`` as this map's region of the HF tensor (the
        inverse of the chain: padding rows dropped, transposes undone, head axes merged)."""
        shapes = self.shapes()
        if tuple(values.shape) != shapes[-1]:
            raise ValueError(f"{self.key}: expected a kdist weight of shape {shapes[-1]}, got "
                             f"{tuple(values.shape)}")
        for step, before in zip(reversed(self.steps), reversed(shapes[:-1])):
            if isinstance(step, Transpose):
                values = np.transpose(values, np.argsort(step.perm))
            elif isinstance(step, Pad):
                values = np.take(values, np.arange(before[step.axis]), axis=step.axis)
            else:
                values = values.reshape(before)
        return values


def assemble(maps_and_values: Sequence[tuple[TensorMap, np.ndarray]]) -> np.ndarray:
    """One HF tensor from the kdist weights whose maps share its key (each fills its region).

    Raises ``ValueError`` if the regions do not cover the tensor exactly once.

    Example:
        >>> a = TensorMap("t", (2, 4), region=((0, 2), (0, 2)))
        >>> b = TensorMap("t", (2, 4), region=((0, 2), (2, 4)))
        >>> assemble([(a, np.zeros((2, 2))), (b, np.ones((2, 2)))]).sum()
        4.0
    """
    first = maps_and_values[0][0]
    if len(maps_and_values) == 1 and first.region is None:
        return first.to_hf(maps_and_values[0][1])
    dtype = np.result_type(*[v.dtype for _, v in maps_and_values])
    out = np.zeros(first.hf_shape, dtype)
    filled = 0
    for tensor_map, values in maps_and_values:
        box = tuple(slice(a, b) for a, b in tensor_map.full_region)
        out[box] = tensor_map.to_hf(values)
        filled += math.prod(b - a for a, b in tensor_map.full_region)
    if filled != math.prod(first.hf_shape):
        raise ValueError(f"The kdist weights mapped to '{first.key}' fill {filled} of its "
                         f"{math.prod(first.hf_shape)} elements; the mapping is incomplete.")
    return out
