"""Peak host memory of loading a gpt2-medium-shaped Hugging Face checkpoint under fsdp=8:
kdist's streamed, sharded load against the checkpoint's size and against the naive path
(keras-hub ``GPT2Backbone.from_preset(DIR)``, then copying its weights into the sharded
kdist model).

Each measurement runs in a fresh process (8 forced host devices) and reports its peak
resident set (``VmHWM``) and its resident set after imports and device start-up (the
baseline), so ``peak - baseline`` is what loading cost. On CPU the 8 "devices" are host
memory: the sharded model itself (1.42 GB for gpt2-medium in float32) is part of every
figure; what a loader adds beyond it is ``peak - baseline - model``.

A third pair of rows reads half of every tensor of the same files with safetensors, once
with one memory map held for the whole pass and once with a map per tensor (what
``kdist.models.hf.checkpoint`` does): the pages a held map touched stay in the RSS.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python benchmarks/hf_loading.py  # ~3 min
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_child, write_result  # noqa: E402

# gpt2-medium (355 M parameters): the checkpoint's shape; written as 4 shards and an index.
SHAPE = dict(vocab_size=50257, n_embd=1024, n_layer=24, n_head=16, n_positions=1024)


def status() -> dict[str, int]:
    """Peak and current resident set, anonymous and file-backed, in bytes (Linux)."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def write(directory: Path) -> dict:
    from safetensors.numpy import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models.hf_fixtures import CONFIGS, gpt2_tensors

    config = {**CONFIGS["gpt2"], **SHAPE}
    shapes = gpt2_tensors(config)
    (directory / "config.json").write_text(json.dumps(config))
    rng = __import__("numpy").random.default_rng(0)
    names, files, weight_map, total = list(shapes), 4, {}, 0
    for i in range(files):  # one shard in memory at a time
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        chunk = {n: rng.standard_normal(shapes[n], dtype="float32") * 0.02
                 for n in names[i::files]}
        save_file(chunk, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
        total += sum(v.nbytes for v in chunk.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    largest = max(shapes.values(), key=lambda s: __import__("math").prod(s))
    return {"checkpoint_bytes": total, "largest_tensor_bytes": 4 * __import__("math").prod(
        largest)}


def _start():
    import jax
    import keras

    import kdist  # noqa: F401 (the 8 host devices come from the environment)

    jax.devices()
    return keras, status()


def child_kdist(directory: str, where: str = "cpu") -> dict:
    keras, before = _start()
    import jax

    import kdist

    devices = jax.device_count()
    mesh = "fsdp=8" if where == "cpu" else (f"fsdp={devices}" if devices > 1 else None)
    keras.distribution.set_distribution(kdist.distribution(mesh) if mesh else None)
    start = time.time()
    lm = kdist.models.GPTCausalLM.from_pretrained(directory)
    seconds = time.time() - start
    model = sum(w.value.nbytes for w in lm.weights)
    stats = jax.devices()[0].memory_stats() or {}
    return {"baseline": before["VmRSS"], "peak": status()["VmHWM"], "model_bytes": model,
            "seconds": seconds, "after": status(), "mesh": mesh,
            "device_peak": stats.get("peak_bytes_in_use")}


# keras-hub GPT2Backbone weight path -> kdist's (the same shapes but the padded table).
RENAMES = [(r"transformer_layer_(\d+)/", r"block_\1/"),
           (r"self_attention/(query|key|value|attention_output)/", r"attention/\1/"),
           (r"self_attention_layer_norm", "attention_norm"),
           (r"feedforward_layer_norm", "mlp_norm"),
           (r"feedforward_intermediate_dense", "mlp/up"),
           (r"feedforward_output_dense", "mlp/down"),
           (r"^layer_norm/", "final_norm/"),
           (r"position_embedding/position_embeddings", "position_embedding/embeddings")]


def child_keras_hub(directory: str) -> dict:
    keras, before = _start()
    import keras_hub
    import numpy as np

    import kdist

    start = time.time()
    theirs = keras_hub.models.GPT2Backbone.from_preset(directory)  # whole, on one device
    loaded = status()
    keras.distribution.set_distribution(kdist.distribution("fsdp=8"))
    lm = kdist.models.GPTCausalLM.from_preset("gpt2-medium", dropout=0.0)  # sharded
    ours = {w.path: w for w in lm.weights}
    for weight in theirs.weights:  # the copy: each tensor to the host, then into its shards
        path = weight.path
        for pattern, replacement in RENAMES:
            path = re.sub(pattern, replacement, path)
        value = np.asarray(weight.value)
        target = ours[path]
        if value.shape != tuple(target.shape):  # the token table: 50257 -> 50304 rows
            value = np.concatenate([value, np.zeros((target.shape[0] - value.shape[0],
                                                     value.shape[1]), value.dtype)])
        target.assign(value)
    seconds = time.time() - start
    return {"baseline": before["VmRSS"], "peak": status()["VmHWM"],
            "after_keras_hub": loaded["VmHWM"], "model_bytes": sum(
                w.value.nbytes for w in lm.weights), "seconds": seconds}


def child_mmap(directory: str, per_tensor: str) -> dict:
    from safetensors import safe_open

    before = status()
    files = sorted(Path(directory).glob("*.safetensors"))
    for file in files:
        if per_tensor == "yes":
            with safe_open(file, "np") as f:
                names = list(f.keys())
            for name in names:
                with safe_open(file, "np") as f:
                    part = f.get_slice(name)
                    part[: max(1, part.get_shape()[0] // 2)]
        else:
            with safe_open(file, "np") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    part[: max(1, part.get_shape()[0] // 2)]
                held = status()
    return {"baseline": before["VmRSS"], "peak": status()["VmHWM"],
            "file_pages_while_held": held["RssFile"] if per_tensor != "yes" else None}


def on_gpu(directory: str | None = None) -> dict:
    """The figure still to take on a GPU machine (``benchmarks/accelerator.py --hf-load``): the same
    checkpoint loaded onto the GPUs (``fsdp=N``, or one device), kdist vs keras-hub's
    ``from_preset``: seconds, device peak and host peak. Each path in its own process."""
    with tempfile.TemporaryDirectory(prefix="kdist-hf-gpu-") as tmp:
        directory = directory or tmp
        sizes = write(Path(directory))
        rows = {name: run_child(__file__, [kind, directory, "gpu"], devices=1)  # the GPUs
                for name, kind in (("kdist from_pretrained", "kdist"),
                                   ("keras-hub from_preset", "keras_hub_only"))}
    return {**sizes, "rows": rows}


def child_keras_hub_only(directory: str, _where: str = "gpu") -> dict:
    keras, before = _start()
    import jax
    import keras_hub

    start = time.time()
    theirs = keras_hub.models.GPT2Backbone.from_preset(directory)
    seconds = time.time() - start
    stats = jax.devices()[0].memory_stats() or {}
    return {"baseline": before["VmRSS"], "peak": status()["VmHWM"], "seconds": seconds,
            "device_peak": stats.get("peak_bytes_in_use"), "parameters": theirs.count_params()}


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("what", nargs="*")
    args = p.parse_args()
    if args.child:
        kind, *rest = args.what
        result = {"kdist": child_kdist, "keras_hub": child_keras_hub, "mmap": child_mmap,
                  "keras_hub_only": child_keras_hub_only}[kind](*rest)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(prefix="kdist-hf-bench-") as tmp:
        directory = Path(tmp)
        sizes = write(directory)
        rows = {
            "kdist from_pretrained, fsdp=8": run_child(__file__, ["kdist", tmp, "cpu"],
                                                        devices=8),
            "keras-hub from_preset + copy, fsdp=8": run_child(__file__, ["keras_hub", tmp],
                                                               devices=8),
            "safetensors, one map held": run_child(__file__, ["mmap", tmp, "no"]),
            "safetensors, a map per tensor": run_child(__file__, ["mmap", tmp, "yes"]),
        }
    print(f"checkpoint {gib(sizes['checkpoint_bytes'])} (largest tensor "
          f"{gib(sizes['largest_tensor_bytes'])}), 4 shards + index")
    print(f"{'path':40s} {'peak':>10s} {'peak-base':>10s} {'- model':>10s} {'seconds':>8s}")
    for name, row in rows.items():
        extra = row["peak"] - row["baseline"] - row.get("model_bytes", 0)
        print(f"{name:40s} {gib(row['peak']):>10s} {gib(row['peak'] - row['baseline']):>10s} "
              f"{gib(extra):>10s} {row.get('seconds', 0):8.1f}")
    write_result("hf_loading", {"shape": SHAPE, **sizes, "rows": rows,
                                "when": time.strftime("%Y-%m-%d %H:%M")})


if __name__ == "__main__":
    main()
