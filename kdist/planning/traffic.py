"""Bytes per mesh axis, and which axes cross the boundary between hosts.

A training step's collectives are :class:`Traffic` terms: a kind, the mesh axes it runs
over and its ring wire bytes per device (:func:`kdist.planning.estimate.collective_terms`
lists them). A collective over several axes — the gradients' all-reduce over
``data x seq`` — runs hierarchically, fastest-varying axis first (a reduce-scatter inside,
the all-reduce of a ``1/n_inner`` shard across, an all-gather inside): over axes of sizes
``n_1`` (fastest), ``n_2``, ... the first carries ``ring(n_1) X``, the second
``ring(n_2) X / n_1``, and so on — together ``ring(n_1 n_2 ...) X``, the flat ring's bytes
(:func:`by_axis`). So the slower axes carry the smaller share.

Devices are numbered host by host and the mesh lays its axes out slowest-varying first
(``replica, data, stage, fsdp, seq, model``; :mod:`kdist.parallel.mesh`): an axis crosses
the host boundary when one of its groups spans more devices than a host holds
(:func:`crossing_axes`; of an axis that starts inside a host, only the hierarchical share
across, :func:`crossing_fractions`). Bytes over the boundary weigh
:data:`HOST_LINK_SLOWDOWN` times those inside a host when the planner ranks meshes
(:func:`weighted_bytes`).

Example:
    >>> terms = [Traffic("all-reduce", ("data", "seq"), 2 * 7 / 8 * 100.0)]
    >>> {a: round(b, 2) for a, b in by_axis(terms, {"data": 4, "seq": 2}).items()}
    {'data': 75.0, 'seq': 100.0}
    >>> crossing_axes({"data": 2, "fsdp": 4}, devices_per_host=4)
    ('data',)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from kdist.parallel.mesh import MESH_AXES

# How much slower a byte between hosts is than one inside a host, when ranking meshes: an
# H100 host's NVLink moves 450 GB/s per GPU each way, its InfiniBand one 400 Gb/s NIC
# (50 GB/s) per GPU — 9x. Pass another figure for other machines.
HOST_LINK_SLOWDOWN = 9.0


class Traffic(NamedTuple):
    """One collective term of a step: ``kind`` (an HLO collective), the mesh ``axes`` it
    runs over and its ring wire ``bytes`` per device per step."""

    kind: str
    axes: tuple[str, ...]
    bytes: float


def by_kind(terms: Iterable[Traffic]) -> dict[str, float]:
    """Wire bytes per collective kind (kinds of zero bytes left out)."""
    out: dict[str, float] = {}
    for t in terms:
        out[t.kind] = out.get(t.kind, 0.0) + t.bytes
    return {k: v for k, v in out.items() if v > 0}


def axis_shares(axes: Iterable[str], mesh: Mapping[str, int]) -> dict[str, float]:
    """The share of a collective's wire bytes each of its axes carries when it runs
    hierarchically, fastest-varying axis first (see the module docstring); axes of size 1
    carry none.

    Example:
        >>> axis_shares(("data", "seq"), {"data": 2, "seq": 2})
        {'seq': 0.6666666666666666, 'data': 0.3333333333333333}
    """
    sized = [a for a in reversed(MESH_AXES) if a in set(axes) and mesh.get(a, 1) > 1]
    total = math.prod(mesh[a] for a in sized)
    if total <= 1:
        return {}
    shares, inner = {}, 1
    for a in sized:  # fastest first
        n = mesh[a]
        shares[a] = (n - 1) / n / inner / ((total - 1) / total)
        inner *= n
    return shares


def by_axis(terms: Iterable[Traffic], mesh: Mapping[str, int]) -> dict[str, float]:
    """Wire bytes per device per step over each mesh axis, in the mesh's order."""
    out = dict.fromkeys(MESH_AXES, 0.0)
    for t in terms:
        for axis, share in axis_shares(t.axes, mesh).items():
            out[axis] += share * t.bytes
    return {a: b for a, b in out.items() if b > 0}


def measured_by_axis(collectives, mesh: Mapping[str, int]) -> dict[str, float]:
    """The compiled program's wire bytes per axis: each :class:`kdist.hlo.Collective`
    (times its executions) over the axes its replica groups span, split as
    :func:`by_axis` splits a term."""
    return by_axis((Traffic(c.kind, tuple(c.axes(mesh)), c.wire_bytes * c.executions)
                    for c in collectives), mesh)


