"""Where the wall time of a ``fit`` went: steps, compilation, evaluation, stalls.

Timed on the host from Keras' batch hooks (``time.perf_counter()``), for the ``Throughput``
callback, which holds its lock around every call (this class is not thread-safe itself).

* **Step time.** Keras calls ``on_train_batch_begin`` on the training thread before it
  dispatches a step, and ``on_train_batch_end`` once the step's logs have been converted to
  Python floats, which waits for the step to finish on the device. That conversion is
  Keras' own and happens anyway: on a worker thread when every callback is ``async_safe``,
  else on the training thread. A step's end is when its hook ran, bounded by any later
  step's hook (steps finish in order, but Keras' worker threads may report them out of
  order), and its time is the gap to the previous step's end; after a pause (epoch start,
  evaluation, a reported stall) it is timed from its own dispatch instead, so the pause is
  not a step. Steps of a few milliseconds can report in bursts, which blurs single-step
  percentiles (not interval throughput: the gaps add up to the same total).
* **Compile time** is the first execution's time (tracing + XLA compilation + one step).
* **Evaluation** is ``on_test_begin``..``on_test_end``, less the time the device was still
  finishing training steps dispatched before it; **stalls** are reported seconds.

Example:
    >>> clock = StepClock()
    >>> clock.begin(("epoch 0", 0), 0.0)
    >>> [elapsed for elapsed, _ in clock.end(("epoch 0", 0), 2.0, 1.5)]  # compiles: no step
    [None]
    >>> clock.begin(("epoch 0", 1), 2.0)
    >>> [elapsed for elapsed, _ in clock.end(("epoch 0", 1), 2.5, 1.4)], clock.compile_s
    ([0.5], 2.0)
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator


class StepClock:
    """Executions (one batch-hook pair each) numbered in dispatch order and finalised in
    that order; the seconds of productive steps, compilation, evaluation and stalls."""

    def __init__(self):
        self.executions = 0  # dispatched so far
        self._next = 0  # next one to finalise
        self._execution_of: dict[Hashable, int] = {}  # hook key -> execution
        self._begin: dict[int, float] = {}
        self._observed: dict[int, tuple[float, float | None]] = {}  # end time, loss
        self._pause_before: set[int] = set()  # executions timed from their own begin
        self.last_done = -math.inf
        self.compile_s: float | None = None
        self.productive_s = 0.0
        self.eval_s = 0.0
        self.stall_s = 0.0
        self._test_start: float | None = None
        self._eval_window: tuple[float, float] | None = None

    def begin(self, key: Hashable, now: float) -> None:
        """An execution is dispatched (``on_train_batch_begin``)."""
        self._execution_of[key] = self.executions
        self._begin[self.executions] = now
        self.executions += 1

    def end(self, key: Hashable, now: float,
            loss: float | None) -> Iterator[tuple[float | None, float | None]]:
        """An execution reported its end (``on_train_batch_end``). Yields ``(seconds,
        loss)`` of every execution now final, in dispatch order (seconds None for the
        compiling one); consume it before the next call."""
        execution = self._execution_of.pop(key, None)
        if execution is None:  # a loop that calls no batch-begin hook
            execution = self.executions
            self._begin[execution] = now
            self.executions += 1
        self._observed[execution] = (now, loss)
        # Keras may run these hooks on several worker threads, out of order: finalise
        # executions in dispatch order, as soon as all earlier ones have reported.
        while self._next in self._observed:
            yield self._finalize(self._next)
            self._next += 1

    def drain(self) -> Iterator[tuple[float | None, float | None]]:
        """Finalises whatever reported after a gap (a hook never called), at the end."""
        for execution in sorted(self._observed):
            yield self._finalize(execution)

    def _finalize(self, execution: int) -> tuple[float | None, float | None]:
        observed, loss = self._observed.pop(execution)
        begin = self._begin.pop(execution)
        # The hook ran some time after the step finished (a worker thread waits for the
        # GIL). Steps finish in order, so a later execution's report bounds this one's end.
        done = min([observed] + [t for t, _ in self._observed.values()])
        elapsed = None
        if self.compile_s is None:
            self.compile_s = done - begin  # first step: trace + compile + one step
        else:
            paused = execution in self._pause_before
            self._pause_before.discard(execution)
            # After a pause the step starts on the device once it is dispatched and the
            # previous one is done; otherwise host gaps between steps (e.g. a slow input
            # pipeline) count as step time, since they cost throughput.
            start = max(begin, self.last_done) if paused else self.last_done
            elapsed = max(done - start, 0.0)
            self.productive_s += elapsed
        self.last_done = max(self.last_done, done)
        return elapsed, loss

    def pause(self) -> None:
        """The next execution dispatched is timed from its own begin, so whatever happens
        until then (evaluation, a stall, an epoch boundary) is not a step."""
        self._pause_before.add(self.executions)

    def stall(self, seconds: float) -> None:
        """Training was blocked for ``seconds`` (e.g. a checkpoint save)."""
        self.stall_s += float(seconds)
        self.pause()

    def test_begin(self, now: float) -> None:
        self._test_start = now

    def test_end(self, now: float) -> None:
        if self._test_start is not None:
            self._eval_window = (self._test_start, now)
            self._test_start = None
            self.pause()

    def epoch_end(self) -> None:
        """Counts the epoch's evaluation, once its training steps are all final."""
        if self._eval_window is not None:
            # Keras dispatches steps ahead and starts evaluating (tracing, compiling) while
            # the device may still run the epoch's last training steps; by now (Keras waited
            # for them) they are finalised, so count that overlap once, as training.
            start, end = self._eval_window
            self.eval_s += max(end - max(start, self.last_done), 0.0)
            self._eval_window = None

    def goodput(self, wall: float) -> float | None:
        """The share of ``wall`` seconds spent in productive steps."""
        return self.productive_s / wall if wall > 0 else None
