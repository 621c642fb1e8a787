"""Mixture of Experts speed, side by side in one run (issue 47): kdist's dropless MoE step
against keras-hub's Mixtral, which runs every expert on every token ("due to the lack of
ragged_dot support in the Keras ops API"), at the same shape, and against kdist's dense
model of the same active parameters.

One device, ``mixed_bfloat16``, AdamW, random tokens; each side trained by ``fit`` in a
process of its own (``--dry-run``: all in this one), the sides' rounds interleaved;
tokens/s of the steps after the first two (compilation and warm-up), the median over
rounds. Shapes (``--shape``):

* ``nano`` (a CPU): ``llama-nano`` (D 256, 4 layers, 8 query / 2 key-value heads,
  vocabulary 8192) at T 256, batch 8, with 8 SwiGLU experts of width 384 in every block,
  top-2: a token's 2 x 3 x 256 x 384 expert weights are exactly the dense model's 768-wide
  SwiGLU MLP;
* ``mixtral-nano`` (a CPU): the same with Mixtral's proportions, experts 3.5 x D wide
  (896; Mixtral 8x7B: 14336 at D 4096), the dense MLP 1792: the experts' share of the
  FLOPs as in the published model, where ``nano``'s vocabulary head costs about as much
  as its MLPs;
* ``small`` (one accelerator): D 1024, 8 layers, 16 / 4 heads, vocabulary 32768, experts of
  width 1408 (dense: 2816), T 1024, batch 8.

kdist's MoE adds its balance losses (auxiliary 0.01, router z 0.001; a few (N, E) float32
ops), keras-hub's Mixtral none (its ``output_router_logits`` is off).

    python benchmarks/moe.py                    # a CPU: ~5 minutes on 2 cores
    python benchmarks/moe.py --shape small      # one TPU v5e chip or GPU (keras-hub installed)
    python benchmarks/moe.py --dry-run          # tiny, one round (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")  # keras is imported before kdist below
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    bench_adamw,
    keras_clock,
    print_table,
    run_child,
    write_result,
)

# Llama-style shapes (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases); "expert"
# is each expert's width, "dense" the dense model's MLP: 2 x expert (top-2, same active).
SHAPES = {
    "nano": dict(preset="llama-nano", length=256, batch=8, expert=384, steps=8,
                 overrides={}),
    "mixtral-nano": dict(preset="llama-nano", length=256, batch=8, expert=896, steps=8,
                         overrides={}),
    "small": dict(preset="llama-nano", length=1024, batch=8, expert=1408, steps=12,
                  overrides=dict(vocabulary_size=32768, num_layers=8, num_heads=16,
                                 num_key_value_heads=4, hidden_dim=1024,
                                 max_sequence_length=1024)),
    "dry": dict(preset="llama-nano", length=64, batch=2, expert=32, steps=4,
                overrides=dict(vocabulary_size=512, num_layers=2, num_heads=4,
                               num_key_value_heads=2, hidden_dim=64, max_sequence_length=64)),
}
EXPERTS, TOP_K, WARMUP = 8, 2, 2
SIDES = ("kdist MoE", "keras-hub Mixtral", "kdist dense")


def kdist_model(shape: dict, moe: bool):
    """kdist's GPTCausalLM of the shape: routed experts, or the dense MLP of their width."""
    import kdist

    overrides = dict(shape["overrides"])
    if moe:
        overrides["moe"] = dict(num_experts=EXPERTS, experts_per_token=TOP_K,
                                expert_dim=shape["expert"])
    else:
        overrides["intermediate_dim"] = TOP_K * shape["expert"]
    model = kdist.models.GPTCausalLM.from_preset(shape["preset"], **overrides)
    model.compile(optimizer=bench_adamw())
    return model


