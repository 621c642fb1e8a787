"""The multi-device accelerator runs (TPU or GPU), reached through
``benchmarks/accelerator.py``'s flags: context parallelism, communicating less, pipeline
schedules, loading a Hugging Face checkpoint onto the devices. Each needs two or more
devices where it splits something across them, and has a CPU dry run (8 host devices, a
tiny shape) that checks its plumbing.

``--communicate-less`` (issue 18; 2 or more devices): gpt2-small on ``data=N`` with each
gradient reduction (XLA's, kdist's float32 and bfloat16, float8, int8, float8 with error
feedback) and DiLoCo (``replica=2,data=N/2``, sync_every 10), 16 sequences per device: step
time against the XLA-reduction row of the same run, tokens/s, MFU, and the collective bytes
per device per step read from the train step's HLO (``kdist.hlo``; ``--no-bytes`` skips the
three extra compilations this costs). On one device it says so and measures nothing.

``--pipeline`` (issue 26; 2 or more devices): gpt2-medium on ``stage=N`` with each
``pipeline_schedule`` at M = 2N and 4N microbatches: step time against GPipe's at the same M,
tokens/s, MFU and peak device memory (the schedules' point: 1F1B's does not grow with M).

``--context``: one long sequence split over every device (``seq=N``), ring against
all-gather attention. ``--hf-load``: ``benchmarks/hf_loading.py`` on the devices.

The single-device runs this script made on an H200 (its former name ``gpu.py``; figures in
``benchmarks/README.md``) are ``benchmarks/accelerator.py``'s now, for TPUs and GPUs alike.

    python benchmarks/accelerator.py --context            # 2+ devices: seq=N
    python benchmarks/accelerator.py --communicate-less   # 2+ devices
    python benchmarks/accelerator.py --communicate-less --dry-run   # CPU, 8 host devices
    python benchmarks/accelerator.py --pipeline           # 2+ devices
    python benchmarks/accelerator.py --pipeline --dry-run # CPU, 8 host devices
    python benchmarks/accelerator.py --hf-load            # a checkpoint onto the devices
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import keras_clock, print_table, write_result  # noqa: E402

# Context parallelism (--context; needs 2 or more GPUs): one long sequence split over all
# of them, both attention variants. Figure still to take: tokens/s, MFU and peak memory of
# gpt2-small at 32,768 tokens on seq=N, ring against all-gather (this machine has 1 GPU).
CONTEXT_RUNS = [
    ("gpt2-small", "all_gather", {}, {}, 1),
    ("gpt2-small", "ring", {}, {}, 1),
]
# Communicating less (--communicate-less; needs 2 or more GPUs, an even count for DiLoCo):
# gpt2-small on data=N with each gradient reduction, and DiLoCo's replica=2,data=N/2 with
# H=10 against the synchronous data=N of the first row; 16 sequences per device. Figure
# still to take: step time of 8-bit reduction and DiLoCo on 2+ GPUs (this machine has 1).
# (variant, mesh for N devices, kdist.distribution options)
COMMUNICATE_LESS_RUNS = [
    ("XLA reduction", "data={n}", {}),
    ("float32", "data={n}", {"gradient_reduction": "float32"}),
    ("float8", "data={n}", {"gradient_reduction": "float8"}),
    ("int8", "data={n}", {"gradient_reduction": "int8"}),
    ("float8 + error feedback", "data={n}", {"gradient_reduction": "float8",
                                            "error_feedback": True}),
    ("DiLoCo H=10", "replica=2,data={half}", {"sync_every": 10}),
    ("bfloat16", "data={n}", {"gradient_reduction": "bfloat16"}),
]
# Pipeline schedules (--pipeline; 2+ devices): (schedule, repeats, microbatches per stage).
# Figure still to take: step time and peak memory of 1F1B, interleaved and zero-bubble
# against GPipe on stage=N GPUs (a one-GPU machine cannot pipeline).
PIPELINE_RUNS = [
    ("gpipe", 1, 2), ("1f1b", 1, 2), ("interleaved_1f1b", 2, 2), ("zero_bubble", 1, 2),
    ("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 4), ("zero_bubble", 1, 4),
]
DRY_SHAPE = dict(vocabulary_size=512, num_layers=2, num_heads=4, hidden_dim=64,
                 intermediate_dim=256, max_sequence_length=64)


def _keep_tensorflow_off_the_gpu():
    try:  # keras-hub imports TensorFlow; it must not take the memory JAX needs
        import tensorflow as tf

        tf.config.set_visible_devices([], "GPU")
    except Exception:  # noqa: BLE001 - no TensorFlow or already initialised: nothing to do
        pass


def uses_cudnn_attention(model, batch: int, length: int) -> bool:
    """Whether the optimized HLO of the model's train step calls cuDNN fused attention."""
    import jax
    import numpy as np

    tokens = np.zeros((batch, length), "int32")
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
    spec = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype)
    hlo = jax.jit(model.train_step).lower(abstract, (spec, spec)).compile().as_text()
    return "cudnn$fmha" in hlo or "__cudnn" in hlo


