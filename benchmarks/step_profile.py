"""Where a kdist training step's device time goes, by kind of op, from JAX's profiler.

Builds ``GPTCausalLM.from_preset(preset)`` at kdist's defaults (``mixed_bfloat16``, AdamW;
``--matmul-precision`` and ``--batch`` as typed), fits two steps (compilation), profiles
three more with ``jax.profiler``, and sums the device plane's "XLA Ops" time per step by kind
of op. Each op is classified from the compiled program's HLO (:func:`classify`): int8 or bf16
matmuls (a convolution or dot inside, int32 or float result), kernels (custom calls: the
flash attention kernels), quantizers (a fusion that writes int8 codes), reduce fusions,
copies and layout changes, other elementwise fusions. Prints the kinds and the costliest ops
and writes ``results/step_profile_<preset>_<precision>.json``. The int8 step's figures in
benchmarks/README.md (issue 44) came from this.

    python benchmarks/step_profile.py --preset gpt2-medium --batch 8 --matmul-precision int8

Needs an accelerator: on a CPU the profiler records no device plane.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402

_ARITHMETIC = re.compile(r" (add|multiply|subtract|divide|exponential|convert|select|maximum|"
                         r"minimum|clamp|log|rsqrt|sqrt|tanh|negate|compare|power|abs)\(")


def computations(hlo: str) -> dict[str, list[str]]:
    """The HLO module's computations: name -> its instruction lines."""
    found, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = re.match(r"^(?:ENTRY )?%?([\w.\-]+)", line).group(1)
            found[name] = []
        elif line.startswith("}"):
            name = None
        elif name:
            found[name].append(line)
    return found


def classify(hlo: str) -> dict[str, str]:
    """Each instruction's name -> its kind, from the optimized HLO text.

    Example:
        >>> hlo = "\\n".join([
        ...     "%fused_dot (p0: s8[4,8], p1: s8[8,2]) -> s32[4,2] {",
        ...     "  ROOT %convolution.1 = s32[4,2]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf",
        ...     "}",
        ...     "ENTRY %main (a: s8[4,8], b: s8[8,2]) -> s32[4,2] {",
        ...     "  ROOT %fusion.7 = s32[4,2]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot",
        ...     "}"])
        >>> classify(hlo)["fusion.7"]
        'int8 matmul'
    """
    comps = computations(hlo)
    kinds = {}
    for lines in comps.values():
        for line in lines:
            head = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
            if not head:
                continue
            op = re.search(r" ([a-z][a-z0-9\-]*)\(", " " + line[head.end():])
            op = op.group(1) if op else "?"
            called = re.search(r"calls=%?([\w.\-]+)", line)
            inner = "\n".join(comps.get(called.group(1), ())) if called else ""
            kinds[head.group(1)] = _kind(op, line, inner)
    return kinds


def _kind(op: str, line: str, inner: str) -> str:
    if op == "custom-call":
        return "kernels (custom calls)"
    products = [x for x in (inner or line).splitlines() if re.search(r" (convolution|dot)\(", x)]
    if op in ("convolution", "dot") or products:
        return ("int8 matmul" if any(re.search(r"= s32\[", x) for x in products)
                else "bf16/f32 matmul")
    if op in ("copy", "transpose", "copy-start", "copy-done", "bitcast"):
        return "copies and layout"
    if re.search(r"= s8\[", inner):
        return "quantizers (int8 codes)"
    if op in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all"):
        return "collectives"
    if op == "reduce" or re.search(r" reduce\(", inner):
        return "reduce fusions"
    if op == "fusion" and not _ARITHMETIC.search(inner):
        return "copies and layout"
    return "elementwise"


def device_time(trace_dir: str, steps: int) -> dict[str, float]:
    """Milliseconds per step of each op on the device plane's "XLA Ops" line."""
    from jax._src.lib import _profile_data

    per_op = collections.Counter()
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in _profile_data.ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                if line.name == "XLA Ops":
                    for event in line.events:  # named by the instruction's full text
                        name = event.name.split(" = ")[0].strip().lstrip("%")
                        per_op[name] += event.duration_ns / 1e6 / steps
    return per_op


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2-medium")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--batch", type=int, default=None, help="default: kdist's for the device")
    p.add_argument("--matmul-precision", default="bf16",
                   choices=("bf16", "int8", "int8-sr", "fp8"))
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    args = p.parse_args(argv)

    import jax
    import keras
    import numpy as np

    import kdist
    from kdist import compiled_step

    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = kdist.models.GPTCausalLM.from_preset(args.preset,
                                                 matmul_precision=args.matmul_precision)
    model.compile(optimizer=kdist.optim.adamw(1e-4, warmup_steps=10, decay_steps=1000))
    batch = args.batch or kdist.accelerators.default_batch(model, args.length)
    tokens = np.random.default_rng(0).integers(0, model.backbone.vocabulary_size,
                                               (batch * (2 + args.steps), args.length + 1))
    x, y = tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, verbose=0, shuffle=False)
    trace_dir = tempfile.mkdtemp(prefix="kdist-profile-")
    jax.profiler.start_trace(trace_dir)
    model.fit(x[2 * batch:], y[2 * batch:], batch_size=batch, verbose=0, shuffle=False)
    jax.profiler.stop_trace()

    hlo = max((e.as_text() for s in compiled_step.steps_of(model.train_function)
               for e in s.compiled), key=len)
    kinds = classify(hlo)
    per_op = device_time(trace_dir, args.steps)
    if not per_op:
        raise SystemExit(f"No device ops in the trace ({jax.devices()[0].platform}): this "
                         "needs an accelerator.")
    by_kind, count = collections.Counter(), collections.Counter()
    for name, ms in per_op.items():
        by_kind[kinds.get(name, "unclassified")] += ms
        count[kinds.get(name, "unclassified")] += 1
    print(f"{args.preset} b{batch} T{args.length} {args.matmul_precision}: "
          f"{sum(per_op.values()):.1f} ms of device ops per step")
    for kind, ms in by_kind.most_common():
        print(f"{ms:9.2f} ms {count[kind]:6d}  {kind}")
    top = [{"op": name, "ms": ms, "kind": kinds.get(name, "unclassified")}
           for name, ms in per_op.most_common(40)]
    write_result(f"step_profile_{args.preset}_{args.matmul_precision}", {
        "args": vars(args), "batch": batch, "device": jax.devices()[0].device_kind,
        "step_ms": sum(per_op.values()),
        "by_kind": {k: {"ms": v, "ops": count[k]} for k, v in by_kind.most_common()},
        "top": top})


if __name__ == "__main__":
    main()
