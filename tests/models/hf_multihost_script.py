"""Run once per rank by tests/models/test_hf_multihost.py under ``kdist.launch``:

    python -m kdist.launch --processes 2 --devices-per-process 4 \\
        tests/models/hf_multihost_script.py --mesh fsdp=8 --source DIR --out DIR

Loads the Hugging Face checkpoint in ``--source`` under the mesh, counting the bytes this
process reads from the files; checks each local shard against the stored tensor; exports
to ``--out/export`` (every process joins the gathers, process 0 writes); writes what it
saw to ``--out/rank<i>.json``.
"""

import argparse
import contextlib
import json
from pathlib import Path

import kdist  # kdist.launch gave this process its host devices

# isort: split
import keras
import numpy as np
from safetensors.numpy import load_file

from kdist.models.hf import checkpoint, stacked


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--scan-layers", action="store_true", help="load into a stacked model")
    args = p.parse_args()
    info = kdist.initialize(timeout=60)
    keras.distribution.set_distribution(kdist.distribution(args.mesh))

    read = {"bytes": 0, "tensors": {}}
    original = checkpoint.HFCheckpoint.opened

    @contextlib.contextmanager
    def counting(self, name):  # every box this process copies out of the files
        with original(self, name) as reader:
            def read_box(box):
                values = reader(box)
                read["bytes"] += values.nbytes
                read["tensors"][name] = read["tensors"].get(name, 0) + values.nbytes
                return values
            yield read_box

    checkpoint.HFCheckpoint.opened = counting
    lm = kdist.models.GPTCausalLM.from_pretrained(args.source, scan_layers=args.scan_layers)
    stored = load_file(str(Path(args.source) / "model.safetensors"))
    worst = 0.0
    for weight in lm.weights:  # local shards against the stored tensors, exactly
        tensor_map = stacked.fitted(
            kdist.models.hf.gpt2.tensor_map(weight.path, lm.backbone.get_config()), weight.shape)
        full = tensor_map.read(lambda key, box: stored[key][box])
        for shard in weight.value.addressable_shards:
            worst = max(worst, float(np.abs(np.asarray(shard.data) - full[shard.index]).max()))
    kdist.hf.export(lm, Path(args.out) / "export")
    total = sum(v.nbytes for v in stored.values())
    (Path(args.out) / f"rank{info.process_index}.json").write_text(json.dumps(
        {"process_index": info.process_index, "local_devices": info.local_device_count,
         "bytes_read": read["bytes"], "tensors_read": read["tensors"],
         "checkpoint_bytes": total, "worst_shard_error": worst}))


if __name__ == "__main__":
    main()
