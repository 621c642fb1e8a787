"""One accelerator benchmark (TPU or GPU): kdist at its defaults against keras-hub and a
plain JAX step at the same shapes, in one process and one run.

For each shape — gpt2-small and gpt2-medium at T = 1024, the Llama-style ``llama-550m``
(554 M parameters, the largest kdist preset that trains with AdamW on a 16 GiB chip) at
T = 2048 — it measures, under ``mixed_bfloat16`` with AdamW, random tokens:

* ``kdist``: ``GPTCausalLM.from_preset(preset)`` and ``fit`` with **no kdist option
  typed**: attention, rematerialisation and loss chunking are the device's defaults
  (``kdist.accelerators``), the batch is kdist's choice for the device
  (``kdist.accelerators.default_batch``, what the recipes use);
* ``keras-hub``: ``GPT2CausalLM`` (or ``LlamaCausalLM`` for the Llama shape) with dropout
  0, compiled with the same optimizer and no metrics, ``fit`` on token ids;
* ``plain JAX``: the same model written in plain JAX (``benchmarks/plain_jax.py``: XLA's
  attention, optax AdamW, a jitted step with its state donated).

A reference runs at kdist's batch where its compiled step fits the device, else at the
largest power of two below that fits (``--reference-batch`` starts the search lower); where
no batch of the plain JAX step fits, it is measured again with each block under
``jax.checkpoint`` (``plain JAX (remat)``, what its user would do next). Each row:
tokens/s of steps after two warm-up steps, MFU in kdist's convention (``kdist.flops``:
6N + 6·L·T·D FLOPs per token, causal attention counted half) against the device's
data-sheet peak and against a bf16 matmul measured in this run, the compiled step's peak
memory (arguments + temporaries + outputs not aliased to arguments, from XLA's
``memory_analysis()`` — a TPU's ``memory_stats()`` leaves temporaries out), the first
step's seconds (compilation), and kdist's speed as a ratio of each reference's.

``--sweep``: kdist only, the candidate settings the device's defaults were chosen from
(batch, rematerialisation, attention) at each shape. ``--dry-run``: tiny shapes on a CPU
(Pallas interpreted), for CI. ``--matmul-precision int8`` adds a kdist row per shape under
``matmul_precision="int8"`` at the bf16 row's batch (its MFU against the int8/bf16 blend
that ``kdist plan --matmul-precision int8`` divides by, ``mfu_peak``). JSON in
``benchmarks/results/``.

    python benchmarks/accelerator.py                # one TPU v5e chip: ~15 minutes
    python benchmarks/accelerator.py --sweep        # the defaults' evidence
    python benchmarks/accelerator.py --dry-run      # CPU
    python benchmarks/accelerator.py --only gpt2-medium llama-550m --sides kdist \
        --matmul-precision int8                     # int8 vs bf16: 1.19x, 1.24x on a v5e
    python benchmarks/accelerator.py --pipeline     # 2+ devices: benchmarks/multi_device.py
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import print_table, write_result  # noqa: E402

# (preset, sequence length)
SHAPES = [("gpt2-small", 1024), ("gpt2-medium", 1024), ("llama-550m", 2048)]
DRY = {"vocabulary_size": 512, "num_layers": 2, "num_heads": 4, "hidden_dim": 256,
       "intermediate_dim": 512}
DRY_SHAPES = [("gpt2-small", 256), ("llama-550m", 256)]
# --sweep: (preset, length, batch, options) beside the defaults, the candidates they were
# chosen among: the other batch, the fused loss, rematerialisation, a scanned stack.
SWEEP = [
    ("gpt2-medium", 1024, 8, {"remat": False}),
    ("gpt2-medium", 1024, 16, {"remat": False, "loss_chunk_size": 256}),
    ("llama-550m", 2048, 8, {"remat": "minimal"}),
    ("llama-550m", 2048, 4, {"remat": False, "loss_chunk_size": 256}),
    ("gpt2-small", 1024, 16, {"scan_layers": True}),
    ("gpt2-small", 1024, 32, {"remat": False}),
]
DRY_SWEEP = [("gpt2-small", 256, 4, {"remat": False}), ("gpt2-small", 256, 4,
                                                          {"remat": "minimal"})]
TIMED_STEPS = 10
# --dry-run times 2 steps: it checks that every side runs and reports, not its speed (10
# timed steps of 8 x 256 bf16 tokens on a CPU were ~30 of the dry run's 52 CPU-s).
DRY_TIMED_STEPS = 2
WARMUP = 2


def timed_steps(dry_run: bool) -> int:
    """Steps timed after the warm-up: :data:`TIMED_STEPS`, or 2 for ``--dry-run``."""
    return DRY_TIMED_STEPS if dry_run else TIMED_STEPS


def dry_shape(preset: str, length: int) -> dict:
    """A tiny version of ``preset`` (grouped-query heads kept grouped) for ``--dry-run``."""
    import kdist

    grouped = kdist.models.GPT_PRESETS[preset].get("num_key_value_heads")
    return dict(DRY, max_sequence_length=length, **({"num_key_value_heads": 2}
                                                   if grouped else {}))


def compiled_peak(jitted, *args) -> float:
    """Bytes of the compiled program's peak: arguments + temporaries + outputs not aliased
    to (donated) arguments, from XLA's memory analysis."""
    m = jitted.lower(*args).compile().memory_analysis()
    return float(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
                 - m.alias_size_in_bytes)


