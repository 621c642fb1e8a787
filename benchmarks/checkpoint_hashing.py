"""What SHA-256 checksums cost a checkpoint: save and restore of a gpt2-small state, with and
without hashing.

Every file of a step is hashed when the step is committed (on orbax's background thread,
after the arrays are written, before the rename) and again before a restore. This measures,
for the state ``fit`` checkpoints for ``gpt2-small`` (weights + AdamW moments, 1.39 GiB
float32), alternately with and without hashing (A B A B ...):

* save: ``Checkpoint.save(wait=True)`` until the step is committed and fsynced;
* the training stall of an asynchronous save: how long ``save(wait=False)`` blocks;
* restore: ``Checkpoint.restore(model)`` (verification + reading every array), the files
  in the page cache (just written), as on a rerun on the same machine.

    PYTHONPATH=. python benchmarks/checkpoint_hashing.py            # ~3 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/checkpoint_hashing.py --rounds 5 --out hashing.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kdist  # noqa: E402
from kdist import durable  # noqa: E402
from kdist.checkpointing import metadata, restore, verify  # noqa: E402


def build(preset: str):
    model = kdist.models.GPTCausalLM.from_preset(preset, vocabulary_size=50304)
    model.compile(optimizer=kdist.optim.adamw(3e-4))
    model.optimizer.build(model.trainable_variables)
    return model


def hashing(on: bool) -> None:
    """Switches the checksums of saves (recorded as absent) and of restores on or off."""
    metadata.file_checksum = durable.file_checksum if on else (lambda path: None)
    restore.verify_step = (verify.verify_step if on else
                           functools.partial(verify.verify_step, checksums=False))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--directory", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)

    model = build(args.preset)
    directory = Path(args.directory or tempfile.mkdtemp(prefix="kdist-hash-bench-")) / "ckpt"
    ckpt = kdist.callbacks.Checkpoint(directory, keep=1, data="restart", verbose=False,
                                      handle_signals=False)
    ckpt.set_model(model)
    ckpt.set_params({"epochs": 1, "steps": 1_000_000})
    ckpt.on_train_begin()
    nbytes = sum(v.value.nbytes for v in ckpt._variables.values())
    # After training the Adam moments are not zeros: random values everywhere, so orbax's
    # compression does not shrink the files below the real state's size.
    rng = np.random.default_rng(0)
    for v in ckpt._variables.values():
        if v.value.dtype == np.float32 and v.value.size > 1:
            v.assign(rng.standard_normal(v.shape, dtype=np.float32) * 0.02)
    ckpt.step += 1
    ckpt.save(wait=True)  # warm-up: compiles the finiteness check, creates the directory
    runs = {"hash": [], "none": []}
    for _ in range(args.rounds):
        for mode in runs:
            hashing(mode == "hash")
            ckpt.step += 1
            t = time.perf_counter()
            ckpt.save(wait=True)
            save_s = time.perf_counter() - t
            ckpt.step += 1
            t = time.perf_counter()
            ckpt.save(wait=False)
            call_s = time.perf_counter() - t
            ckpt._wait()  # the asynchronous save committed
            reader = kdist.callbacks.Checkpoint(directory, data="restart", verbose=False)
            t = time.perf_counter()
            step = reader.restore(model)
            restore_s = time.perf_counter() - t
            assert step == ckpt.step
            on_disk = sum(f.stat().st_size for f in (directory / str(step)).rglob("*")
                          if f.is_file())
            runs[mode].append({"save_s": save_s, "async_call_s": call_s,
                               "restore_s": restore_s, "bytes_on_disk": on_disk})
    hashing(True)
    ckpt.on_train_end()

    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in runs}
    summary = {
        "preset": args.preset, "state_bytes": nbytes, "rounds": args.rounds,
        "devices": jax.device_count(), "backend": jax.default_backend(),
        "median": med,
        "save_ratio": med["hash"]["save_s"] / med["none"]["save_s"],
        "restore_ratio": med["hash"]["restore_s"] / med["none"]["restore_s"],
        "runs": runs,
    }
    print(f"{args.preset}: state {nbytes / 2**30:.2f} GiB (weights + AdamW moments), "
          f"{med['hash']['bytes_on_disk'] / 2**30:.2f} GiB on disk, median of {args.rounds}, "
          f"with / without SHA-256:")
    for key, what in (("save_s", "save until committed, fsynced"), ("async_call_s",
                      "async save() blocks training"), ("restore_s", "restore")):
        print(f"  {what:30}: {med['hash'][key]:6.2f} s / {med['none'][key]:6.2f} s  "
              f"(x{med['hash'][key] / med['none'][key]:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
