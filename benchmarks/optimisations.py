"""Before/after of kdist's performance options: tokens/s of ``fit`` and the compiled train
step's temporary memory, each against the defaults, in one process.

Options: the fused chunked cross-entropy (``GPTCausalLM(loss_chunk_size=...)``), the fused
QKV projection (``fused_qkv=True``), the remat policies (``remat="block"`` /
``"save_dots"``) and chunked attention (``attention_chunk_size``). Every variant is built
from the same seed and trained on the same batches; rounds interleave them (order reversed
every other round) and each variant's tokens/s is divided by the baseline's of the same
round. Memory is XLA's
``memory_analysis()`` of the compiled train step: ``temp`` is the scratch the step needs on
top of its arguments (weights, optimizer state, batch) — activations kept for the backward
pass, logits, gradients.

    python benchmarks/optimisations.py                   # ~10 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import keras_clock, print_table, run_child, spread, write_result  # noqa: E402

# config -> (preset, overrides, batch, length, {variant: (backbone options, LM options)})
CONFIGS = {
    "gpt-nano": ("gpt-nano", {}, 8, 256, {
        "baseline": ({}, {}),
        "loss_chunk_size=64": ({}, {"loss_chunk_size": 64}),
        "fused_qkv": ({"fused_qkv": True}, {}),
        "remat=block": ({"remat": "block"}, {}),
        "remat=save_dots": ({"remat": "save_dots"}, {}),
    }),
    "gpt2-small(2 layers, T=128)": ("gpt2-small", {"num_layers": 2, "vocabulary_size": 50256},
                                    8, 128, {
        "baseline": ({}, {}),
        "loss_chunk_size=32": ({}, {"loss_chunk_size": 32}),
    }),
    "gpt2-small(2 layers, T=1024)": ("gpt2-small", {"num_layers": 2, "vocabulary_size": 50256},
                                     2, 1024, {
        "baseline": ({}, {}),
        "attention_chunk_size=128": ({"attention_chunk_size": 128}, {}),
    }),
}


def step_memory(model, batch: int, length: int) -> dict:
    """Bytes from XLA's memory_analysis() of the model's compiled train step (abstract inputs,
    nothing runs)."""
    import jax
    import numpy as np

    tokens = np.zeros((batch, length), "int32")
    model._symbolic_build(data_batch=(tokens, tokens))
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
    batch_spec = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype)
    compiled = jax.jit(model.train_step).lower(abstract, (batch_spec, batch_spec)).compile()
    m = compiled.memory_analysis()
    return {"temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
            "output_bytes": m.output_size_in_bytes}


def child(args) -> dict:
    import keras
    import numpy as np

    import kdist

    preset, overrides, batch, length, variants = CONFIGS[args.config]
    models, memory = {}, {}
    for name, (backbone_options, lm_options) in variants.items():
        keras.utils.set_random_seed(0)
        lm = kdist.models.GPTCausalLM.from_preset(preset, **lm_options, **overrides,
                                                  **backbone_options)
        lm.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=10, decay_steps=1000))
        memory[name] = step_memory(lm, batch, length)
        models[name] = lm
    vocab = next(iter(models.values())).backbone.vocabulary_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, ((args.steps + 1) * batch, length + 1), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    losses = {}

    def run(name):
        clock = keras_clock(1)
        history = models[name].fit(x, y, batch_size=batch, epochs=1, verbose=0,
                                   shuffle=False, callbacks=[clock])
        losses.setdefault(name, history.history["loss"][-1])
        return args.steps * batch * length / clock.seconds

    for name in models:
        run(name)  # compile
    rounds = {name: [] for name in models}
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(reversed(models))):
            rounds[name].append(run(name))
    base = rounds["baseline"]
    return {"config": args.config, "batch": batch, "length": length, "rows": [
        {"variant": name, "tokens_per_s": spread(v),
         "speed_vs_baseline": spread(a / b for a, b in zip(v, base)),
         "first_epoch_loss": losses[name], **memory[name],
         "temp_vs_baseline": memory[name]["temp_bytes"] / memory["baseline"]["temp_bytes"]}
        for name, v in rounds.items()]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, choices=list(CONFIGS))
    p.add_argument("--configs", nargs="*", default=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return None
    rows = []
    for config in args.configs:
        out = run_child(__file__, ["--config", config, "--rounds", str(args.rounds),
                                   "--steps", str(args.steps)])
        for row in out["rows"]:
            rows.append({"config": config, "variant": row["variant"],
                         "tokens_per_s": row["tokens_per_s"]["median"],
                         "speed": row["speed_vs_baseline"]["median"],
                         "speed_min": row["speed_vs_baseline"]["min"],
                         "speed_max": row["speed_vs_baseline"]["max"],
                         "temp_mb": row["temp_bytes"] / 2**20,
                         "temp_ratio": row["temp_vs_baseline"],
                         "loss": row["first_epoch_loss"], "detail": row})
        print(f"{config} done", flush=True)
        write_result("optimisations", {"args": vars(args), "rows": rows, "partial": True})
    print_table(f"Options vs baseline, 1 device, float32 (median of {args.rounds} interleaved "
                f"rounds of {args.steps} fit steps; memory from XLA's memory_analysis)", rows,
                [("config", "config", ""), ("variant", "variant", ""),
                 ("tokens/s", "tokens_per_s", ",.0f"), ("speed", "speed", ".3f"),
                 ("min", "speed_min", ".3f"), ("max", "speed_max", ".3f"),
                 ("temp MiB", "temp_mb", ",.0f"), ("temp ratio", "temp_ratio", ".3f"),
                 ("loss", "loss", ".5f")])
    write_result("optimisations", {"args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
