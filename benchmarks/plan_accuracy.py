"""Planned per-device memory (kdist.planning, compiled on abstract inputs) against a real run.

For each configuration: ``kdist.planning.plan(...)`` on 1 device, then
``kdist.measure.measure_train_memory(...)`` — real weights, real AdamW state, 3 real
``train_on_batch`` steps in a fresh subprocess on 1 device; the peak is device memory stats
where the backend has them, else the process's peak RSS above its idle baseline (the
compiled step is loaded from a persistent cache so the compiler's own memory is not counted).

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/plan_accuracy.py   # ~6 min on 2 cores
"""

import argparse
import json
import time
from pathlib import Path

import kdist  # noqa: F401  (before jax: Keras' JAX backend)

# isort: split
import jax

from kdist.measure import measure_train_memory
from kdist.planning import format_bytes, plan

CONFIGS = [
    # activation-dominated
    dict(preset="gpt-nano", global_batch_size=32, sequence_length=256),
    # the same with each block rematerialised
    dict(preset="gpt-nano", global_batch_size=32, sequence_length=256, remat=True),
    # state-dominated: GPT-2 small's embedding table and width, 2 layers
    dict(preset="gpt2-small", global_batch_size=4, sequence_length=512,
         model_overrides={"num_layers": 2}),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_accuracy.json"))
    p.add_argument("--only", type=int, default=None, help="run only config number N")
    args = p.parse_args()
    rows = []
    configs = CONFIGS if args.only is None else [CONFIGS[args.only]]
    for config in configs:
        start = time.perf_counter()
        planned = plan(config["preset"], mesh="data=1", devices=jax.devices()[:1],
                       global_batch_size=config["global_batch_size"],
                       sequence_length=config["sequence_length"],
                       remat=config.get("remat", False), device_memory="1TiB",
                       model_overrides=config.get("model_overrides"))
        plan_s = time.perf_counter() - start
        measured = measure_train_memory(steps=3, **config)
        rows.append({"config": config, "planned": planned.total, "measured": measured["peak"],
                     "ratio": planned.total / measured["peak"], "source": measured["source"],
                     "plan_memory": planned.memory, "plan_seconds": plan_s,
                     "measure_seconds": time.perf_counter() - start - plan_s})
        r = rows[-1]
        print(f"{json.dumps(config)}: planned {format_bytes(r['planned'])}, measured "
              f"{format_bytes(r['measured'])} ({r['source']}), planned/measured "
              f"{r['ratio']:.3f}", flush=True)
    print(f"\n{'configuration':<64}{'planned':>12}{'measured':>12}{'ratio':>8}")
    for r in rows:
        c = r["config"]
        name = (f"{c['preset']}{' (2 layers)' if 'model_overrides' in c else ''}, batch "
                f"{c['global_batch_size']}x{c['sequence_length']}, remat "
                f"{c.get('remat', False)}")
        print(f"{name:<64}{format_bytes(r['planned']):>12}{format_bytes(r['measured']):>12}"
              f"{r['ratio']:>8.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
