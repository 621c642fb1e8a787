"""Keras' overhead: tokens/s of ``model.fit`` against a hand-written jitted train step.

Both train the same kdist GPT (same weights at the start, same AdamW, same batches) in one
process; the hand-written step is ``model.stateless_call`` + ``jax.value_and_grad`` + the
same optimizer's ``stateless_apply``, jitted with the state donated, batches placed with the
distribution's data sharding — what Keras' JAX trainer does, minus Keras. Rounds interleave
the variants (fit, fit with steps_per_execution, hand-written; order reversed every other
round) so machine noise hits all of them; the ratio is taken per round and its median and
spread are reported. Each (preset, mesh) runs in its own process (1 device, or 8 forced
host devices for fsdp=8) with tcmalloc preloaded where it exists.

    python benchmarks/keras_overhead.py                  # gpt-nano and gpt2-small(2 layers)
    python benchmarks/keras_overhead.py --rounds 6 --steps 8
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import keras_clock, print_table, run_child, spread, write_result  # noqa: E402

# (name, preset, overrides, batch, sequence length). gpt2-small keeps its width, heads and
# vocabulary but runs 2 of its 12 layers at 128 positions so a step takes seconds on 2 cores.
CONFIGS = {
    "gpt-nano": ("gpt-nano", {}, 16, 256),
    "gpt2-small(2 layers, T=128)": ("gpt2-small", {"num_layers": 2, "vocabulary_size": 50256},
                                    8, 128),
}
MESHES = ("1 device", "fsdp=8")


def child(args) -> dict:
    import jax
    import keras
    import numpy as np
    from jax.sharding import NamedSharding

    import kdist

    preset, overrides, batch, length = CONFIGS[args.config]
    if args.mesh != "1 device":
        keras.distribution.set_distribution(kdist.distribution(args.mesh))
    def build(steps_per_execution):
        keras.utils.set_random_seed(0)
        lm = kdist.models.GPTCausalLM.from_preset(preset, **overrides)
        lm.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=10, decay_steps=1000),
                   steps_per_execution=steps_per_execution)
        return lm

    model, model_spe = build(1), build(args.spe)  # same initial weights
    vocab = model.backbone.vocabulary_size
    steps = args.steps + 1  # one untimed step per measurement
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (steps * batch, length + 1), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def fit(lm):
        spe = lm.steps_per_execution
        clock = keras_clock(spe)  # the first execution (spe steps) is not timed
        n = spe * (1 + -(-args.steps // spe))
        xs, ys = np.resize(x, (n * batch, length)), np.resize(y, (n * batch, length))
        lm.fit(xs, ys, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[clock])
        return (n - spe) * batch * length / clock.seconds

    # === The hand-written step ===
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compute_loss(trainable, non_trainable, xb, yb):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, xb,
                                                     training=True)
        return loss_fn(yb, logits), non_trainable

    def step(state, xb, yb):
        trainable, non_trainable, opt = state
        (loss, non_trainable), grads = jax.value_and_grad(compute_loss, has_aux=True)(
            trainable, non_trainable, xb, yb)
        trainable, opt = model.optimizer.stateless_apply(opt, grads, trainable)
        return (trainable, non_trainable, opt), loss

    model.optimizer.build(model.trainable_variables)
    state = ([v.value.copy() for v in model.trainable_variables],
             [v.value.copy() for v in model.non_trainable_variables],
             [v.value.copy() for v in model.optimizer.variables])
    shardings = jax.tree.map(lambda a: a.sharding, state)
    jitted = jax.jit(step, donate_argnums=0, out_shardings=(shardings, None))
    dist = keras.distribution.distribution()
    data_sharding = (dist.get_data_layout((batch, length)).backend_layout if dist else
                     NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("d",)),
                                   jax.sharding.PartitionSpec()))
    hand_state = [state]

    def hand():
        start = None
        for i in range(steps):
            if i == 1:
                jax.block_until_ready(hand_state[0])
                start = time.perf_counter()
            rows = slice(i * batch, (i + 1) * batch)
            xb = jax.device_put(x[rows], data_sharding)
            yb = jax.device_put(y[rows], data_sharding)
            hand_state[0], loss = jitted(hand_state[0], xb, yb)
        float(loss)
        jax.block_until_ready(hand_state[0])
        return args.steps * batch * length / (time.perf_counter() - start)

    variants = {"fit": functools.partial(fit, model),
                f"fit spe={args.spe}": functools.partial(fit, model_spe),
                "hand-written": hand}
    for run in variants.values():  # compile everything once
        run()
    rounds = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            rounds[name].append(variants[name]())
    hand_tps = rounds["hand-written"]
    return {
        "config": args.config, "mesh": args.mesh, "batch": batch, "length": length,
        "vocabulary_size": vocab, "num_layers": model.backbone.num_layers,
        "tokens_per_s": {k: spread(v) for k, v in rounds.items()},
        "ratio_fit_over_hand": spread(f / h for f, h in zip(rounds["fit"], hand_tps)),
        "ratio_spe_over_hand": spread(
            f / h for f, h in zip(rounds[f"fit spe={args.spe}"], hand_tps)),
        "rounds": rounds,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, choices=list(CONFIGS))
    p.add_argument("--mesh", default="1 device", choices=MESHES)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    p.add_argument("--spe", type=int, default=4, help="steps_per_execution of the third variant")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS))
    p.add_argument("--meshes", nargs="*", default=list(MESHES))
    p.add_argument("--name", default="keras_overhead", help="results/<name>.json")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return None

    rows = []
    for config in args.configs:
        for mesh in args.meshes:
            out = run_child(__file__, ["--config", config, "--mesh", mesh, "--rounds",
                                       str(args.rounds), "--steps", str(args.steps),
                                       "--spe", str(args.spe)],
                            devices=8 if mesh != "1 device" else 1)
            t = out["tokens_per_s"]
            row = {"config": config, "mesh": mesh, "fit": t["fit"]["median"],
                   "spe": t[f"fit spe={args.spe}"]["median"],
                   "hand": t["hand-written"]["median"],
                   "ratio": out["ratio_fit_over_hand"]["median"],
                   "ratio_min": out["ratio_fit_over_hand"]["min"],
                   "ratio_max": out["ratio_fit_over_hand"]["max"],
                   "spe_ratio": out["ratio_spe_over_hand"]["median"], "detail": out}
            rows.append(row)
            print(f"{config} / {mesh}: fit/hand {row['ratio']:.3f} "
                  f"[{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]", flush=True)
            write_result(args.name, {"args": vars(args), "rows": rows, "partial": True})
    print_table(f"model.fit vs hand-written step, tokens/s (median of {args.rounds} interleaved "
                f"rounds of {args.steps} steps; [min, max] of per-round ratios)", rows,
                [("config", "config", ""), ("mesh", "mesh", ""), ("fit", "fit", ",.0f"),
                 (f"fit spe={args.spe}", "spe", ",.0f"), ("hand-written", "hand", ",.0f"),
                 ("fit/hand", "ratio", ".3f"), ("min", "ratio_min", ".3f"),
                 ("max", "ratio_max", ".3f"), ("spe/hand", "spe_ratio", ".3f")])
    write_result(args.name, {"args": vars(args), "target": "fit >= 0.98 x hand-written",
                                    "rows": rows})
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
