"""Bytes moved by each collective of the compiled train step, per strategy, vs the minimum.

For each mesh, ``kdist.planning.plan`` compiles the real Keras train step on abstract inputs
over 8 host devices and ``kdist.hlo`` reads every collective from the optimized HLO. The
figure compared is ring "wire" bytes sent per device per step (all-reduce 2(n-1)/n x size,
all-gather / reduce-scatter (n-1)/n x size); the minimum per strategy is
``kdist.planning.theoretical_collective_bytes`` (dp: ring all-reduce of the gradients; fsdp:
all-gather of the weights forward and backward + reduce-scatter of the gradients; model:
4 activation all-reduces per layer + 2 for the vocabulary-parallel embedding).

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/communication.py   # ~4 min
"""

import argparse
import json
from pathlib import Path

import kdist  # noqa: E402

kdist.force_host_devices(8)  # before anything starts JAX's devices

# isort: split
from kdist.planning import format_bytes, plan  # noqa: E402

# gpt-nano with 8 heads (head_dim 32) so that model=8 divides the heads.
OVERRIDES = {"num_heads": 8}
FUSED = {**OVERRIDES, "fused_qkv": True}  # one query/key/value projection per block
STRATEGIES = [  # (name, mesh, model options, gradient_reduction: None = XLA places them)
    ("dp", "data=8", OVERRIDES, None), ("fsdp", "fsdp=8", OVERRIDES, None),
    ("model", "model=8", OVERRIDES, None), ("hybrid", "data=2,fsdp=2,model=2", OVERRIDES, None),
    ("model, fused QKV", "model=8", FUSED, None),
    ("hybrid, fused QKV", "data=2,fsdp=2,model=2", FUSED, None),
    ("data+fsdp", "data=2,fsdp=4", OVERRIDES, None),
    # kdist reduces each weight's gradient itself (kdist.parallel.reduction): f32, then bf16.
    ("dp, kdist f32", "data=8", OVERRIDES, "float32"),
    ("fsdp, kdist f32", "fsdp=8", OVERRIDES, "float32"),
    ("data+fsdp, kdist f32", "data=2,fsdp=4", OVERRIDES, "float32"),
    ("dp, kdist bf16", "data=8", OVERRIDES, "bfloat16"),
    ("fsdp, kdist bf16", "fsdp=8", OVERRIDES, "bfloat16"),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt-nano")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--strategies", nargs="*", default=[s[0] for s in STRATEGIES],
                   help="names of the rows to compile (default: all)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "communication.json"))
    args = p.parse_args()
    rows = []
    for strategy, mesh, overrides, reduction in STRATEGIES:
        if strategy not in args.strategies:
            continue
        result = plan(args.preset, mesh=mesh, global_batch_size=args.batch,
                      sequence_length=args.length, device_memory="1TiB", suggest=False,
                      model_overrides=overrides, gradient_reduction=reduction)
        actual = {k: v["wire_bytes"] for k, v in result.collectives.items()}
        counts = {k: int(v["count"]) for k, v in result.collectives.items()}
        theory = result.theoretical_collectives
        rows.append({"strategy": strategy, "mesh": mesh, "actual_wire_bytes": actual,
                     "counts": counts, "logical_bytes":
                         {k: v["bytes"] for k, v in result.collectives.items()},
                     "theoretical_wire_bytes": theory,
                     "ratio": sum(actual.values()) / sum(theory.values()),
                     "parameters": result.parameters})
        print(f"{strategy} ({mesh}): {format_bytes(sum(actual.values()))} vs minimum "
              f"{format_bytes(sum(theory.values()))}", flush=True)
    print(f"\n{args.preset} (heads 8), float32, batch {args.batch} x {args.length}, "
          f"per device per step, ring wire bytes")
    print(f"{'strategy':<20}{'kind':<16}{'count':>6}{'actual':>12}{'minimum':>12}{'ratio':>8}")
    for r in rows:
        kinds = sorted(set(r["actual_wire_bytes"]) | set(r["theoretical_wire_bytes"]))
        for kind in kinds:
            a = r["actual_wire_bytes"].get(kind, 0.0)
            t = r["theoretical_wire_bytes"].get(kind, 0.0)
            ratio = f"{a / t:.2f}" if t else "-"
            print(f"{r['strategy']:<20}{kind:<16}{r['counts'].get(kind, 0):>6}"
                  f"{format_bytes(a):>12}{format_bytes(t):>12}{ratio:>8}")
        print(f"{r['strategy']:<20}{'total':<16}{'':>6}"
              f"{format_bytes(sum(r['actual_wire_bytes'].values())):>12}"
              f"{format_bytes(sum(r['theoretical_wire_bytes'].values())):>12}"
              f"{r['ratio']:>8.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