def matmul_tflops(dry_run: bool) -> float:
    """bf16 TFLOP/s of back-to-back square matmuls on the first device (8192^3)."""
    import jax
    import jax.numpy as jnp

    n = 256 if dry_run else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(a))
    repeats = 3 if dry_run else 20
    start = time.perf_counter()
    out = [f(a) for _ in range(repeats)]
    jax.block_until_ready(out)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def _tokens(vocabulary: int, batch: int, length: int, steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocabulary, (batch * steps, length + 1), dtype=np.int32)
    return ids[:, :-1], ids[:, 1:]


def _fit_rate(model, x, y, batch: int, steps: int,
              plain_fit: bool = False) -> tuple[float, float, float]:
    """(tokens/s after the warm-up, first step's seconds, last loss) of one ``fit``."""
    import jax
    import keras

    marks = {}

    class Clock(keras.callbacks.Callback):
        async_safe = True

        def on_train_batch_begin(self, step, logs=None):
            if step == 0:
                marks["begin"] = time.perf_counter()
            if step == 1:
                marks["first"] = time.perf_counter() - marks["begin"]
            if step == WARMUP:
                jax.block_until_ready(jax.live_arrays())
                marks["start"] = time.perf_counter()

        def on_train_end(self, logs=None):
            marks["end"] = time.perf_counter()

    # keras-hub's own fit turns NumPy inputs into a grain/tf.data pipeline (neither is
    # installed where kdist trains without TensorFlow): keras.Model's, the same step.
    fit = keras.Model.fit if plain_fit else type(model).fit
    history = fit(model, x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=[Clock()])
    timed = (steps - WARMUP) * batch * x.shape[1] if hasattr(x, "shape") else \
        (steps - WARMUP) * batch * x["token_ids"].shape[1]
    return (timed / (marks["end"] - marks["start"]), marks["first"],
            float(history.history["loss"][-1]))


def _keras_peak(model, batch: int, length: int, dict_inputs: bool) -> float:
    """Compiled peak of a Keras model's train step (the program ``fit`` runs: JAX's
    persistent cache serves it without compiling again where enabled)."""
    import jax

    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    spec = jax.ShapeDtypeStruct((batch, length), "int32")
    x = {"token_ids": spec, "padding_mask": jax.ShapeDtypeStruct((batch, length), "bool")} \
        if dict_inputs else spec
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
    return compiled_peak(jax.jit(model.train_step, donate_argnums=0), abstract, (x, spec))


