"""Converting weights between unstacked blocks and a stacked layer stack, by weight path.

An unstacked backbone has one block per layer, ``block_0/attention/query/kernel``,
``block_1/...`` (BERT: ``encoder_block_<i>/...``). A backbone built with
``scan_layers=True`` (:class:`kdist.models.scan.LayerStack`) holds each block weight once,
stacked on a leading layer axis: ``blocks/attention/query/kernel`` of shape ``(L, ...)``
(BERT: ``encoder_blocks/...``), or ``(R, L / R, ...)`` under a pipeline with ``R``
circular repeats — the same layers in the same (row-major) order, only viewed with two
leading dimensions. Every conversion here is pure data movement, so it is exact.

The functions take and return plain ``{key: array}`` dicts (NumPy or JAX arrays). Keys
are weight paths (``variable.path``), or any string naming one the same way: the
checkpoint keys ``params.block_0.attention.query.kernel`` and optimizer slots
``optimizer.block_0_attention_query_kernel_momentum`` convert alike, since the block
index is found between separators (``/``, ``.`` or ``_``).

* :func:`stack_layer_weights` — unstacked to stacked;
* :func:`unstack_layer_weights` — stacked to unstacked;
* :func:`match_layer_layout` — whatever the source, the layout of a given target (its
  keys and shapes), e.g. a model's ``{w.path: w.shape}``;
* :func:`conversion_plan` — the same decision without the arrays (what to read, how to
  combine it), for readers that load lazily (checkpoints).

Example:
    >>> import numpy as np
    >>> w = {f"block_{i}/mlp/up/kernel": np.full((2, 3), i) for i in range(4)}
    >>> stacked = stack_layer_weights(w)
    >>> stacked["blocks/mlp/up/kernel"].shape
    (4, 2, 3)
    >>> int(unstack_layer_weights(stacked)["block_3/mlp/up/kernel"][0, 0])
    3
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

# Block name of each family -> the stack's name is the block name + "s".
BLOCK_NAMES = ("encoder_block", "block")
_SEP = r"[/._]"
_UNSTACKED = re.compile(
    rf"^(?P<pre>(?:.*?{_SEP})?)(?P<name>{'|'.join(BLOCK_NAMES)})_(?P<index>\d+)"
    rf"(?P<rest>{_SEP}.+)$")
_STACKED = re.compile(
    rf"^(?P<pre>(?:.*?{_SEP})?)(?P<name>{'|'.join(BLOCK_NAMES)})s(?P<rest>{_SEP}.+)$")


def stacked_key(key: str) -> tuple[str, int] | None:
    """``(stacked key, layer index)`` of an unstacked block weight's key, else None.

    Example:
        >>> stacked_key("params.encoder_block_7.mlp.up.kernel")
        ('params.encoder_blocks.mlp.up.kernel', 7)
        >>> stacked_key("token_embedding/embeddings") is None
        True
    """
    m = _UNSTACKED.match(key)
    if not m:
        return None
    return f"{m['pre']}{m['name']}s{m['rest']}", int(m["index"])


def unstacked_key(key: str, index: int) -> str | None:
    """The key of layer ``index`` of a stacked weight's key, else None (not stacked).

    Example:
        >>> unstacked_key("optimizer.blocks_mlp_up_kernel_momentum", 2)
        'optimizer.block_2_mlp_up_kernel_momentum'
    """
    m = _STACKED.match(key)
    if not m:
        return None
    return f"{m['pre']}{m['name']}_{index}{m['rest']}"


@dataclasses.dataclass(frozen=True)
class Source:
    """How one target array is made from source arrays.

    ``kind``: ``"copy"`` (``keys[0]`` as it is, reshaped to ``shape`` when only the
    leading layer dimensions differ), ``"stack"`` (``keys`` stacked in order on a new
    leading axis, then reshaped to ``shape``) or ``"slice"`` (layer ``index`` of the stack
    ``keys[0]``, whose leading dimensions are flattened first).
    """

    kind: str
    keys: tuple[str, ...]
    shape: tuple[int, ...]
    index: int = 0


def _prod(shape) -> int:
    return math.prod(int(d) for d in shape)


def _plan_one(key: str, shape: tuple[int, ...], source: Mapping[str, tuple]) -> Source | str:
    """The :class:`Source` of ``key``, or a sentence saying why there is none."""
    if key in source:
        have = tuple(source[key])
        if have == shape:
            return Source("copy", (key,), shape)
        # Both stacked, viewed with other leading dims ((L, ...) vs (R, L/R, ...)).
        if _STACKED.match(key) and _prod(have) == _prod(shape) and _same_tail(have, shape):
            return Source("copy", (key,), shape)
        return f"'{key}' has shape {have} in the source but {shape} in the target"
    layers = []
    m = _STACKED.match(key)
    if m:  # a stacked target: its layers from unstacked source weights
        for i in range(_prod(shape)):
            k = unstacked_key(key, i)
            if k not in source:
                break
            layers.append(k)
        if layers:
            per_layer = tuple(source[layers[0]])
            lead = shape[: len(shape) - len(per_layer)]
            if shape[len(lead):] == per_layer and _prod(lead) == len(layers) and all(
                    tuple(source[k]) == per_layer for k in layers):
                return Source("stack", tuple(layers), shape)
            return (f"'{key}' (shape {shape}) does not match the {len(layers)} layers "
                    f"'{layers[0]}' ... (shape {per_layer}) of the source")
        return f"'{key}' (shape {shape}) is missing from the source, stacked or not"
    found = stacked_key(key)
    if found:  # an unstacked target: one layer of a stacked source weight
        stack, index = found
        if stack in source:
            have = tuple(source[stack])
            lead = have[: len(have) - len(shape)]
            if have[len(lead):] == tuple(shape) and index < _prod(lead):
                return Source("slice", (stack,), shape, index)
            return (f"'{key}' (shape {shape}) is not a layer of '{stack}' (shape {have}) in "
                    f"the source")
    return f"'{key}' (shape {shape}) is missing from the source"


def _same_tail(a: tuple, b: tuple) -> bool:
    """Whether two shapes are views of one stack: the same per-layer shape after one or two
    leading layer dims holding the same number of layers (row-major, so the same order)."""
    for n in (1, 2):
        for k in (1, 2):
            if len(a) > n and len(b) > k and a[n:] == b[k:] and _prod(a[:n]) == _prod(b[:k]):
                return True
    return False


def reviewed(value, shape: Sequence[int]):
    """``value`` reshaped to ``shape`` when the two are views of one layer stack (``(L,
    ...)`` and ``(R, L / R, ...)``: another pipeline's circular repeats), else unchanged.

    Example:
        >>> reviewed(np.zeros((4, 3)), (2, 2, 3)).shape
        (2, 2, 3)
    """
    have, shape = tuple(np.shape(value)), tuple(int(d) for d in shape)
    if have != shape and _same_tail(have, shape):
        return np.reshape(value, shape)
    return value


def conversion_plan(target: Mapping[str, Sequence[int]],
                    source: Mapping[str, Sequence[int]]) -> dict[str, Source]:
    """For every target key and shape, how to make it from the source's keys and shapes.

    Raises ``ValueError`` naming every target key that cannot be made (missing, or a
    shape that is not the same weight stacked or unstacked), before anything is read.

    Example:
        >>> plan = conversion_plan({"blocks/x": (2, 3)}, {"block_0/x": (3,), "block_1/x": (3,)})
        >>> plan["blocks/x"].kind, plan["blocks/x"].keys
        ('stack', ('block_0/x', 'block_1/x'))
    """
    source = {k: tuple(int(d) for d in v) for k, v in source.items()}
    out, problems = {}, []
    for key, shape in target.items():
        found = _plan_one(key, tuple(int(d) for d in shape), source)
        if isinstance(found, str):
            problems.append(found)
        else:
            out[key] = found
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                           if len(problems) > 5 else "")
        raise ValueError(f"The weights do not convert to the target layout: {shown}. "
                         f"Stacked and unstacked blocks convert into each other "
                         f"(kdist.models.stacking); other differences (another preset, "
                         f"another vocabulary) do not.")
    return out


def apply_plan(plan: Mapping[str, Source], arrays: Mapping[str, object], xp=np) -> dict:
    """The target arrays of ``plan`` made from ``arrays`` (``xp``: ``numpy`` or
    ``jax.numpy``, whichever the arrays are)."""
    out = {}
    for key, src in plan.items():
        if src.kind == "copy":
            out[key] = xp.reshape(arrays[src.keys[0]], src.shape)
        elif src.kind == "stack":
            out[key] = xp.reshape(xp.stack([arrays[k] for k in src.keys]), src.shape)
        else:
            stack = arrays[src.keys[0]]
            flat = xp.reshape(stack, (-1,) + tuple(src.shape))
            out[key] = flat[src.index]
    return out


def match_layer_layout(weights: Mapping[str, object],
                       target: Mapping[str, Sequence[int]]) -> dict:
    """``weights`` converted to the keys and shapes of ``target`` (e.g. ``{w.path: w.shape
    for w in model.weights}``): stacked, unstacked or re-viewed as needed, exactly.

    Example:
        >>> import numpy as np
        >>> w = {"blocks/x": np.arange(6).reshape(2, 3)}
        >>> match_layer_layout(w, {"block_1/x": (3,)})["block_1/x"].tolist()
        [3, 4, 5]
    """
    plan = conversion_plan(target, {k: np.shape(v) for k, v in weights.items()})
    return apply_plan(plan, weights, _array_module(weights))


def _array_module(weights):
    if any(type(v).__module__.startswith("jax") for v in weights.values()):
        import jax.numpy as jnp

        return jnp
    return np


def stack_layer_weights(weights: Mapping[str, object], repeats: int = 1) -> dict:
    """Every group of unstacked block weights (``block_<i>/<rest>``, ``encoder_block_<i>/
    <rest>``, for i = 0 .. L-1) as one stacked weight ``blocks/<rest>`` of shape ``(L, ...)``
    (``(repeats, L / repeats, ...)`` for a pipeline with circular repeats); other weights
    unchanged. Raises ``ValueError`` if a group has a gap or mixed shapes.

    Example:
        >>> import numpy as np
        >>> w = {"block_0/b": np.zeros(2), "block_1/b": np.ones(2), "final_norm/gamma": np.ones(2)}
        >>> sorted(stack_layer_weights(w))
        ['blocks/b', 'final_norm/gamma']
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int; got {repeats!r}.")
    groups: dict[str, dict[int, str]] = {}
    target = {}
    for key, value in weights.items():
        found = stacked_key(key)
        if found is None:
            target[key] = tuple(np.shape(value))
        else:
            groups.setdefault(found[0], {})[found[1]] = key
    for stack, members in groups.items():
        count = len(members)
        if sorted(members) != list(range(count)):
            raise ValueError(f"Layers of '{stack}' are not numbered 0 .. {count - 1}: got "
                             f"{sorted(members)}.")
        if count % repeats:
            raise ValueError(f"{count} layers of '{stack}' do not divide into repeats="
                             f"{repeats}; use a repeats value among "
                             f"{[r for r in range(1, count + 1) if count % r == 0]}.")
        lead = (count,) if repeats == 1 else (repeats, count // repeats)
        target[stack] = lead + tuple(np.shape(weights[members[0]]))
    return match_layer_layout(weights, target)


def unstack_layer_weights(weights: Mapping[str, object], num_layers: int | None = None) -> dict:
    """Every stacked weight (``blocks/<rest>`` of shape ``(L, ...)``, or ``(R, L / R, ...)``
    under circular repeats) as L weights ``block_<i>/<rest>``; other weights unchanged.
    ``num_layers``: L, needed only for the ``(R, L / R, ...)`` form (without it the first
    dimension is taken as the layers).

    Example:
        >>> import numpy as np
        >>> w = {"blocks/mlp/up/kernel": np.ones((2, 3, 4, 8))}
        >>> unstack_layer_weights(w, num_layers=6)["block_5/mlp/up/kernel"].shape
        (4, 8)
    """
    target = {}
    for key, value in weights.items():
        shape = tuple(np.shape(value))
        if _STACKED.match(key) is None:
            target[key] = shape
            continue
        dims = 1
        if num_layers is not None:
            dims = next((n for n in (1, 2) if _prod(shape[:n]) == num_layers), 0)
            if not dims:
                raise ValueError(f"'{key}' (shape {shape}) does not hold num_layers="
                                 f"{num_layers} layers on its leading dimensions.")
        for i in range(_prod(shape[:dims])):
            target[unstacked_key(key, i)] = shape[dims:]
    return match_layer_layout(weights, target)
