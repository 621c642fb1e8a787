"""Collectives of a compiled XLA program, read from its optimized HLO text.

``compiled.as_text()`` (a ``jax.stages.Compiled``) prints the per-device SPMD program after
XLA's optimisation passes. Every collective there is one instruction such as::

    %all-gather.2 = f32[768,12,64]{2,1,0} all-gather(%param.154), channel_id=3,
        replica_groups=[1,8]<=[8], dimensions={0}, ...

From the result shape and the size of the replica groups we get, per device and per
execution of the instruction:

* ``bytes``: the logical size of the collective — the full (unsharded) tensor for an
  all-gather / reduce-scatter, the reduced tensor for an all-reduce, the buffer for an
  all-to-all or collective-permute;
* ``wire_bytes``: what a bandwidth-optimal ring implementation sends from each device —
  ``(n-1)/n * bytes`` for all-gather, reduce-scatter and all-to-all, ``2(n-1)/n * bytes``
  for all-reduce (a reduce-scatter then an all-gather), ``bytes`` for a collective-permute.
  This is the figure to compare strategies with, and the one
  :func:`kdist.planning.theoretical_collective_bytes` predicts.

A collective inside a loop body runs once per iteration: each instruction carries
``executions``, the product of the ``known_trip_count`` of the ``while`` loops around it
(1 outside any loop, or when XLA did not infer the count), and the summary counts and adds
every execution (``lax.scan`` over layers, or over ring-attention steps).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")

# Bytes per element of HLO primitive types.
_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}

# `%name = SHAPE kind(` or `name = SHAPE kind-start(`; SHAPE may be a tuple.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(",
    re.MULTILINE,
)
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled per-device program."""

    name: str
    kind: str
    bytes: float  # logical size, see the module docstring
    group_size: int  # devices taking part in each replica group
    wire_bytes: float  # sent per device by a ring implementation
    op_name: str = ""  # the JAX operation it came from (HLO metadata), if printed
    executions: int = 1  # per run of the program: the trip counts of the loops around it
    groups: tuple | None = None  # the devices of each replica group, when printed

    def crosses(self, block: int) -> bool:
        """Whether a replica group spans devices of different blocks of ``block``
        consecutive devices (e.g. DiLoCo's replica groups: ``block`` = devices per group).
        Unknown groups count as crossing."""
        if self.groups is None:
            return True
        return any(len({d // block for d in group}) > 1 for group in self.groups)


def _element_bytes(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"Unknown HLO element type '{dtype}' in a collective's shape.")
    return _DTYPE_BYTES[dtype]


def shape_bytes(shape: str) -> list[float]:
    """Bytes of each array in an HLO shape string (one entry, or one per tuple element).

    Example:
        >>> shape_bytes("f32[768,12]{1,0}")
        [36864]
        >>> shape_bytes("(bf16[4]{0}, /*index=1*/f32[])")
        [8, 4]
    """
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(count * _element_bytes(dtype))
    return out


def _group_size(line: str, num_devices: int | None) -> int:
    """Devices per replica group, from any of the printed forms of ``replica_groups``."""
    # Iota form: replica_groups=[G,S]<=[N] (G groups of S devices).
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    # Mesh form: replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}.
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(int(sizes[a]) for a in axes)
    # Explicit form: replica_groups={{0,1,2,3},{4,5,6,7}}.
    m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()])
    # collective-permute: pairs; each device sends its buffer once.
    if "source_target_pairs" in line:
        return 2
    # replica_groups={} means all devices.
    if num_devices is None:
        raise ValueError(f"Cannot tell the replica group size of: {line[:200]}")
    return num_devices


def replica_groups(line: str, num_devices: int | None = None) -> tuple | None:
    """The devices of each replica group of a collective's HLO line, or None.

    Example:
        >>> replica_groups("x = f32[] all-reduce(y), replica_groups=[4,2]<=[2,4]T(1,0)")
        ((0, 4), (1, 5), (2, 6), (3, 7))
    """
    import numpy as np

    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return tuple(tuple(int(d) for d in g) for g in ids.reshape(int(m.group(1)), -1))
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", line)
    if m:
        return tuple(tuple(int(d) for d in g.split(",") if d.strip())
                     for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
    if "replica_groups={}" in line and num_devices is not None:
        return (tuple(range(num_devices)),)
    return None


# A computation's header: `%name (params) -> shape {` (`ENTRY %name ...` for the entry).
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$",
                          re.MULTILINE)
_CALLEE = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation"
                     r"|branch_computations)=\{?%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def loop_executions(hlo_text: str) -> list[tuple[int, int, int]]:
    r"""``(start, end, executions)`` of every computation in HLO text: how many times it runs
    per run of the entry computation (a ``while`` body its trip count times its caller's).

    Example:
        >>> text = ('%body (p: f32[]) -> f32[] {\n}\n'
        ...         'ENTRY %main (x: f32[]) -> f32[] {\n'
        ...         '  %w = f32[] while(%x), body=%body, '
        ...         'backend_config={"known_trip_count":{"n":"7"}}\n}')
        >>> [n for _, _, n in loop_executions(text)]
        [7, 1]
    """
    headers = list(_COMPUTATION.finditer(hlo_text))
    spans, calls, entry = {}, {}, None
    for i, m in enumerate(headers):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(hlo_text)
        spans[m.group("name")] = (m.start(), end)
        entry = m.group("name") if m.group("entry") else entry
        for line in hlo_text[m.end():end].splitlines():
            trips = _TRIP_COUNT.search(line) if " while(" in line else None
            for callee in _CALLEE.findall(line):
                is_body = trips and f"body=%{callee}" in line or f"body={callee}" in line
                calls.setdefault(callee, []).append(
                    (m.group("name"), int(trips.group(1)) if trips and is_body else 1))
    memo: dict[str, int] = {}

    def executions(name: str, seen=()) -> int:
        if name == entry or name not in calls or name in seen:
            return 1
        if name not in memo:
            memo[name] = sum(executions(caller, (*seen, name)) * n
                             for caller, n in calls[name])
        return memo[name]

    return [(start, end, executions(name)) for name, (start, end) in spans.items()]


def parse_collectives(hlo_text: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective instruction in optimized HLO text, with its bytes per device.

    ``num_devices`` is the group size assumed for ``replica_groups={}`` (all devices).

    Example:
        >>> text = "%ag = f32[8,4]{1,0} all-gather(%p), replica_groups=[1,4]<=[4], dimensions={0}"
        >>> c, = parse_collectives(text)
        >>> c.kind, c.bytes, c.group_size, c.wire_bytes
        ('all-gather', 128.0, 4, 96.0)
    """
    found = []
    spans = loop_executions(hlo_text)
    for m in _INSTRUCTION.finditer(hlo_text):
        line_end = hlo_text.find("\n", m.end())
        line = hlo_text[m.start(): line_end if line_end >= 0 else len(hlo_text)]
        kind = m.group("kind")
        arrays = shape_bytes(m.group("shape"))
        if m.group("start") and kind in ("all-gather", "collective-permute"):
            # Async start returns (operand(s), result(s), ...): the result is the second half.
            arrays = arrays[len(arrays) // 2:] if len(arrays) > 1 else arrays
            arrays = arrays[:1] if kind == "collective-permute" else arrays
        size = float(sum(arrays))
        n = _group_size(line, num_devices)
        if kind == "reduce-scatter":
            size *= n  # the result is one shard of the reduced tensor
        if n <= 1:
            wire = 0.0
        elif kind == "all-reduce":
            wire = 2 * (n - 1) / n * size
        elif kind == "collective-permute":
            wire = size
        else:
            wire = (n - 1) / n * size
        op = re.search(r'op_name="([^"]*)"', line)
        runs = next((k for start, end, k in spans if start <= m.start() < end), 1)
        found.append(Collective(m.group("name"), kind, size, n, wire, op.group(1) if op else "",
                                runs, replica_groups(line, num_devices)))
    return found


def summarize_collectives(collectives: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """Executions, logical bytes and ring wire bytes per collective kind (kinds with none
    omitted), every execution of an instruction in a loop counted.

    Example:
        >>> text = "%ar = f32[10]{0} all-reduce(%x), replica_groups=[1,2]<=[2], to_apply=%add"
        >>> summarize_collectives(parse_collectives(text))
        {'all-reduce': {'count': 1, 'bytes': 40.0, 'wire_bytes': 40.0}}
    """
    out: dict[str, dict[str, float]] = {}
    for c in collectives:
        row = out.setdefault(c.kind, {"count": 0, "bytes": 0.0, "wire_bytes": 0.0})
        row["count"] += c.executions
        row["bytes"] += c.bytes * c.executions
        row["wire_bytes"] += c.wire_bytes * c.executions
    return {k: out[k] for k in COLLECTIVE_KINDS if k in out}
