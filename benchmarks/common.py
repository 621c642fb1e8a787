"""Shared plumbing of the benchmark scripts: allocator, subprocesses, tables, JSON results.

Every script prints a small table and writes ``benchmarks/results/<name>.json`` holding its
arguments, the machine, the rows and the noise it saw.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Where results go: benchmarks/results/, or $BENCHMARK_RESULTS (the tests' dry runs).
RESULTS = Path(os.environ.get("BENCHMARK_RESULTS") or Path(__file__).resolve().parent / "results")
ROOT = Path(__file__).resolve().parents[1]
# Debian's libtcmalloc-minimal4 (apt-get install libtcmalloc-minimal4). The notes measured
# +30% for XLA:CPU and +18% for PyTorch over glibc malloc (page faults on large temporaries).
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")
HOST8 = "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"


def tcmalloc_path() -> str | None:
    """The tcmalloc shared library if this machine has it, else None."""
    return next((p for p in TCMALLOC if os.path.exists(p)), None)


def child_env(devices: int = 1, tcmalloc: bool = True) -> dict[str, str]:
    """Environment for a measuring subprocess: forced host devices, tcmalloc if present."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)
    env.pop("NPROC", None)
    if devices > 1:  # what kdist.force_host_devices(devices) sets
        env["XLA_FLAGS"] = HOST8.replace("=8", f"={devices}", 1)
        env["NPROC"] = str(4 * devices)
    lib = tcmalloc_path() if tcmalloc else None
    if lib:
        env["LD_PRELOAD"] = lib
    else:
        env.pop("LD_PRELOAD", None)
    return env


def run_child(script: str, args: list[str], devices: int = 1, tcmalloc: bool = True,
              timeout: float = 1800) -> dict:
    """Runs ``script --child ...`` in a fresh process and returns the JSON it printed last."""
    cmd = [sys.executable, script, "--child", *args]
    out = subprocess.run(cmd, env=child_env(devices, tcmalloc), capture_output=True, text=True,
                         timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def spread(values) -> dict[str, float]:
    """Median, min and max of a list (the noise of interleaved rounds)."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def machine() -> dict:
    """What the figures were measured on."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": load,
            "python": platform.python_version(), "tcmalloc": tcmalloc_path(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """Prints ``rows`` as a table; columns are (header, key, format spec)."""
    print(f"\n{title}")
    cells = [[(format(row[key], fmt) if row.get(key) is not None and row.get(key) != "" else "-")
              for _, key, fmt in columns] for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths)))
    for line in cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


def keras_clock(warmup: int):
    """A Keras callback timing from the start of step ``warmup`` to the end of training.

    At that start it waits for every step dispatched so far (``jax.live_arrays()``): Keras'
    JAX loop dispatches steps asynchronously and never waits per step, so without the wait
    the window would also contain the tail of the untimed warm-up steps (measured here: up
    to one extra step, i.e. -20% at 4 timed steps). The end is exact: ``fit`` turns the last
    logs into Python numbers before ``on_train_end``.
    """
    import jax
    import keras

    class Clock(keras.callbacks.Callback):
        async_safe = True

        def on_train_batch_begin(self, batch, logs=None):
            if batch == warmup:
                jax.block_until_ready(jax.live_arrays())
                self.start = time.perf_counter()

        def on_train_end(self, logs=None):
            self.seconds = time.perf_counter() - self.start

    return Clock()


def bench_adamw():
    """The optimizer every side of a speed comparison trains with (kdist's AdamW)."""
    import kdist

    return kdist.optim.adamw(1e-4, warmup_steps=10, decay_steps=1000)


def keras_fit_runner(model, x, y, batch: int, timed_tokens: int):
    """A function running one ``model.fit`` over ``x, y`` and returning tokens/s of every
    step after the first (timed by :func:`keras_clock`)."""
    def run():
        clock = keras_clock(1)
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=[clock])
        return timed_tokens / clock.seconds
    return run


def write_result(name: str, payload: dict) -> Path:
    """Writes ``benchmarks/results/<name>.json`` (with the machine) and returns its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=str))
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path
