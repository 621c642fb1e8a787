"""Throughput, MFU, memory and goodput of a ``model.fit`` run, measured on the host.

What is measured, and how (all wall-clock, ``time.perf_counter()`` on the host):

* **Step time.** Keras calls ``on_train_batch_begin`` on the training thread before it
  dispatches a step, and ``on_train_batch_end`` once the step's logs have been converted to
  Python floats, which waits for the step to finish on the device. That conversion is
  Keras' own and happens anyway: on a worker thread when every callback is
  ``async_safe`` (this one is, so adding it keeps Keras' asynchronous dispatch), else on the
  training thread. A step's end is when its hook ran, bounded by any later step's hook
  (steps finish in order, but Keras' worker threads may report them out of order), and its
  time is the gap to the previous step's end; after a pause (epoch start, evaluation, a
  reported stall) it is timed from its own dispatch instead, so the pause is not a step.
  Steps of a few milliseconds can report in bursts, which blurs single-step percentiles
  (not interval throughput: the gaps add up to the same total).
* **Compile time** is the first step's time (tracing + XLA compilation + one step).
* **Goodput** is the share of wall time since ``on_train_begin`` spent in productive steps:
  not in compilation, evaluation (``on_test_begin``..``on_test_end``, less the time the
  device was still finishing training steps dispatched before it), reported stalls
  (:meth:`Throughput.report_stall`, e.g. a synchronous checkpoint save; starting and
  writing a profiler trace counts as one) or pauses between epochs.
* **Tokens** are counted from ``global_batch_size x sequence_length``; with gradient
  accumulation each ``fit`` step is one micro-batch of ``global_batch_size / N`` sequences
  and ``step`` counts optimizer updates. With ``steps_per_execution = k`` the batch hooks
  fire once per k steps and each call counts k steps.
* **MFU** = model FLOPs per token (``kdist.flops``, remat recompute excluded) x tokens/s per
  device / the device's dense peak. With remat on, **HFU** (hardware FLOPs) is logged too.

Nothing in a batch hook touches ``self.model`` (on JAX that syncs the whole training state
back into the Keras variables) or reads a device array; the model is read once, in
``on_train_begin``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np

from kdist import flops as flops_lib
from kdist.optim import AdamW

JSONL_NAME = "throughput.jsonl"
TENSORBOARD_DIR = "tensorboard"


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
    """``"A:B"`` -> ``(A, B)``: trace optimizer steps A to B inclusive (1-based); None -> None.

    Example:
        >>> parse_profile_steps("10:12")
        (10, 12)
    """
    if spec is None or spec == "":
        return None
    try:
        first, last = (int(part) for part in spec.split(":"))
    except ValueError:
        first = last = -1
    if not 1 <= first <= last:
        raise ValueError(f"Profile steps must be 'A:B' with 1 <= A <= B (optimizer steps, "
                         f"inclusive); got {spec!r}. E.g. --profile-steps 10:12.")
    return first, last


class Throughput(keras.callbacks.Callback):
    """Logs tokens/s, step-time percentiles, MFU, memory and goodput every few steps.

    Each interval of ``log_every`` optimizer steps becomes one JSON line in
    ``log_dir/throughput.jsonl`` (process 0 only) and TensorBoard scalars in
    ``log_dir/tensorboard``; ``tok/s`` and ``mfu`` are added to Keras' progress bar. The
    first line (``"kind": "config"``) states the FLOPs convention, the peak and its source.
    ``kdist report log_dir`` plots the file.

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
        flops_per_token: training (model) FLOPs per token, for models whose config
            ``kdist.flops.model_flops_per_token`` cannot read.
        tensorboard: also write TensorBoard scalars (needs TensorFlow; installed with
            keras-hub).
        profile_steps: ``(A, B)``: a JAX profiler trace of optimizer steps A..B
            (1-based, inclusive), into ``log_dir/tensorboard`` (TensorBoard's profile tab,
            with the ``tensorboard-plugin-profile`` package).
        progress_bar: add ``tok/s`` and ``mfu`` to Keras' progress bar.

    Checkpoint stalls: a callback that blocks training (e.g. waits for a save) reports
    the seconds with :meth:`report_stall`, or wraps the wait in ``with throughput.stall():``;
    they are then excluded from goodput and from step times.

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

    # The batch hooks never touch the model or device arrays, so Keras may run them on its
    # worker thread; declaring it keeps Keras' asynchronous dispatch (no per-step sync on
    # the training thread). All shared state is guarded by self._lock.
    async_safe = True

    def __init__(
        self,
        global_batch_size: int,
        sequence_length: int,
        log_dir: str | os.PathLike | None = None,
        log_every: int = 10,
        causal_half: bool = True,
        peak_tflops: float | None = None,
        flops_per_token: float | None = None,
        tensorboard: bool = True,
        profile_steps: tuple[int, int] | None = None,
        progress_bar: bool = True,
    ):
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
        self.rows: list[dict[str, Any]] = []  # every row written, also when log_dir is None
        self._lock = threading.Lock()  # counters; held for microseconds
        self._io_lock = threading.Lock()  # files; never taken on the training thread per step
        self._pending: list[dict[str, Any]] = []  # rows computed, not yet written
        self._jsonl = None
        self._writer = None

    # === Hooks (Keras calls them) ===

    def on_train_begin(self, logs=None):
        import jax

        # The only place the model is read: no training state is held by the trainer yet.
        model = self.model
        optimizer = model.optimizer
        self._accumulation = int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)
        if self.global_batch_size % self._accumulation:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by the "
                f"optimizer's gradient_accumulation_steps={self._accumulation}. Pass the "
                f"sequences per optimizer step (micro-batch x accumulation steps)."
            )
        self._steps_per_execution = int(getattr(model, "steps_per_execution", 1) or 1)
        updates = int(keras.ops.convert_to_numpy(optimizer.iterations))  # > 0 when resumed
        self._initial_fit_steps = updates * self._accumulation
        self._schedule = getattr(optimizer, "_learning_rate", None)
        self._schedule_fn = None
        self._schedule_counts_updates = isinstance(optimizer, AdamW)
        if self.flops_per_token is not None:
            self._flops = None
            self._training_flops = float(self.flops_per_token)
            self._hardware_flops = self._training_flops
            convention = "given by the user (flops_per_token)"
        else:
            self._flops = flops_lib.model_flops_per_token(
                model, self.sequence_length, causal_half=self.causal_half)
            self._training_flops = self._flops.training
            self._hardware_flops = self._flops.hardware
            convention = self._flops.convention
        self._remat = bool(self._flops and self._flops.remat)
        distribution = keras.distribution.distribution()
        if distribution is not None:
            self._devices = list(distribution.device_mesh.backend_mesh.devices.flat)
        else:
            self._devices = [jax.devices()[0]]
        local = [d for d in self._devices if d.process_index == jax.process_index()]
        self._local_devices = local or jax.local_devices()[:1]
        dtype = keras.backend.standardize_dtype(model.dtype_policy.compute_dtype)
        self._peak = flops_lib.device_peak(self._local_devices, dtype, self.peak_tflops)

        self._is_writer = jax.process_index() == 0 and self.log_dir is not None
        self._t0 = time.perf_counter()
        # Executions (one per batch-hook pair: steps_per_execution fit steps) are numbered
        # in dispatch order on the training thread, and finalised in that order.
        self._executions = 0  # dispatched so far
        self._next_execution = 0  # next one to finalise
        self._execution_of: dict[tuple[int, int], int] = {}  # (epoch, batch) -> execution
        self._begin_time: dict[int, float] = {}
        self._observed: dict[int, tuple[float, float | None]] = {}  # end time, loss
        self._pause_before: set[int] = set()  # executions timed from their own begin
        self._epoch = 0
        self._fit_steps = 0  # completed, as seen by the batch-end hook
        self._compile_s: float | None = None
        self._productive_s = 0.0
        self._eval_s = 0.0
        self._stall_s = 0.0
        self._test_start: float | None = None
        self._eval_window: tuple[float, float] | None = None
        self._last_done = -math.inf
        self._last_loss: float | None = None
        self._last_row_step = self._optimizer_step(0)
        self._interval_tokens = 0
        self._interval_s = 0.0
        self._step_times: collections.deque[float] = collections.deque(maxlen=4096)
        self._progress: dict[str, float] = {}
        self._tracing = False
        self._stop_trace_pending = False
        self._training = True
        self._open_outputs()
        self._write({
            "kind": "config",
            "step": self._last_row_step,
            "time": time.time(),
            "global_batch_size": self.global_batch_size,
            "sequence_length": self.sequence_length,
            "gradient_accumulation_steps": self._accumulation,
            "steps_per_execution": self._steps_per_execution,
            "num_devices": len(self._devices),
            "device_kind": self._peak.device_kind,
            "peak_tflops_per_device": self._peak.tflops,
            "peak_source": self._peak.source,
            "peak": self._peak.describe(),
            "dtype": dtype,
            "flops_per_token": self._training_flops,
            "hardware_flops_per_token": self._hardware_flops,
            "flops_convention": convention,
            "flops_breakdown": self._flops.as_dict() if self._flops else None,
        })

    def on_epoch_begin(self, epoch, logs=None):
        with self._lock:
            self._epoch = epoch
            self._pause()  # time between epochs is not a step

    def on_train_batch_begin(self, batch, logs=None):
        if self.profile_steps and not self._tracing:
            # Profile from the start of optimizer step A (the first micro-batch of it).
            dispatched = self._executions * self._steps_per_execution
            next_step = self._optimizer_step(dispatched) + 1
            if (self.profile_steps[0] <= next_step <= self.profile_steps[1]
                    and (self._initial_fit_steps + dispatched) % self._accumulation == 0):
                self._start_trace()
        now = time.perf_counter()
        with self._lock:
            self._execution_of[(self._epoch, batch)] = self._executions
            self._begin_time[self._executions] = now
            self._executions += 1

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        loss = logs.get("loss") if logs else None
        with self._lock:
            key = (self._epoch, batch - self._steps_per_execution + 1)
            execution = self._execution_of.pop(key, None)
            if execution is None:  # a loop that calls no batch-begin hook
                execution = self._executions
                self._begin_time[execution] = now
                self._executions += 1
            self._observed[execution] = (now, loss if isinstance(loss, (int, float)) else None)
            # Keras may run these hooks on several worker threads, out of order: finalise
            # executions in dispatch order, as soon as all earlier ones have reported.
            while self._next_execution in self._observed:
                self._finalize(self._next_execution)
                self._next_execution += 1
            if self.progress_bar and logs is not None and self._progress:
                logs.update(self._progress)  # Keras' progress bar shows every logs key
        if self._pending or self._stop_trace_pending:  # once per interval
            self._flush()  # outside self._lock

    def _finalize(self, execution: int) -> None:
        # With self._lock held.
        observed, loss = self._observed.pop(execution)
        begin = self._begin_time.pop(execution)
        # The hook ran some time after the step finished (a worker thread waits for the
        # GIL). Steps finish in order, so a later execution's report bounds this one's end.
        done = min([observed] + [t for t, _ in self._observed.values()])
        n = self._steps_per_execution
        if self._compile_s is None:
            self._compile_s = done - begin  # first step: trace + compile + one step
        else:
            paused = execution in self._pause_before
            self._pause_before.discard(execution)
            # After a pause the step starts on the device once it is dispatched and the
            # previous one is done; otherwise host gaps between steps (e.g. a slow input
            # pipeline) count as step time, since they cost throughput.
            start = max(begin, self._last_done) if paused else self._last_done
            elapsed = max(done - start, 0.0)
            self._productive_s += elapsed
            self._interval_s += elapsed
            self._interval_tokens += n * self._tokens_per_fit_step
            self._step_times.append(elapsed / n)
        self._last_done = max(self._last_done, done)
        self._fit_steps += n
        if loss is not None:
            self._last_loss = float(loss)
        step = self._optimizer_step(self._fit_steps)
        if step - self._last_row_step >= self.log_every:
            self._emit_interval(step)
        if self._tracing and step >= self.profile_steps[1]:
            self._tracing = False
            self._stop_trace_pending = True  # done by _flush, outside self._lock

    def _pause(self) -> None:
        # With self._lock held: the next execution to be dispatched is timed from its own
        # begin, so whatever happens until then (evaluation, a stall) is not a step.
        self._pause_before.add(self._executions)

    def on_test_begin(self, logs=None):
        if getattr(self, "_training", False):
            with self._lock:
                self._test_start = time.perf_counter()

    def on_test_end(self, logs=None):
        if getattr(self, "_training", False) and self._test_start is not None:
            with self._lock:
                self._eval_window = (self._test_start, time.perf_counter())
                self._test_start = None
                self._pause()

    def on_epoch_end(self, epoch, logs=None):
        with self._lock:
            if self._eval_window is not None:
                # Keras dispatches steps ahead and starts evaluating (tracing, compiling)
                # while the device may still run the epoch's last training steps; by now
                # (Keras waited for them) they are finalised, so count that overlap once, as
                # training.
                start, end = self._eval_window
                self._eval_s += max(end - max(start, self._last_done), 0.0)
                self._eval_window = None
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
            for execution in sorted(self._observed):  # after a gap (a hook never called)
                self._finalize(execution)
            step = self._optimizer_step(self._fit_steps)
            if step > self._last_row_step:
                self._emit_interval(step)
            if self._tracing:
                self._tracing, self._stop_trace_pending = False, True
            wall = time.perf_counter() - self._t0
            self._pending.append({
                "kind": "end", "step": step, "time": time.time(),
                "tokens": self._tokens(), "elapsed_s": wall,
                "compile_s": self._compile_s, "eval_s": self._eval_s,
                "stall_s": self._stall_s, "productive_s": self._productive_s,
                "goodput": self._productive_s / wall if wall > 0 else None,
            })
            self._training = False
        self._flush()
        with self._io_lock:
            self._close_outputs()

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
            self._add_stall(seconds)

    def _add_stall(self, seconds: float) -> None:
        # With self._lock held.
        self._stall_s = getattr(self, "_stall_s", 0.0) + float(seconds)
        if hasattr(self, "_pause_before"):  # i.e. during fit
            self._pause()

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
        n_dev = len(self._devices)
        # The step count the learning-rate schedule saw for the last update: kdist's AdamW
        # counts updates, Keras' own optimizers micro-steps (see kdist.optim).
        lr_at = step - 1 if self._schedule_counts_updates else (
            self._initial_fit_steps + self._fit_steps - 1)
        row: dict[str, Any] = {"kind": "interval", "step": step, "epoch": self._epoch,
                               "time": time.time(), "tokens": self._tokens(),
                               "loss": self._last_loss, "lr": None, "_lr_at": lr_at}
        if self._interval_s > 0 and self._step_times:
            tokens_per_s = self._interval_tokens / self._interval_s
            tflops = tokens_per_s * self._training_flops / n_dev / 1e12
            times = np.asarray(self._step_times) * self._accumulation  # per optimizer step
            row.update(
                tokens_per_s=tokens_per_s,
                tokens_per_s_per_device=tokens_per_s / n_dev,
                examples_per_s=tokens_per_s / self.sequence_length,
                step_time_median_s=float(np.median(times)),
                step_time_p90_s=float(np.percentile(times, 90)),
                tflops_per_device=tflops,
                mfu=tflops / self._peak.tflops,
            )
            if self._remat:
                hw = tokens_per_s * self._hardware_flops / n_dev / 1e12
                row.update(hardware_tflops_per_device=hw, hfu=hw / self._peak.tflops)
            self._progress = {"tok/s": round(tokens_per_s, 1), "mfu": round(row["mfu"], 4)}
        wall = time.perf_counter() - self._t0
        row.update(compile_s=self._compile_s, eval_s=self._eval_s, stall_s=self._stall_s,
                   elapsed_s=wall, goodput=self._productive_s / wall if wall > 0 else None)
        self._pending.append(row)
        self._last_row_step = step
        self._interval_tokens, self._interval_s = 0, 0.0
        self._step_times.clear()

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
                self._stop_trace()
            for row in rows:
                if row["kind"] == "interval":
                    row["lr"] = self._learning_rate(row.pop("_lr_at"))
                    row.update(_memory(self._local_devices))
                self._write(row)
                if row["kind"] in ("interval", "validation"):
                    self._scalars(row["step"], {
                        k: v for k, v in row.items() if k not in ("kind", "step", "epoch", "time")
                    })

    def _learning_rate(self, at: int) -> float | None:
        """The schedule's learning rate at step count ``at``, evaluated on the host CPU
        (reading the optimizer's variable would sync the training state)."""
        import jax

        schedule = self._schedule
        if schedule is None:
            return None
        if isinstance(schedule, (int, float)):
            return float(schedule)
        if not callable(schedule):
            return None
        if self._schedule_fn is None:  # compiled once: eager evaluation costs ~50 ms
            self._schedule_fn = jax.jit(schedule)
        cpu = jax.local_devices(backend="cpu")[0]  # jax.devices() lists other processes' too
        return float(self._schedule_fn(jax.device_put(np.int32(max(at, 0)), cpu)))

    def _open_outputs(self) -> None:
        if not self._is_writer:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues its file (steps keep counting from the restored
        # optimizer step). Use a fresh directory for a fresh run.
        self._jsonl = open(self.log_dir / JSONL_NAME, "a", encoding="utf-8")  # noqa: SIM115
        if self.tensorboard:
            self._writer = _ScalarWriter(self.log_dir / TENSORBOARD_DIR)

    def _close_outputs(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, row: dict[str, Any]) -> None:
        row = {k: _finite_or_none(v) for k, v in row.items()}
        self.rows.append(row)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()  # `kdist report` may read a running run

    def _scalars(self, step: int, values: dict[str, Any]) -> None:
        if self._writer is not None:
            self._writer.write(step, {k: v for k, v in values.items()
                                      if isinstance(v, (int, float)) and math.isfinite(v)})

    def _start_trace(self) -> None:
        import jax

        start = time.perf_counter()
        jax.profiler.start_trace(str(self.log_dir / TENSORBOARD_DIR))
        self._tracing = True
        with self._lock:
            self._add_stall(time.perf_counter() - start)  # profiler start-up is not a step

    def _stop_trace(self) -> None:
        import jax

        start = time.perf_counter()
        jax.profiler.stop_trace()
        with self._lock:
            self._add_stall(time.perf_counter() - start)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


def _memory(devices: list) -> dict[str, Any]:
    """Device memory in use and peak (max over local devices), else the process RSS."""
    in_use, peak = [], []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = None
        if stats and "bytes_in_use" in stats:
            in_use.append(stats["bytes_in_use"])
            peak.append(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))
    if in_use:
        return {"memory_in_use_bytes": max(in_use), "memory_peak_bytes": max(peak),
                "memory_source": "device"}
    # CPU: the process's resident set (current from /proc, peak from getrusage; KiB on Linux).
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = peak_rss
    return {"memory_in_use_bytes": rss, "memory_peak_bytes": max(peak_rss, rss),
            "memory_source": "process_rss"}