def kdist_row(preset, length, batch, options, dry_run) -> dict:
    import keras

    import kdist
    from kdist import compiled_step

    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    shape = dry_shape(preset, length) if dry_run else {}
    model = kdist.models.GPTCausalLM.from_preset(preset, **shape, **options)
    model.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=10, decay_steps=1000))
    if batch is None:
        batch = kdist.accelerators.default_batch(model, length)
    steps = WARMUP + timed_steps(dry_run)
    x, y = _tokens(model.backbone.vocabulary_size, batch, length, steps)
    rate, first, loss = _fit_rate(model, x, y, batch, steps)
    flops = kdist.flops.model_flops_per_token(model, length)
    memory = compiled_step.largest(compiled_step.steps_of(model.train_function))
    chosen = kdist.accelerators.remat_for(model, batch, length)
    return {"side": "kdist", "batch": batch, "tokens_per_s": rate, "first_step_s": first,
            "loss": loss, "flops_per_token": flops.training, "convention": flops.convention,
            "flops_breakdown": flops, "peak_bytes": memory.peak,
            "remat": options.get("remat", chosen),
            "attention": next(
                layer for layer in model.backbone._flatten_layers()
                if isinstance(layer, kdist.models.attention.CausalSelfAttention)
            ).implementation(length, length, arbitrary_mask=False)}


def keras_hub_row(preset, length, batch, dry_run) -> dict:
    import keras
    import keras_hub
    import numpy as np

    import kdist

    keras.utils.clear_session()
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    c = kdist.models.GPTBackbone.full_config(kdist.models.GPT_PRESETS[preset])
    if dry_run:
        c.update(dry_shape(preset, length))
    if c["position_embedding"] == "learned":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=c["vocabulary_size"], num_layers=c["num_layers"],
            num_heads=c["num_heads"], hidden_dim=c["hidden_dim"],
            intermediate_dim=c["intermediate_dim"], max_sequence_length=length, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=c["vocabulary_size"], num_layers=c["num_layers"],
            num_query_heads=c["num_heads"], num_key_value_heads=c["num_key_value_heads"],
            hidden_dim=c["hidden_dim"], intermediate_dim=c["intermediate_dim"],
            rope_max_wavelength=c["rotary_max_wavelength"], dropout=0.0,
            tie_word_embeddings=c["tie_embeddings"])
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    # No metrics (keras-hub adds a masked accuracy by default): the training step alone.
    model.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=10, decay_steps=1000),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    steps = WARMUP + timed_steps(dry_run)
    ids, y = _tokens(c["vocabulary_size"], batch, length, steps)
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, dtype=bool)}
    rate, first, loss = _fit_rate(model, x, y, batch, steps, plain_fit=True)
    return {"side": "keras-hub", "batch": batch, "tokens_per_s": rate, "first_step_s": first,
            "loss": loss, "peak_bytes": _keras_peak(model, batch, length, True)}


def plain_jax_row(preset, length, batch, dry_run, remat: bool = False) -> dict:
    import jax

    import kdist
    from benchmarks import plain_jax

    config = dict(kdist.models.GPT_PRESETS[preset], max_sequence_length=length)
    if dry_run:
        config.update(dry_shape(preset, length))
    init_state, step = plain_jax.make_step(config, remat=remat)
    state = init_state(plain_jax.init(config, 0))
    steps = WARMUP + timed_steps(dry_run)
    x, y = _tokens(config["vocabulary_size"], batch, length, steps)
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
    spec = jax.ShapeDtypeStruct((batch, length), "int32")
    start = time.perf_counter()
    for i in range(steps):
        if i == 1:
            jax.block_until_ready(state)
            first = time.perf_counter() - start
        if i == WARMUP:
            jax.block_until_ready(state)
            begin = time.perf_counter()
        rows = slice(i * batch, (i + 1) * batch)
        state, loss = step(state, x[rows], y[rows])
    loss = float(loss)
    rate = timed_steps(dry_run) * batch * length / (time.perf_counter() - begin)
    del state
    return {"side": "plain JAX" + (" (remat)" if remat else ""), "batch": batch,
            "tokens_per_s": rate, "first_step_s": first,
            "loss": loss, "peak_bytes": compiled_peak(step, abstract, spec, spec)}


