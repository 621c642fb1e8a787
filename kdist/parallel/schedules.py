"""Pipeline schedules as data: which microbatch each stage works on at each tick, and how.

A schedule is a table of ticks. At each tick every stage (device along the ``stage`` axis)
runs at most one :class:`Task`: the forward ``F`` of one microbatch through one of its model
chunks, its backward ``B``, or, for zero-bubble schedules, the backward split in two: the
input gradient ``I`` (on the critical path: the stage before waits for it) and the weight
gradient ``W`` (needed by nobody, so it can fill idle ticks). With ``chunks`` v per device
(kdist's circular repeats) virtual stage ``k = chunk * S + s`` lives on device ``s = k % S``.

The table is built by simulating the pipeline tick by tick: a task may run once what it
needs finished at an earlier tick (its input crosses one collective-permute per tick); among
the ready tasks each schedule picks by its own rule, and 1F1B-like schedules start a new
forward only while fewer than a cap of microbatches are in flight (forward done, backward
not yet), which is what bounds their activation memory by ``S`` instead of ``M``:

- ``gpipe``: every forward first, then every backward: ``M`` microbatches in flight.
- ``1f1b``: a backward as soon as one is ready; stage ``s`` holds at most ``S - s``.

Interleaved 1F1B (``v`` chunks in Megatron-LM's order) and zero-bubble (ZB-H1: ``B`` split into
``I`` and ``W``) are the next rows of :data:`SCHEDULES`: a greedy pick over ready tasks is not
enough for them (interleaved stalls at ``S=4, M=16, v=2``; ZB's ``W`` placement gave twice the
ZB-H1 bubble), so they need explicit per-stage task orders.

This module is pure Python (no JAX): the planner, ``kdist plan``'s timeline and the tests
read the same tables.

Example:
    >>> t = build("1f1b", stages=2, microbatches=3)
    >>> print(t.timeline())
    stage 0 | F0 F1 .  B0 F2 B1 .  B2
    stage 1 | .  F0 B0 F1 B1 F2 B2 .
    >>> t.ticks, t.max_in_flight(), round(t.bubble, 3)
    (8, 2, 0.25)
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One stage's work at one tick: ``action`` (``F``, ``B``, ``I`` or ``W``) on
    ``microbatch`` through model ``chunk`` (0 unless the schedule is interleaved)."""

    action: str
    microbatch: int
    chunk: int = 0

    def label(self, chunks: int) -> str:
        chunk = "abcdefghijklmnopqrstuvwxyz"[self.chunk] if chunks > 1 else ""
        return f"{self.action}{self.microbatch}{chunk}"


@dataclasses.dataclass(frozen=True)
class Table:
    """A schedule's table: ``cells[tick][stage]`` is a :class:`Task` or ``None`` (idle)."""

    name: str
    stages: int
    microbatches: int
    chunks: int
    cells: tuple

    @property
    def ticks(self) -> int:
        return len(self.cells)

    @property
    def bubble(self) -> float:
        """Idle share of the stage-ticks (every task counted as one tick)."""
        idle = sum(task is None for row in self.cells for task in row)
        return idle / (self.ticks * self.stages)

    def in_flight(self, stage: int) -> list[int]:
        """Per tick, after it: the microbatch chunks whose forward ran on ``stage`` and
        whose activations are still needed (until its ``B``; its ``W`` once split)."""
        held, counts = 0, []
        for row in self.cells:
            task = row[stage]
            if task is not None and task.action == "F":
                held += 1
            elif task is not None and task.action in ("B", "W"):
                held -= 1
            counts.append(held)
        return counts

    def max_in_flight(self) -> int:
        """The most microbatch chunks any stage holds at once: the activation memory."""
        return max(max(self.in_flight(s)) for s in range(self.stages))

    def timeline(self) -> str:
        """Stages × ticks, one cell per task (``.`` for idle): the picture the papers draw."""
        labels = [[task.label(self.chunks) if task else "." for task in row]
                  for row in self.cells]
        width = max(len(label) for row in labels for label in row)
        lines = []
        for s in range(self.stages):
            cells = " ".join(row[s].ljust(width) for row in labels)
            lines.append(f"stage {s} | {cells}".rstrip())
        return "\n".join(lines)


def check(name: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Raises ``ValueError`` naming ``pipeline_schedule`` (or the count) when the schedule
    cannot run with these settings.

    Example:
        >>> check("1f1b", stages=4, microbatches=8)
    """
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {', '.join(SCHEDULES)}; "
                         f"got {name!r}.")
    for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what} must be a positive int; got {value!r}.")
    if name == "1f1b" and chunks != 1:
        raise ValueError(f"pipeline_schedule='1f1b' runs one model chunk per stage; got "
                         f"{chunks} (pipeline_repeats). Use pipeline_repeats=1, or 'gpipe' "
                         f"for circular repeats.")
    if stages > 1 and microbatches < stages:
        raise ValueError(f"pipeline_microbatches={microbatches} is fewer than the {stages} "
                         f"stages: some stage would never have work.")


def build(name: str, stages: int, microbatches: int, chunks: int = 1) -> Table:
    """The table of schedule ``name`` for ``stages`` S, ``microbatches`` M and ``chunks``
    v model chunks per stage.

    Example:
        >>> build("gpipe", stages=2, microbatches=2).ticks
        6
    """
    check(name, stages, microbatches, chunks)
    S, M, v = stages, microbatches, chunks
    V = S * v  # virtual stages; k lives on device k % S
    done: dict[tuple[str, int, int], int] = {}  # (action, microbatch, virtual stage) -> tick

    def finished(key: tuple[str, int, int], tick: int) -> bool:  # before this tick
        return done.get(key, tick) < tick

    def runnable(action: str, m: int, k: int, tick: int) -> bool:
        if (action, m, k) in done:
            return False
        if action == "F":
            return k == 0 or finished(("F", m, k - 1), tick)
        # B: the last virtual stage's forward includes the loss, so it needs no cotangent.
        return finished(("F", m, k), tick) and (k == V - 1 or finished(("B", m, k + 1), tick))

    # 1F1B starts a forward only while fewer than S - s microbatches are in flight on stage s.
    cap = [M * v if name == "gpipe" else S - s for s in range(S)]
    held, forwards = [0] * S, [0] * S
    cells = []
    while len(done) < 2 * M * V:
        tick, row = len(cells), []
        for s in range(S):
            mine = [(m, c) for c in range(v) for m in range(M)]
            back = [(m, c) for m, c in mine if runnable("B", m, c * S + s, tick)]
            fwd = [(m, c) for m, c in mine if runnable("F", m, c * S + s, tick)]
            if back and (name != "gpipe" or forwards[s] == M * v):  # GPipe: every F first
                m, c = min(back, key=lambda mc: (-mc[1], mc[0]))  # the last chunk first
                row.append(Task("B", m, c))
            elif fwd and held[s] < cap[s]:
                m, c = min(fwd, key=lambda mc: (mc[1], mc[0]))
                row.append(Task("F", m, c))
            else:
                row.append(None)
        for s, task in enumerate(row):
            if task is not None:
                done[(task.action, task.microbatch, task.chunk * S + s)] = len(cells)
                held[s] += 1 if task.action == "F" else -1
                forwards[s] += task.action == "F"
        if all(task is None for task in row):  # a bug in a rule, never the user's input
            raise RuntimeError(f"schedule {name!r} stalled at tick {tick} (S={S}, M={M}, v={v})")
        cells.append(tuple(row))
    return Table(name, S, M, v, tuple(cells))
