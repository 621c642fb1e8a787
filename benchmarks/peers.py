"""Peers on this CPU: kdist's GPT ``fit`` against keras-hub's ``GPT2CausalLM.fit`` and a
PyTorch module of the same shape (eager and ``torch.compile``), tokens/s in one run.

All sides train the same shape (gpt-nano: vocabulary 8192, 4 layers, d 256, 4 heads, MLP
1024, 256 positions; dropout 0) on the same random token batches with AdamW (betas 0.9/0.95,
weight decay 0.1, clip 1.0), float32, tcmalloc preloaded for the whole process where the
machine has it (it helps XLA:CPU and PyTorch alike). Rounds interleave the sides (order
reversed every other round); tokens/s ratios are taken per round, median and spread
reported. Two processes:

* ``1 device``: kdist ``fit`` / keras-hub ``GPT2CausalLM.fit`` / torch eager / torch.compile;
* ``fsdp=8`` — the main job's mesh (``make run``) on 8 forced host devices — against
  torch eager / torch.compile (keras-hub has no layout map for GPT-2, see the notes).

    pip install -e ".[bench]"       # torch==2.13.0
    python benchmarks/peers.py      # ~10 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import os
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

SHAPE = dict(vocabulary_size=8192, num_layers=4, num_heads=4, hidden_dim=256,
             intermediate_dim=1024, max_sequence_length=256)


def child(args) -> dict:
    import keras
    import numpy as np
    import torch

    import kdist
    from benchmarks.torch_gpt import TorchGPT, train_step_fn

    batch, length, steps = args.batch, SHAPE["max_sequence_length"], args.steps
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocabulary_size"], ((steps + 1) * batch, length + 1),
                          dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    timed_tokens = steps * batch * length

    adamw = bench_adamw

    def keras_fit(model, inputs):
        return keras_fit_runner(model, inputs, y, batch, timed_tokens)

    sides = {}
    if args.mesh != "1 device":
        keras.distribution.set_distribution(kdist.distribution(args.mesh))
    keras.utils.set_random_seed(0)
    ours = kdist.models.GPTCausalLM(kdist.models.GPTBackbone(**SHAPE),
                                    loss_chunk_size=args.loss_chunk_size)
    ours.compile(optimizer=adamw())
    sides[f"kdist fit ({args.mesh})"] = keras_fit(ours, x)
    if args.mesh == "1 device":
        import keras_hub

        hub = keras_hub.models.GPT2CausalLM(
            backbone=keras_hub.models.GPT2Backbone(dropout=0.0, **SHAPE), preprocessor=None)
        hub.compile(optimizer=adamw(),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        hub_x = {"token_ids": x, "padding_mask": np.ones_like(x, dtype=bool)}
        sides["keras-hub GPT2CausalLM.fit"] = keras_fit(hub, hub_x)

    torch.manual_seed(0)
    tx, ty = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))
    for name, compiled in (("torch eager", False), ("torch.compile", True)):
        module = TorchGPT(**SHAPE)
        step = train_step_fn(module, compile=compiled)

        def run(step=step):
            for i in range(steps + 1):
                if i == 1:
                    start = time.perf_counter()
                rows = slice(i * batch, (i + 1) * batch)
                loss = step(tx[rows], ty[rows])
            float(loss)
            return timed_tokens / (time.perf_counter() - start)
        sides[name] = run

    compile_s = {}
    for name, run in sides.items():  # compile / warm up every side once
        start = time.perf_counter()
        run()
        compile_s[name] = time.perf_counter() - start
    rounds = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            rounds[name].append(sides[name]())
    ours_name = next(iter(sides))
    ratios = {f"{ours_name} / {name}": spread(a / b for a, b in zip(rounds[ours_name], v))
              for name, v in rounds.items() if name != ours_name}
    return {"mesh": args.mesh, "batch": batch, "length": length, "steps": steps,
            "torch_threads": torch.get_num_threads(), "tokens_per_s":
            {k: spread(v) for k, v in rounds.items()}, "ratios": ratios, "rounds": rounds,
            "first_run_s": compile_s, "loss_chunk_size": args.loss_chunk_size}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mesh", default="1 device")
    p.add_argument("--meshes", nargs="*", default=["1 device", "fsdp=8"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loss-chunk-size", type=int, default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return None
    rows = []
    for mesh in args.meshes:
        extra = ["--loss-chunk-size", str(args.loss_chunk_size)] if args.loss_chunk_size else []
        out = run_child(__file__, ["--mesh", mesh, "--batch", str(args.batch), "--steps",
                                   str(args.steps), "--rounds", str(args.rounds), *extra],
                        devices=8 if mesh != "1 device" else 1)
        for name, value in out["tokens_per_s"].items():
            rows.append({"process": mesh, "side": name, "tokens_per_s": value["median"],
                         "min": value["min"], "max": value["max"],
                         "first_run_s": out["first_run_s"][name]})
        for name, value in out["ratios"].items():
            rows.append({"process": mesh, "side": "ratio " + name, "ratio": value["median"],
                         "min": value["min"], "max": value["max"]})
        print(json.dumps(out["ratios"]), flush=True)
        write_result("peers", {"args": vars(args), "shape": SHAPE, "rows": rows, "partial": True})
    print_table(f"Peers, gpt-nano shape, batch {args.batch} x 256, float32, median of "
                f"{args.rounds} interleaved rounds of {args.steps} steps", rows,
                [("process", "process", ""), ("side", "side", ""),
                 ("tokens/s", "tokens_per_s", ",.0f"), ("ratio", "ratio", ".3f"),
                 ("min", "min", ",.3f"), ("max", "max", ",.3f"),
                 ("first run s", "first_run_s", ".1f")])
    write_result("peers", {"args": vars(args), "shape": SHAPE,
                           "targets": ["kdist fit >= 1.08 x keras-hub GPT2CausalLM.fit",
                                       "main job (fsdp=8) >= 0.9 x PyTorch (tracked)"],
                           "rows": rows})
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
