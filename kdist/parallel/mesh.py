"""The mesh axes kdist knows, mesh specs, and the order devices are laid out in.

Each mesh axis is one :class:`MeshAxis` entry of :data:`AXES`, listed from the slowest-
varying to the fastest-varying: ``np.reshape`` of the device list (ordered process by
process, then by local id, as ``jax.devices()`` gives it) puts neighbouring devices on the
last axis. So ``model`` — whose collectives run inside every layer — stays inside a host,
and ``data`` — one gradient reduction per step — spans hosts. Each axis sits at the
position its traffic calls for: ``replica`` (groups that synchronise every few steps)
outermost, then ``data``, ``stage`` (point-to-point activations between pipeline
stages), ``fsdp`` (weight all-gathers every layer), ``expert`` (an all-to-all of tokens
each way in every MoE layer; the batch is split over it outside them), ``seq`` (keys and
values of every attention layer) and ``model`` innermost. Adding an axis is one entry here plus its
logical-axis rules in :mod:`kdist.parallel.rules` and its transform in a module of
:mod:`kdist.parallel`.

A *mesh spec* names axis sizes: ``"fsdp=8"``, ``"data=2,model=4"``, ``"stage=4,fsdp=2"``,
``"data=2,fsdp=2,model=2"``, ``"fsdp=-1,model=2"`` (``-1`` takes the remaining devices),
``"auto"`` (every device on ``fsdp``) or a strategy shorthand (``"dp"``, ``"fsdp"``,
``"tp"``). Axes not named have size 1.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class MeshAxis:
    """One axis of the device mesh.

    Args:
        name: the name in mesh specs and ``PartitionSpec``s.
        batch: whether the global batch is split over it (a replica axis).
        shorthand: a strategy name that means "every device on this axis", or None.
        doc: one line for error messages and ``kdist plan``.
    """

    name: str
    batch: bool
    shorthand: str | None
    doc: str


# Slowest-varying first (across hosts) to fastest-varying last (inside a host).
AXES: tuple[MeshAxis, ...] = (
    MeshAxis("replica", batch=True, shorthand=None,
             doc="replica groups that synchronise every few steps (DiLoCo)"),
    MeshAxis("data", batch=True, shorthand="dp",
             doc="replicas holding whole weights (data parallel)"),
    MeshAxis("stage", batch=False, shorthand=None,
             doc="consecutive layers split into pipeline stages"),
    MeshAxis("fsdp", batch=True, shorthand="fsdp",
             doc="replicas holding a shard of every weight (ZeRO-3)"),
    MeshAxis("expert", batch=True, shorthand="ep",
             doc="Mixture-of-Experts experts split; tokens go to them by all-to-all"),
    MeshAxis("seq", batch=False, shorthand=None,
             doc="each sequence's tokens split (context parallel)"),
    MeshAxis("model", batch=False, shorthand="tp",
             doc="heads, MLP features and vocabulary split (tensor parallel)"),
)
MESH_AXES: tuple[str, ...] = tuple(a.name for a in AXES)
REPLICA_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.batch)
_SHORTHANDS = {a.shorthand: a.name for a in AXES if a.shorthand}


def batch_axes(sizes: Mapping[str, int] | None,
               among: Container[str] | None = None) -> tuple[str, ...]:
    """The axes that split the batch (:data:`REPLICA_AXES`), in the batch layout's order
    (outermost first): those of size > 1 in ``sizes`` (every one when ``sizes`` is None),
    and of those only the ones in ``among`` when given (e.g. the axes still automatic in a
    region). The one definition of "which axes split the rows".

    Example:
        >>> batch_axes({"replica": 2, "data": 1, "fsdp": 4, "seq": 2})
        ('replica', 'fsdp')
        >>> batch_axes({"replica": 2, "fsdp": 4}, among={"fsdp", "seq"})
        ('fsdp',)
    """
    return tuple(a for a in REPLICA_AXES if (sizes is None or sizes.get(a, 1) > 1)
                 and (among is None or a in among))


def summed_axes(sizes: Mapping[str, int],
                among: Container[str] | None = None) -> tuple[str, ...]:
    """The axes (of size > 1, and in ``among`` when given) a gradient computed per device
    is partial over: the batch axes but ``replica`` (DiLoCo's groups sum nothing per step;
    they average parameters in the sync step), and ``seq`` (each device its tokens).

    Example:
        >>> summed_axes({"replica": 2, "data": 2, "seq": 2, "stage": 2})
        ('data', 'seq')
        >>> summed_axes({"data": 2, "seq": 2}, among={"data", "replica"})
        ('data',)
    """
    tokens = ("seq",) if sizes.get("seq", 1) > 1 and (among is None or "seq" in among) else ()
    return tuple(a for a in batch_axes(sizes, among) if a != "replica") + tokens


def parse_mesh(spec: str, num_devices: int) -> dict[str, int]:
    """Parses a mesh spec into ``{axis: size}`` for every axis, sizes multiplying to
    ``num_devices``.

    Example:
        >>> parse_mesh("data=2,model=-1", 8)
        {'replica': 1, 'data': 2, 'stage': 1, 'fsdp': 1, 'expert': 1, 'seq': 1, 'model': 4}
        >>> parse_mesh("auto", 8)["fsdp"]
        8
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"Mesh spec must be a non-empty string such as 'fsdp=8' or 'data=2,model=4'; "
            f"got {spec!r}."
        )
    text = spec.strip().lower()
    if text == "auto":
        text = "fsdp=-1"
    elif text in _SHORTHANDS:
        text = f"{_SHORTHANDS[text]}=-1"
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name:
            raise ValueError(
                f"Mesh spec {spec!r}: '{part}' is not of the form AXIS=SIZE. "
                f"Write e.g. 'data=2,fsdp=2,model=2', or 'auto'."
            )
        if name not in MESH_AXES:
            raise ValueError(
                f"Mesh spec {spec!r}: unknown axis '{name}'. Valid axes are "
                f"{', '.join(MESH_AXES)} (or the shorthands auto, "
                f"{', '.join(_SHORTHANDS)})."
            )
        if name in sizes:
            raise ValueError(f"Mesh spec {spec!r}: axis '{name}' is given twice.")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(
                f"Mesh spec {spec!r}: size of '{name}' must be an integer (or -1), got '{value}'."
            ) from None
        if size == 0 or size < -1:
            raise ValueError(
                f"Mesh spec {spec!r}: size of '{name}' must be a positive integer or -1, "
                f"got {size}."
            )
        sizes[name] = size
    wildcards = [n for n, s in sizes.items() if s == -1]
    if len(wildcards) > 1:
        raise ValueError(
            f"Mesh spec {spec!r}: only one axis may be -1 (it takes the remaining devices); "
            f"got {wildcards}."
        )
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if wildcards:
        if num_devices % fixed:
            raise ValueError(
                f"Mesh spec {spec!r}: the fixed axes use {fixed} devices, which does not divide "
                f"the {num_devices} available, so '{wildcards[0]}=-1' has no integer size. "
                f"Choose sizes whose product divides {num_devices}."
            )
        sizes[wildcards[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"Mesh spec {spec!r} describes {fixed} devices, but {num_devices} are available. "
            f"The product of the axis sizes must equal the device count: e.g. "
            f"'fsdp={num_devices}', or put -1 on one axis ('data=-1,model=2') to take the rest."
        )
    return {axis: sizes.get(axis, 1) for axis in MESH_AXES}


def full_mesh(sizes: dict[str, int]) -> dict[str, int]:
    """``sizes`` with every axis of :data:`MESH_AXES`, in registry order (size 1 when absent).

    Example:
        >>> full_mesh({"fsdp": 8})
        {'replica': 1, 'data': 1, 'stage': 1, 'fsdp': 8, 'expert': 1, 'seq': 1, 'model': 1}
    """
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"Unknown mesh axes {sorted(unknown)}; valid axes are "
                         f"{', '.join(MESH_AXES)}.")
    return {axis: int(sizes.get(axis, 1)) for axis in MESH_AXES}