def keras_hub_model(shape: dict):
    """keras-hub's MixtralCausalLM of the same shape (dropout 0, no window within T)."""
    import keras
    import keras_hub

    import kdist

    c = kdist.models.GPTBackbone.full_config({**kdist.models.GPT_PRESETS[shape["preset"]],
                                              **shape["overrides"]})
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=c["vocabulary_size"], num_layers=c["num_layers"],
        num_query_heads=c["num_heads"], num_key_value_heads=c["num_key_value_heads"],
        hidden_dim=c["hidden_dim"], intermediate_dim=shape["expert"], num_experts=EXPERTS,
        top_k=TOP_K, rope_max_wavelength=c["rotary_max_wavelength"],
        layer_norm_epsilon=c["layer_norm_epsilon"], sliding_window=shape["length"], dropout=0)
    model = keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)
    # No metrics (keras-hub adds a masked accuracy by default): the training step alone.
    model.compile(optimizer=bench_adamw(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    return model


def child(side: str, shape_name: str) -> dict:
    """One side's tokens/s (in this process, on its first device)."""
    import keras
    import numpy as np

    shape = SHAPES[shape_name]
    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = keras_hub_model(shape) if side == "keras-hub Mixtral" else \
        kdist_model(shape, moe=side == "kdist MoE")
    batch, length, steps = shape["batch"], shape["length"], shape["steps"]
    rng = np.random.default_rng(0)
    vocabulary = model.backbone.vocabulary_size
    ids = rng.integers(0, vocabulary, (batch * steps, length + 1), dtype=np.int32)
    x, y = ids[:, :-1], ids[:, 1:]
    if side == "keras-hub Mixtral":
        x = {"token_ids": x, "padding_mask": np.ones_like(x, dtype=bool)}
    clock = keras_clock(WARMUP)
    start = time.perf_counter()
    # keras.Model's fit for both: keras-hub's own turns NumPy into a tf.data pipeline.
    history = keras.Model.fit(model, x, y, batch_size=batch, epochs=1, verbose=0,
                              shuffle=False, callbacks=[clock])
    total = time.perf_counter() - start
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return {"side": side, "tokens_per_s": (steps - WARMUP) * batch * length / clock.seconds,
            "fit_s": total, "loss": float(history.history["loss"][-1]),
            "parameters": weights}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("nano", "mixtral-nano", "small"), default="nano")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the sides")
    p.add_argument("--dry-run", action="store_true", help="a tiny shape, one round (CI)")
    p.add_argument("--child", nargs=2, metavar=("SIDE", "SHAPE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    shape_name = "dry" if args.dry_run else args.shape
    rounds = 1 if args.dry_run else args.rounds
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in SIDES:
            # A process per side and round (run_child passes "--child SIDE SHAPE"); a dry
            # run's sides in this one, which keeps its caller's compile-time XLA flags.
            row = child(side, shape_name) if args.dry_run else \
                run_child(__file__, [side, shape_name], timeout=3600)
            runs[side].append(row)
            print(f"round {r + 1}: {side}: {row['tokens_per_s']:,.0f} tokens/s "
                  f"(fit {row['fit_s']:.0f} s, loss {row['loss']:.3f})", flush=True)
    rows = []
    for side, found in runs.items():
        rate = statistics.median(row["tokens_per_s"] for row in found)
        rows.append({"side": side, "tokens_per_s": rate,
                     "tokens_per_s_rounds": [row["tokens_per_s"] for row in found],
                     "parameters": found[0]["parameters"]})
    ours = rows[0]["tokens_per_s"]
    for row in rows:
        row["kdist MoE vs this"] = ours / row["tokens_per_s"]
    shape = SHAPES[shape_name]
    print_table(f"{'DRY RUN — ' if args.dry_run else ''}MoE ({EXPERTS} experts, top-{TOP_K}, "
                f"width {shape['expert']}) at T {shape['length']}, batch {shape['batch']}, "
                f"mixed_bfloat16, AdamW", rows,
                [("side", "side", ""), ("parameters", "parameters", ",d"),
                 ("tokens/s", "tokens_per_s", ",.0f"),
                 ("kdist MoE vs this", "kdist MoE vs this", ".2f")])
    write_result("moe_dry_run" if args.dry_run else f"moe_{shape_name}",
                 {"shape": {**shape, "experts": EXPERTS, "top_k": TOP_K},
                  "rounds": rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
