"""Communicate less (issue 18): DiLoCo replica groups and 8-bit gradients on the main job.

Three parts, one command (``--parts`` picks some):

* ``bytes``: the compiled train step of gpt-nano (vocabulary 8192, batch 16 x 256, 8 host
  devices), collectives read from the HLO (``kdist.hlo``). 8-bit: per device, the gradient
  exchange's bytes (all-to-all + all-gather of ``uint8`` buffers) against float32 and
  bfloat16 reduction, on the main job's mesh (``data=8``) and ``fsdp=8``. DiLoCo
  (``replica=2,data=4``): the bytes of collectives whose device groups span the two replica
  groups, in the inner and the sync program, per optimizer step ``(sync + (H-1) inner) / H``,
  against synchronous data parallelism (``data=8``) over the same 8 devices.
* ``error``: each 8-bit format's error on one real gradient of the main job (same weights,
  same batch: one SGD step of lr 1 under ``data=8``, the gradient read back as the weights'
  change), ``|g8 - g32| / |g32|`` over all weights and the worst weight.
* ``train``: the main job itself (``recipes/gpt_pretrain.py``, 200 steps, same seed, same
  tokens, validation on the whole split every 100 steps), once per configuration, in fresh
  processes, back to back: float32 / bfloat16 / float8 / int8 reduction with and without
  error feedback on ``data=8``, and DiLoCo ``replica=2,data=4`` with H in {1, 10, 50}
  (the paper's outer SGD: lr 0.7, Nesterov momentum 0.9) against synchronous ``data=8``.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python benchmarks/communicate_less.py
    # bytes + error ~5 min; train ~9 min a run on 2 idle cores (10 runs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, child_env, machine, print_table, write_result  # noqa: E402

PRESET, VOCAB, BATCH, LENGTH = "gpt-nano", 8192, 16, 256
REDUCTIONS = [("kdist float32", "float32", False), ("kdist bfloat16", "bfloat16", False),
              ("float8", "float8", False), ("float8 + error feedback", "float8", True),
              ("int8", "int8", False), ("int8 + error feedback", "int8", True)]
SYNC_EVERY = (1, 10, 50)


def _model_and_state(mesh, optimizer=None, step=True, **dist_options):
    import keras
    import numpy as np

    import kdist
    from kdist import _keras_compat

    keras.utils.clear_session()
    keras.distribution.set_distribution(kdist.distribution(mesh, **dist_options))
    keras.utils.set_random_seed(0)
    model = kdist.models.GPTCausalLM.from_preset(PRESET, vocabulary_size=VOCAB)
    model.compile(optimizer=optimizer or kdist.optim.adamw(2e-3, warmup_steps=30,
                                                           decay_steps=170))
    x = np.random.default_rng(0).integers(0, VOCAB, (BATCH, LENGTH + 1)).astype("int32")
    batch = (x[:, :-1], x[:, 1:])
    if not step:
        return model, None, batch
    model.train_on_batch(*batch)  # builds the state
    return model, _keras_compat.jax_state(model), batch


def _crossing_bytes(step, state, batch, block) -> float:
    """Bytes per device of the compiled ``step``'s collectives spanning replica groups."""
    import jax

    text = jax.jit(step).lower(state, batch).compile().as_text()
    return sum(c.bytes for c in _collectives(text) if c.crosses(block))


def _collectives(text):
    import jax

    from kdist import hlo

    return hlo.parse_collectives(text, jax.device_count())


