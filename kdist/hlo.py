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

A collective inside a loop body runs once per iteration: :func:`executions` reads how
often each computation runs (a ``while`` body: its ``known_trip_count``; nested loops
multiply), and each :class:`Collective` carries that count, which
:func:`summarize_collectives` multiplies in — a scanned layer stack's per-layer all-gathers,
a pipeline's per-iteration ``collective-permute``, a ring attention's per-step key/value
blocks. :func:`matmul_flops` counts the program's matmul FLOPs the same way: XLA's own
``cost_analysis()`` counts a loop body once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping

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
    # per run of the program: the trip counts of the loops around it (an average over the
    # devices, so fractional, inside a branch that only some devices take: branch_weights)
    executions: float = 1
    groups: tuple | None = None  # the devices of each replica group, when printed

    def axes(self, mesh_shape) -> frozenset:
        """The mesh axes this collective communicates over: those along which the devices
        of one of its replica groups (or a collective-permute's source and target) differ.
        ``mesh_shape``: ``{axis: size}`` in the mesh's order (device ``i`` of a group is
        ``np.unravel_index(i, sizes)``). Unknown groups count as every axis.

        Example:
            >>> c = Collective("ar", "all-reduce", 4.0, 2, 4.0, groups=((0, 2), (1, 3)))
            >>> sorted(c.axes({"data": 2, "model": 2}))
            ['data']
        """
        import numpy as np

        names, sizes = list(mesh_shape), [int(n) for n in mesh_shape.values()]
        if self.groups is None:
            return frozenset(a for a, n in zip(names, sizes) if n > 1)
        found = set()
        for group in self.groups:
            coords = np.array(np.unravel_index(np.asarray(group), sizes)).T  # (members, axes)
            found.update(names[i] for i in np.nonzero((coords != coords[0]).any(0))[0])
        return frozenset(found)

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
    m = re.search(r"source_target_pairs=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", line)
    if m:  # a collective-permute: each (source, target) pair as a group
        return tuple(tuple(int(d) for d in g.split(",") if d.strip())
                     for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
    return None


def parse_collectives(hlo_text: str, num_devices: int | None = None,
                      branch_weights: Mapping[str, float] | None = None) -> list[Collective]:
    """Every collective instruction in optimized HLO text, with its bytes per device.

    ``num_devices`` is the group size assumed for ``replica_groups={}`` (all devices);
    ``branch_weights``: how often a conditional's branch runs, as in :func:`executions`.

    Example:
        >>> text = "%ag = f32[8,4]{1,0} all-gather(%p), replica_groups=[1,4]<=[4], dimensions={0}"
        >>> c, = parse_collectives(text)
        >>> c.kind, c.bytes, c.group_size, c.wire_bytes
        ('all-gather', 128.0, 4, 96.0)
    """
    found = []
    runs, headers = executions(hlo_text, branch_weights=branch_weights), _headers(hlo_text)
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
        found.append(Collective(m.group("name"), kind, size, n, wire, op.group(1) if op else "",
                                runs.get(_computation_at(headers, m.start()), 1),
                                replica_groups(line, num_devices)))
    return found


def summarize_collectives(collectives: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """Count, logical bytes and ring wire bytes per collective kind (kinds with none
    omitted), each instruction counted as often as it runs (``executions``).

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


# --- Computations, loops and matmul FLOPs ------------------------------------------------

_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\((?P<params>.*)\)\s+->"
                     r".*\{\s*$", re.MULTILINE)
_CALLS = re.compile(r"\b(?P<how>calls|to_apply|body|condition|true_computation|"
                    r"false_computation)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>[a-z][a-z0-9]*"
                         r"\[[\d,]*\])", re.MULTILINE)
_PARAM = re.compile(r"(?P<name>[\w.\-]+):\s*(?P<shape>[a-z][a-z0-9]*\[[\d,]*\])")
_DOT = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[a-z][a-z0-9]*\[(?P<dims>[\d,]*)\]\S*\s+"
                  r"dot\(%?(?P<lhs>[\w.\-]+),", re.MULTILINE)


def _headers(text: str) -> list[tuple[int, str, bool]]:
    """``(offset, name, is_entry)`` of every computation header, in order."""
    return [(m.start(), m.group("name"), bool(m.group("entry"))) for m in _HEADER.finditer(text)]


def _computation_at(headers, offset: int) -> str | None:
    name = None
    for start, header, _ in headers:
        if start > offset:
            break
        name = header
    return name


def _bodies(text: str, headers) -> dict[str, str]:
    ends = [start for start, _, _ in headers[1:]] + [len(text)]
    return {name: text[start:end] for (start, name, _), end in zip(headers, ends)}


def executions(hlo_text: str, root: str | None = None,
               branch_weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """How many times each computation of an HLO module runs per execution of its entry:
    a ``while`` body its trip count (``known_trip_count``, which XLA records for ``scan``
    loops; 1 if unknown) times its caller's; fusions, reductions and branches their
    caller's count (a branch as if taken: an upper bound). ``branch_weights``: for the
    branches named there, the share of their conditional's runs that take them instead
    (e.g. a pipeline schedule's tasks, from its table: ``kdist.planning.executed``).
    ``root``: per execution of that computation instead (those it does not reach: 0).

    Example:
        >>> text = ('ENTRY %main (p: f32[]) -> f32[] {\\n  %w = (s32[]) while(%t), condition=%c, '
        ...         'body=%b, backend_config={"known_trip_count":{"n":"7"}}\\n}\\n'
        ...         '%b (q: (s32[])) -> (s32[]) {\\n}\\n')
        >>> executions(text)["b"]
        7
    """
    headers = _headers(hlo_text)
    bodies = _bodies(hlo_text, headers)
    callers: dict[str, list[tuple[str, int]]] = {}
    for caller, body in bodies.items():
        for line in body.splitlines()[1:]:
            trip = _TRIP.search(line)
            for m in _CALLS.finditer(line):
                weight = int(trip.group(1)) if (trip and m.group("how") == "body") else 1
                callers.setdefault(m.group("name"), []).append((caller, weight))
            for m in _BRANCHES.finditer(line):
                for name in re.findall(r"%?([\w.\-]+)", m.group("names")):
                    weight = (branch_weights or {}).get(name, 1)
                    callers.setdefault(name, []).append((caller, weight))
    entry = root or next((name for _, name, is_entry in headers if is_entry), None)
    memo: dict[str, int] = {}

    def count(name, seen=()):
        if name not in memo:
            if name == entry or name not in callers:
                memo[name] = int(name == entry or root is None)
            else:
                memo[name] = sum(count(c, seen + (name,)) * w
                                 for c, w in callers[name] if c not in seen)
        return memo[name]

    return {name: count(name) for name in bodies}


def matmul_flops(hlo_text: str, in_loops_only: bool = False, per_iteration: bool = True,
                 root: str | None = None,
                 branch_weights: Mapping[str, float] | None = None) -> float:
    """The matmul FLOPs of an optimized HLO module (``dot`` instructions: ``2 x result
    elements x contracted size``), each counted as often as it runs (:func:`executions`).
    On a CPU-compiled program this is every matmul; a GPU program's cuBLAS calls are
    ``custom-call``\\ s, not counted here. ``in_loops_only``: only those in computations
    that run more than once (a scanned layer stack, a pipeline's schedule);
    ``per_iteration=False``: each counted once, as XLA's ``cost_analysis()`` does;
    ``root``: per execution of that computation (e.g. one branch of a conditional);
    ``branch_weights``: how often a conditional's branches run (:func:`executions`).

    Example:
        >>> text = ("ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {\\n"
        ...         "  ROOT %d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
        ...         "rhs_contracting_dims={0}\\n}\\n")
        >>> matmul_flops(text)
        128.0
    """
    headers = _headers(hlo_text)
    runs = executions(hlo_text, root, branch_weights)
    total = 0.0
    for name, body in _bodies(hlo_text, headers).items():
        if (in_loops_only and runs.get(name, 1) <= 1) or not runs.get(name, 1):
            continue
        shapes = {m.group("name"): m.group("shape") for m in _PARAM.finditer(
            body.splitlines()[0])}
        shapes.update({m.group("name"): m.group("shape") for m in _DEFINITION.finditer(body)})
        for m in _DOT.finditer(body):
            line = body[m.start(): body.find("\n", m.end())]
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
            lhs = _dims(shapes.get(m.group("lhs"), ""))
            if lhs is None or contracting is None:
                continue
            k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d)
            result = math.prod(int(d) for d in m.group("dims").split(",") if d)
            total += 2.0 * result * k * (runs.get(name, 1) if per_iteration else 1)
    return total


def _dims(shape: str) -> list[int] | None:
    m = re.match(r"[a-z][a-z0-9]*\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else None


def branch_flops(hlo_text: str) -> list[float]:
    """The matmul FLOPs of each branch of the module's conditional with the most branches
    (a ``lax.switch``; e.g. the pipeline interpreter's tasks,
    :mod:`kdist.parallel.pipeline.interpreter`), in branch order, each per execution of that branch
    (its loops' trip counts included). ``[]`` without a conditional.

    Example:
        >>> text = ("ENTRY %main (i: s32[], a: f32[4,8], b: f32[8,2]) -> f32[4,2] {\\n"
        ...         "  ROOT %c = f32[4,2]{1,0} conditional(%i, %a, %a), "
        ...         "branch_computations={%idle, %mm}\\n}\\n"
        ...         "%idle (p: f32[4,8]) -> f32[4,2] {\\n}\\n"
        ...         "%mm (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {\\n  ROOT %d = f32[4,2]{1,0} "
        ...         "dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}\\n}\\n")
        >>> branch_flops(text)
        [0.0, 128.0]
    """
    return [matmul_flops(hlo_text, root=name) for name in switch_branches(hlo_text)]


def switch_branches(hlo_text: str) -> list[str]:
    """The branch computations of the module's conditional with the most branches (a
    ``lax.switch``), in branch order; ``[]`` without a conditional.

    Example:
        >>> switch_branches("%c = f32[] conditional(%i, %a, %a), branch_computations={%x, %y}")
        ['x', 'y']
    """
    found = [re.findall(r"%?([\w.\-]+)", m.group("names"))
             for m in _BRANCHES.finditer(hlo_text)]
    return max(found, key=len) if found else []
