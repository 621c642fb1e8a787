"""Per-device peak memory of gpt2-small's train step, by strategy and remat, against the
weights + optimizer + activations estimate and against keras-hub's GPT2 of the same shape.

Every figure is XLA's ``memory_analysis()`` of the compiled train step (arguments + outputs
- donated aliases + temporaries), from ``kdist.planning.plan`` on abstract inputs over 8 host
devices (1 device for the 1-device rows). The keras-hub model is ``GPT2Backbone`` (dropout
0, as kdist's preset) with its tied token embedding as the LM head, sharded by
``kdist.parallel.auto`` (``auto_shard=True``); both use kdist's AdamW and sparse
categorical cross-entropy on float32 logits.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/memory.py   # ~10 min on 2 cores
"""

import argparse
import json
from pathlib import Path

import kdist  # noqa: E402

kdist.force_host_devices(8)  # before anything starts JAX's devices

# isort: split
import jax  # noqa: E402
import keras  # noqa: E402

from kdist.models import GPT_PRESETS  # noqa: E402
from kdist.planning import estimate, format_bytes, plan  # noqa: E402

PRESET = "gpt2-small"
RUNS = [  # (label, mesh, remat)
    ("kdist", "data=1", False),
    ("kdist", "data=1", True),
    ("kdist", "data=8", False),
    ("kdist", "fsdp=8", False),
    ("kdist", "fsdp=8", True),
    ("kdist", "data=2,fsdp=4", False),
    ("kdist fused CE", "data=1", False),
    ("kdist fused CE", "fsdp=8", False),
    ("kdist fused CE + chunked attention", "data=1", False),
    ("kdist fused CE + chunked attention", "fsdp=8", False),
    ("keras-hub", "data=1", False),
    ("keras-hub", "fsdp=8", False),
]
# The same shape as keras-hub's: the preset's table padding (50304 rows) left out.
SAME_SHAPE = {"vocabulary_divisible_by": 1}
# Options of the rows named after them: GPTCausalLM(loss_chunk_size=...) never builds the full
# logits; attention_chunk_size never keeps the attention probabilities.
VARIANTS = {"kdist fused CE": {"loss_chunk_size": 128},
            "kdist fused CE + chunked attention": {"loss_chunk_size": 128,
                                                   "attention_chunk_size": 128}}


def kdist_variant(label):
    from kdist.models import GPTCausalLM

    return lambda: GPTCausalLM.from_preset(PRESET, **SAME_SHAPE, **VARIANTS[label])


def keras_hub_gpt2():
    """keras-hub GPT2Backbone of gpt2-small's shape with the tied embedding as LM head."""
    import keras_hub

    c = GPT_PRESETS[PRESET]
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=c["vocabulary_size"], num_layers=c["num_layers"],
        num_heads=c["num_heads"], hidden_dim=c["hidden_dim"],
        intermediate_dim=c["intermediate_dim"], max_sequence_length=c["max_sequence_length"],
        dropout=0.0)
    logits = backbone.token_embedding(backbone.output, reverse=True)
    logits = keras.layers.Activation("linear", dtype="float32")(logits)
    return keras.Model(backbone.input, logits)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    args = p.parse_args()
    rows = []
    spec = jax.ShapeDtypeStruct((args.batch, args.length), "int32")
    for label, mesh, remat in RUNS:
        devices = jax.devices()[:1] if mesh == "data=1" else jax.devices()
        if label == "kdist":
            result = plan(PRESET, mesh=mesh, global_batch_size=args.batch,
                          sequence_length=args.length, remat=remat, devices=devices,
                          device_memory="1TiB", suggest=False, model_overrides=SAME_SHAPE)
        elif label in VARIANTS:
            result = plan(kdist_variant(label), mesh=mesh, global_batch_size=args.batch,
                          sequence_length=args.length, devices=devices, device_memory="1TiB",
                          suggest=False, batch=(spec, spec))
        else:
            result = plan(keras_hub_gpt2, mesh=mesh, global_batch_size=args.batch,
                          sequence_length=args.length, devices=devices, device_memory="1TiB",
                          suggest=False, auto_shard=True,
                          batch=({"token_ids": spec, "padding_mask": spec}, spec))
        sizes = result.mesh
        config = {**GPT_PRESETS[PRESET], **VARIANTS.get(label, {})}
        est = estimate(config, sizes, args.batch, args.length, remat=remat)
        rows.append({"model": label, "mesh": mesh, "remat": remat, "peak": result.total,
                     "memory": result.memory, "estimate": est,
                     "compile_seconds": result.compile_seconds})
        print(f"{label} {mesh} remat={remat}: peak {format_bytes(result.total)}, estimate "
              f"{format_bytes(est['total'])} ({result.compile_seconds:.0f} s)", flush=True)
    print(f"\n{PRESET}, float32, global batch {args.batch} x {args.length}, per device")
    print(f"{'model':<36}{'mesh':<15}{'remat':<7}{'peak':>11}{'estimate':>11}{'peak/est':>9}"
          f"{'vs keras-hub':>13}")
    hub = {r["mesh"]: r["peak"] for r in rows if r["model"] == "keras-hub"}
    for r in rows:
        versus = (f"{r['peak'] / hub[r['mesh']]:.2f}x" if r["mesh"] in hub else "-")
        r["vs_keras_hub"] = r["peak"] / hub[r["mesh"]] if r["mesh"] in hub else None
        print(f"{r['model']:<36}{r['mesh']:<15}{str(r['remat']):<7}"
              f"{format_bytes(r['peak']):>11}{format_bytes(r['estimate']['total']):>11}"
              f"{r['peak'] / r['estimate']['total']:>9.2f}{versus:>13}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