def crossing_fractions(mesh: Mapping[str, int],
                       devices_per_host: int | None) -> dict[str, float]:
    """For each axis (of size > 1) whose groups span hosts, the share of its bytes that
    crosses the host boundary when hosts hold ``devices_per_host`` consecutive devices
    (None: one host, nothing crosses). An axis of stride ``t`` (the product of the faster
    axes' sizes) and size ``n`` wholly across hosts (``t >= devices_per_host``) sends all
    its bytes between hosts; one that starts inside a host (``a = devices_per_host / t``
    members of each group there, ``b = n / a`` hosts) runs hierarchically, and its share
    across is ``ring(b) / a / ring(n)`` (see :func:`axis_shares`).

    Example:
        >>> crossing_fractions({"data": 2, "fsdp": 4}, devices_per_host=4)
        {'data': 1.0}
        >>> round(crossing_fractions({"data": 16}, 8)["data"], 4)  # 2 hosts of 8
        0.0667
    """
    if not devices_per_host:
        return {}
    if isinstance(devices_per_host, bool) or not isinstance(devices_per_host, int) \
            or devices_per_host < 1:
        raise ValueError(f"devices_per_host must be a positive integer; got "
                         f"{devices_per_host!r}.")
    out, stride = {}, 1
    for axis in reversed(MESH_AXES):  # fastest first: its stride is 1
        n = mesh.get(axis, 1)
        if n > 1 and n * stride > devices_per_host:
            if stride >= devices_per_host:
                out[axis] = 1.0
            else:
                inside = devices_per_host // stride
                hosts = n / inside
                out[axis] = (hosts - 1) / hosts / inside / ((n - 1) / n)
        stride *= n
    return {a: out[a] for a in MESH_AXES if a in out}


def crossing_axes(mesh: Mapping[str, int], devices_per_host: int | None) -> tuple[str, ...]:
    """The axes (of size > 1) some of whose bytes cross hosts
    (:func:`crossing_fractions`), slowest-varying first.

    Example:
        >>> crossing_axes({"replica": 2, "stage": 2, "seq": 2}, 4)
        ('replica',)
        >>> crossing_axes({"data": 4, "model": 2}, 2)
        ('data',)
    """
    return tuple(crossing_fractions(mesh, devices_per_host))


def percent(share: float) -> str:
    """A share of an axis's bytes as a percentage, small ones not rounded to nothing.

    Example:
        >>> percent(1.0), percent(1 / 3), percent(0.002)
        ('100%', '33%', '0.20%')
    """
    return f"{share:.0%}" if share >= 0.01 else f"{share:.2%}"


def weighted_bytes(axis_bytes: Mapping[str, float], fractions: Mapping[str, float],
                   slowdown: float = HOST_LINK_SLOWDOWN) -> float:
    """The bytes per axis summed, the share of each that crosses hosts (``fractions``,
    :func:`crossing_fractions`) ``slowdown`` times.

    Example:
        >>> weighted_bytes({"data": 10.0, "fsdp": 5.0}, {"data": 0.5}, slowdown=9.0)
        55.0
    """
    return sum(b * (1.0 + (slowdown - 1.0) * fractions.get(a, 0.0))
               for a, b in axis_bytes.items())


def _ring(n: int) -> float:
    return (n - 1) / n


def needs_dimensions(dims: dict, mesh: dict[str, int], activations: bool = True) -> None:
    """A ``ValueError`` when a model or seq axis's activation traffic cannot be counted
    because the model states not its dimensions."""
    tensor = activations and mesh.get("model", 1) > 1
    context = activations and mesh.get("seq", 1) > 1
    if (tensor or context) and ("hidden_dim" not in dims or "num_layers" not in dims or (
            context and "num_heads" not in dims)):
        raise ValueError(
            "A model or seq axis needs the model's hidden_dim and num_layers (and, for "
            "seq, num_heads) to estimate its activation traffic; this cost model states "
            "them not (give it a config with them), or plan a mesh without those axes.")


def context_terms(dims, s, m, local_batch, length, value_bytes, variant,
                  layers: float | None = None) -> list[Traffic]:
    """Keys and values crossing the seq axis per step (``layers``, default all), by kind."""
    heads = dims["num_heads"]
    kv_heads = dims.get("num_key_value_heads") or heads
    head_dim = dims.get("head_dim") or dims["hidden_dim"] // heads
    width = kv_heads / m * head_dim  # K/m heads of H per token
    layers = dims["num_layers"] if layers is None else layers
    if variant == "ring":  # kdist.parallel.context.cost.ring_bytes, for every layer
        block = local_batch * length / s * width
        return [Traffic("collective-permute", ("seq",), layers * (
            4 * (s - 1) * block * value_bytes + 2 * s * block * 4))]
    gathered = local_batch * length * width * value_bytes  # one layer's keys (or values)
    return [Traffic("all-gather", ("seq",), layers * 2 * _ring(s) * gathered),
            Traffic("reduce-scatter", ("seq",), layers * 2 * _ring(s) * gathered)]


def gathered_kv_bytes(dims: dict, rows: float, length: int, m: int, value_bytes: int,
                      layers: float) -> float:
    """The keys and values ``context_parallel="all_gather"`` keeps gathered: ``layers``
    layers of ``rows`` whole sequences, ``K/m`` heads each."""
    kv = dims.get("num_key_value_heads") or dims["num_heads"]
    head_dim = dims.get("head_dim") or dims["hidden_dim"] // dims["num_heads"]
    return layers * rows * length * 2 * kv / m * head_dim * value_bytes
