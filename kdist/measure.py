"""Measure what a real train step uses, to check a plan against (see :mod:`kdist.planning`).

:func:`measure_train_memory` trains a kdist GPT for a few steps in a fresh subprocess on
one device and returns its peak memory above an idle baseline:

* where the backend reports device memory (GPU, TPU): ``peak_bytes_in_use`` of
  ``device.memory_stats()``;
* otherwise (CPU): the process's peak resident set (``VmHWM``) minus its resident set just
  before the model is built (after imports and backend start-up).

Compilation can need more host memory than the step itself, which would make the peak
measure the compiler. So the subprocess runs twice with a persistent compilation cache:
the first run compiles and fills the cache (one step: a second runs the same programs);
the second, measured, run loads every program from the cache (``"compiled"``, the programs
it compiled, is 0). Weights are initialised for real (random), the optimizer state is
real, and ``train_on_batch`` is the same jitted step ``fit`` runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_SCRIPT = r"""
import json, os, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
import jax.monitoring
import kdist, keras, numpy as np

events = []  # the persistent cache's: a program compiled is a request without a hit
jax.monitoring.register_event_listener(lambda event, **_: events.append(event))

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

args = json.loads(sys.argv[1])
# Before the baseline: Keras' set_random_seed imports TensorFlow where it is installed (to
# seed it too), and TensorFlow's memory is not the step's.
keras.utils.set_random_seed(0)
device = jax.devices()[0]
stats = device.memory_stats() if hasattr(device, "memory_stats") else None
baseline = rss("VmRSS")
baseline_device = (stats or {}).get("bytes_in_use", 0)
keras.config.set_dtype_policy(args["policy"])
model = kdist.models.GPTCausalLM.from_preset(args["preset"], remat=args["remat"],
                                              **args["overrides"])
model.compile(optimizer=kdist.optim.adamw())
rng = np.random.default_rng(0)
vocab = model.backbone.vocabulary_size
tokens = rng.integers(0, vocab, (args["batch"], args["length"] + 1), dtype=np.int32)
losses = [float(model.train_on_batch(tokens[:, :-1], tokens[:, 1:]))
          for _ in range(args["steps"])]
stats = device.memory_stats() if hasattr(device, "memory_stats") else None
out = {"baseline_rss": baseline, "peak_rss": rss("VmHWM"), "losses": losses,
       "compiled": events.count("/jax/compilation_cache/compile_requests_use_cache")
       - events.count("/jax/compilation_cache/cache_hits")}
if stats and stats.get("peak_bytes_in_use"):
    out.update(source="device memory_stats peak_bytes_in_use",
               peak=stats["peak_bytes_in_use"] - baseline_device)
else:
    out.update(source="process peak RSS (VmHWM) above idle baseline",
               peak=out["peak_rss"] - baseline)
print("MEASURED " + json.dumps(out))
"""


def measure_train_memory(
    preset: str,
    global_batch_size: int,
    sequence_length: int,
    *,
    precision: str = "float32",
    remat: bool = False,
    steps: int = 2,
    model_overrides: dict | None = None,
    timeout: float = 900,
) -> dict:
    """Peak memory of ``steps`` real train steps of a kdist GPT on one device, in bytes.

    Returns ``{"peak", "source", "baseline_rss", "peak_rss", "losses", "compiled"}``;
    ``peak`` is the figure to compare with a 1-device :func:`kdist.planning.plan` of the
    same configuration.

    Example:
        >>> m = measure_train_memory("gpt-nano", 4, 64)  # doctest: +SKIP
        >>> m["peak"] > 0  # doctest: +SKIP
        True
    """
    from kdist.planning import precision_policy

    args = {"preset": preset, "batch": global_batch_size, "length": sequence_length,
            "policy": precision_policy(precision), "remat": bool(remat), "steps": steps,
            "overrides": model_overrides or {}}
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory(prefix="kdist-measure-") as cache:
        result = None
        # 1: compile into the cache (one step compiles every program a step runs); 2: the
        # measured run of ``steps`` steps, which loads them from the cache.
        for run_steps in (1, steps):
            proc = subprocess.run(
                [sys.executable, "-c", _SCRIPT, json.dumps({**args, "steps": run_steps}),
                 cache],
                env=env, capture_output=True, text=True, timeout=timeout,
            )
            if proc.returncode:
                raise RuntimeError(f"The measuring subprocess failed:\n{proc.stderr[-3000:]}")
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEASURED ")]
            result = json.loads(lines[-1][len("MEASURED "):])
    return result
