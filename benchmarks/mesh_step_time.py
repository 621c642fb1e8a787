"""Train-step time of one model under each mesh, against 1 device, measured in one run.

On forced host devices every "device" shares the same CPU cores, so this measures the
overhead a strategy's sharding adds (collectives, resharding), not a speed-up.

    NPROC=32 XLA_FLAGS="--xla_force_host_platform_device_count=8 \
    --xla_cpu_multi_thread_eigen=false" .venv/bin/python benchmarks/mesh_step_time.py \
        --preset gpt-nano --out mesh_step_time.json
"""

import argparse
import json
import statistics
import time

import kdist  # before jax: it selects Keras' JAX backend

# isort: split
import keras
import numpy as np

MESHES = [None, "data=8", "fsdp=8", "fsdp=4,model=2", "data=2,fsdp=2,model=2", "data=2,model=4"]


def step_seconds(mesh, args) -> float:
    """Median seconds per train step after warm-up, for one mesh (None = 1 device)."""
    keras.utils.clear_session()
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    model = kdist.models.GPTCausalLM.from_preset(args.preset, vocabulary_size=args.vocabulary_size)
    model.compile(optimizer=kdist.optim.adamw())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocabulary_size, (args.batch, args.length + 1), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(2):  # compile, then one more to settle
        float(model.train_on_batch(x, y))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        float(model.train_on_batch(x, y))  # float() waits for the step to finish
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt-nano")
    p.add_argument("--vocabulary-size", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help="write the table as JSON here")
    args = p.parse_args()

    rows = []
    for mesh in MESHES:
        seconds = step_seconds(mesh, args)
        rows.append({"mesh": mesh or "1 device", "step_s": seconds,
                     "tokens_per_s": args.batch * args.length / seconds})
    base = rows[0]["step_s"]
    print(f"{args.preset}, batch {args.batch} x {args.length}, median of {args.steps} steps")
    print(f"{'mesh':<24}{'s/step':>8}{'tokens/s':>10}{'vs 1 device':>13}")
    for row in rows:
        row["ratio_vs_1_device"] = base / row["step_s"]
        print(f"{row['mesh']:<24}{row['step_s']:>8.2f}{row['tokens_per_s']:>10.0f}"
              f"{row['ratio_vs_1_device']:>12.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
