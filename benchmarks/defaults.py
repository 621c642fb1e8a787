"""What a new user meets: kdist ``fit`` with its defaults against keras-hub's
``GPT2CausalLM.fit`` and a hand-written jitted step with optax AdamW, tokens/s in one run.

Two shapes, each in its own process on 1 device (float32, tcmalloc preloaded where the
machine has it, the same random batches for every side):

* ``gpt-nano``: vocabulary 8192, 4 layers, d 256, 4 heads, MLP 1024, T 256, batch 16;
* ``gpt2-vocab``: GPT-2's vocabulary (50257), d 768, 12 heads, MLP 3072, 2 layers, T 1024,
  batch 2.

Sides: kdist ``GPTCausalLM.fit`` with the defaults (whatever ``loss_chunk_size`` defaults
to), the same with the fused loss turned off (full logits, Keras' loss), keras-hub's
``GPT2CausalLM.fit`` (dropout 0), and the hand-written step: kdist's model through
``stateless_call``, optax's ``adamw`` after ``clip_by_global_norm``, ``jax.jit`` with the
state donated — Keras' trainer minus Keras. Rounds interleave the sides (order reversed
every other round); ratios are taken per round, median and spread reported.

    pip install -e ".[bench]"           # optax (and torch, unused here)
    python benchmarks/defaults.py       # ~15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    bench_adamw,
    keras_fit_runner,
    print_table,
    run_child,
    spread,
    write_result,
)

SHAPES = {
    "gpt-nano": (dict(vocabulary_size=8192, num_layers=4, num_heads=4, hidden_dim=256,
                      intermediate_dim=1024, max_sequence_length=256), 16),
    # The same model with twice the batch: where the "auto" rule's logits threshold lies.
    "gpt-nano-b32": (dict(vocabulary_size=8192, num_layers=4, num_heads=4, hidden_dim=256,
                          intermediate_dim=1024, max_sequence_length=256), 32),
    "gpt2-vocab": (dict(vocabulary_size=50257, num_layers=2, num_heads=12, hidden_dim=768,
                        intermediate_dim=3072, max_sequence_length=1024), 2),
}
# The explicit way to turn the fused loss off (full logits, then Keras' loss).
FUSED_OFF = {"loss_chunk_size": None}


def child(args) -> dict:
    import jax
    import keras
    import keras_hub
    import numpy as np
    import optax

    import kdist

    shape, batch = SHAPES[args.shape]
    length, steps = shape["max_sequence_length"], args.steps
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shape["vocabulary_size"], ((steps + 1) * batch, length + 1),
                          dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    timed_tokens = steps * batch * length

    adamw = bench_adamw

    def keras_fit(model, inputs):
        return keras_fit_runner(model, inputs, y, batch, timed_tokens)

    def kdist_model(**kwargs):
        keras.utils.set_random_seed(0)
        model = kdist.models.GPTCausalLM(kdist.models.GPTBackbone(**shape), **kwargs)
        model.compile(optimizer=adamw())
        return model

    sides = {}
    default = kdist_model()
    sides["kdist fit (defaults)"] = keras_fit(default, x)
    sides["kdist fit (fused loss off)"] = keras_fit(kdist_model(**FUSED_OFF), x)
    hub = keras_hub.models.GPT2CausalLM(
        backbone=keras_hub.models.GPT2Backbone(dropout=0.0, **shape), preprocessor=None)
    hub.compile(optimizer=adamw(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    sides["keras-hub GPT2CausalLM.fit"] = keras_fit(
        hub, {"token_ids": x, "padding_mask": np.ones_like(x, dtype=bool)})

    # === The hand-written step: stateless_call + optax AdamW, jitted, state donated ===
    hand_model = kdist_model(**FUSED_OFF)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compute_loss(trainable, non_trainable, xb, yb):
        logits, non_trainable = hand_model.stateless_call(trainable, non_trainable, xb,
                                                          training=True)
        return loss_fn(yb, logits), non_trainable

    def step(state, xb, yb):
        trainable, non_trainable, opt = state
        (loss, non_trainable), grads = jax.value_and_grad(compute_loss, has_aux=True)(
            trainable, non_trainable, xb, yb)
        updates, opt = optimizer.update(grads, opt, trainable)
        return (optax.apply_updates(trainable, updates), non_trainable, opt), loss

    trainable = [v.value.copy() for v in hand_model.trainable_variables]
    hand_state = [(trainable, [v.value.copy() for v in hand_model.non_trainable_variables],
                   optimizer.init(trainable))]
    jitted = jax.jit(step, donate_argnums=0)

    def hand():
        for i in range(steps + 1):
            if i == 1:
                jax.block_until_ready(hand_state[0])
                start = time.perf_counter()
            rows = slice(i * batch, (i + 1) * batch)
            hand_state[0], loss = jitted(hand_state[0], x[rows], y[rows])
        float(loss)
        jax.block_until_ready(hand_state[0])
        return timed_tokens / (time.perf_counter() - start)

    sides["hand-written (optax AdamW)"] = hand

    first_run_s = {}
    for name, run in sides.items():  # compile / warm up every side once
        start = time.perf_counter()
        run()
        first_run_s[name] = time.perf_counter() - start
    rounds = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            rounds[name].append(sides[name]())
    ours = "kdist fit (defaults)"
    ratios = {f"{ours} / {name}": spread(a / b for a, b in zip(rounds[ours], v))
              for name, v in rounds.items() if name != ours}
    return {"shape": args.shape, "batch": batch, "length": length, "steps": steps,
            "default_loss_chunk_size": getattr(default, "loss_chunk_size", None),
            "tokens_per_s": {k: spread(v) for k, v in rounds.items()}, "ratios": ratios,
            "rounds": rounds, "first_run_s": first_run_s}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", default="gpt-nano", choices=list(SHAPES))
    p.add_argument("--shapes", nargs="*", default=["gpt-nano", "gpt2-vocab"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    results = []
    for shape in args.shapes:
        results.append(run_child(__file__, ["--shape", shape, "--steps", str(args.steps),
                                            "--rounds", str(args.rounds)]))
        r = results[-1]
        rows = [{"side": k, "tps": v["median"], "lo": v["min"], "hi": v["max"]}
                for k, v in r["tokens_per_s"].items()]
        print_table(f"{shape} (batch {r['batch']} x {r['length']}; default loss_chunk_size "
                    f"{r['default_loss_chunk_size']})", rows,
                    [("side", "side", ""), ("tokens/s", "tps", ",.0f"), ("min", "lo", ",.0f"),
                     ("max", "hi", ",.0f")])
        for name, s in r["ratios"].items():
            print(f"  {name}: {s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]")
    write_result("defaults", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
