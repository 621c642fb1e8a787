"""Throughput, MFU, memory and goodput of a ``model.fit`` run, measured on the host.

What is measured, and how (all wall-clock, ``time.perf_counter()`` on the host):

* **Step time**, **compile time** (the first step's), **goodput** (the share of wall time
  since ``on_train_begin`` in productive steps: not compilation, evaluation, reported
  stalls — :meth:`Throughput.report_stall`, e.g. a synchronous checkpoint save or a
  profiler trace — or pauses between epochs): :mod:`kdist.callbacks.step_clock`. The
  hooks keep Keras' asynchronous dispatch: this callback is ``async_safe``.
* **Tokens**: ``global_batch_size x sequence_length`` per optimizer step (``step``); with
  gradient accumulation each ``fit`` step is one micro-batch of ``global_batch_size / N``
  sequences; with ``steps_per_execution = k`` each batch hook counts k steps.
* **MFU** = model FLOPs per token x tokens/s per device / the device's dense peak. FLOPs:
  the model's cost model (any family with ``cost_model()``; remat recompute excluded),
  else ``flops_per_token=``, else ``6 x trainable parameters`` (so labelled); with remat,
  **HFU** too. The peak (:mod:`kdist.callbacks.peak`): the table's (int8 ``matmul_precision``:
  blended with its int8 rate), the user's, or measured here and kept per machine. **No MFU
  above 1** (:mod:`kdist.callbacks.mfu`): ``mfu`` is None and ``mfu_unreliable`` says why;
  a peak measured under load is flagged in every row, its MFU kept out of the progress bar.
* **Loss**: ``loss`` is Keras' running epoch mean; ``step_losses`` each step's own
  (:mod:`kdist.callbacks.step_loss`), which ``kdist report`` plots. **Rounds** of separate
  replica group jobs: :mod:`kdist.groups.rounds`. **Expert load** of a MoE model's layers
  at each interval's end: :class:`kdist.callbacks.expert_load.IntervalExpertLoad`.

No batch hook touches ``self.model`` (on JAX that syncs the whole training state back
into the Keras variables) or reads a device array; the model is read in ``on_train_begin``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np

from kdist import _keras_compat
from kdist.callbacks.expert_load import IntervalExpertLoad
from kdist.callbacks.fit_devices import fit_devices
from kdist.callbacks.mfu import ModelFlops, interval_rates, shown_mfu
from kdist.callbacks.peak import device_peak, matmul_peak
from kdist.callbacks.run_log import (
    JSONL_NAME,
    TENSORBOARD_DIR,
    RunLog,
    ScheduleValue,
    parse_profile_steps,
    profiler_trace,
)
from kdist.callbacks.step_clock import StepClock
from kdist.callbacks.step_loss import StepLosses, per_optimizer_step
from kdist.callbacks.step_memory import StepMemory
from kdist.callbacks.stragglers import InputTimer, Stragglers
from kdist.groups.rounds import interval_rounds
from kdist.optim import AdamW
from kdist.parallel.step import state_optimizer

__all__ = ["JSONL_NAME", "TENSORBOARD_DIR", "Throughput", "parse_profile_steps"]


class Throughput(keras.callbacks.Callback):
    """Logs tokens/s, step-time percentiles, MFU, memory and goodput every few steps.

    Each interval of ``log_every`` optimizer steps becomes one JSON line in
    ``log_dir/throughput.jsonl`` (process 0 only) and TensorBoard scalars in
    ``log_dir/tensorboard``; ``tok/s`` and ``mfu`` are added to Keras' progress bar. The
    first line (``"kind": "config"``) states the FLOPs convention, the peak and its source,
    and the memory figures (:mod:`kdist.callbacks.step_memory`). ``kdist report`` plots it.

    Args:
        global_batch_size: sequences per optimizer step, over all processes and all
            micro-batches (with gradient accumulation N, each ``fit`` batch holds
            ``global_batch_size / N`` sequences).
        sequence_length: tokens per sequence.
        log_dir: directory for the JSONL file, TensorBoard scalars and profiles; None
            logs only to the progress bar (and :attr:`rows`).
        log_every: optimizer steps per interval.
        causal_half: the causal-attention FLOPs convention (see ``kdist.flops``).
        peak_tflops: the per-device dense peak to use instead of the table/measurement.
        flops_per_token: training (model) FLOPs per token, instead of the model's cost
            model (e.g. BERT's masked-LM count at the masked positions actually trained).
        tensorboard: also write TensorBoard scalars (event files kdist writes: no TensorFlow).
        profile_steps: ``(A, B)``: a JAX profiler trace of optimizer steps A..B (1-based,
            inclusive) into ``log_dir/tensorboard`` (``tensorboard-plugin-profile``).
        progress_bar: add ``tok/s`` and ``mfu`` (when reliable) to Keras' progress bar.
        stragglers: how a process waiting longer for its input than the others is named
            (:class:`kdist.callbacks.stragglers.Stragglers`; rows carry ``input_wait_s``).

    A callback that blocks training (e.g. waits for a save) reports the seconds with
    :meth:`report_stall` or ``with throughput.stall():``: not goodput, not step time.

    Example:
        >>> import numpy as np, kdist
        >>> model = kdist.models.GPTCausalLM.from_preset(
        ...     "gpt-nano", vocabulary_size=256, num_layers=1, max_sequence_length=16)
        >>> model.compile(optimizer="adamw")
        >>> x = np.random.randint(0, 256, (32, 16)).astype("int32")
        >>> cb = Throughput(global_batch_size=8, sequence_length=16, log_every=2)
        >>> _ = model.fit(x, x, batch_size=8, verbose=0, callbacks=[cb])
        >>> cb.rows[-2]["step"], cb.rows[-2]["tokens"]  # the last interval; then "end"
        (4, 512)
    """

    async_safe = True  # batch hooks touch no model or device array; state under self._lock

    def __init__(self, global_batch_size: int, sequence_length: int,
                 log_dir: str | os.PathLike | None = None, log_every: int = 10,
                 causal_half: bool = True, peak_tflops: float | None = None,
                 flops_per_token: float | None = None, tensorboard: bool = True,
                 profile_steps: tuple[int, int] | None = None, progress_bar: bool = True,
                 stragglers: Stragglers | None = None):
        super().__init__()
        for name, value in (("global_batch_size", global_batch_size),
                            ("sequence_length", sequence_length), ("log_every", log_every)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}. E.g. "
                                 f"Throughput(global_batch_size=16, sequence_length=256).")
        if profile_steps is not None:
            if log_dir is None:
                raise ValueError("profile_steps needs a log_dir to write the trace to: pass "
                                 "Throughput(..., log_dir='runs/x', profile_steps=(10, 12)).")
            profile_steps = parse_profile_steps(f"{profile_steps[0]}:{profile_steps[1]}")
        self.global_batch_size = global_batch_size
        self.sequence_length = sequence_length
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.log_every = log_every
        self.causal_half = causal_half
        self.peak_tflops = peak_tflops
        self.flops_per_token = flops_per_token
        self.tensorboard = tensorboard
        self.profile_steps = profile_steps
        self.progress_bar = progress_bar
        self.stragglers = stragglers or Stragglers()
        self._inputs = InputTimer()  # the training thread in next(iterator)
        self._log = RunLog()
        self._clock = StepClock()  # a fresh one at train begin; stalls before fit go here
        self.rows = self._log.rows  # every row written, also when log_dir is None
        self._lock = threading.Lock()  # counters; held for microseconds
        self._io_lock = threading.Lock()  # files; never taken on the training thread per step
        self._pending: list[dict[str, Any]] = []  # rows computed, not yet written

    # === Hooks (Keras calls them) ===

    def on_train_begin(self, logs=None):
        # The only place the model is read: no training state is held by the trainer yet.
        model = self.model
        self._read_optimizer(model)
        self._flops = ModelFlops.of(model, self.sequence_length, self.causal_half,
                                    self.flops_per_token)
        self._devices, self._local_devices, process = fit_devices()
        self._first_process = process == 0  # the one that prints and writes
        self._is_writer = self._first_process and self.log_dir is not None
        dtype = keras.backend.standardize_dtype(model.dtype_policy.compute_dtype)
        peak = device_peak(self._local_devices, dtype, self.peak_tflops)
        self._peak = matmul_peak(peak, self._flops.breakdown, model)
        self._reset_counters()
        steps = (self.params or {}).get("steps")  # an epoch entered half-way: see step_loss
        self._step_losses = StepLosses(self._initial_fit_steps // steps if steps and
                                       self._initial_fit_steps % steps else None)
        self._memory = StepMemory(model)  # the train step fit runs, compiled ahead
        self._experts = IntervalExpertLoad(model)  # MoE layers' load in interval rows
        self._inputs.install(model)
        self.stragglers.begin()
        if self._is_writer:
            self._log.open(self.log_dir, self.tensorboard)
        self._log.write(self._config_row(dtype))

    # --- on_train_begin's steps ---

    def _read_optimizer(self, model) -> None:
        """Accumulation, steps per execution, the restored step count, the schedule."""
        optimizer = model.optimizer
        self._groups = getattr(optimizer, "groups", None)  # DiLoCo's; separate jobs: rounds
        self._accumulation = int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)
        if self.global_batch_size % self._accumulation:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by "
                             f"the optimizer's gradient_accumulation_steps={self._accumulation}"
                             f". Pass the sequences per optimizer step (micro-batch x "
                             f"accumulation steps).")
        self._steps_per_execution = int(getattr(model, "steps_per_execution", 1) or 1)
        updates = int(keras.ops.convert_to_numpy(optimizer.iterations))  # > 0 when resumed
        self._initial_fit_steps = updates * self._accumulation
        optimizer = state_optimizer(model)  # DiLoCo's schedule is its inner optimizer's
        self._schedule_value = ScheduleValue(_keras_compat.learning_rate_schedule(optimizer))
        self._schedule_counts_updates = isinstance(optimizer, AdamW)

    def _reset_counters(self) -> None:
        self._t0 = time.perf_counter()
        self._clock = StepClock()
        self._epoch = 0
        self._fit_steps = 0  # completed, as seen by the batch-end hook
        self._last_loss: float | None = None
        self._losses: list[tuple[int, float]] = []  # (fit step, that step's loss)
        self._mfu_hidden = False
        self._last_row_step = self._optimizer_step(0)
        self._interval_tokens = 0
        self._interval_s = 0.0
        self._step_times: collections.deque[float] = collections.deque(maxlen=4096)
        self._progress: dict[str, float] = {}
        self._tracing = False
        self._stop_trace_pending = False
        self._training = True

    def _config_row(self, dtype: str) -> dict[str, Any]:
        # "step": where this fit starts (a resumed run's sessions: kdist.run_report).
        return {"kind": "config", "step": self._last_row_step, "time": time.time(),
                "global_batch_size": self.global_batch_size,
                "sequence_length": self.sequence_length,
                "gradient_accumulation_steps": self._accumulation,
                "steps_per_execution": self._steps_per_execution,
                "num_devices": len(self._devices), **self._peak.row(), "dtype": dtype,
                **self._flops.row(), **self._memory.config()}

    # === Hooks (Keras calls them), continued ===

    def on_epoch_begin(self, epoch, logs=None):
        with self._lock:
            self._epoch = epoch
            self._clock.pause()  # time between epochs is not a step

    def on_train_batch_begin(self, batch, logs=None):
        if self.profile_steps and not self._tracing:
            # Profile from the start of optimizer step A (the first micro-batch of it).
            dispatched = self._clock.executions * self._steps_per_execution
            next_step = self._optimizer_step(dispatched) + 1
            if (self.profile_steps[0] <= next_step <= self.profile_steps[1]
                    and (self._initial_fit_steps + dispatched) % self._accumulation == 0):
                self._trace(start=True)
        now = time.perf_counter()
        with self._lock:
            self._clock.begin((self._epoch, batch), now)

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        loss = logs.get("loss") if logs else None
        with self._lock:
            key = (self._epoch, batch - self._steps_per_execution + 1)
            loss = loss if isinstance(loss, (int, float)) else None
            for seconds, observed in self._clock.end(key, now, (self._epoch, batch + 1, loss)):
                self._count(seconds, observed)
            if self.progress_bar and logs is not None and self._progress:
                logs.update(self._progress)  # Keras' progress bar shows every logs key
        if self._pending or self._stop_trace_pending:  # once per interval
            self._flush()  # outside self._lock

    def _count(self, seconds: float | None, observed: tuple) -> None:
        # With self._lock held: one execution is final (seconds None: it compiled).
        epoch, done, loss = observed  # loss: Keras' running epoch mean
        n = self._steps_per_execution
        if seconds is not None:
            self._interval_s += seconds
            self._interval_tokens += n * self._tokens_per_fit_step
            self._step_times.append(seconds / n)
        self._fit_steps += n
        if loss is not None:
            self._last_loss = float(loss)
            step_loss = self._step_losses.observe(epoch, done, loss)  # this step's own
            if step_loss is not None:
                self._losses.append((self._initial_fit_steps + self._fit_steps, step_loss))
        step = self._optimizer_step(self._fit_steps)
        if step - self._last_row_step >= self.log_every:
            self._emit_interval(step)
        if self._tracing and step >= self.profile_steps[1]:
            self._tracing = False
            self._stop_trace_pending = True  # done by _flush, outside self._lock

    def on_test_begin(self, logs=None):
        if getattr(self, "_training", False):
            with self._lock:
                self._clock.test_begin(time.perf_counter())

    def on_test_end(self, logs=None):
        if getattr(self, "_training", False):
            with self._lock:
                self._clock.test_end(time.perf_counter())

    def on_epoch_end(self, epoch, logs=None):
        with self._lock:
            self._clock.epoch_end()
        logs = logs or {}
        val = {k: v for k, v in logs.items()
               if k.startswith("val_") and isinstance(v, (int, float))}
        if val:
            with self._lock:
                self._pending.append({"kind": "validation", "epoch": epoch,
                                      "step": self._optimizer_step(self._fit_steps),
                                      "time": time.time(), **val})
        self._flush()

    def on_train_end(self, logs=None):
        with self._lock:
            for seconds, observed in self._clock.drain():  # after a gap (a hook not called)
                self._count(seconds, observed)
            step = self._optimizer_step(self._fit_steps)
            if step > self._last_row_step:
                self._emit_interval(step)
            if self._tracing:
                self._tracing, self._stop_trace_pending = False, True
            wall = time.perf_counter() - self._t0
            c = self._clock
            self._pending.append({
                "kind": "end", "step": step, "time": time.time(), "tokens": self._tokens(),
                "elapsed_s": wall, "compile_s": c.compile_s, "eval_s": c.eval_s,
                "stall_s": c.stall_s, "productive_s": c.productive_s, "goodput": c.goodput(wall)})
            self._training = False
        self._flush()
        with self._io_lock:
            self._log.close()
        InputTimer.uninstall(_keras_compat.callback_model(self))  # no state sync

    def record_validation(self, logs: dict[str, float], step: int = 0) -> None:
        """Logs a validation made outside ``fit`` (e.g. before training: the report's
        step-0 point); written with the next rows (after ``on_train_begin``'s config row).

        Example:
            >>> Throughput(8, 16).record_validation({"loss": 9.07}, step=0)
        """
        val = {k if k.startswith("val_") else f"val_{k}": float(v) for k, v in logs.items()}
        with self._lock:
            self._pending.append({"kind": "validation", "step": step, "time": time.time(), **val})

    def resume_epoch_mean(self, epoch: int, total: float, count: float) -> None:
        """Tells the callback that ``fit`` goes on inside ``epoch`` from Keras' running loss
        mean as restored (its loss tracker's ``total`` and ``count``, which count examples;
        kdist's ``Checkpoint`` calls this), so each step's own loss is known there too.

        Example:
            >>> throughput.resume_epoch_mean(1, total=56.0, count=16.0)  # doctest: +SKIP
        """
        batch = self.global_batch_size // self._accumulation  # the examples of a fit step
        if count % batch == 0:  # else not kdist's equal batches: those steps stay unknown
            with self._lock:
                self._step_losses.resume(epoch, int(count // batch), total / batch)

    # === Stalls reported by other callbacks ===

    def report_stall(self, seconds: float, kind: str = "checkpoint") -> None:
        """Tells the callback that training was blocked for ``seconds`` (e.g. a save).

        The seconds are excluded from goodput and the next step is timed from its own
        start. Call it from any thread, right after the stall.

        Example:
            >>> cb = Throughput(global_batch_size=8, sequence_length=16)
            >>> cb.report_stall(0.5)
        """
        if seconds < 0:
            raise ValueError(f"Stall seconds must be >= 0; got {seconds}.")
        with self._lock:
            self._clock.stall(seconds)

    @contextlib.contextmanager
    def stall(self, kind: str = "checkpoint"):
        """Context manager form of :meth:`report_stall`: times the block and reports it.

        Example:
            >>> cb = Throughput(global_batch_size=8, sequence_length=16)
            >>> with cb.stall():
            ...     pass  # e.g. checkpoint_manager.wait_until_finished()
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            self.report_stall(time.perf_counter() - start, kind)

    # === Internals ===

    @property
    def _tokens_per_fit_step(self) -> int:
        return self.global_batch_size // self._accumulation * self.sequence_length

    def _optimizer_step(self, fit_steps: int) -> int:
        return (self._initial_fit_steps + fit_steps) // self._accumulation

    def _tokens(self) -> int:
        return self._fit_steps * self._tokens_per_fit_step

    def _emit_interval(self, step: int) -> None:
        # With self._lock held, once per interval: arithmetic only; _flush does the rest.
        # The step count the learning-rate schedule saw for the last update: kdist's AdamW
        # counts updates, Keras' own optimizers micro-steps (see kdist.optim).
        lr_at = step - 1 if self._schedule_counts_updates else (
            self._initial_fit_steps + self._fit_steps - 1)
        waited, fetched = self._inputs.take((step - self._last_row_step) * self._accumulation)
        row: dict[str, Any] = {"kind": "interval", "step": step, "epoch": self._epoch,
                               "time": time.time(), "tokens": self._tokens(),
                               "loss": self._last_loss, "lr": None, "_lr_at": lr_at,
                               "step_losses": per_optimizer_step(self._losses, self._accumulation),
                               "input_wait_s": waited / fetched * self._accumulation
                               if fetched else None}
        if self._interval_s > 0 and self._step_times:
            times = np.asarray(self._step_times) * self._accumulation  # per optimizer step
            row.update(interval_rates(self._flops, self._peak, self._interval_tokens,
                                      self._interval_s, times, len(self._devices),
                                      self.sequence_length))
            mfu = shown_mfu(row)
            self._progress = {"tok/s": _keras_compat.progress_bar_figure(row["tokens_per_s"]),
                              **({} if mfu is None else {"mfu": mfu})}
            if row.get("mfu_unreliable") and not self._mfu_hidden:
                self._mfu_hidden = True  # once per fit: said (by _flush), not shown
                row["_notice"] = (f"Throughput: MFU is not shown in the progress bar: "
                                  f"{row['mfu_unreliable']} (the rows keep it, and why).")
        wall = time.perf_counter() - self._t0
        c = self._clock
        row.update(compile_s=c.compile_s, eval_s=c.eval_s, stall_s=c.stall_s, elapsed_s=wall,
                   goodput=c.goodput(wall))
        row["_figures"] = {k: row.get(k) for k in ("step_time_median_s", "input_wait_s",
                                                   "tokens_per_s")}
        self._pending.append(row)
        self._last_row_step = step
        self._interval_tokens, self._interval_s = 0, 0.0
        self._step_times.clear()
        self._losses.clear()

    def _flush(self) -> None:
        """Writes the pending rows: learning rate, memory, JSONL, TensorBoard.

        Runs on whichever thread called the hook, never holding self._lock, so the training
        thread's batch-begin hook does not wait for file or TensorFlow work.
        """
        with self._io_lock:
            with self._lock:
                rows, self._pending = self._pending, []
                stop_trace, self._stop_trace_pending = self._stop_trace_pending, False
            if stop_trace:
                self._trace(start=False)
            for row in rows:
                notice = row.pop("_notice", None)
                if notice and self._first_process:  # a line of its own ("\n": out of the
                    print(f"\n{notice}", flush=True)  # bar; a warning printed its source)
                if row["kind"] == "interval":
                    row["lr"] = self._schedule_value(row.pop("_lr_at"))
                    row.update(self.stragglers.interval(row["step"], row.pop("_figures")),
                               **interval_rounds(getattr(self, "_groups", None)))
                    row.update(self._memory.row(self._local_devices), **self._experts.row())
                self._log.write(row)
                if row["kind"] in ("interval", "validation"):
                    self._log.scalars(row["step"], {
                        k: v for k, v in row.items() if k not in ("kind", "step", "epoch", "time")
                    })

    def _trace(self, start: bool) -> None:
        """Starts or stops the profiler trace; its seconds are a stall, not a step."""
        began = time.perf_counter()
        profiler_trace(self.log_dir, start)
        self._tracing = self._tracing or start
        with self._lock:
            self._clock.stall(time.perf_counter() - began)