def bytes_part() -> dict:
    import functools

    import jax

    from kdist.groups import diloco

    out = {"reduction": [], "diloco": []}
    for mesh in ("data=8", "fsdp=8"):
        for name, fmt, feedback in [("XLA (default)", None, False), *REDUCTIONS[:4]]:
            model, state, batch = _model_and_state(mesh, gradient_reduction=fmt,
                                                   error_feedback=feedback)
            params = sum(w.value.size for w in model.trainable_variables)
            # kdist's: the emitted program (before XLA:CPU promotes 16-bit collectives to 32
            # bits); XLA's own reductions exist only in the optimized one.
            lowered = jax.jit(model.train_step).lower(state, batch)
            text = (lowered.compile().as_text() if fmt is None
                    else lowered.compiler_ir("hlo").as_hlo_text())
            found = _collectives(text)
            # Gradient traffic: everything but the forward pass's fsdp all-gathers of the
            # float32 weights (and the loss's scalar).
            gradient = [c for c in found if c.bytes > 64 and not (
                c.kind == "all-gather" and "f32" in _kind_type(text, c.name))]
            out["reduction"].append({
                "mesh": mesh, "reduction": name, "parameters": params,
                "gradient_bytes": sum(c.bytes for c in gradient),
                "gradient_wire_bytes": sum(c.wire_bytes for c in gradient),
                "kinds": sorted({f"{c.kind} {_kind_type(text, c.name)}" for c in gradient}),
            })
            row = out["reduction"][-1]
            row["bytes_per_parameter"] = row["gradient_bytes"] / params
            print(row, flush=True)
    synchronous = None
    for h in ("XLA", "float32", *SYNC_EVERY):
        mesh = "data=8" if isinstance(h, str) else "replica=2,data=4"
        options = ({"sync_every": h} if isinstance(h, int) else
                   {"gradient_reduction": "float32"} if h == "float32" else {})
        model, state, batch = _model_and_state(mesh, **options)
        params = sum(w.value.size for w in model.trainable_variables)
        block = jax.device_count() // 2  # devices per replica group
        if isinstance(h, str):
            per_step = inner = sync = _crossing_bytes(model.train_step, state, batch, block)
            synchronous = per_step  # the second: kdist's float32 reduction, the ring minimum
        else:
            inner, sync = (_crossing_bytes(functools.partial(diloco.train_step, model,
                                                             sync=s), state, batch, block)
                           for s in (False, True))
            per_step = (sync + (h - 1) * inner) / h
        out["diloco"].append({
            "config": (f"synchronous data=8 ({'XLA' if h == 'XLA' else 'kdist float32'})"
                       if isinstance(h, str) else f"DiLoCo replica=2,data=4, H={h}"),
            "parameters": params, "inner_program_bytes": inner, "sync_program_bytes": sync,
            "bytes_per_step": per_step})
        print(out["diloco"][-1], flush=True)
    for row in out["diloco"]:  # against the synchronous ring minimum (kdist float32)
        row["vs_synchronous"] = row["bytes_per_step"] / synchronous
    return out


def _kind_type(text: str, name: str) -> str:
    """The element type of instruction ``name``'s result in HLO text (e.g. ``u8``)."""
    import re

    m = re.search(rf"%?{re.escape(name)} = \(?([a-z0-9]+)\[", text)
    return m.group(1) if m else "?"


def error_part() -> dict:
    import keras
    import numpy as np

    rows = []
    gradients = {}
    for fmt in ("float32", "float8", "int8"):  # the same initial weights and batch
        model, _, batch = _model_and_state("data=8", keras.optimizers.SGD(1.0), step=False,
                                           gradient_reduction=fmt)  # w' = w - g: g = w - w'
        before = [np.asarray(w.value, np.float64) for w in model.trainable_variables]
        model.train_on_batch(*batch)
        gradients[fmt] = [b - np.asarray(w.value, np.float64)
                          for b, w in zip(before, model.trainable_variables)]
    exact = gradients["float32"]
    for fmt in ("float8", "int8"):
        per_weight = [np.linalg.norm(g - e) / np.linalg.norm(e)
                      for g, e in zip(gradients[fmt], exact) if np.linalg.norm(e) > 0]
        total = np.sqrt(sum(np.sum((g - e) ** 2) for g, e in zip(gradients[fmt], exact))
                        / sum(np.sum(e ** 2) for e in exact))
        rows.append({"format": fmt, "relative_error": float(total),
                     "worst_weight": float(max(per_weight)),
                     "median_weight": float(np.median(per_weight))})
        print(rows[-1], flush=True)
    return {"rows": rows}