def measure(preset, backbone_options, lm_options, batch, length, steps, dry_run,
            check_attention=True, context_parallel=None, mesh=None, mesh_options=None,
            exchange=False) -> dict:
    import jax
    import keras
    import numpy as np

    import kdist

    keras.utils.clear_session()
    devices = jax.devices()
    if context_parallel:  # the sequence split over every device
        backbone_options = {**backbone_options, "max_sequence_length": length}
        keras.distribution.set_distribution(kdist.distribution(
            f"seq={len(devices)}", context_parallel=context_parallel))
    elif mesh:  # --communicate-less: the row's mesh and gradient exchange
        keras.distribution.set_distribution(kdist.distribution(mesh, **(mesh_options or {})))
    else:
        keras.distribution.set_distribution(
            kdist.distribution(f"fsdp={len(devices)}") if len(devices) > 1 else None)
    keras.config.set_dtype_policy("float32" if dry_run else "mixed_bfloat16")
    keras.utils.set_random_seed(0)
    shape = dict(DRY_SHAPE) if dry_run else {}
    lm = kdist.models.GPTCausalLM.from_preset(preset, **{**shape, **backbone_options},
                                              **lm_options)
    lm.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=10, decay_steps=1000))
    vocab = lm.backbone.vocabulary_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch * (steps + 3), length + 1), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    start = time.perf_counter()
    lm._symbolic_build(data_batch=(x[:batch], y[:batch]))
    if not lm.optimizer.built:  # _symbolic_build builds it; DiLoCo's build is not idempotent
        lm.optimizer.build(lm.trainable_variables)
    # One extra compilation: only for each preset's first run (same attention after).
    cudnn = uses_cudnn_attention(lm, batch, length) if check_attention else None
    clock = keras_clock(3)  # after compilation and two warm-up steps
    history = lm.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                     callbacks=[clock])
    tokens_per_s = steps * batch * length / clock.seconds
    flops = kdist.flops.model_flops_per_token(lm, length)  # causal half (MaxText)
    full = kdist.flops.model_flops_per_token(lm, length, causal_half=False)
    dtype = "float32" if dry_run else "bfloat16"
    peak = kdist.callbacks.peak.device_peak(devices, dtype)
    denominator = len(devices) * peak.tflops * 1e12
    stats = devices[0].memory_stats() or {}
    row = exchange_bytes(lm, x[:batch], y[:batch]) if exchange else {}
    return {**row, "preset": preset, "options": {**backbone_options, **lm_options}, "batch": batch,
            "length": length, "devices": len(devices), "device_kind": devices[0].device_kind,
            "dtype_policy": keras.config.dtype_policy().name, "cudnn_attention": cudnn,
            "step_s": clock.seconds / steps, "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * flops.training / denominator,
            "mfu_full_attention": tokens_per_s * full.training / denominator,
            "hfu": tokens_per_s * flops.hardware / denominator,
            "peak": peak.describe(), "convention": flops.convention,
            "final_loss": history.history["loss"][-1],
            "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
            "wall_s": time.perf_counter() - start}


