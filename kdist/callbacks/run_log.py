"""Where the ``Throughput`` callback's rows go: a list, a JSONL file, TensorBoard scalars
(written without TensorFlow: :mod:`kdist.callbacks.event_file`) and profiles
(:func:`parse_profile_steps`); the device (or process) memory each interval row reports.

Example:
    >>> log = RunLog()
    >>> log.write({"kind": "end", "goodput": float("nan")})
    >>> log.rows
    [{'kind': 'end', 'goodput': None}]
"""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Any

from kdist.callbacks.event_file import EventFileWriter

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


def profiler_trace(log_dir: Path, start: bool) -> None:
    """Starts a JAX profiler trace into ``log_dir/tensorboard``, or stops it.

    Example:
        >>> profiler_trace(Path("runs/x"), start=True)  # doctest: +SKIP
    """
    import jax

    if start:
        jax.profiler.start_trace(str(log_dir / TENSORBOARD_DIR))
    else:
        jax.profiler.stop_trace()


class RunLog:
    """Every row written (:attr:`rows`, also without a directory), and on the writing
    process ``log_dir/throughput.jsonl`` (appended: a resumed run continues its file) and
    TensorBoard scalars in ``log_dir/tensorboard/train``."""

    def __init__(self):
        self.rows: list[dict[str, Any]] = []
        self._jsonl = None
        self._writer = None

    def open(self, log_dir: Path, tensorboard: bool) -> None:
        """Opens the files of ``log_dir`` (call on the writing process only)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues its file (steps keep counting from the restored
        # optimizer step). Use a fresh directory for a fresh run.
        self._jsonl = open(log_dir / JSONL_NAME, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            self._writer = EventFileWriter(log_dir / TENSORBOARD_DIR / "train")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def write(self, row: dict[str, Any]) -> None:
        """Keeps ``row`` (non-finite floats as None: JSON has no NaN) and appends it."""
        row = {k: finite_or_none(v) for k, v in row.items()}
        self.rows.append(row)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()  # `kdist report` may read a running run

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        """The finite numbers of ``values`` as TensorBoard scalars at ``step``."""
        if self._writer is not None:
            self._writer.write(step, {k: v for k, v in values.items()
                                      if isinstance(v, (int, float)) and math.isfinite(v)})


def finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


def memory_usage(devices: list) -> dict[str, Any]:
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


class ScheduleValue:
    """A learning-rate schedule's value at a step count, evaluated on the host CPU (reading
    the optimizer's variable would sync the training state); None without a schedule.

    Example:
        >>> ScheduleValue(0.5)(10), ScheduleValue(None)(10)
        (0.5, None)
    """

    def __init__(self, schedule):
        self.schedule, self._compiled = schedule, None

    def __call__(self, at: int) -> float | None:
        import jax
        import numpy as np

        schedule = self.schedule
        if schedule is None:
            return None
        if isinstance(schedule, (int, float)):
            return float(schedule)
        if not callable(schedule):
            return None
        if self._compiled is None:  # compiled once: eager evaluation costs ~50 ms
            self._compiled = jax.jit(schedule)
        cpu = jax.local_devices(backend="cpu")[0]  # jax.devices() lists other processes' too
        return float(self._compiled(jax.device_put(np.int32(max(at, 0)), cpu)))
