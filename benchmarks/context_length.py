"""The longest sequence that trains on 8 host devices within a per-device memory: seq=8
(ring and all-gather attention) against fsdp=8, planned and measured; step time of the ring
against the all-gather at the same length.

Planned: ``kdist.planning.plan`` (the real train step compiled on abstract inputs, XLA's
``memory_analysis``) at doubling lengths, then bisected to a multiple of ``--granularity``:
the longest length whose plan fits ``--device-memory`` (90% usable, as every plan). fsdp=8
needs one sequence per device (global batch 8) and attends with kdist's chunked attention
(``attention_chunk_size=256``: no ``T x T`` probabilities kept, the least memory one device
can do); seq=8 trains one sequence (global batch 1) split over the 8 devices. The model's
learned position table grows with the length (``max_sequence_length = T``).

Measured: a fresh process with 8 forced host devices trains ``--steps`` real steps at that
length; its peak resident memory above the idle baseline (``VmHWM``), divided by 8, is the
per-device figure (CPU devices report no memory statistics); the compiled step is loaded
from a persistent compilation cache filled by a first run, so the compiler is not counted.
Step time: the median of the steps after the first.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/context_length.py   # ~1 h, 2 cores
    PYTHONPATH=. python benchmarks/context_length.py --preset gpt2-small --device-memory 16GiB \
        --plan-only --granularity 8192
    PYTHONPATH=. python benchmarks/context_length.py --step-time 4096 --rounds 5  # ~20 min
    PYTHONPATH=. python benchmarks/context_length.py --per-op-memory                # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_table, run_child, write_result  # noqa: E402

CONFIGS = [  # (name, mesh, global batch, context_parallel, model overrides)
    ("fsdp=8 (chunked attention)", "fsdp=8", 8, "all_gather", {"attention_chunk_size": 256}),
    ("seq=8 all-gather", "seq=8", 1, "all_gather", {}),
    ("seq=8 ring", "seq=8", 1, "ring", {}),
]


def _child(args) -> None:
    """One measured run: build, train ``steps`` steps, print peak memory and step times."""
    import jax

    jax.config.update("jax_compilation_cache_dir", args.cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    import keras
    import numpy as np

    import kdist

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    config = json.loads(args.config)
    jax.devices()  # backends up before the baseline
    baseline = rss("VmRSS")
    keras.distribution.set_distribution(kdist.distribution(
        config["mesh"], context_parallel=config["context_parallel"]))
    keras.utils.set_random_seed(0)
    model = kdist.models.GPTCausalLM.from_preset(
        config["preset"], max_sequence_length=config["length"], **config["overrides"])
    model.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=1, decay_steps=10))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.backbone.vocabulary_size,
                          (config["batch"], config["length"] + 1), dtype=np.int32)
    times, losses = [], []
    for _ in range(config["steps"]):
        start = time.perf_counter()
        losses.append(float(model.train_on_batch(tokens[:, :-1], tokens[:, 1:])))
        times.append(time.perf_counter() - start)
    peak = rss("VmHWM") - baseline
    print(json.dumps({"peak_bytes": peak, "per_device_bytes": peak / 8, "losses": losses,
                      "step_seconds": times, "baseline_bytes": baseline}))


def _step_time_child(args) -> None:
    """Ring and all-gather step times in one process, steps interleaved round by round
    (the same weights and tokens), so load on the machine hits both alike."""
    import keras
    import numpy as np

    import kdist

    config = json.loads(args.config)
    models, dists = {}, {}
    for variant in ("all_gather", "ring"):
        dists[variant] = kdist.distribution("seq=8", context_parallel=variant)
        keras.distribution.set_distribution(dists[variant])
        keras.utils.set_random_seed(0)
        models[variant] = kdist.models.GPTCausalLM.from_preset(
            config["preset"], max_sequence_length=config["length"])
        models[variant].compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=1,
                                                            decay_steps=10))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 8192, (1, config["length"] + 1), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times = {v: [] for v in models}
    for round_ in range(config["rounds"] + 1):  # round 0: compile and warm up
        order = list(models) if round_ % 2 else list(models)[::-1]  # alternate who goes first
        for variant in order:
            model = models[variant]
            keras.distribution.set_distribution(dists[variant])
            start = time.perf_counter()
            for _ in range(config["steps"]):
                float(model.train_on_batch(x, y))
            if round_:
                times[variant].append((time.perf_counter() - start) / config["steps"])
    print(json.dumps(times))


def per_op_memory() -> list[dict]:
    """XLA's temporary bytes of one attention layer's forward and backward per device, as
    the seq axis grows with a fixed block per device (1 sequence of 1,024 tokens per device,
    4 key/value heads of 64, float32): the all-gather's grow with the sequence, the ring's
    do not."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from kdist.parallel.context import SequenceLayout, local_attention

    rows = []
    for n in (2, 4, 8):
        length = 1024 * n
        mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:n])
        q = jax.ShapeDtypeStruct((1, length, 4, 64), jnp.float32)
        row = {"seq": n, "length": length, "block_mib": 1024 * 4 * 64 * 4 / 2**20}
        for variant in ("all_gather", "ring"):
            layout = SequenceLayout(length, n, balanced=True)
            attend = jax.shard_map(
                lambda q, k, v, layout=layout, variant=variant: local_attention(
                    q, k, v, layout=layout, variant=variant),
                mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
            grad = jax.jit(jax.grad(lambda q, k, v, f=attend: (f(q, k, v) ** 2).sum(), (0, 1, 2)))
            temp = grad.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
            row[f"{variant}_mib"] = temp / 2**20
        rows.append(row)
    return rows


def measure(script, preset, mesh, batch, variant, overrides, length, steps) -> dict:
    config = dict(preset=preset, mesh=mesh, batch=batch, context_parallel=variant,
                  overrides=overrides, length=length, steps=steps)
    with tempfile.TemporaryDirectory(prefix="kdist-context-") as cache:
        run_child(script, ["--config", json.dumps(config), "--cache", cache], devices=8,
                  tcmalloc=False)  # fills the compilation cache
        out = run_child(script, ["--config", json.dumps(config), "--cache", cache],
                        devices=8, tcmalloc=False)
    out["step_median_s"] = statistics.median(out["step_seconds"][1:] or out["step_seconds"])
    return out


def planned(preset, mesh, batch, variant, overrides, length, device_memory):
    import jax

    from kdist.planning import plan

    p = plan(preset, mesh=mesh, global_batch_size=batch, sequence_length=length,
             device_memory=device_memory, devices=jax.devices()[:8], suggest=False,
             model_overrides={"max_sequence_length": length, **overrides},
             context_parallel=variant)
    return p.total, p.fits


def longest(preset, mesh, batch, variant, overrides, device_memory, start, granularity):
    """The longest multiple of ``granularity`` whose plan fits, and every plan tried."""
    tried = {}

    def fits(length):
        tried[length] = planned(preset, mesh, batch, variant, overrides, length,
                                device_memory)
        print(f"  plan {mesh} {variant} T={length}: {tried[length][0] / 2**20:.0f} MiB "
              f"{'fits' if tried[length][1] else 'does not fit'}", flush=True)
        return tried[length][1]

    low, high = 0, start
    while fits(high):  # doubling until a plan does not fit
        low, high = high, 2 * high
    while high - low > granularity:
        mid = (low + high) // 2 // granularity * granularity
        if mid in (low, high):
            break
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, tried


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--preset", default="gpt-nano")
    p.add_argument("--device-memory", default="512MiB", help="the per-device budget")
    p.add_argument("--start", type=int, default=2048, help="first length planned")
    p.add_argument("--granularity", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="measured steps per run")
    p.add_argument("--plan-only", action="store_true", help="no measured runs")
    p.add_argument("--step-time", type=int, default=None, metavar="T",
                   help="only ring against all-gather step time at T tokens, interleaved")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-op-memory", action="store_true",
                   help="only one attention layer's temporaries against the seq size")
    args = p.parse_args()
    if args.child:
        return _step_time_child(args) if json.loads(args.config).get("rounds") else \
            _child(args)

    if args.step_time:
        times = run_child(__file__, ["--config", json.dumps(dict(
            preset=args.preset, length=args.step_time, rounds=args.rounds,
            steps=args.steps))], devices=8, tcmalloc=False)
        ratios = [r / a for r, a in zip(times["ring"], times["all_gather"])]
        result = {v: statistics.median(t) for v, t in times.items()}
        print(f"{args.preset} at T={args.step_time} on seq=8, {args.rounds} interleaved rounds "
              f"of {args.steps} steps: all-gather {result['all_gather']:.2f} s/step, ring "
              f"{result['ring']:.2f} s/step; ring / all-gather {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]")
        write_result(f"context_step_time_{args.preset}_{args.step_time}",
                     {"args": vars(args), "seconds": times, "ratios": ratios})
        return None

    import kdist

    kdist.force_host_devices(8)
    from kdist.planning import format_bytes, parse_bytes

    if args.per_op_memory:
        rows = per_op_memory()
        print_table("one attention layer, forward + backward, temporaries per device (XLA)",
                    rows, [("seq", "seq", "d"), ("T", "length", ","),
                           ("block MiB", "block_mib", ".1f"),
                           ("all-gather MiB", "all_gather_mib", ".1f"),
                           ("ring MiB", "ring_mib", ".1f")])
        write_result("context_per_op_memory", {"rows": rows})
        return None

    rows = []
    for name, mesh, batch, variant, overrides in CONFIGS:
        length, tried = longest(args.preset, mesh, batch, variant, overrides,
                                args.device_memory, args.start, args.granularity)
        row = {"config": name, "mesh": mesh, "batch": batch, "length": length,
               "tokens_per_device": batch * length // 8, "planned": tried[length][0]}
        failing = min((k for k, v in tried.items() if not v[1]), default=None)
        if failing:  # the shortest length planned that does not fit
            row.update(fails_at=failing, fails_planned=tried[failing][0])
        if not args.plan_only and length:
            m = measure(__file__, args.preset, mesh, batch, variant, overrides, length,
                        args.steps)
            row.update(measured=m["per_device_bytes"], step_s=m["step_median_s"],
                       losses=m["losses"], planned_over_measured=row["planned"]
                       / m["per_device_bytes"])
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    if not args.plan_only:  # ring against all-gather where both fit
        common = min(r["length"] for r in rows if r["mesh"] == "seq=8")
        for name, mesh, batch, variant, overrides in CONFIGS[1:]:
            m = measure(__file__, args.preset, mesh, batch, variant, overrides, common,
                        args.steps)
            rows.append({"config": f"{name} at the common length", "mesh": mesh,
                         "batch": batch, "length": common, "measured": m["per_device_bytes"],
                         "step_s": m["step_median_s"], "losses": m["losses"]})
            print(json.dumps(rows[-1], default=str), flush=True)
    budget = parse_bytes(args.device_memory)
    for r in rows:
        for key in ("planned", "measured", "fails_planned"):
            if r.get(key) is not None:
                r[key + "_text"] = format_bytes(r[key])
    print_table(f"{args.preset}: longest trainable sequence within {args.device_memory} per "
                f"device (plans use 90%), 8 host devices", rows,
                [("configuration", "config", ""), ("T", "length", ","),
                 ("tokens/device", "tokens_per_device", ","), ("planned", "planned_text", ""),
                 ("measured", "measured_text", ""), ("plan/meas.", "planned_over_measured",
                                                     ".3f"),
                 ("s/step", "step_s", ".1f"), ("fails at T", "fails_at", ","),
                 ("planned there", "fails_planned_text", "")])
    write_result(f"context_length_{args.preset}", {
        "args": vars(args), "budget_bytes": budget, "rows": rows, "machine": machine()})


if __name__ == "__main__":
    main()
