"""The Throughput callback's own cost on step time: the same model, fit with and without it.

One process, one compiled train step: `fit` runs alternately without and with the callback
(order ABBA per round, so drift cancels), each over the same number of steps, and the
ratio of the median wall times per step is reported. Also reported: the time spent inside
the callback's batch hooks, the part of the cost that does not depend on timing noise.

    python benchmarks/throughput_overhead.py               # ~1-2 minutes on 2 CPU cores
    python benchmarks/throughput_overhead.py --rounds 10 --steps 100

The model is deliberately small (steps of tens of milliseconds on a CPU) so a fixed
per-step cost would show; on an accelerator with bigger steps the ratio only gets smaller.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kdist  # noqa: E402

SHAPE = dict(vocabulary_size=2048, num_layers=2, num_heads=4, hidden_dim=128,
             intermediate_dim=512, max_sequence_length=128)


def timed(fn, totals, key):
    """Wraps a hook so the seconds spent in it add up in totals[key], split by thread:
    time on the training thread delays training; time on Keras' worker thread does not,
    except by competing for the CPU and the GIL."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            where = "main" if threading.current_thread() is threading.main_thread() else "worker"
            totals[f"{key}_{where}"] += time.perf_counter() - start
    return wrapper


class Clock(keras.callbacks.Callback):
    """Wall time from the batch-begin of step `warmup` to the end of training (after Keras
    has waited for the last step), so per-fit set-up costs stay out of the step time."""

    async_safe = True

    def __init__(self, warmup):
        super().__init__()
        self.warmup = warmup

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, logs=None):
        self.seconds = time.perf_counter() - self.start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps", type=int, default=30, help="fit steps per measurement")
    p.add_argument("--warmup", type=int, default=5, help="steps of each fit not timed")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--no-tensorboard", action="store_true", help="JSONL only")
    args = p.parse_args(argv)

    keras.utils.set_random_seed(0)
    model = kdist.models.GPTCausalLM(kdist.models.GPTBackbone(**SHAPE))
    model.compile(optimizer=kdist.optim.adamw(1e-3, warmup_steps=10, decay_steps=1000))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocabulary_size"],
                          (args.steps * args.batch, args.sequence_length + 1)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    log_dir = Path(tempfile.mkdtemp(prefix="throughput-overhead-"))
    hook_s = dict.fromkeys(("begin_main", "begin_worker", "end_main", "end_worker"), 0.0)

    def run(with_callback: bool) -> float:
        clock = Clock(args.warmup)
        callbacks = [clock]  # first, so its on_train_end runs before the callback's
        if with_callback:
            cb = kdist.callbacks.Throughput(args.batch, args.sequence_length, log_dir=log_dir,
                                            log_every=args.log_every,
                                            tensorboard=not args.no_tensorboard)
            cb.on_train_batch_begin = timed(cb.on_train_batch_begin, hook_s, "begin")
            cb.on_train_batch_end = timed(cb.on_train_batch_end, hook_s, "end")
            callbacks.append(cb)
        model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)
        return clock.seconds / (args.steps - args.warmup)

    run(False), run(True)  # compile, import TensorFlow, measure the CPU peak once
    hook_s.update(dict.fromkeys(hook_s, 0.0))
    without, with_ = [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for flag in order:
            (with_ if flag else without).append(run(flag))
    ratio = statistics.median(with_) / statistics.median(without)
    steps = args.rounds * args.steps
    main_thread = (hook_s["begin_main"] + hook_s["end_main"]) / steps
    result = {
        "step_s_without": statistics.median(without),
        "step_s_with": statistics.median(with_),
        "ratio_with_over_without": ratio,
        "median_of_paired_round_ratios": statistics.median(
            w / o for w, o in zip(with_, without)),
        "per_round_ratios": [w / o for w, o in zip(with_, without)],
        **{f"hook_us_per_step_{k}": v / steps * 1e6 for k, v in hook_s.items()},
        "training_thread_hook_share_of_step": main_thread / statistics.median(with_),
        "rounds": args.rounds, "steps_per_fit": args.steps, "warmup": args.warmup,
        "batch": args.batch,
        "sequence_length": args.sequence_length, "log_every": args.log_every,
        "tensorboard": not args.no_tensorboard,
    }
    print(json.dumps(result, indent=2))
    print(f"step time {result['step_s_without'] * 1e3:.1f} ms without, "
          f"{result['step_s_with'] * 1e3:.1f} ms with the callback: ratio {ratio:.4f}; "
          f"its hooks on the training thread take "
          f"{result['training_thread_hook_share_of_step']:.3%} of a step")
    return result


if __name__ == "__main__":
    main()
