"""A training step's memory on one TPU v5e chip, unrolled against ``scan_layers=True``,
compiled ahead of time on this CPU by the chip's own compiler (libtpu), beside the plan's
estimate of the same step.

Per row: ``memory_analysis()``'s ``temp_size_in_bytes`` as libtpu reports it, the compiler's
heap (``peak_memory_in_bytes`` less the arguments: what ``kdist.compiled_step.ProgramMemory``
reports for a TPU, because the reported figure counts a loop's carried buffers twice), the
arguments, the peak, and ``kdist plan --compile none``'s temporaries and total for the chip.
No device is needed; the figures are the compiler's, not a run's.

    make .cache/libtpu/libtpu    # the TPU compiler, outside .venv
    PYTHONPATH=.cache/libtpu:. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/tpu_memory.py
    # ~8 min on 2 cores; writes benchmarks/results/tpu_memory_ht.json
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

from kdist.accelerators import assume
from kdist.accelerators.defaults import attention_of
from kdist.models import GPTBackbone
from kdist.models.presets import GPT_PRESETS
from kdist.planning import plan
from kdist.planning.target import libtpu_available

GiB = 2**30
ROWS = [  # (preset, batch, overrides): the accelerator benchmark's batches, T = 1024
    ("gpt2-small", 16, {"num_layers": 4}),
    ("gpt2-small", 16, {"num_layers": 4, "scan_layers": True}),
    ("gpt2-small", 16, {}),
    ("gpt2-small", 16, {"scan_layers": True}),
    ("gpt2-medium", 8, {}),
    ("gpt2-medium", 8, {"scan_layers": True}),
]
LENGTH = 1024


def row(preset: str, batch: int, overrides: dict) -> dict:
    kwargs = dict(mesh="data=1", global_batch_size=batch, sequence_length=LENGTH,
                  precision="bf16", device="tpu-v5e", num_devices=1, suggest=False,
                  model_overrides=overrides)
    compiled = plan(preset, compile="tpu", **kwargs)
    estimated = plan(preset, compile="none", **kwargs)
    x = compiled.xla_memory
    with assume("TPU v5 lite"):
        config = GPTBackbone.full_config({**GPT_PRESETS[preset], **overrides})
        attention = attention_of(config, LENGTH)
    guess = estimated.memory
    return {
        "preset": preset, "batch": batch, "overrides": overrides, "attention": attention,
        "reported_temp_gib": round(x["reported_temp"] / GiB, 3),
        "heap_gib": round(x["temp"] / GiB, 3),
        "argument_gib": round(x["argument"] / GiB, 3),
        "peak_gib": round(compiled.memory["total"] / GiB, 3),
        "estimate_temp_gib": round((guess["activations_and_temporaries"]
                                    + guess["gradients"]) / GiB, 3),
        "estimate_total_gib": round(guess["total"] / GiB, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/tpu_memory_ht.json")
    args = parser.parse_args()
    if not libtpu_available():
        print("libtpu is not importable: `make .cache/libtpu/libtpu`, then run with "
              "PYTHONPATH=.cache/libtpu:.", file=sys.stderr)
        return 2
    rows = []
    print(f"{'preset':12} {'b':>3} {'overrides':38} {'reported':>9} {'heap':>6} "
          f"{'peak':>6} {'est.temp':>8} {'est.total':>9}  GiB")
    for preset, batch, overrides in ROWS:
        r = row(preset, batch, overrides)
        rows.append(r)
        print(f"{preset:12} {batch:3} {json.dumps(overrides):38} {r['reported_temp_gib']:9.3f} "
              f"{r['heap_gib']:6.3f} {r['peak_gib']:6.3f} {r['estimate_temp_gib']:8.3f} "
              f"{r['estimate_total_gib']:9.3f}", flush=True)
    from importlib.metadata import version

    import libtpu  # noqa: F401 (its version names the compiler)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": f"tpu-v5e (v5e:1x1), compiled ahead of time on a CPU by libtpu "
                  f"{version('libtpu')}",
        "command": "PYTHONPATH=.cache/libtpu:. python benchmarks/tpu_memory.py",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
