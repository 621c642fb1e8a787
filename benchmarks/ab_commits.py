"""A/B of two commits on the main job's train step, in one run: did a change move the speed?

Each round runs the same measuring script once in each tree (a ``git worktree`` of
``--base``, and this working tree), order reversed every other round, with the identical
environment (8 forced host devices with kdist's XLA:CPU settings, tcmalloc where present).
The script trains the main job's model — ``gpt-nano`` (vocabulary 8192), global batch 16 ×
256, kdist's AdamW, float32 — with ``fit`` on fixed random batches and reports tokens/s
after one untimed step. The ratio new / base is taken per round; its median and spread are
printed, so the spread is the noise to read the median against.

    python benchmarks/ab_commits.py --base 7f3d1d7 --meshes data=8 fsdp=8 --rounds 3
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
from benchmarks.common import ROOT, child_env, print_table, spread, write_result  # noqa: E402

# Uses only API both sides have: kdist.distribution, GPTCausalLM.from_preset, optim.adamw.
MEASURE = r'''
import json, sys, time
import kdist, keras, numpy as np, jax

mesh, steps = sys.argv[1], int(sys.argv[2])
keras.distribution.set_distribution(kdist.distribution(mesh))
keras.utils.set_random_seed(0)
model = kdist.models.GPTCausalLM.from_preset("gpt-nano", vocabulary_size=8192)
model.compile(optimizer=kdist.optim.adamw())
batch, length = 16, 256
tokens = np.random.default_rng(0).integers(0, 8192, ((steps + 1) * batch, length + 1),
                                            dtype=np.int32)

class Clock(keras.callbacks.Callback):
    async_safe = True
    def on_train_batch_begin(self, b, logs=None):
        if b == 1:
            jax.block_until_ready(jax.live_arrays())
            self.start = time.perf_counter()
    def on_train_end(self, logs=None):
        self.seconds = time.perf_counter() - self.start

clock = Clock()
history = model.fit(tokens[:, :-1], tokens[:, 1:], batch_size=batch, epochs=1, verbose=0,
                    shuffle=False, callbacks=[clock])
print(json.dumps({"tokens_per_s": steps * batch * length / clock.seconds,
                  "loss": history.history["loss"][-1]}))
'''


def measure(tree: Path, mesh: str, steps: int) -> dict:
    env = child_env(devices=8)
    env["PYTHONPATH"] = str(tree)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(MEASURE)
    try:
        out = subprocess.run([sys.executable, f.name, mesh, str(steps)], env=env, cwd=tree,
                             capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{tree} {mesh} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="the commit to compare against")
    p.add_argument("--meshes", nargs="*", default=["data=8", "fsdp=8"])
    p.add_argument("--steps", type=int, default=4, help="timed steps per measurement")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    base_tree = Path(tempfile.mkdtemp(prefix="kdist-ab-")) / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base],
                   cwd=ROOT, check=True, capture_output=True)
    try:
        trees = {"base": base_tree, "new": ROOT}
        results = []
        for mesh in args.meshes:
            rounds = {"base": [], "new": []}
            losses = {}
            for r in range(args.rounds):
                for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
                    m = measure(trees[side], mesh, args.steps)
                    rounds[side].append(m["tokens_per_s"])
                    losses[side] = m["loss"]
            ratio = spread(n / b for n, b in zip(rounds["new"], rounds["base"]))
            results.append({"mesh": mesh, "base": spread(rounds["base"]),
                            "new": spread(rounds["new"]), "ratio_new_over_base": ratio,
                            "final_loss": losses, "rounds": rounds})
        print_table(f"main job train step, {args.base} (base) vs working tree (new)",
                    [{"mesh": r["mesh"], "base": r["base"]["median"], "new": r["new"]["median"],
                      "ratio": r["ratio_new_over_base"]["median"],
                      "lo": r["ratio_new_over_base"]["min"],
                      "hi": r["ratio_new_over_base"]["max"]} for r in results],
                    [("mesh", "mesh", ""), ("base tok/s", "base", ",.0f"),
                     ("new tok/s", "new", ",.0f"), ("new/base", "ratio", ".3f"),
                     ("min", "lo", ".3f"), ("max", "hi", ".3f")])
        write_result("ab_commits", {"args": vars(args), "results": results})
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT,
                       capture_output=True)


if __name__ == "__main__":
    main()