def _out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


def reference(side, measure, preset, length, batch, start: int | None, dry_run) -> dict:
    """A reference side at ``batch`` (or ``start``), halved until its step fits."""
    tried = []
    b = start or batch
    while b >= 1:
        try:
            row = measure(preset, length, b, dry_run)
            return {**row, "batches_not_fitting": tried}
        except Exception as error:  # noqa: BLE001 - out of memory: the next smaller batch
            if not _out_of_memory(error):
                raise
            tried.append(b)
            b //= 2
    return {"side": side, "error": f"no batch fits the device (tried {tried}: out of memory)"}


def finish(row: dict, preset: str, length: int, peak_tflops: float, matmul: float,
           flops_per_token: float, hbm: float | None) -> dict:
    """Fills a row's derived figures."""
    if "tokens_per_s" not in row:
        return row
    achieved = row["tokens_per_s"] * flops_per_token / 1e12
    return {**row, "preset": preset, "length": length, "tflops": achieved,
            "mfu": achieved / peak_tflops, "mfu_vs_matmul": achieved / matmul,
            "peak_gib": row["peak_bytes"] / 2**30,
            "peak_of_hbm": row["peak_bytes"] / hbm if hbm else None}


MODES = ("--context", "--communicate-less", "--pipeline", "--hf-load", "--codec")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(mode in argv for mode in MODES):  # the multi-device runs
        from benchmarks import multi_device

        return multi_device.main(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog=f"Multi-device modes ({', '.join(MODES)}): "
                                       f"benchmarks/multi_device.py.")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on any device (CI)")
    p.add_argument("--sweep", action="store_true",
                   help="kdist only: the candidate settings the defaults were chosen among")
    p.add_argument("--only", nargs="*", default=None, help="presets to run (default: all)")
    p.add_argument("--rows", nargs="*", type=int, default=None,
                   help="with --sweep: indices into SWEEP (default: all)")
    p.add_argument("--sides", nargs="*", default=["kdist", "keras-hub", "plain JAX"])
    p.add_argument("--reference-batch", nargs="*", default=[], metavar="[SIDE:]PRESET=B",
                   help="the batch a reference starts its search for one that fits at, per "
                        "preset, or per side and preset (keras:llama-550m=2, "
                        "plain:llama-550m=1; default: kdist's)")
    p.add_argument("--plain-remat", action="store_true",
                   help="the plain JAX step with each block under jax.checkpoint from the "
                        "start (by default only where no batch fits without)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="skip what is left once this much time has passed")
    p.add_argument("--output", default="accelerator", help="result name under results/")
    p.add_argument("--matmul-precision", nargs="*", default=[], choices=("int8", "fp8"),
                   help="also kdist with these matmul_precision policies (kdist.precision), "
                        "at the bf16 row's batch: the 'vs bf16' column is their speed-up")
    args = p.parse_args(argv)

    import jax

    import kdist

    device = jax.devices()[0]
    if not args.dry_run and device.platform == "cpu":
        raise SystemExit("No accelerator: JAX sees CPU devices. Run on a TPU or GPU machine, "
                         "or pass --dry-run.")
    peak = kdist.callbacks.peak.device_peak([device], "float32" if args.dry_run
                                            else "bfloat16")
    matmul = matmul_tflops(args.dry_run)
    hbm = (device.memory_stats() or {}).get("bytes_limit")
    fixed = dict(item.split("=") for item in args.reference_batch)
    start, rows, skipped = time.perf_counter(), [], []
    print(f"{device.device_kind}: data-sheet peak {peak.describe()}; measured bf16 matmul "
          f"{matmul:.1f} TFLOP/s", flush=True)

    def over_budget(what):
        if time.perf_counter() - start > args.budget_s:
            skipped.append(what)
            return True
        return False

    def add(row, preset, length, flops_per_token):
        row = finish(row, preset, length, peak.tflops, matmul, flops_per_token, hbm)
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
        write_result(f"{args.output}_partial", {"rows": rows})  # kept if the run is cut
        return row

    if args.sweep:
        for i, (preset, length, batch, options) in enumerate(DRY_SWEEP if args.dry_run
                                                              else SWEEP):
            if args.rows is not None and i not in args.rows:
                continue
            if over_budget(f"{preset} b{batch} {options}"):
                continue
            row = kdist_row(preset, length, 4 if args.dry_run else batch, options,
                            args.dry_run)
            row.pop("flops_breakdown")
            add({**row, "options": options}, preset, length, row["flops_per_token"])
    else:
        for preset, length in DRY_SHAPES if args.dry_run else SHAPES:
            if args.only is not None and preset not in args.only:
                continue
            if over_budget(preset):
                continue
            row = kdist_row(preset, length, None, {}, args.dry_run)
            row.pop("flops_breakdown")
            ours = add(row, preset, length, row["flops_per_token"])
            for precision in args.matmul_precision:  # same batch: tokens/s comparable
                if over_budget(f"{preset} {precision}"):
                    continue
                row = kdist_row(preset, length, ours["batch"],
                                {"matmul_precision": precision}, args.dry_run)
                blended = kdist.callbacks.peak.matmul_peak(
                    peak, row.pop("flops_breakdown"), matmul_precision=precision)
                row = add({**row, "side": f"kdist {precision}"}, preset, length,
                          row["flops_per_token"])
                row["vs bf16"] = row["tokens_per_s"] / ours["tokens_per_s"]
                if "tflops" in row:  # MFU against the int8/bf16 blend (the plan's)
                    row.update(mfu_peak=blended.tflops, mfu=row["tflops"] / blended.tflops)
            for side, measure in (("keras-hub", keras_hub_row), ("plain JAX", plain_jax_row)):
                if side not in args.sides or over_budget(f"{preset} {side}"):
                    continue
                start_at = fixed.get(f"{side.split()[0].split('-')[0]}:{preset}",
                                     fixed.get(preset))
                remat = side == "plain JAX" and args.plain_remat
                row = {"error": "not tried"} if remat else reference(
                    side, measure, preset, length, ours["batch"],
                    int(start_at) if start_at else None, args.dry_run)
                if side == "plain JAX" and "error" in row:  # what its user does next
                    if not remat:
                        add(row, preset, length, ours["flops_per_token"])
                    row = reference(f"{side} (remat)", functools.partial(measure, remat=True),
                                    preset, length, ours["batch"], None, args.dry_run)
                row = add(row, preset, length, ours["flops_per_token"])
                if "tokens_per_s" in row:
                    ours[f"vs {side}"] = ours["tokens_per_s"] / row["tokens_per_s"]
    print_table(f"{'DRY RUN — ' if args.dry_run else ''}{device.device_kind}, mixed_bfloat16, "
                f"AdamW; MFU against {peak.tflops:g} TFLOP/s ({peak.source}) and a measured "
                f"matmul ({matmul:.0f})", rows,
                [("preset", "preset", ""), ("T", "length", "d"), ("side", "side", ""),
                 ("batch", "batch", "d"), ("tokens/s", "tokens_per_s", ",.0f"),
                 ("MFU", "mfu", ".1%"), ("MFU/matmul", "mfu_vs_matmul", ".1%"),
                 ("peak GiB", "peak_gib", ".2f"), ("first step s", "first_step_s", ".1f"),
                 ("vs keras-hub", "vs keras-hub", ".2f"), ("vs plain JAX", "vs plain JAX",
                                                           ".2f"),
                 ("vs bf16", "vs bf16", ".2f")])
    if skipped:
        print(f"skipped (time budget): {', '.join(skipped)}")
    name = args.output + ("_sweep" if args.sweep else "") + ("_dry_run" if args.dry_run else "")
    write_result(name, {"args": vars(args), "device_kind": device.device_kind,
                        "peak": peak.describe(), "matmul_tflops": matmul, "hbm_bytes": hbm,
                        "date": time.strftime("%Y-%m-%d"), "rows": rows, "skipped": skipped})
    return rows


if __name__ == "__main__":
    main()
