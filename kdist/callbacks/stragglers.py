"""Which process makes the others wait: per-process step and input-wait times, no step sync.

In a multi-process SPMD job every step ends in collectives, so every process's *step time*
is the slowest process's: a straggler does not show in its own step time. What differs is
where each process spends the step on its host. :class:`InputTimer` wraps the model's
train function (the callable Keras' ``fit`` calls per step) and times the training thread
inside ``next(iterator)``: the **input wait**, the classic cause of load imbalance (a slow
loader, a slow disk, a busy host). A process that waits for its input longer than the
median process, by more than ``threshold`` of the median step time, for ``patience``
intervals in a row, is a **straggler**: named in a warning and in the interval row's
``stragglers`` field (``kdist report`` prints every process's line).

Gathered without a per-step sync: once per ``Throughput`` interval each process writes its
figures to JAX's coordination service (a key-value store on the coordinator, over TCP; no
device collective, no barrier), and process 0 reads everyone's figures of the *previous*
interval with non-blocking gets (each process wrote them ``log_every`` steps ago). A slow
device rather than a slow host shows in no host clock: use the profiler
(``--profile-steps``) for that.

Example:
    >>> Stragglers(threshold=0.1, patience=2).judge(
    ...     [{"process": 0, "input_wait_s": 0.01, "step_time_median_s": 1.0},
    ...      {"process": 1, "input_wait_s": 0.50, "step_time_median_s": 1.0},
    ...      {"process": 2, "input_wait_s": 0.02, "step_time_median_s": 1.0}])
    []
"""

from __future__ import annotations

import collections
import itertools
import json
import statistics
import threading
import time
import warnings

from kdist import _keras_compat

_fits = itertools.count()  # fits started in this process: the same sequence in every process


def _unwrapped(function):
    return getattr(function, "unwrapped", function)


class InputTimer:
    """Times the training thread in ``next(iterator)`` of Keras' train function.

    Example:
        >>> timer = InputTimer()
        >>> step = timer.wrap(lambda state, iterator: (next(iterator), state))
        >>> step(None, iter([1]))[0], timer.take(5)[1]
        (1, 1)
    """

    def __init__(self):
        self._waits: collections.deque[float] = collections.deque()  # per batch, in order
        self._lock = threading.Lock()

    def wrap(self, train_function):
        """``train_function(state, iterator)`` with its ``next(iterator)`` timed."""
        timer = self

        class Timed:
            def __init__(self, iterator):
                self.iterator = iter(iterator)

            def __iter__(self):
                return self

            def __next__(self):
                start = time.perf_counter()
                try:
                    return next(self.iterator)
                finally:
                    timer.add(time.perf_counter() - start)

        def timed(state, iterator):
            return train_function(state, Timed(iterator))

        timed.unwrapped = train_function
        return timed

    def install(self, model) -> None:
        """Times ``model.train_function`` (``fit`` made it just before ``on_train_begin``);
        a failed fit's timed function is replaced, not wrapped twice."""
        model.train_function = self.wrap(_unwrapped(model.train_function))

    @staticmethod
    def uninstall(model) -> None:
        """Puts Keras' own train function back."""
        model.train_function = _unwrapped(model.train_function)

    def add(self, seconds: float) -> None:
        with self._lock:
            self._waits.append(seconds)

    def take(self, batches: int | None = None) -> tuple[float, int]:
        """Seconds waited for the next ``batches`` batches fetched (all: None), and how
        many there were. The training thread fetches ahead of the steps that have ended
        (Keras dispatches asynchronously): an interval takes its own steps' batches."""
        with self._lock:
            n = len(self._waits) if batches is None else min(batches, len(self._waits))
            waits = [self._waits.popleft() for _ in range(n)]
        return sum(waits), n


class Stragglers:
    """Per-process figures of each ``Throughput`` interval, gathered on process 0, judged.

    Args:
        threshold: a process is slow in an interval when its input wait per step exceeds
            the median process's by more than this share of the median step time.
        patience: consecutive slow intervals before the process is named a straggler.

    Example:
        >>> s = Stragglers(threshold=0.1, patience=1)
        >>> s.judge([{"process": p, "input_wait_s": w, "step_time_median_s": 1.0}
        ...          for p, w in enumerate([0.0, 0.3, 0.01])])
        [1]
    """

    def __init__(self, threshold: float = 0.1, patience: int = 3):
        if not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(f"threshold must be a number > 0 (a share of the step time, "
                             f"e.g. 0.1); got {threshold!r}.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an integer >= 1 (intervals); got "
                             f"{patience!r}.")
        self.threshold, self.patience = threshold, patience
        self._slow: dict[int, int] = {}  # process -> consecutive slow intervals
        self._named: set[int] = set()

    def begin(self) -> None:
        """At train begin: this process's place; a fresh key space for this fit."""
        import jax

        self.process, self.processes = jax.process_index(), jax.process_count()
        self._prefix = f"kdist/stragglers/{next(_fits)}"
        self._client = _keras_compat.distributed_client() if self.processes > 1 else None
        self._published: list[int] = []
        self._previous: int | None = None
        self._slow.clear()
        self._named.clear()

    def interval(self, step: int, figures: dict) -> dict:
        """This process's ``figures`` of the interval ending at ``step``, published; on
        process 0, the fields its row gets: every process's previous interval and the
        stragglers. Call once per interval, in step order, outside the training thread's
        hot path (it talks to the coordinator)."""
        if self._client is None:
            return {}
        self._client.key_value_set(f"{self._prefix}/{step}/{self.process}", json.dumps(figures))
        self._published.append(step)
        if len(self._published) > 3:  # the coordinator keeps the last few only
            self._client.key_value_delete(
                f"{self._prefix}/{self._published.pop(0)}/{self.process}")
        previous, self._previous = self._previous, step
        if self.process != 0 or previous is None:
            return {}
        rows = []
        for p in range(self.processes):
            try:  # not there (yet): that process is left out of this interval's judgement
                value = self._client.key_value_try_get(f"{self._prefix}/{previous}/{p}")
            except Exception:  # noqa: BLE001 (JAX raises its own status error: NOT_FOUND)
                value = None
            if value:
                rows.append({"process": p, **json.loads(value)})
        return {"processes_step": previous, "processes": rows, "stragglers": self.judge(rows)}

    def judge(self, rows: list[dict]) -> list[int]:
        """The processes named stragglers after this interval's ``rows``."""
        waits = [r["input_wait_s"] for r in rows if r.get("input_wait_s") is not None]
        steps = [r["step_time_median_s"] for r in rows if r.get("step_time_median_s")]
        if len(waits) < 2 or not steps:
            return sorted(self._named)
        median_wait, median_step = statistics.median(waits), statistics.median(steps)
        for r in rows:
            p, wait = r["process"], r.get("input_wait_s")
            slow = wait is not None and wait - median_wait > self.threshold * median_step
            self._slow[p] = self._slow.get(p, 0) + 1 if slow else 0
            if self._slow[p] >= self.patience and p not in self._named:
                self._named.add(p)
                warnings.warn(
                    f"Throughput: process {p} is a straggler: it waits {wait:.3f} s per step "
                    f"for its input, {wait - median_wait:.3f} s more than the median process "
                    f"({(wait - median_wait) / median_step:.0%} of the {median_step:.3f} s "
                    f"step), for {self._slow[p]} intervals. Every process waits for it.",
                    stacklevel=2)
            elif not self._slow[p]:
                self._named.discard(p)
        return sorted(self._named)
