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
activation memory. Tables the interpreter runs (:mod:`kdist.parallel.pipeline.interpreter`) give the
last virtual stage no ``F``: its ``B`` (or ``I``) computes its forward with the loss.

**Ticks of one kind.** The interpreter runs a table in lockstep — every tick ends in a
collective-permute all stages join — so a tick lasts as long as its costliest task, and a
backward costs about 3 forwards (it recomputes its forward). A table whose ticks mix
forwards and backwards (Megatron-LM's 1F1B pairs a forward on stage ``s`` with a backward
on ``s + 1`` in every steady tick) idles its forward stages two thirds of each tick: its
bubble in time is far above the formula. So ``1f1b`` and ``interleaved_1f1b`` run
forwards-only and backwards-only ticks, alternating when both have work (:data:`LOCKSTEP`):
``v M + S - 2`` forward ticks and ``v M + S - 1`` backward ticks, whatever the costs —
GPipe's ``(v M + S - 1) (F + B)`` less one forward: the bubble in time is the formula
``(S - 1) / (v M + S - 1)``. The price: a microbatch crosses one stage per forward tick
and per backward tick, so stage ``s`` must warm up with ``2 (S - s) - 3 + (v - 1) S``
forwards to keep busy, and holds ``2 (S - s) - 2 + (v - 1) S`` chunk inputs (at most
``v M``):

- ``gpipe``: every forward first, then every backward: ``M`` microbatches in flight.
- ``1f1b``: stage ``s`` holds ``2 (S - s) - 2`` microbatch inputs whatever ``M``
  (Megatron's table holds ``S - s`` in mixed ticks: 1.35x the step at ``S = 4, M = 16``
  with the compiled task costs, ``benchmarks/pipeline.py ticks``).