def train_part(steps: int, results: dict, out: Path) -> None:
    configs = [("synchronous data=8 (kdist float32)", "data=8", ["--gradient-reduction",
                                                                 "float32"])]
    configs += [(f"DiLoCo H={h}", "replica=2,data=4", ["--sync-every", str(h)])
                for h in (50, 10, 1)]
    configs += [(name, "data=8", ["--gradient-reduction", fmt]
                 + (["--error-feedback"] if feedback else []))
                for name, fmt, feedback in REDUCTIONS[1:]]
    # The outer momentum's part: the groups' plain average every 10 steps.
    configs += [("DiLoCo H=10, plain average (outer lr 1, momentum 0)", "replica=2,data=4",
                 ["--sync-every", "10", "--outer-learning-rate", "1", "--outer-momentum", "0"])]
    done = {r["config"] for r in results.setdefault("train", [])}
    for name, mesh, extra in configs:
        if name in done:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, str(ROOT / "recipes" / "gpt_pretrain.py"),
                       "--mesh", mesh, "--steps", str(steps), "--eval-every", "100",
                       "--sample-length", "8", "--output-dir", tmp, *extra]
            run = subprocess.run(command, env=child_env(8), capture_output=True, text=True,
                                 timeout=4 * 3600)
            if run.returncode:
                raise RuntimeError(f"{name}: {' '.join(command)}:\n{run.stderr[-3000:]}")
            summary = json.loads((Path(tmp) / "summary.json").read_text())
            rows = [json.loads(x) for x in (Path(tmp) / "throughput.jsonl").read_text()
                    .splitlines()]
        steps_s = [r["step_time_median_s"] for r in rows if r.get("step_time_median_s")]
        results["train"].append({
            "config": name, "mesh": mesh, "flags": " ".join(extra),
            "val_loss": summary["history"]["val_loss"],
            "val100": summary["history"]["val_loss"][0],
            "validation_loss_after": summary["validation_loss_after"],
            "train_loss": summary["history"]["loss"][-1],
            "step_s": sorted(steps_s)[len(steps_s) // 2] if steps_s else None,
            "load_average": os.getloadavg()})
        print(results["train"][-1], flush=True)
        write_result("communicate_less", results)  # after every run: partial results kept


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="*", default=["bytes", "error", "train"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    path = ROOT / "benchmarks" / "results" / "communicate_less.json"
    results = json.loads(path.read_text()) if path.is_file() else {}  # train runs done
    results = {k: results[k] for k in ("train",) if k in results}
    results.update(args={"steps": args.steps}, machine_start=machine())
    if {"bytes", "error"} & set(args.parts):
        # Compile-only parts in one child process of 8 host devices.
        command = [sys.executable, __file__, "--child", "--parts",
                   *[x for x in args.parts if x in ("bytes", "error")]]
        run = subprocess.run(command, env=child_env(8), capture_output=True, text=True,
                             timeout=3600)
        if run.returncode:
            raise RuntimeError(run.stderr[-3000:])
        write_result("communicate_less_bytes", {"machine_start": machine(),
                                                **json.loads(run.stdout.splitlines()[-1])})
    if "train" in args.parts:
        train_part(args.steps, results, path.parent)
    static = path.with_name("communicate_less_bytes.json")
    _print({**results, **(json.loads(static.read_text()) if static.is_file() else {})})


def _print(results):
    if "reduction" in results:
        print_table("gradient exchange per device per step (emitted HLO)", results["reduction"],
                    [("mesh", "mesh", ""), ("reduction", "reduction", ""),
                     ("bytes", "gradient_bytes", ",.0f"),
                     ("bytes / parameter", "bytes_per_parameter", ".3f"),
                     ("wire bytes", "gradient_wire_bytes", ",.0f")])
    if "diloco" in results:
        print_table("bytes across replica groups per device (optimized HLO)", results["diloco"],
                    [("config", "config", ""), ("inner program", "inner_program_bytes", ",.0f"),
                     ("sync program", "sync_program_bytes", ",.0f"),
                     ("per step", "bytes_per_step", ",.0f"),
                     ("vs synchronous (kdist float32)", "vs_synchronous", ".4f")])
    if "rows" in results:
        print_table("8-bit error on one gradient", results["rows"],
                    [("format", "format", ""), ("|g8-g32|/|g32|", "relative_error", ".4f"),
                     ("worst weight", "worst_weight", ".4f"),
                     ("median weight", "median_weight", ".4f")])
    if results.get("train"):
        print_table("main job, validation loss (whole split)", results["train"],
                    [("config", "config", ""), ("val @100", "val100", ".4f"),
                     ("val after", "validation_loss_after", ".4f"),
                     ("step s", "step_s", ".2f")])


def child(parts):
    import kdist

    kdist.force_host_devices(8)
    out = {}
    if "bytes" in parts:
        out.update(bytes_part())
    if "error" in parts:
        out.update(error_part())
    print(json.dumps(out))


if __name__ == "__main__":
    if "--child" in sys.argv:
        parts = sys.argv[sys.argv.index("--parts") + 1:]
        child(parts)
    else:
        main()
