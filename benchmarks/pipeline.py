"""Pipelines (the ``stage`` axis) and scanned layer stacks: compile time, bubble, plans.

``compile``: the gpt2-xl (48 blocks) train step compiled on abstract inputs
(``kdist.planning.plan``: no weight allocated) with its blocks unstacked and stacked
(``scan_layers=True``) on ``fsdp=8``, and as a pipeline on ``stage=8``; each in its own
process (seconds to lower and compile, peak RSS, the plan's memory and bytes per device).
The ratios are within one run of this script.

``bubble``: the bubble measured two ways against ``(S-1)/(R M+S-1)``, for R = 1 and 2
(``--real-devices --devices 8`` on a machine with 8 GPUs; else 8 forced host devices),
on a GPT whose head is negligible (vocabulary 256): (1) XLA's compiled program — the matmul
FLOPs inside loops (the layer stack) of the pipelined step (``stage=4,data=2``) against
the same model's unpipelined, stacked step (``data=8``, the same devices, the same useful
work): ``1 - useful / executed``; (2) the step time of the two, median of interleaved
rounds: ``1 - t_unpipelined / t_pipelined``. On forced host devices all "devices" share the
CPU cores, so (2) charges the bubble's compute on zeros as real work — as a GPU would
charge its idle time — plus the schedule's overhead (copies, permutes).

``schedules``: per-device memory of the compiled train step (``kdist.planning.plan``) of
gpt2-xl at batch 32 x 1024 on ``stage=8`` under each ``pipeline_schedule`` at M = 16 and 32,
against GPipe at the same M and against ``fsdp=8``, beside the analytic estimate
``--mesh auto`` ranks by; and gpt-nano (with 8 blocks) on ``stage=4,data=2``, the same
schedules (interleaved with 2 chunks per stage).

``ticks``: the bubble of the interpreter's schedules (1F1B, interleaved, zero-bubble) from
their compiled programs: each task's matmul FLOPs (a branch of the tick's ``lax.switch``),
every tick as long as its costliest task (:func:`kdist.planning.executed.tick_costs`, which
``kdist plan`` also counts a scheduled step's executed work with), against the table's idle
cells and the formula.

    python benchmarks/pipeline.py compile     # minutes, ~7 GB peak: run on a quiet machine
    python benchmarks/pipeline.py schedules   # ~5 minutes
    python benchmarks/pipeline.py ticks       # ~3 minutes
    python benchmarks/pipeline.py bubble
    python benchmarks/pipeline.py bubble --real-devices --devices 8 --batch 64 --length 1024
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import print_table, run_child, write_result  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
COMPILE_CASES = [  # (label, mesh, scan_layers, pipeline_microbatches)
    ("unstacked, fsdp=8", "fsdp=8", False, None),
    ("stacked, fsdp=8", "fsdp=8", True, None),
    ("pipeline, stage=8", "stage=8", True, 8),
]
SCHEDULE_CASES = [  # (preset, mesh, batch, length, schedule, microbatches, repeats)
    ("gpt2-xl", "fsdp=8", 32, 1024, None, None, 1),
    *(("gpt2-xl", "stage=8", 32, 1024, s, m, r) for m in (16, 32)
      for s, r in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))),
    # gpt-nano with 8 layers (its preset has 4): 2 chunks of 4 stages need 8
    *(("gpt-nano", "stage=4,data=2", 64, 256, s, m, r) for m in (16, 32)
      for s, r in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))),
]
LAYERS = {"gpt-nano": 8}  # layer-count overrides of the schedule cases' presets
BUBBLE_MODEL = dict(vocabulary_size=256, num_layers=8, num_heads=4, hidden_dim=256,
                    intermediate_dim=1024, max_sequence_length=128)


def _compile_child(args) -> dict:
    import kdist

    start = time.perf_counter()
    p = kdist.planning.plan(
        "gpt2-xl", mesh=args.mesh, global_batch_size=8, sequence_length=1024,
        device_memory="141GiB", suggest=False, model_overrides={"scan_layers": args.scan},
        pipeline_microbatches=args.microbatches)
    return {"compile_s": p.compile_seconds, "wall_s": time.perf_counter() - start,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "memory_gib": p.memory["total"] / 2**30,
            "state_gib": (p.memory["parameters"] + p.memory["optimizer_state"]) / 2**30,
            "wire_gib": sum(r["wire_bytes"] for r in p.collectives.values()) / 2**30,
            "theory_gib": sum(p.theoretical_collectives.values()) / 2**30,
            "collectives": p.collectives, "theory": p.theoretical_collectives,
            "pipeline": p.pipeline, "report": p.report()}


def _schedule_child(args) -> dict:
    import kdist

    options = dict(pipeline_schedule=args.schedule, pipeline_microbatches=args.microbatches,
                   pipeline_repeats=args.repeats) if args.schedule else {}
    overrides = {"num_layers": LAYERS[args.preset]} if args.preset in LAYERS else {}
    p = kdist.planning.plan(args.preset, mesh=args.mesh, global_batch_size=args.batch,
                            sequence_length=args.length, device_memory="141GiB",
                            suggest=False, model_overrides=overrides, **options)
    analytic = kdist.planning.estimate(kdist.planning.cost_model_of(args.preset, **overrides),
                                       p.mesh, args.batch, args.length, **options)
    return {"memory_gib": p.memory["total"] / 2**30,
            "activations_gib": p.memory["activations_and_temporaries"] / 2**30,
            "estimate_gib": analytic["total"] / 2**30, "compile_s": p.compile_seconds,
            "permute_mib": p.collectives.get("collective-permute", {}).get("bytes", 0) / 2**20,
            "in_flight": (p.pipeline or {}).get("in_flight"),
            "bubble": (p.pipeline or {}).get("bubble")}


def schedules_benchmark(args) -> None:
    rows = []
    for preset, mesh, batch, length, schedule, micro, repeats in SCHEDULE_CASES:
        child = ["schedules", "--preset", preset, "--mesh", mesh, "--batch", str(batch),
                 "--length", str(length), "--repeats", str(repeats)] + (
            ["--schedule", schedule, "--microbatches", str(micro)] if schedule else [])
        row = run_child(SCRIPT, child, devices=8, timeout=1800)
        row.update(preset=preset, mesh=mesh, schedule=schedule or "-", microbatches=micro,
                   repeats=repeats)
        rows.append(row)
        print(f"{preset} {mesh} {schedule} M={micro} R={repeats}: {row['memory_gib']:.2f} GiB",
              flush=True)
    for row in rows:  # against GPipe (R = 1) at the same preset, mesh and M
        gpipe = next((r for r in rows if r["schedule"] == "gpipe" and r["repeats"] == 1
                      and (r["preset"], r["mesh"], r["microbatches"])
                      == (row["preset"], row["mesh"], row["microbatches"])), None)
        row["vs_gpipe"] = row["memory_gib"] / gpipe["memory_gib"] if gpipe else None
    print_table("per-device memory of the compiled train step by pipeline schedule (float32, "
                "8 host devices, XLA:CPU memory_analysis)", rows,
                [("preset", "preset", ""), ("mesh", "mesh", ""), ("schedule", "schedule", ""),
                 ("M", "microbatches", "d"), ("R", "repeats", "d"),
                 ("activations GiB", "activations_gib", ".2f"), ("total GiB", "memory_gib", ".2f"),
                 ("vs GPipe", "vs_gpipe", ".3f"), ("estimate GiB", "estimate_gib", ".2f"),
                 ("permutes MiB", "permute_mib", ".1f"), ("in flight", "in_flight", ""),
                 ("compile s", "compile_s", ".0f")])
    write_result("pipeline_schedules", {"args": vars(args), "rows": rows})


def compile_benchmark(args) -> None:
    rows = []
    for label, mesh, scan, micro in COMPILE_CASES:
        child = ["compile", "--mesh", mesh] + (["--scan"] if scan else []) + (
            ["--microbatches", str(micro)] if micro else [])
        row = run_child(SCRIPT, child, devices=8, timeout=3600)
        row.update(case=label)
        rows.append(row)
        print(f"{label}: compile {row['compile_s']:.1f} s, peak RSS {row['peak_rss_gib']:.1f} "
              f"GiB", flush=True)
    base = rows[0]["compile_s"]
    for row in rows:
        row["vs_unstacked"] = row["compile_s"] / base
    print_table("gpt2-xl train step compiled on abstract inputs (batch 8 x 1024, float32, "
                "8 host devices)", rows,
                [("case", "case", ""), ("compile s", "compile_s", ".1f"),
                 ("x unstacked", "vs_unstacked", ".2f"), ("peak RSS GiB", "peak_rss_gib", ".1f"),
                 ("memory/dev GiB", "memory_gib", ".2f"), ("state/dev GiB", "state_gib", ".2f"),
                 ("wire GiB/step", "wire_gib", ".2f"), ("theory GiB", "theory_gib", ".2f")])
    for row in rows:
        print(f"\n--- {row['case']}\n{row['report']}")
    write_result("pipeline_compile", {"args": vars(args), "rows": rows})


def _bubble_child(args) -> dict:
    import jax
    import keras
    import numpy as np

    import kdist
    from kdist import _keras_compat, hlo

    keras.utils.clear_session()
    dist = kdist.distribution(args.mesh, pipeline_microbatches=args.microbatches,
                              pipeline_repeats=args.repeats)
    keras.distribution.set_distribution(dist)
    keras.utils.set_random_seed(0)
    config = dict(BUBBLE_MODEL, scan_layers=True)
    model = kdist.models.GPTCausalLM(kdist.models.GPTBackbone(**config))
    model.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=1, decay_steps=100))
    batch, length = args.batch, args.length
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch, length + 1), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(2):
        float(model.train_on_batch(x, y))
    # The program fit runs (its state's and batch's shardings), compiled once more to read.
    placed = [jax.device_put(a, dist.get_data_layout(a.shape).backend_layout) for a in (x, y)]
    text = jax.jit(model.train_step).lower(_keras_compat.jax_state(model),
                                           tuple(placed)).compile().as_text()
    loop_flops = hlo.matmul_flops(text, in_loops_only=True) * jax.device_count()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        float(model.train_on_batch(x, y))
        times.append(time.perf_counter() - start)
    return {"loop_flops": loop_flops, "step_s": times}


def _ticks_child(args) -> dict:
    import jax
    import keras
    import numpy as np

    import kdist
    from kdist import _keras_compat
    from kdist.parallel.pipeline import schedules

    keras.utils.clear_session()
    dist = kdist.distribution(args.mesh, pipeline_microbatches=args.microbatches,
                              pipeline_repeats=args.repeats, pipeline_schedule=args.schedule)
    keras.distribution.set_distribution(dist)
    model = kdist.models.GPTCausalLM(kdist.models.GPTBackbone(**dict(BUBBLE_MODEL,
                                                                     scan_layers=True)))
    model.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=1, decay_steps=100))
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.length + 1),
                                               dtype=np.int32)
    float(model.train_on_batch(tokens[:, :-1], tokens[:, 1:]))  # builds the state
    placed = [jax.device_put(a, dist.get_data_layout(a.shape).backend_layout)
              for a in (tokens[:, :-1], tokens[:, 1:])]
    text = jax.jit(model.train_step).lower(_keras_compat.jax_state(model),
                                           tuple(placed)).compile().as_text()
    from kdist.planning import executed

    stages = dist.mesh_shape["stage"]
    out = {}
    for mixed in (False, True):  # kdist's table, and Megatron-LM's of the same schedule
        costs = executed.tick_costs(text, schedules.build(
            args.schedule, stages, args.microbatches, args.repeats, mixed=mixed))
        # per action code: idle, F, B, last B, I, last I, W, last W
        out["branch_flops"] = costs.pop("branch_flops")
        out["mixed_" * mixed + "table"] = costs
    return out


TICK_CASES = [(s, m, r) for m in (4, 8, 16) for s, r in
              (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))]


def ticks_benchmark(args) -> None:
    """The interpreter's bubble from its compiled program: each task's FLOPs (a branch of
    the tick's ``lax.switch``), every tick as long as its costliest task."""
    from kdist.parallel.pipeline.settings import bubble_fraction

    rows = []
    batch = max(args.batch, 2 * max(m for _, m, _ in TICK_CASES))  # 2 data shards x M
    for schedule, micro, repeats in TICK_CASES:
        child = ["ticks", "--mesh", "stage=4,data=2", "--schedule", schedule, "--microbatches",
                 str(micro), "--repeats", str(repeats), "--batch", str(batch),
                 "--length", str(args.length)]
        row = run_child(SCRIPT, child, devices=8)
        f = row["branch_flops"]
        row.update(row.pop("table"))
        row.update({f"mixed_{k}": v for k, v in row.pop("mixed_table").items()})
        row.update(schedule=schedule, microbatches=micro, repeats=repeats,
                   # GPipe's scan, autodiff: (v M + S - 1) iterations of F, then of 2 F
                   gpipe_forwards=3 * (repeats * micro + 4 - 1) / repeats,
                   formula=bubble_fraction(4, micro, repeats),
                   costs="F 1 : B {:.2f} : I {:.2f} : W {:.2f}".format(
                       *(f[k] / f[1] for k in (2, 4, 6))) if f[1] else "-")
        rows.append(row)
        print(f"{schedule} M={micro}: lockstep {row['lockstep_bubble']:.3f} "
              f"({row['step_forwards']:.1f} F), Megatron's table "
              f"{row['mixed_lockstep_bubble']:.3f} ({row['mixed_step_forwards']:.1f} F), "
              f"{row['costs']}", flush=True)
    print_table("Bubble and step of the interpreter's schedules on stage=4,data=2 (GPT 8 x "
                f"256, batch {batch} x {args.length}): the formula (S-1)/(vM+S-1); kdist's "
                "tables (ticks of one kind) and Megatron-LM's (mixed ticks), each as the "
                "share of the devices' time idle with every tick as long as its costliest "
                "task (compiled FLOPs) and as the step in forwards F of a stage; GPipe's "
                "autodiff scan 3 (vM+S-1) F / v for scale", rows,
                [("schedule", "schedule", ""), ("M", "microbatches", "d"),
                 ("R", "repeats", "d"), ("formula", "formula", ".3f"),
                 ("lockstep", "lockstep_bubble", ".3f"), ("step F", "step_forwards", ".1f"),
                 ("ticks", "ticks", "d"), ("Megatron lockstep", "mixed_lockstep_bubble",
                                           ".3f"),
                 ("Megatron step F", "mixed_step_forwards", ".1f"),
                 ("GPipe step F", "gpipe_forwards", ".1f"),
                 ("compiled task FLOPs", "costs", "")])
    write_result("pipeline_ticks", {"args": vars(args), "rows": rows})


def bubble_benchmark(args) -> None:
    n = args.devices
    cases = [("unpipelined", f"data={n}", None, 1)] + [
        (f"R={r}, M={m}", f"stage=4,data={n // 4}", m, r) for r in (1, 2) for m in (4, 8)]
    times: dict[str, list[float]] = {c[0]: [] for c in cases}
    flops = {}
    for round_ in range(args.rounds):  # interleaved: the machine's load hits all alike
        for label, mesh, micro, repeats in cases:
            child = ["bubble", "--mesh", mesh, "--repeats", str(repeats), "--steps",
                     str(args.steps), "--batch", str(args.batch), "--length", str(args.length)]
            if micro:
                child += ["--microbatches", str(micro)]
            # --real-devices: the children see the machine's own devices (GPUs), unforced.
            row = run_child(SCRIPT, child, devices=1 if args.real_devices else n)
            times[label] += row["step_s"]
            flops[label] = row["loop_flops"]
            print(f"round {round_} {label}: {statistics.median(row['step_s']):.3f} s/step",
                  flush=True)
    from kdist.parallel.pipeline.settings import bubble_fraction

    ref_t, ref_f = statistics.median(times["unpipelined"]), flops["unpipelined"]
    rows = []
    for label, _, micro, repeats in cases[1:]:
        t = statistics.median(times[label])
        rows.append({"case": label, "formula": bubble_fraction(4, micro, repeats),
                     # GPU programs' matmuls are cuBLAS calls, not counted (kdist.hlo).
                     "xla": 1 - ref_f / flops[label] if flops[label] else None,
                     "time": 1 - ref_t / t, "step_s": t,
                     "ref_step_s": ref_t, "spread": (min(times[label]), max(times[label]))})
    import os

    print_table(f"Bubble of stage=4,data={n // 4} against the unpipelined data={n} step "
                f"(GPT 8 x 256, batch {args.batch} x {args.length}; load "
                f"{os.getloadavg()[0]:.1f})", rows,
                [("case", "case", ""), ("formula", "formula", ".3f"), ("XLA FLOPs", "xla", ".3f"),
                 ("step time", "time", ".3f"), ("step s", "step_s", ".3f"),
                 ("unpipelined s", "ref_step_s", ".3f")])
    write_result("pipeline_bubble", {"args": vars(args), "rows": rows, "times": times,
                                     "flops": flops})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["compile", "bubble", "schedules", "ticks"])
    p.add_argument("--preset", default="gpt2-xl", help="(schedules)")
    p.add_argument("--schedule", default=None, help="pipeline_schedule (schedules)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--scan", action="store_true")
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="timed steps per round (bubble)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (bubble)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--devices", type=int, default=8, help="devices (bubble; a multiple of 4)")
    p.add_argument("--real-devices", action="store_true",
                   help="bubble on the machine's own devices (e.g. 8 GPUs), not host devices")
    args = p.parse_args(argv)
    if args.child:
        child = {"compile": _compile_child, "bubble": _bubble_child,
                 "schedules": _schedule_child, "ticks": _ticks_child}[args.what]
        print(json.dumps(child(args), default=str))
        return
    {"compile": compile_benchmark, "bubble": bubble_benchmark,
     "schedules": schedules_benchmark, "ticks": ticks_benchmark}[args.what](args)


if __name__ == "__main__":
    main()
