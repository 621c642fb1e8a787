"""Gradient reduction by XLA vs by kdist (float32, bfloat16): the main job's losses and speed.

Runs the GPT recipe (gpt-nano on the embedded corpus, ``fsdp=8`` over 8 host devices, the
main job's settings) once per ``--gradient-reduction`` setting, each in a fresh process
with the same seed and data, and compares the training and validation losses at every
evaluation (what reducing in bfloat16 does to the loss) and the median step time from the
Throughput callback's rows. The bytes each setting moves are ``communication.py``'s.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/gradient_reduction.py   # ~15 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, child_env, print_table, write_result  # noqa: E402

VARIANTS = {"XLA (default)": [], "kdist float32": ["--gradient-reduction", "float32"],
            "kdist bfloat16": ["--gradient-reduction", "bfloat16"]}


def run(name: str, extra: list[str], args, out: Path) -> dict:
    command = [sys.executable, str(ROOT / "recipes" / "gpt_pretrain.py"), "--mesh", args.mesh,
               "--steps", str(args.steps), "--eval-every", str(args.eval_every),
               "--sample-length", "8", "--output-dir", str(out), *extra]
    done = subprocess.run(command, env=child_env(8), capture_output=True, text=True,
                          timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{name}: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "throughput.jsonl").read_text().splitlines()]
    steps = [r["step_time_median_s"] for r in rows if r.get("kind") == "interval"]
    return {"variant": name, "loss": summary["history"]["loss"],
            "val_loss": summary["history"]["val_loss"],
            "validation_loss_after": summary["validation_loss_after"],
            "step_s": statistics.median(steps)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=25)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in VARIANTS.items():
            results.append(run(name, extra, args, Path(tmp) / name.split()[-1].strip("()")))
            print(f"{name}: validation loss {results[-1]['validation_loss_after']:.5f}, "
                  f"step {results[-1]['step_s']:.2f} s", flush=True)
    base = results[0]
    rows = []
    for r in results:
        rows.append({**r, "val_delta": r["validation_loss_after"] - base["validation_loss_after"],
                     "max_train_delta": max(abs(a - b) for a, b in zip(r["loss"], base["loss"])),
                     "step_ratio": r["step_s"] / base["step_s"]})
    for i in range(len(base["val_loss"])):
        for r in rows:
            r[f"val@{(i + 1) * args.eval_every}"] = r["val_loss"][i]
    columns = [("variant", "variant", "")] + [
        (f"val loss @{(i + 1) * args.eval_every}", f"val@{(i + 1) * args.eval_every}", ".5f")
        for i in range(len(base["val_loss"]))] + [
        ("Δ val vs XLA", "val_delta", "+.5f"), ("max |Δ train|", "max_train_delta", ".5f"),
        ("step s", "step_s", ".2f"), ("step / XLA", "step_ratio", ".3f")]
    print_table(f"gpt-nano, {args.mesh}, {args.steps} steps, float32 compute", rows, columns)
    write_result("gradient_reduction", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