def exchange_bytes(model, x, y) -> dict:
    """Collective bytes per device per optimizer step of the model's train step, from its
    HLO (``kdist.hlo``; collectives of 64 bytes or less, the loss and metrics, left out):
    ``exchange_bytes`` all of them (on a data-only mesh: the gradient exchange, 8-bit
    scales included), ``exchange_wire_bytes`` what a ring sends of them (the figure to
    compare: an all-reduce sends ``2(n-1)/n`` of its tensor, 8-bit's all-to-all and
    all-gather ``(n-1)/n`` each), and ``crossing_wire_bytes`` those whose device groups span
    the two halves of the devices (what a link between two hosts carries; DiLoCo's replica
    groups are those halves). kdist's own
    reductions are read from the emitted program (no compilation; XLA:CPU widens 16-bit
    collectives when it compiles); XLA's reductions exist only in the optimized program, so
    the XLA row and DiLoCo's two programs (inner step, sync step: ``(sync + (H-1) inner) /
    H`` per step, as ``benchmarks/communicate_less.py``) compile once more each."""
    import functools

    import jax
    import keras

    from kdist import _keras_compat, hlo
    from kdist.groups import diloco

    distribution = keras.distribution.distribution()
    batch = tuple(jax.device_put(a, distribution.get_data_layout(a.shape).backend_layout)
                  for a in (x, y))  # sharded as fit shards it
    state = _keras_compat.jax_state(model)
    half = jax.device_count() // 2

    def count(step, optimized):
        lowered = jax.jit(step).lower(state, batch)
        text = (lowered.compile().as_text() if optimized
                else lowered.compiler_ir("hlo").as_hlo_text())
        found = [c for c in hlo.parse_collectives(text, jax.device_count()) if c.bytes > 64]
        return {"exchange_bytes": sum(c.bytes * c.executions for c in found),
                "exchange_wire_bytes": sum(c.wire_bytes * c.executions for c in found),
                "crossing_wire_bytes": sum(c.wire_bytes * c.executions for c in found
                                           if c.crosses(half))}

    h = distribution.sync_every
    if h:
        inner, sync = (count(functools.partial(diloco.train_step, model, sync=s), True)
                       for s in (False, True))
        return {**{k: (sync[k] + (h - 1) * inner[k]) / h for k in inner},
                "inner_program": inner, "sync_program": sync}
    return count(model.train_step, distribution.gradient_reduction is None)