class _ScalarWriter:
    """TensorBoard scalars through TensorFlow's summary writer, on the CPU.

    ``tf.summary.scalar`` needs the ``tensorboard`` package; ``tf.summary.write`` with the
    scalars plugin's metadata (what ``scalar`` itself writes) does not, and TensorBoard reads
    it the same way. A row is one ``Summary`` protocol buffer built in Python and written by
    one ``write_raw_pb`` op (20 eager ``tf.summary.write`` ops took 4 ms, and a flush per row
    3 ms more); the writer flushes every 10 s and on close.
    """

    def __init__(self, path: Path):
        try:
            import tensorflow as tf
            from tensorflow.core.framework import summary_pb2
        except ImportError as e:
            raise ImportError("TensorBoard scalars need TensorFlow (installed with keras-hub): "
                              "pip install tensorflow, or pass "
                              "Throughput(..., tensorboard=False).") from e
        try:  # keep TensorFlow off accelerators: JAX needs their memory
            tf.config.set_visible_devices([], "GPU")
        except RuntimeError:
            pass  # TensorFlow was initialised already by someone else; leave it
        self._tf, self._summary_pb2 = tf, summary_pb2
        self._metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
            data_class=summary_pb2.DATA_CLASS_SCALAR,
        )
        with tf.device("/cpu:0"):
            self._writer = tf.summary.create_file_writer(str(path / "train"),
                                                         flush_millis=10_000)

    def write(self, step: int, values: dict[str, float]) -> None:
        tf, summary_pb2 = self._tf, self._summary_pb2
        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=name, metadata=self._metadata,
                                      tensor=tf.make_tensor_proto(float(value), tf.float32))
            for name, value in values.items()
        ])
        with tf.device("/cpu:0"), self._writer.as_default():
            tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=step)

    def close(self) -> None:
        self._writer.close()