def mesh_spec(sizes: dict[str, int]) -> str:
    """The canonical spec of axis sizes: axes of size 1 left out, ``data=1`` for one device.

    Example:
        >>> mesh_spec({"data": 2, "fsdp": 1, "model": 4})
        'data=2,model=4'
    """
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if sizes.get(a, 1) > 1) or "data=1"


def device_grid(devices, sizes: dict[str, int]):
    """The devices as an array with one dimension per axis of :data:`MESH_AXES` (in that
    order; axes absent from ``sizes`` have size 1): ``model`` fastest-varying.

    ``devices`` in ``jax.devices()`` order (process by process): consecutive devices — the
    same host — share a ``model`` group; ``data`` groups span hosts.

    Example:
        >>> grid = device_grid(list(range(8)), {"data": 2, "fsdp": 2, "model": 2})
        >>> grid.shape, grid[0, 1, 0, 0, 0, 0].tolist()
        ((1, 2, 1, 2, 1, 1, 2), [4, 5])
    """
    import numpy as np

    shape = tuple(full_mesh(sizes).values())
    if math.prod(shape) != len(devices):
        raise ValueError(f"Mesh {mesh_spec(sizes)} needs {math.prod(shape)} devices; "
                         f"{len(devices)} were given.")
    grid = np.empty(len(devices), dtype=object)
    grid[:] = list(devices)
    return grid.reshape(shape)