- ``interleaved_1f1b`` (``v`` chunks per stage, the microbatches in groups of ``S`` as in
  Megatron-LM): the bubble divided by ``v``; stage 0 holds ``2 S - 2 + (v - 1) S`` chunk
  inputs (each ``1 / v`` of a stage's layers) whatever ``M``.
- ``zero_bubble`` (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's
  order (``S - s - 1`` warm-up forwards) with each ``B`` split into ``I`` and ``W``; a
  stage runs its next ``F`` or ``I`` when it is ready, and a pending ``W`` when it is not
  (or when one more ``F`` would hold more than ``S`` microbatches): the weight gradients
  fill idle cells, ``3 M + S - 2`` ticks. Its ticks mix kinds, and here ``I`` and ``W``
  each recompute (``I`` ~ 2 forwards, ``W`` 3: :mod:`kdist.parallel.pipeline.interpreter`): in
  time it is the slowest schedule until ``W`` reuses ``I``'s activation gradients.

This module is pure Python (no JAX): the planner, ``kdist plan``'s timeline and the tests
read the same tables.

Example:
    >>> t = build("1f1b", stages=2, microbatches=3)
    >>> print(t.timeline())
    stage 0 | F0 .  F1 B0 F2 B1 B2
    stage 1 | .  B0 .  B1 .  B2 .
    >>> t.ticks, t.max_in_flight(), t.kinds()
    (7, 2, 'FBFBFBB')
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
SPLIT = ("zero_bubble",)  # the backward as I then W
LOCKSTEP = ("1f1b", "interleaved_1f1b")  # every tick runs forwards only or backwards only


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
        """Idle share of the stage-ticks (every task counted as one tick; for the time,
        :func:`kdist.parallel.pipeline.interpreter.lockstep_bubble`)."""
        idle = sum(task is None for row in self.cells for task in row)
        return idle / (self.ticks * self.stages)

    def kinds(self) -> str:
        """Per tick, the actions its tasks run (``F``, ``B``; ``*`` where they mix)."""
        return "".join(next(iter(a)) if len(a) == 1 else "*" if a else "." for a in (
            {task.action for task in row if task is not None} for row in self.cells))

    def in_flight(self, stage: int) -> list[int]:
        """Per tick, after it: the microbatch chunks whose forward ran on ``stage`` and
        whose activations are still needed (until its ``B``; its ``W`` once split)."""
        held, counts = 0, []
        for row in self.cells:
            task = row[stage]
            if task is not None:
                # The interpreter's last virtual stage has no F (its B or I runs it).
                computed = self.name != "gpipe" and task.chunk * self.stages + stage == \
                    self.stages * self.chunks - 1
                held += {"F": 1, "B": -1 + computed, "I": computed, "W": -1}.get(task.action)
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


def build(name: str, stages: int, microbatches: int, chunks: int = 1, *,
          mixed: bool = False) -> Table:
    """The table of schedule ``name`` for ``stages`` S, ``microbatches`` M and ``chunks``
    v model chunks per stage. ``mixed``: for comparison, Megatron-LM's 1F1B and interleaved
    tables (its warm-up, ticks that mix forwards and backwards) instead of :data:`LOCKSTEP`'s.

    Example:
        >>> build("gpipe", stages=2, microbatches=2).ticks
        6
    """
    check(name, stages, microbatches, chunks)
    S, M, v = stages, microbatches, chunks
    V = S * v  # virtual stages; k lives on device k % S
    split = name in SPLIT
    back = "I" if split else "B"  # the task that sends the cotangent back
    # The interpreter's last virtual stage computes its forward inside its backward (with
    # the loss): no F of its own, which would cost a tick of latency and a cell.
    computed = name != "gpipe"
    lockstep = name in LOCKSTEP and not mixed
    orders = [[t for t in order(name, S, M, v, s, mixed)
               if not (computed and t.action == "F" and t.chunk * S + s == V - 1)]
              for s in range(S)]
    done: dict[tuple[str, int, int], int] = {}  # (action, microbatch, virtual stage) -> tick

    def finished(key: tuple[str, int, int], tick: int) -> bool:  # before this tick
        return done.get(key, tick) < tick

    def ready(task: Task, s: int, tick: int) -> bool:
        k, m = task.chunk * S + s, task.microbatch
        if task.action == "F" or (computed and k == V - 1):  # needs its input
            return k == 0 or finished(("F", m, k - 1), tick)
        # B/I: the last virtual stage's forward includes the loss, so it needs no cotangent.
        return finished(("F", m, k), tick) and (k == V - 1 or finished((back, m, k + 1), tick))

    # Zero-bubble: W tasks wait here from their I on; a stage holds (F done, W not) at
    # most S microbatches, 1F1B's peak (its stage 0). (Capped at 1F1B's S - s per stage,
    # the last stages could not defer their W and the cool-down's I would wait for them:
    # 3 M + 2 (S - 1) ticks, not 3 M + S - 1.)
    pending: list[list[Task]] = [[] for _ in range(S)]
    held = [0] * S

    def candidate(s: int, tick: int) -> Task | None:  # what stage s would run at tick
        task = orders[s][position[s]] if position[s] < len(orders[s]) else None
        if task is not None and not ready(task, s, tick):
            task = None
        if split and task is not None and task.action == "F" and held[s] >= S:
            task = None
        if task is None and split and pending[s] and finished(
                ("I", pending[s][0].microbatch, s), tick):
            return pending[s][0]
        return task

    cells, position, kind = [], [0] * S, "B"
    while len(done) < (3 if split else 2) * M * V - computed * M:
        tick = len(cells)
        row = [candidate(s, tick) for s in range(S)]
        if lockstep:  # this tick's kind: the other one's if any stage has work of it
            kind = next((k for k in ("F" if kind == "B" else "B", kind)
                         if any(t is not None and t.action == k for t in row)), kind)
            row = [t if t is not None and t.action == kind else None for t in row]
        if all(task is None for task in row):  # a bug in an order, never the user's input
            raise RuntimeError(f"schedule {name!r} stalled at tick {tick} (S={S}, M={M}, v={v})")
        for s, task in enumerate(row):
            if task is None:
                continue
            if task.action == "W":
                pending[s].pop(0)
            else:
                position[s] += 1
            done[(task.action, task.microbatch, task.chunk * S + s)] = tick
            held[s] += {"F": 1, "W": -1}.get(task.action, 0)
            if task.action == "I":
                pending[s].append(Task("W", task.microbatch, task.chunk))
        cells.append(tuple(row))
    return Table(name, S, M, v, tuple(cells))


def order(name: str, stages: int, microbatches: int, chunks: int, stage: int,
          mixed: bool = False):
    """The tasks of device ``stage`` in the order it runs them (each as soon as what it needs
    has arrived).

    - ``gpipe``: every forward (chunk by chunk, microbatch by microbatch), then every
      backward (the last chunk first).
    - ``1f1b``: ``2 (S - s) - 3`` warm-up forwards (the round trip of ticks of one
      kind), then one forward and one backward in turn, then the backwards left.
    - ``zero_bubble``: Megatron-LM's 1F1B order (``S - s - 1`` warm-up forwards) with ``I``
      for ``B`` (:func:`build` adds the ``W``).
    - ``interleaved_1f1b``: the microbatches in groups of ``S``, each group's forwards
      through chunk 0, 1, ... and its backwards through chunk v-1, ..., 0 (Megatron-LM's
      order); ``2 (S - s) - 3 + (v - 1) S`` warm-up forwards, then one forward and one
      backward in turn.
    - ``mixed``: Megatron-LM's warm-ups, ``S - s - 1`` and ``2 (S - s - 1) + (v - 1) S``.

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
    warm = (2 * (S - s) - 3 + (v - 1) * S if name in LOCKSTEP and not mixed
            else 2 * (S - s - 1) + (v - 1) * S if name == "interleaved_1f1b" else S - s - 1)
    warm = max(0, min(warm, total))
    tasks = [nth("F", i) for i in range(warm)]
    for i in range(total - warm):
        tasks += [nth("F", warm + i), nth(back, i)]
    return tasks + [nth(back, i) for i in range(total - warm, total)]