def communicate_less(args) -> list[dict]:
    """--communicate-less: COMMUNICATE_LESS_RUNS on every device, one table, one result."""
    import jax

    n = jax.device_count()
    if n < 2:
        print(f"--communicate-less compares gradient exchanges between devices and needs 2 or "
              f"more; JAX sees {n} ({jax.devices()[0].device_kind}). Skipped: nothing "
              f"measured, no result written.", flush=True)
        return []
    length = 64 if args.dry_run else args.length
    steps = 10 if args.dry_run else args.steps  # the dry run's window holds one sync
    batch = (1 if args.dry_run else 16) * n
    preset = "gpt2-small"
    start, rows, skipped = time.perf_counter(), [], []
    for i, (variant, mesh, options) in enumerate(COMMUNICATE_LESS_RUNS):
        if args.runs is not None and i not in args.runs:
            continue
        if "replica" in mesh and n % 2:
            skipped.append(f"{variant} (replica=2 needs an even device count; {n} here)")
            continue
        if time.perf_counter() - start > args.budget_s:
            skipped.append(f"{variant} (time budget)")
            continue
        mesh = mesh.format(n=n, half=n // 2)
        row = measure(preset, {}, {}, batch, length, steps, args.dry_run,
                      check_attention=False, mesh=mesh, mesh_options=options,
                      exchange=not args.no_bytes)
        row.update(variant=variant, mesh=mesh, steps=steps, **{
            k: v for k, v in options.items() if k != "sync_every"})
        if "sync_every" in options:  # syncs inside the timed window (steps 3 .. 3+steps-1),
            # whose last step is fit's (3 + steps batches): it ends a partial round too
            row["sync_every"] = h = options["sync_every"]
            row["syncs_timed"] = sum((s + 1) % h == 0 or s == steps + 2
                                     for s in range(3, 3 + steps))
        rows.append(row)
        print(f"{variant} ({mesh}): {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%}, "
              f"exchange {row.get('exchange_wire_bytes', 0):,.0f} wire B/device/step",
              flush=True)
    reference = next((r for r in rows if r["variant"] == "XLA reduction"), None)
    for row in rows:  # against the XLA-reduction row of this run
        row["step_vs_xla"] = row["step_s"] / reference["step_s"] if reference else None
    print_table(f"{'DRY RUN (tiny shape, CPU host devices) — ' if args.dry_run else ''}"
                f"communicating less: {preset}, {n} devices, batch {batch} x T={length}, "
                f"{rows[0]['dtype_policy'] if rows else ''}; step ratio against the XLA-"
                f"reduction row; bytes per device per step (kdist.hlo)", rows,
                [("variant", "variant", ""), ("mesh", "mesh", ""), ("step s", "step_s", ".4f"),
                 ("vs XLA", "step_vs_xla", ".3f"), ("tokens/s", "tokens_per_s", ",.0f"),
                 ("MFU", "mfu", ".1%"), ("exchange B", "exchange_bytes", ",.0f"),
                 ("wire B", "exchange_wire_bytes", ",.0f"),
                 ("across halves wire B", "crossing_wire_bytes", ",.0f"),
                 ("syncs timed", "syncs_timed", "d"), ("peak GiB", "peak_memory_gib", ".1f"),
                 ("loss", "final_loss", ".3f")])
    if skipped:
        print(f"skipped: {', '.join(skipped)}")
    print(f"total {time.perf_counter() - start:.0f} s")
    write_result("gpu_dry_run_communicate_less" if args.dry_run else
                 f"{args.output}_communicate_less",
                 {"args": vars(args), "rows": rows, "skipped": skipped})
    return rows


def pipeline_schedules(args) -> list[dict]:
    """--pipeline: PIPELINE_RUNS on every device (dry run: stage=2,data=4 of 8 host
    devices, 4 layers), one table against GPipe's row of the same M, one result."""
    import jax

    n = jax.device_count()
    if n < 2:
        print(f"--pipeline splits the model over stages and needs 2 or more devices; JAX sees "
              f"{n} ({jax.devices()[0].device_kind}). Skipped: nothing measured, no result "
              f"written.", flush=True)
        return []
    stages = 2 if args.dry_run else n
    mesh = f"stage={stages}" + (f",data={n // stages}" if n > stages else "")
    length = 64 if args.dry_run else args.length
    steps = 3 if args.dry_run else args.steps
    batch = 8 * n
    preset, shape = "gpt2-medium", ({"num_layers": 4} if args.dry_run else {})
    start, rows, skipped = time.perf_counter(), [], []
    for i, (schedule, repeats, per_stage) in enumerate(PIPELINE_RUNS):
        micro = per_stage * stages
        if args.runs is not None and i not in args.runs:
            continue
        if time.perf_counter() - start > args.budget_s:
            skipped.append(f"{schedule} M={micro} (time budget)")
            continue
        options = dict(pipeline_schedule=schedule, pipeline_microbatches=micro,
                       pipeline_repeats=repeats)
        row = measure(preset, shape, {}, batch, length, steps, args.dry_run,
                      check_attention=False, mesh=mesh, mesh_options=options)
        row.update(variant=schedule, mesh=mesh, microbatches=micro, repeats=repeats)
        rows.append(row)
        print(f"{schedule} M={micro} ({mesh}): {row['tokens_per_s']:,.0f} tokens/s, MFU "
              f"{row['mfu']:.1%}, peak {row['peak_memory_gib']:.2f} GiB", flush=True)
    for row in rows:  # against GPipe at the same M, measured in this run
        gpipe = next((r for r in rows if r["variant"] == "gpipe"
                      and r["microbatches"] == row["microbatches"]), None)
        row["step_vs_gpipe"] = row["step_s"] / gpipe["step_s"] if gpipe else None
        row["memory_vs_gpipe"] = (row["peak_memory_gib"] / gpipe["peak_memory_gib"]
                                  if gpipe and gpipe["peak_memory_gib"] else None)
    print_table(f"{'DRY RUN (tiny shape, CPU host devices) — ' if args.dry_run else ''}"
                f"pipeline schedules: {preset}, {mesh}, batch {batch} x T={length}, "
                f"{rows[0]['dtype_policy'] if rows else ''}; ratios against GPipe at the same M",
                rows,
                [("schedule", "variant", ""), ("M", "microbatches", "d"),
                 ("chunks", "repeats", "d"), ("step s", "step_s", ".4f"),
                 ("vs GPipe", "step_vs_gpipe", ".3f"), ("tokens/s", "tokens_per_s", ",.0f"),
                 ("MFU", "mfu", ".1%"), ("peak GiB", "peak_memory_gib", ".2f"),
                 ("memory vs GPipe", "memory_vs_gpipe", ".3f"), ("loss", "final_loss", ".3f")])
    if skipped:
        print(f"skipped: {', '.join(skipped)}")
    print(f"total {time.perf_counter() - start:.0f} s")
    write_result("gpu_dry_run_pipeline" if args.dry_run else f"{args.output}_pipeline",
                 {"args": vars(args), "rows": rows, "skipped": skipped})
    return rows


def codec_throughput(dry_run: bool) -> list[dict]:
    """The 8-bit gradient codec (``kdist.parallel.compression``) on one device: encode +
    decode of a gpt2-medium-sized gradient (355 M float32 values), values per second. The
    figure to compare with the link: 8-bit saves 3 bytes per value on the wire (float32),
    so it pays where the link moves fewer than ``3 x values/s`` bytes per second."""
    import jax
    import jax.numpy as jnp

    from kdist.parallel import compression

    n = 1 << 16 if dry_run else 355_000_000 // compression.BLOCK * compression.BLOCK
    x = jax.random.normal(jax.random.key(0), (n // compression.BLOCK, compression.BLOCK))
    rows = []
    for fmt in compression.FORMATS:
        roundtrip = jax.jit(lambda v, fmt=fmt: compression.dequantize(
            *compression.quantize(v, fmt), fmt))
        roundtrip(x).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            roundtrip(x).block_until_ready()
            times.append(time.perf_counter() - start)
        best = min(times)
        rows.append({"format": fmt, "values": n, "seconds": best, "values_per_s": n / best,
                     "error": float(jnp.linalg.norm(roundtrip(x) - x) / jnp.linalg.norm(x))})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny float32 shape, any device (checks the script on a CPU)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip the remaining runs once this much time has passed")
    p.add_argument("--output", default="gpu", help="result name under benchmarks/results/")
    p.add_argument("--runs", nargs="*", type=int, default=None,
                   help="indices into the mode's runs (default: all)")
    p.add_argument("--context", action="store_true",
                   help="CONTEXT_RUNS instead: one sequence of --length tokens (default "
                        "32768) split over every GPU (seq=N), ring and all-gather")
    p.add_argument("--communicate-less", action="store_true",
                   help="COMMUNICATE_LESS_RUNS instead (2+ devices): gpt2-small on data=N with "
                        "XLA's, float32, float8, int8, float8 + error feedback and bfloat16 "
                        "gradient reduction, and DiLoCo replica=2,data=N/2 (sync_every 10)")
    p.add_argument("--no-bytes", action="store_true",
                   help="--communicate-less without the HLO byte counts (saves the XLA and "
                        "DiLoCo rows' extra compilations)")
    p.add_argument("--pipeline", action="store_true",
                   help="PIPELINE_RUNS instead (2+ devices): gpt2-medium on stage=N, GPipe, "
                        "1F1B and interleaved 1F1B at M = 2N and 4N")
    p.add_argument("--hf-load", action="store_true",
                   help="instead: load a gpt2-medium-shaped Hugging Face checkpoint onto the "
                        "devices, kdist vs keras-hub (benchmarks/hf_loading.py; ~2 min)")
    p.add_argument("--codec", action="store_true",
                   help="the 8-bit gradient codec's encode + decode on one device")
    args = p.parse_args(argv)
    if args.hf_load:  # seconds, device and host peaks of each path, in its own process
        from benchmarks import hf_loading

        result = hf_loading.on_gpu()
        print(result)
        write_result("gpu_hf_loading", result)
        return result
    if (args.context or args.communicate_less or args.pipeline) and args.dry_run:
        import kdist

        kdist.force_host_devices(8)  # a CPU's 8 host devices stand in for the GPUs
    _keep_tensorflow_off_the_gpu()
    import jax

    if not args.dry_run and jax.devices()[0].platform == "cpu":
        raise SystemExit("No accelerator: JAX sees CPU devices. Run on a TPU or GPU machine, "
                         "or pass --dry-run.")
    if args.communicate_less:
        return communicate_less(args)
    if args.pipeline:
        return pipeline_schedules(args)
    if args.codec:
        codec = codec_throughput(args.dry_run)  # issue 18: the 8-bit codec's on-device cost
        print_table("8-bit gradient codec (encode + decode), one device", codec,
                    [("format", "format", ""), ("values", "values", ",d"),
                     ("seconds", "seconds", ".4f"), ("values/s", "values_per_s", ".3g"),
                     ("rel. error", "error", ".4f")])
        write_result(("gpu_dry_run" if args.dry_run else args.output) + "_codec",
                     {"args": vars(args), "codec": codec})
        return codec
    if not args.context:
        raise SystemExit("Name a mode: --context, --communicate-less, --pipeline, --hf-load "
                         "or --codec (one device's comparison: benchmarks/accelerator.py).")
    if jax.device_count() < 2:
        raise SystemExit("--context splits a sequence over several devices; JAX sees one.")
    if args.length == 1024:
        args.length = 32768
    length = 256 if args.dry_run else args.length
    steps = 3 if args.dry_run else args.steps
    start, rows, skipped = time.perf_counter(), [], []
    for i, (preset, variant, backbone_options, lm_options, batch) in enumerate(CONTEXT_RUNS):
        if args.runs is not None and i not in args.runs:
            continue
        if time.perf_counter() - start > args.budget_s:
            skipped.append(f"{preset} {variant}")
            continue
        row = measure(preset, backbone_options, lm_options, batch, length, steps, args.dry_run,
                      check_attention=False, context_parallel=variant)
        row["variant"] = variant
        rows.append(row)
        print(f"{preset} {variant}: {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%}",
              flush=True)
    print_table(f"{'DRY RUN (tiny shape, CPU) — ' if args.dry_run else ''}context parallel "
                f"training, T={length}, {rows[0]['dtype_policy'] if rows else ''}; MFU: "
                f"{rows[0]['convention'] if rows else ''}", rows,
                [("preset", "preset", ""), ("variant", "variant", ""), ("batch", "batch", "d"),
                 ("step s", "step_s", ".3f"), ("tokens/s", "tokens_per_s", ",.0f"),
                 ("MFU", "mfu", ".1%"), ("peak GiB", "peak_memory_gib", ".1f"),
                 ("loss", "final_loss", ".3f")])
    if skipped:
        print(f"skipped (time budget): {', '.join(skipped)}")
    write_result(("gpu_dry_run" if args.dry_run else args.output) + "_context",
                 {"args": vars(args), "rows": rows, "skipped": skipped})
    return rows


if __name__ == "__main__":
    main()
