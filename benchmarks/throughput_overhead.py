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
    """Wraps a hook so the seconds spent in it add up in totals[key]."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
    return wrapper


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=60, help="fit steps per measurement")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)

    keras.utils.set_random_seed(0)
    model = kdist.models.GPTCausalLM(kdist.models.GPTBackbone(**SHAPE))
    model.compile(optimizer=kdist.optim.adamw(1e-3, warmup_steps=10, decay_steps=1000))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocabulary_size"],
                          (args.steps * args.batch, args.sequence_length + 1)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    log_dir = Path(tempfile.mkdtemp(prefix="throughput-overhead-"))
    hook_s = {"begin": 0.0, "end": 0.0}

    def run(with_callback: bool) -> float:
        callbacks = []
        if with_callback:
            cb = kdist.callbacks.Throughput(args.batch, args.sequence_length, log_dir=log_dir,
                                            log_every=args.log_every)
            cb.on_train_batch_begin = timed(cb.on_train_batch_begin, hook_s, "begin")
            cb.on_train_batch_end = timed(cb.on_train_batch_end, hook_s, "end")
            callbacks.append(cb)
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)
        return (time.perf_counter() - start) / args.steps

    run(False), run(True)  # compile, import TensorFlow, measure the CPU peak once
    hook_s.update(begin=0.0, end=0.0)
    without, with_ = [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for flag in order:
            (with_ if flag else without).append(run(flag))
    ratio = statistics.median(with_) / statistics.median(without)
    steps = args.rounds * args.steps
    result = {
        "step_s_without": statistics.median(without),
        "step_s_with": statistics.median(with_),
        "ratio_with_over_without": ratio,
        "per_round_ratios": [w / o for w, o in zip(with_, without)],
        "hook_us_per_step_begin": hook_s["begin"] / steps * 1e6,
        "hook_us_per_step_end": hook_s["end"] / steps * 1e6,
        "hook_share_of_step": (hook_s["begin"] + hook_s["end"]) / steps
        / statistics.median(with_),
        "rounds": args.rounds, "steps_per_fit": args.steps, "batch": args.batch,
        "sequence_length": args.sequence_length, "log_every": args.log_every,
    }
    print(json.dumps(result, indent=2))
    print(f"step time {result['step_s_without'] * 1e3:.1f} ms without, "
          f"{result['step_s_with'] * 1e3:.1f} ms with the callback: ratio {ratio:.4f}; "
          f"time inside its hooks {result['hook_share_of_step']:.3%} of a step")
    return result


if __name__ == "__main__":
    main()
