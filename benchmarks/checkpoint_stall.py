"""Training stall caused by saving a gpt2-small-sized state: asynchronous vs synchronous.

The state is the real one a ``fit`` of ``gpt2-small`` checkpoints: the model's weights
(124 M float32 parameters) plus AdamW's two moments, ~1.5 GB, saved by
``kdist.callbacks.Checkpoint`` exactly as in ``fit``. Training is stood in for by a
jitted, donated update of every state array per step (memory-bound, like an optimizer
step), so that a save must have copied the arrays before the next step overwrites them.

In one process, alternately (A B A B ...): a run of ``--steps`` steps with no save
(baseline), with one asynchronous save at step 3, and with one synchronous save at step 3,
after a warm-up run that compiles the step and makes one save.
The stall of a run is its wall time minus the median baseline run's; the asynchronous run
ends with ``wait_until_finished`` outside the timed loop only if the write outlasts it
(reported separately). Reported: median stalls, their ratio, and the time ``save()``
blocks the training thread.

    PYTHONPATH=. python benchmarks/checkpoint_stall.py            # ~3-5 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/checkpoint_stall.py --rounds 3 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import keras  # noqa: E402

import kdist  # noqa: E402


def build(preset: str):
    model = kdist.models.GPTCausalLM.from_preset(preset, vocabulary_size=50304)
    model.compile(optimizer=kdist.optim.adamw(3e-4))
    model.optimizer.build(model.trainable_variables)
    return model


def run_once(ckpt, variables, step_fn, steps: int, mode: str) -> dict:
    """``steps`` stand-in training steps; ``mode`` in none/async/sync saves at step 3."""
    values = [v.value for v in variables]
    save_s = 0.0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        values = step_fn(values)
        for v, x in zip(variables, values):
            v.assign(x)
        if step == 3 and mode != "none":
            ckpt.step += 1
            t = time.perf_counter()
            ckpt.save(wait=mode == "sync")
            save_s = time.perf_counter() - t
    jax.block_until_ready(values)
    loop_s = time.perf_counter() - start
    t = time.perf_counter()
    ckpt._wait()  # the async write's tail, if it outlasted the loop
    return {"loop_s": loop_s, "save_call_s": save_s, "tail_s": time.perf_counter() - t}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="stand-in steps per run")
    p.add_argument("--directory", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)

    model = build(args.preset)
    directory = Path(args.directory or tempfile.mkdtemp(prefix="kdist-ckpt-bench-")) / "ckpt"
    ckpt = kdist.callbacks.Checkpoint(directory, keep=1, data="restart", verbose=False,
                                      handle_signals=False)
    ckpt.set_model(model)
    ckpt.set_params({"epochs": 1, "steps": 1_000_000})
    ckpt.on_train_begin()
    variables = list(ckpt._variables.values())
    nbytes = sum(v.value.nbytes for v in variables)
    step_fn = jax.jit(lambda xs: [x * 0.999 + 1e-6 if x.dtype.kind == "f" else x + 1
                                  for x in xs], donate_argnums=0)
    run_once(ckpt, variables, step_fn, 3, "sync")  # compile the step and the save's checks
    results = {"none": [], "async": [], "sync": []}
    for _ in range(args.rounds):
        for mode in results:
            results[mode].append(run_once(ckpt, variables, step_fn, args.steps, mode))
    ckpt.on_train_end()

    base = statistics.median(r["loop_s"] for r in results["none"])
    modes = ("async", "sync")
    stall = {m: statistics.median(r["loop_s"] - base for r in results[m]) for m in modes}
    call = {m: statistics.median(r["save_call_s"] for r in results[m]) for m in modes}
    tail = statistics.median(r["tail_s"] for r in results["async"])
    summary = {
        "preset": args.preset, "parameters": model.count_params(), "state_bytes": nbytes,
        "devices": jax.device_count(), "backend": jax.default_backend(),
        "steps_per_run": args.steps, "rounds": args.rounds,
        "step_s": base / args.steps, "stall_async_s": stall["async"],
        "stall_sync_s": stall["sync"],
        "stall_ratio_async_over_sync": stall["async"] / stall["sync"],
        "save_call_async_s": call["async"], "save_call_sync_s": call["sync"],
        "async_tail_after_loop_s": tail, "runs": results,
    }
    print(f"{args.preset}: {model.count_params():,} parameters, state {nbytes / 2**30:.2f} GiB "
          f"(weights + AdamW moments), {jax.device_count()} {jax.default_backend()} device(s)")
    print(f"stand-in step {base / args.steps * 1e3:.0f} ms; per run of {args.steps} steps, "
          f"median of {args.rounds}:")
    for m in ("async", "sync"):
        print(f"  {m:5}: stall {stall[m]:6.2f} s, save() blocks the training thread "
              f"{call[m]:6.2f} s")
    print(f"  async write still running after the loop: {tail:.2f} s (median)")
    print(f"stall ratio async / sync: {stall['async'] / stall['sync']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    keras.config.set_dtype_policy("float32")
    main()
