"""Pipeline schedules as data: which microbatch each stage works on at each tick, and how.

A schedule is a table of ticks. At each tick every stage (device along the ``stage`` axis)
runs at most one :class:`Task`: the forward ``F`` of one microbatch through one of its model
chunks, its backward ``B``, or, for zero-bubble schedules, the backward split in two: the
input gradient ``I`` (on the critical path: the stage before waits for it) and the weight
gradient ``W`` (needed by nobody, so it can fill idle ticks). With ``chunks`` v per device
(kdist's circular repeats) virtual stage ``k = chunk * S + s`` lives on device ``s = k % S``.

The table is built by simulating the pipeline tick by tick: each device has its tasks in a
fixed order (:func:`order`) and runs the next one as soon as what it needs finished at an
earlier tick (its input crosses one collective-permute per tick), else idles. The order is
what bounds the microbatches in flight (forward done, backward not yet), and with them the
activation memory:

- ``gpipe``: every forward first, then every backward: ``M`` microbatches in flight.
- ``1f1b``: ``S - s - 1`` warm-up forwards, then one forward and one backward in turn:
  stage ``s`` holds at most ``S - s``.
- ``interleaved_1f1b`` (Megatron-LM's order, ``v`` chunks per stage): the bubble divided
  by ``v``, ``(S - 1) / (v M + S - 1)``; stage 0 holds ``2 (S - 1) + (v - 1) S + 1``
  chunk activations (each ``1 / v`` of a stage's layers) whatever ``M``.

- ``zero_bubble`` (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's
  order with each ``B`` split into ``I`` and ``W``; a stage runs its next ``F`` or ``I``
  when it is ready, and a pending ``W`` when it is not (or when one more ``F`` would hold
  more than 1F1B's peak of ``S`` microbatches): the weight gradients fill the ticks 1F1B
  leaves idle, at 1F1B's peak memory. Counting each task as one tick, a stage's ``3 M``
  tasks take ``3 M + S - 1`` ticks where 1F1B's split ones would take ``3 (M + S - 1)``:
  the bubble ``(S - 1) / (3 M + S - 1)``, a third of 1F1B's.

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

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
SPLIT = ("zero_bubble",)  # the backward as I then W


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

    def max_deferred(self) -> int:
        """The most microbatches any stage holds between their ``I`` and ``W`` (their
        output's cotangent kept for the weight gradient; 0 unless the backward is split)."""
        most = 0
        for s in range(self.stages):
            held = 0
            for row in self.cells:
                task = row[s]
                held += {"I": 1, "W": -1}.get(task.action, 0) if task else 0
                most = max(most, held)
        return most

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
    if name in ("1f1b", "zero_bubble") and chunks != 1:
        raise ValueError(f"pipeline_schedule={name!r} runs one model chunk per stage; got "
                         f"{chunks} (pipeline_repeats). Use pipeline_repeats=1, or "
                         f"'interleaved_1f1b' for {chunks} chunks per stage.")
    if name == "interleaved_1f1b" and chunks < 2:
        raise ValueError(f"pipeline_schedule='interleaved_1f1b' runs several model chunks per "
                         f"stage; got pipeline_repeats={chunks}. Use pipeline_repeats >= 2, or "
                         f"'1f1b' for one chunk per stage.")
    if name == "interleaved_1f1b" and microbatches % stages:
        raise ValueError(f"pipeline_schedule='interleaved_1f1b' runs the microbatches in groups "
                         f"of the {stages} stages; pipeline_microbatches={microbatches} is not "
                         f"a multiple of {stages}. Use e.g. pipeline_microbatches="
                         f"{stages * max(1, round(microbatches / stages))}.")
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
    split = name in SPLIT
    back = "I" if split else "B"  # the task that sends the cotangent back
    orders = [list(order(name, S, M, v, s)) for s in range(S)]
    done: dict[tuple[str, int, int], int] = {}  # (action, microbatch, virtual stage) -> tick

    def finished(key: tuple[str, int, int], tick: int) -> bool:  # before this tick
        return done.get(key, tick) < tick

    def ready(task: Task, s: int, tick: int) -> bool:
        k = task.chunk * S + s
        if task.action == "F":
            return k == 0 or finished(("F", task.microbatch, k - 1), tick)
        # B/I: the last virtual stage's forward includes the loss, so it needs no cotangent.
        return finished(("F", task.microbatch, k), tick) and (
            k == V - 1 or finished((back, task.microbatch, k + 1), tick))

    # Zero-bubble: W tasks wait here from their I on; a stage holds (F done, W not) at
    # most S microbatches, 1F1B's peak (its stage 0). (Capped at 1F1B's S - s per stage,
    # the last stages could not defer their W and the cool-down's I would wait for them:
    # 3 M + 2 (S - 1) ticks, not 3 M + S - 1.)
    pending: list[list[Task]] = [[] for _ in range(S)]
    held = [0] * S

    def next_task(s: int, tick: int) -> Task | None:
        task = orders[s][position[s]] if position[s] < len(orders[s]) else None
        if task is not None and not ready(task, s, tick):
            task = None
        if split and task is not None and task.action == "F" and held[s] >= S:
            task = None
        if task is None and split and pending[s] and finished(
                ("I", pending[s][0].microbatch, s), tick):
            return pending[s].pop(0)
        if task is not None:
            position[s] += 1
        return task

    cells, position = [], [0] * S
    while len(done) < (3 if split else 2) * M * V:
        tick = len(cells)
        row = tuple(next_task(s, tick) for s in range(S))
        if all(task is None for task in row):  # a bug in an order, never the user's input
            raise RuntimeError(f"schedule {name!r} stalled at tick {tick} (S={S}, M={M}, v={v})")
        for s, task in enumerate(row):
            if task is None:
                continue
            done[(task.action, task.microbatch, task.chunk * S + s)] = tick
            held[s] += {"F": 1, "W": -1}.get(task.action, 0)
            if task.action == "I":
                pending[s].append(Task("W", task.microbatch, task.chunk))
        cells.append(row)
    return Table(name, S, M, v, tuple(cells))


def order(name: str, stages: int, microbatches: int, chunks: int, stage: int):
    """The tasks of device ``stage`` in the order it runs them (each as soon as what it needs
    has arrived).

    - ``gpipe``: every forward (chunk by chunk, microbatch by microbatch), then every
      backward (the last chunk first).
    - ``1f1b``: ``S - s - 1`` warm-up forwards, then one forward and one backward in turn,
      then the backwards left.
    - ``zero_bubble``: 1F1B's order with ``I`` for ``B`` (:func:`build` adds the ``W``).
    - ``interleaved_1f1b`` (Megatron-LM's order): the microbatches in groups of ``S``, each
      group's forwards through chunk 0, 1, ... and its backwards through chunk v-1, ..., 0;
      ``2 (S - s - 1) + (v - 1) S`` warm-up forwards, then one forward and one backward
      in turn.

    Example:
        >>> [t.label(1) for t in order("1f1b", 2, 3, 1, stage=0)]
        ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    S, M, v, s = stages, microbatches, chunks, stage
    if name == "gpipe":
        forwards = [Task("F", m, c) for c in range(v) for m in range(M)]
        return forwards + [Task("B", m, c) for c in reversed(range(v)) for m in range(M)]

    def nth(action: str, i: int) -> Task:  # the i-th forward or backward of this device
        group, rest = divmod(i, S * v)
        c, j = divmod(rest, S)
        return Task(action, group * S + j, c if action == "F" else v - 1 - c)

    total, back = M * v, "I" if name in SPLIT else "B"
    warm = min(2 * (S - s - 1) + (v - 1) * S if name == "interleaved_1f1b" else S - s - 1,
               total)
    tasks = [nth("F", i) for i in range(warm)]
    for i in range(total - warm):
        tasks += [nth("F", warm + i), nth(back, i)]
    return tasks + [nth(back, i) for i in range(total - warm, total)]
